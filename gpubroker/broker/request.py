"""A lease request (SPEC §3.1), checked field by field: anything else is INVALID_REQUEST."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpubroker.config import CLASSES
from gpubroker.errors import InvalidRequest
from gpubroker.units import CONTROL, UnitError, parse_duration, parse_size, parse_time

PREEMPTIONS = ("never", "drain", "interrupt")
BINDS = ("caller", "none")
FIELDS = (
    "gpu_memory",
    "gpus",
    "exclusive",
    "gpu",
    "cpu_cores",
    "memory",
    "priority",
    "preemption",
    "ttl",
    "wait",
    "deadline",
    "holder",
    "bind",
    "labels",
)
_KNOWN = frozenset(FIELDS)
MAX_GPUS = 64
MAX_CORES = 4096
MAX_LABELS = 32
MAX_TEXT = 256
MAX_PID = 2**22 - 1  # the largest pid_max Linux allows, less one


@dataclass(frozen=True, slots=True)
class LeaseRequest:
    gpu_memory: int = 0
    gpus: int = 0
    exclusive: bool = False
    gpu: int | str | None = None  # pinned by index or UUID
    cpu_cores: int = 0
    memory: int = 0
    priority: str = "interactive"
    preemption: str = "never"
    ttl: float | None = None  # None: the node's default_ttl
    wait: float = 0.0
    deadline: float | None = None
    holder_name: str | None = None
    holder_pid: int | None = None  # declared in the body; on the Unix socket the kernel's word replaces it
    bind: str | None = None  # None: caller on the Unix socket, none on TCP
    labels: dict[str, str] = field(default_factory=dict)

    @property
    def wants_gpus(self) -> bool:
        return self.gpus > 0


def _invalid(name: str, problem: str) -> InvalidRequest:
    return InvalidRequest(f"{name}: {problem}", {"field": name})


def _count(body: dict[str, Any], name: str, limit: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= limit:
        raise _invalid(name, f"must be an integer from 0 to {limit}, not {value!r}")
    return value


def _text(value: Any, name: str, *, empty: bool = False) -> str:
    if not isinstance(value, str) or (not value and not empty) or len(value) > MAX_TEXT:
        raise _invalid(name, f"must be a {'' if empty else 'non-empty '}string of at most {MAX_TEXT} characters")
    if not _encodes(value):
        raise _invalid(name, "must be UTF-8 text")
    if CONTROL.search(value):  # it is printed, in events, listings and terminals
        raise _invalid(name, "must be printable text, without control, bidirectional or invisible formatting characters")
    return value


def _encodes(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: JSON can carry it, nothing downstream can
        return False
    return True


def _choice(body: dict[str, Any], name: str, choices: tuple[str, ...], default: str | None) -> str | None:
    value = body.get(name)
    if value is None:
        return default
    if value not in choices:
        raise _invalid(name, f"must be one of {', '.join(choices)}, not {value!r}")
    return str(value)


def _unit(body: dict[str, Any], name: str, parse: Any) -> Any:
    value = body.get(name)
    if value is None:
        return None
    try:
        return parse(value)
    except UnitError as error:
        raise _invalid(name, str(error)) from None


def parse_request(body: Any) -> LeaseRequest:
    """A LeaseRequest from a decoded JSON body, or InvalidRequest naming the field."""
    if not isinstance(body, dict):
        raise InvalidRequest("a lease request is a JSON object")
    if not _KNOWN.issuperset(body):
        unknown = sorted(set(body) - _KNOWN)
        raise InvalidRequest(f"unknown field {unknown[0]!r}; a request has: {', '.join(FIELDS)}", {"field": unknown[0]})
    gpu_memory = _unit(body, "gpu_memory", parse_size) or 0
    exclusive = body.get("exclusive")
    if exclusive is None:
        exclusive = False  # null means left out, as for every field
    if not isinstance(exclusive, bool):
        raise _invalid("exclusive", "must be true or false")
    gpus = _count(body, "gpus", MAX_GPUS)
    if gpus is None:
        gpus = 1 if (gpu_memory or exclusive) else 0
    if gpus and not gpu_memory and not exclusive:
        if body.get("gpu_memory") is not None:  # given, as 0: that is what to change, not gpus
            raise _invalid("gpu_memory", f"must be more than 0 with gpus ({gpus}), or give exclusive: true for whole GPUs")
        raise _invalid("gpus", "needs gpu_memory per GPU, or exclusive: true")
    if gpu_memory and not gpus:
        raise _invalid("gpus", "is 0 while gpu_memory is asked for")
    pin = body.get("gpu")
    if isinstance(pin, str) and pin.isascii() and pin.isdigit() and len(pin) <= 3 and int(pin) < MAX_GPUS:
        pin = int(pin)  # "1" is GPU 1, as the CLI's --gpu 1 is: no UUID is all digits
    if pin is not None:
        if isinstance(pin, bool) or not isinstance(pin, int | str) or (isinstance(pin, int) and not 0 <= pin < MAX_GPUS):
            raise _invalid("gpu", "must be a GPU index or UUID")
        if isinstance(pin, str):
            pin = _text(pin, "gpu")
        if gpus != 1:
            raise _invalid("gpu", f"pins one GPU, but {gpus} are asked for")
    cpu_cores = _count(body, "cpu_cores", MAX_CORES) or 0
    memory = _unit(body, "memory", parse_size) or 0
    if not (gpus or cpu_cores or memory):
        raise InvalidRequest("the request asks for nothing: give gpu_memory, exclusive, cpu_cores or memory")
    ttl = _unit(body, "ttl", parse_duration)
    if ttl is not None and ttl < 1:
        raise _invalid("ttl", "must be at least 1s")
    holder = body.get("holder")
    holder_name = holder_pid = None
    if holder is not None:
        if not isinstance(holder, dict):
            raise _invalid("holder", "must be an object with name and optional pid")
        if unknown := sorted(set(holder) - {"name", "pid"}):  # a lease's holder has a uid too: the kernel's word, not the caller's
            raise InvalidRequest(
                f"unknown field {'holder.' + unknown[0]!r}; a request's holder has: name, pid (a uid is the kernel's to say, on the Unix socket)",
                {"field": f"holder.{unknown[0]}"},
            )
        if "name" in holder:
            holder_name = _text(holder["name"], "holder.name")
        if "pid" in holder:
            holder_pid = holder["pid"]
            if isinstance(holder_pid, bool) or not isinstance(holder_pid, int) or not 0 < holder_pid <= MAX_PID:
                raise _invalid("holder.pid", f"must be a process id, an integer from 1 to {MAX_PID}")
    labels = body.get("labels")
    if labels is None:
        labels = {}
    if not isinstance(labels, dict) or len(labels) > MAX_LABELS:
        raise _invalid("labels", f"must be an object of at most {MAX_LABELS} string values")
    for key, value in labels.items():
        _text(key, "labels")
        try:
            _text(value, "labels", empty=True)
        except InvalidRequest as error:  # which label: its key is known to be printable text by now
            raise _invalid("labels", f"the value of {key!r} {error.message.removeprefix('labels: ')}") from None
    return LeaseRequest(
        gpu_memory=gpu_memory,
        gpus=gpus,
        exclusive=exclusive,
        gpu=pin,
        cpu_cores=cpu_cores,
        memory=memory,
        priority=_choice(body, "priority", CLASSES, "interactive") or "interactive",
        preemption=_choice(body, "preemption", PREEMPTIONS, "never") or "never",
        ttl=ttl,
        wait=_unit(body, "wait", parse_duration) or 0.0,
        deadline=_unit(body, "deadline", parse_time),
        holder_name=holder_name,
        holder_pid=holder_pid,
        bind=_choice(body, "bind", BINDS, None),
        labels=dict(labels),
    )
