"""What the hardware says: GPU readings behind one interface, simulated or through NVML.

A probe's `sample()` is blocking and runs in a thread, never on the event loop.
It returns one `GpuReading` per accelerator or raises `ProbeError` (no driver,
an unreadable file): the broker then refuses GPU requests with `DRIVER_ERROR`
and goes on brokering CPU cores and host memory. When only some accelerators
cannot be read (a card fallen off the bus), it raises `GpusUnreadable`, a
`ProbeError` that carries the readings of the others: the broker goes on
brokering those, and offers none of the unreadable ones.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import psutil

from gpubroker.broker.holders import start_time
from gpubroker.config import toml_document
from gpubroker.units import CONTROL, UnitError, gib, parse_size, printable_text


class ProbeError(Exception):
    """The accelerators cannot be read: no driver, a driver fault, a broken simulation file."""


@dataclass(frozen=True, slots=True)
class UnreadableGpu:
    """An accelerator the driver lists but cannot read now (a card fallen off the bus, Xid 79)."""

    index: int  # its place in the numbering of accelerators, which the others keep
    uuid: str | None  # None: not even its handle could be had, so nothing says which card it is
    error: str  # the driver's fault, naming the function and the driver's own number of the GPU

    def label(self) -> str:
        return f"GPU {self.index} ({self.uuid or 'UUID unknown'})"

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "uuid": self.uuid, "error": self.error}


@dataclass(frozen=True, slots=True)
class GpuProcess:
    """One process using an accelerator, as the driver lists it."""

    pid: int
    name: str
    bytes: int | None  # None: the driver lists the process but not its memory
    pgid: int | None = None  # None: not a process on this machine (a simulated one)
    ancestors: tuple[int, ...] = ()  # parent, grandparent, ... up to init
    # When the process and each of its ancestors started, in that order; empty when not known. A pid is reused once
    # its process is gone: with its start time, a later process is not taken for a lease's holder or its work.
    started: tuple[float, ...] = ()
    # When its group's leader (the process whose pid is `pgid`) started; None when it is gone or not known.
    leader_started: float | None = None

    def same_as(self, place: int, started: float | None) -> bool:
        """Whether the process at `place` in its line (0 itself, 1 its parent, ...) is the one that started at
        `started`; when either time is not known, the pid alone says so."""
        return started is None or place >= len(self.started) or abs(self.started[place] - started) < 0.01

    def in_group_since(self, started: float | None) -> bool:
        """Whether its process group may be the one registered at `started`, as `holders.is_same_group` says: not when
        its leader started later (the registered group ended, and its id was reused)."""
        return started is None or self.leader_started is None or self.leader_started < started + 0.01


@dataclass(frozen=True, slots=True)
class GpuReading:
    """One accelerator at one moment."""

    index: int
    uuid: str
    name: str
    total: int
    used: int  # what the driver says is in use, all processes and contexts included
    observed_at: float  # Unix time of the reading
    # None: the driver cannot list processes on this GPU; their memory is then unattributed.
    processes: tuple[GpuProcess, ...] | None = field(default=())


class GpusUnreadable(ProbeError):
    """Some accelerators cannot be read; `readings` holds those that could, `unreadable` the others."""

    def __init__(self, readings: list[GpuReading], unreadable: list[UnreadableGpu]) -> None:
        super().__init__("; ".join(f"{gpu.label()} cannot be read: {gpu.error}" for gpu in unreadable))
        self.readings = readings
        self.unreadable = unreadable


class GpuProbe(Protocol):
    def sample(self) -> list[GpuReading]: ...

    def close(self) -> None:
        """Let the driver go (NVML's shutdown); the broker calls it once it stops sampling."""


def describe_process(pid: int) -> tuple[str, int | None, tuple[int, ...], tuple[float, ...], float | None]:
    """Name, process group, ancestor pids, start times of it and its ancestors, and its group leader's start time,
    of a local process; empty when it is gone."""
    try:
        process = psutil.Process(pid)
        name = printable_text(process.name())  # a process may name itself with any bytes
        pgid = os.getpgid(pid)
        ancestors = tuple(parent.pid for parent in process.parents())
    except (psutil.Error, ProcessLookupError, PermissionError):
        return "", None, (), (), None
    line = (pid, *ancestors)
    started: list[float] = []
    for one in line:  # as holders read them, so that a holder's time and its work's compare
        at = start_time(one)
        if at is None:  # gone since: those above it are not known either
            break
        started.append(at)
    # Its leader is most often itself or an ancestor, already read; one read more where it is not.
    place = line.index(pgid) if pgid in line else None
    leader = started[place] if place is not None and place < len(started) else start_time(pgid)
    return name, pgid, ancestors, tuple(started), leader


_SPEC_PART = re.compile(r"^\s*(?:(\d+)\s*x\s*)?(\S+)\s*$", re.IGNORECASE)
DEFAULT_SIM_NAME = "Simulated GPU"


@dataclass(frozen=True, slots=True)
class _SimGpu:
    name: str
    memory: int
    uuid: str
    unreadable: str | None = None  # why the driver cannot read it, as a card fallen off the bus


@dataclass(frozen=True, slots=True)
class _SimProcess:
    gpu: int
    pid: int
    name: str
    used: int


def parse_gpu_spec(spec: str) -> list[_SimGpu]:
    """GPUs from the grammar `[Nx]SIZE[,...]`, e.g. `2x24GiB,1x12GiB`."""
    gpus: list[_SimGpu] = []
    for part in spec.split(","):
        match = _SPEC_PART.match(part)
        if not match:
            raise ProbeError(f"simulated GPUs {spec!r}: {part!r} is not [Nx]SIZE, e.g. 2x24GiB")
        count = int(match.group(1) or 1)
        try:
            memory = parse_size(match.group(2))
        except UnitError as error:
            raise ProbeError(f"simulated GPUs {spec!r}: {error}") from None
        if count < 1 or count > 64 or memory <= 0:
            raise ProbeError(f"simulated GPUs {spec!r}: {part!r} needs 1 to 64 GPUs of more than 0 bytes")
        for _ in range(count):
            index = len(gpus)
            gpus.append(_SimGpu(DEFAULT_SIM_NAME, memory, f"GPU-sim-{index}"))
    return gpus


_GPU_KEYS = ("name", "memory", "uuid", "unreadable")
_PROCESS_KEYS = ("gpu", "pid", "name", "used")
_UUID = re.compile(r"[^\s,]+")  # CUDA_VISIBLE_DEVICES is a comma-separated list: a UUID holds no comma, and is never empty


def parse_gpu_file(data: bytes, source: str) -> tuple[list[_SimGpu], list[_SimProcess]]:
    """GPUs and external processes from a simulation TOML file; a ProbeError naming the table, the key and the
    value of the first thing that describes no real machine (a key misspelt is refused, never left out)."""
    try:
        document = toml_document(data)
    except ValueError as error:  # not TOML (tomllib's TOMLDecodeError), or not UTF-8
        raise ProbeError(f"{source}: not a simulation file: {error}") from None
    if unknown := sorted(set(document) - {"gpu", "process"}):
        raise ProbeError(f"{source}: unknown {_listed(unknown)}; a simulation file holds [[gpu]] and [[process]] tables")
    gpus = [_sim_gpu(table, f"{source}: GPU {index}", index) for index, table in enumerate(_tables(document, "gpu", source))]
    for index, card in enumerate(gpus):
        if card.uuid in [other.uuid for other in gpus[:index]]:  # leases are on a card by its UUID: two cards, two UUIDs
            raise ProbeError(f"{source}: GPU {index} has the UUID {card.uuid!r} of an earlier GPU: give each its own")
    processes = [
        _sim_process(table, f"{source}: [[process]] table {number}", len(gpus))
        for number, table in enumerate(_tables(document, "process", source), start=1)
    ]
    for index, card in enumerate(gpus):
        used = sum(p.used for p in processes if p.gpu == index)
        if used > card.memory:  # the driver never lists more in use than the card holds
            raise ProbeError(
                f"{source}: the processes on GPU {index} use {used} bytes ({gib(used)} GiB), more than its memory, "
                f"{card.memory} bytes ({gib(card.memory)} GiB)"
            )
    return gpus, processes


def _listed(keys: list[str]) -> str:
    return f"key{'s' * (len(keys) > 1)} {', '.join(repr(key) for key in keys)}"


def _tables(document: dict[str, Any], kind: str, source: str) -> list[dict[str, Any]]:
    tables = document.get(kind, [])
    if not isinstance(tables, list) or not all(isinstance(table, dict) for table in tables):
        raise ProbeError(f"{source}: {kind} must be [[{kind}]] tables, not {tables!r}")
    return tables


def _fields(table: dict[str, Any], kind: str, keys: tuple[str, ...], required: tuple[str, ...], where: str) -> None:
    if unknown := sorted(set(table) - set(keys)):
        raise ProbeError(f"{where}: unknown {_listed(unknown)}; a [[{kind}]] table takes {', '.join(keys)}")
    if missing := [key for key in required if key not in table]:
        raise ProbeError(f"{where}: no {' and no '.join(missing)} given; a [[{kind}]] table needs {', '.join(required)}")


def _string(table: dict[str, Any], key: str, default: str, where: str) -> str:
    value = table.get(key, default)
    if not isinstance(value, str):
        raise ProbeError(f"{where}: {key} {value!r} is not a string (quote it)")
    return value


def _size(table: dict[str, Any], key: str, where: str) -> int:
    try:
        return parse_size(table[key])
    except UnitError as error:
        raise ProbeError(f"{where}: {key}: {error}") from None


def _sim_gpu(table: dict[str, Any], where: str, index: int) -> _SimGpu:
    _fields(table, "gpu", _GPU_KEYS, ("memory",), where)
    uuid = _string(table, "uuid", f"GPU-sim-{index}", where)
    if not _UUID.fullmatch(uuid) or CONTROL.search(uuid):  # an ESC would go into the CUDA_VISIBLE_DEVICES printed to be evaluated
        raise ProbeError(f"{where}: uuid {uuid!r} is not a UUID: give it without spaces or commas, as GPU-sim-{index}")
    memory = _size(table, "memory", where)
    if memory <= 0:
        raise ProbeError(f"{where} has memory {memory}: a GPU has more than 0 bytes")
    unreadable = None if table.get("unreadable") is None else _string(table, "unreadable", "", where)
    return _SimGpu(_string(table, "name", DEFAULT_SIM_NAME, where), memory, uuid, unreadable)


def _sim_process(table: dict[str, Any], where: str, gpus: int) -> _SimProcess:
    _fields(table, "process", _PROCESS_KEYS, ("gpu", "pid", "used"), where)
    gpu, pid = table["gpu"], table["pid"]
    if isinstance(gpu, bool) or not isinstance(gpu, int) or not 0 <= gpu < gpus:
        defined = f"GPUs 0 to {gpus - 1}" if gpus > 1 else "GPU 0" if gpus else "no [[gpu]] table"
        raise ProbeError(f"{where}: process {table.get('name')!r} is on GPU {gpu!r}, which is not defined ({defined})")
    if isinstance(pid, bool) or not isinstance(pid, int) or pid < 1:
        raise ProbeError(f"{where}: pid {pid!r} is not a process id (an integer from 1)")
    return _SimProcess(gpu, pid, _string(table, "name", "", where), _size(table, "used", where))


class SimulatedProbe:
    """Accelerators from `--simulate-gpus SPEC` or a TOML file re-read at every sample."""

    def __init__(self, spec_or_file: str, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        path = Path(spec_or_file)
        # A spec never holds a slash: a path to a file not there yet is said to be missing, not to be a bad size.
        self._path: Path | None = path if path.suffix == ".toml" or path.exists() or "/" in spec_or_file else None
        if self._path is None and not spec_or_file.lstrip()[:1].isdigit():  # names no size: a file's name, or nothing
            raise ProbeError(f"simulated GPUs {spec_or_file!r}: no such file, and not GPUs as [Nx]SIZE (2x24GiB,1x12GiB)")
        self._gpus: list[_SimGpu] = [] if self._path else parse_gpu_spec(spec_or_file)
        if self._path:
            with contextlib.suppress(GpusUnreadable):  # a GPU the file says cannot be read is no fault of the file
                self.sample()  # a broken file is an error at start, not a surprise later

    def sample(self) -> list[GpuReading]:
        gpus, processes = self._gpus, list[_SimProcess]()
        if self._path is not None:
            try:
                data = self._path.read_bytes()
            except OSError as error:
                raise ProbeError(f"{self._path}: {error.strerror}") from None
            gpus, processes = parse_gpu_file(data, str(self._path))
        now = self._clock()
        readings, unreadable = [], []
        for index, gpu in enumerate(gpus):
            if gpu.unreadable is not None:
                unreadable.append(UnreadableGpu(index, gpu.uuid, f"simulated: {gpu.unreadable}"))
                continue
            mine = tuple(_simulated_process(p) for p in processes if p.gpu == index)
            used = sum(p.used for p in processes if p.gpu == index)
            readings.append(GpuReading(index, gpu.uuid, gpu.name, gpu.memory, min(used, gpu.memory), now, mine))
        if unreadable:
            raise GpusUnreadable(readings, unreadable)
        return readings

    def close(self) -> None:
        """Nothing to let go: the file is opened afresh at each sample."""


def _simulated_process(process: _SimProcess) -> GpuProcess:
    """A process of the simulation file; one that runs here is described as NVML's are, so a lease's
    descendants and process groups own it as they would on a real GPU."""
    _, pgid, ancestors, started, leader = describe_process(process.pid)
    return GpuProcess(process.pid, process.name, process.used, pgid, ancestors, started, leader)


@dataclass(frozen=True, slots=True)
class HostReading:
    """This machine's CPU cores and memory."""

    cores: int
    memory: int


def sample_host() -> HostReading:
    """CPU cores and host memory through psutil."""
    return HostReading(psutil.cpu_count(logical=True) or 1, int(psutil.virtual_memory().total))
