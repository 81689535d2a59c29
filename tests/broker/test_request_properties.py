"""Properties of parse_request (SPEC §3.1): a LeaseRequest, or InvalidRequest naming the field; never anything else."""

from __future__ import annotations

from typing import Any

import jsonschema_rs
import pytest
import schemathesis
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gpubroker.broker.request import BINDS, FIELDS, MAX_CORES, MAX_GPUS, MAX_LABELS, MAX_TEXT, PREEMPTIONS, LeaseRequest, parse_request
from gpubroker.config import CLASSES
from gpubroker.errors import FailureCode, InvalidRequest
from gpubroker.ui.openapi import OPENAPI
from gpubroker.units import CONTROL, UnitError, parse_duration, parse_size, parse_time

SCHEMA = OPENAPI["components"]["schemas"]["LeaseRequest"]
VALID = jsonschema_rs.Draft4Validator(SCHEMA, validate_formats=True)
NAMED = {*FIELDS, "holder.name", "holder.pid"}
NOTHING = "nothing"  # the one refusal that is about the whole request, not a field
# Bodies the OpenAPI document calls valid, generated from the document itself.
DOCUMENT_BODIES = schemathesis.openapi.from_dict(OPENAPI)["/v1/leases"]["POST"].as_strategy().map(lambda case: case.body)

JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**256), 2**256), st.floats(allow_nan=False), st.text(max_size=12)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=8,
)  # integers are bounded: past ~2^1000 parse_duration overflows (pinned by test_a_huge_integer_ttl_is_an_invalid_request)


def _refusal(body: Any) -> InvalidRequest | None:
    try:
        parse_request(body)
    except InvalidRequest as error:
        return error
    return None


def _named(error: InvalidRequest) -> str:
    """The field a refusal names, or NOTHING for the request that asks for nothing."""
    assert error.code is FailureCode.INVALID_REQUEST
    assert error.status == 400
    assert error.message
    field = error.details.get("field")
    if field is None:
        assert error.message.startswith("the request asks for nothing") or error.message.startswith("a lease request is a JSON object"), (
            error.message
        )
        return NOTHING
    assert isinstance(field, str)
    assert field in NAMED or field not in FIELDS, field  # a known field, or the unknown one it refuses
    assert field in error.message or repr(field) in error.message, error.message
    return field


def _size(value: Any) -> int | None:
    try:
        return parse_size(value)
    except UnitError:
        return None


def _seconds(value: Any) -> float | None:
    try:
        return parse_duration(value)
    except UnitError:
        return None


# What names and labels may hold: no control character, nor one that reorders or hides the text around it.
PRINTABLE = st.characters(exclude_categories=("Cc", "Cs")).filter(lambda c: not CONTROL.search(c))


def _text(value: Any, empty: bool = False) -> bool:
    """A name or label as the contract has it: a string of at most MAX_TEXT characters, none of them a control character."""
    return isinstance(value, str) and (empty or len(value) > 0) and len(value) <= MAX_TEXT and not any(_control(c) for c in value)


def _control(character: str) -> bool:
    return ord(character) < 0x20 or 0x7F <= ord(character) <= 0x9F


def _count(value: Any, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= high


def problems(body: dict[str, Any]) -> set[str]:
    """SPEC §3.1's rules written a second time, for bodies the document calls valid: the fields a refusal may name."""
    found: set[str] = {key for key in body if key not in FIELDS}
    gpu_memory = _size(body["gpu_memory"]) if "gpu_memory" in body else 0
    memory = _size(body["memory"]) if "memory" in body else 0
    found |= {name for name, value in (("gpu_memory", gpu_memory), ("memory", memory)) if value is None}
    exclusive = body.get("exclusive", False)
    if not isinstance(exclusive, bool):
        found.add("exclusive")
    if "gpus" in body and not _count(body["gpus"], MAX_GPUS):
        found.add("gpus")
    gpus = body["gpus"] if "gpus" in body else (1 if (gpu_memory or exclusive) else 0)
    if gpus and not gpu_memory and not exclusive:
        found.add("gpu_memory" if "gpu_memory" in body else "gpus")  # given as 0: gpu_memory is the one to change
    if gpu_memory and not gpus:
        found.add("gpus")
    if "gpu" in body:
        pin = body["gpu"]
        if not (_count(pin, MAX_GPUS - 1) or _text(pin)) or gpus != 1:
            found.add("gpu")
    if "cpu_cores" in body and not _count(body["cpu_cores"], MAX_CORES):
        found.add("cpu_cores")
    if not (gpus or body.get("cpu_cores") or memory):
        found.add(NOTHING)
    if "ttl" in body and ((_seconds(body["ttl"]) or 0) < 1):
        found.add("ttl")
    if "wait" in body and _seconds(body["wait"]) is None:
        found.add("wait")
    if "deadline" in body:
        try:
            parse_time(body["deadline"])
        except UnitError:
            found.add("deadline")
    holder = body.get("holder", {})
    if not isinstance(holder, dict):
        found.add("holder")
    elif set(holder) - {"name", "pid"}:
        found |= {f"holder.{key}" for key in set(holder) - {"name", "pid"}}
    else:
        if "name" in holder and not _text(holder["name"]):
            found.add("holder.name")
        if "pid" in holder and not (_count(holder["pid"], 2**22 - 1) and holder["pid"] > 0):
            found.add("holder.pid")
    for name, choices in (("priority", CLASSES), ("preemption", PREEMPTIONS), ("bind", BINDS)):
        if name in body and body[name] not in choices:
            found.add(name)
    labels = body.get("labels", {})
    if not isinstance(labels, dict) or len(labels) > MAX_LABELS or not all(_text(k) and _text(v, empty=True) for k, v in labels.items()):
        found.add("labels")
    return found


def assert_decoded_as_written(body: dict[str, Any], request: LeaseRequest) -> None:
    """Every field of the LeaseRequest is what the body says, or its default."""
    gpu_memory = parse_size(body["gpu_memory"]) if "gpu_memory" in body else 0
    exclusive = body.get("exclusive", False)
    assert request.gpu_memory == gpu_memory
    assert request.exclusive is exclusive
    assert request.gpus == body.get("gpus", 1 if (gpu_memory or exclusive) else 0)
    pin = body.get("gpu")
    as_index = isinstance(pin, str) and pin.isascii() and pin.isdigit() and len(pin) <= 3 and int(pin) < MAX_GPUS
    assert request.gpu == (int(pin) if as_index else pin)  # "1" is GPU 1
    assert request.cpu_cores == body.get("cpu_cores", 0)
    assert request.memory == (parse_size(body["memory"]) if "memory" in body else 0)
    assert request.priority == body.get("priority", "interactive")
    assert request.preemption == body.get("preemption", "never")
    assert request.ttl == (parse_duration(body["ttl"]) if "ttl" in body else None)
    assert request.wait == (parse_duration(body["wait"]) if "wait" in body else 0.0)
    assert request.deadline == (parse_time(body["deadline"]) if "deadline" in body else None)
    assert request.holder_name == body.get("holder", {}).get("name")
    assert request.holder_pid == body.get("holder", {}).get("pid")
    assert request.bind == body.get("bind")
    assert request.labels == body.get("labels", {})
    assert request.wants_gpus == (request.gpus > 0)


# ----- bodies the document calls valid ------------------------------------------------------


@settings(max_examples=300, suppress_health_check=list(HealthCheck))
@given(DOCUMENT_BODIES)
@example({"gpu_memory": "8GiB"})
@example({"exclusive": True, "gpus": 2, "gpu": 0})
@example({"gpus": 1})
@example({"gpu_memory": 0, "gpus": 1})
@example({"gpu_memory": "0GiB"})
@example({})
def test_a_document_valid_body_is_accepted_exactly_when_it_is_meaningful(body: dict[str, Any]) -> None:
    assert VALID.is_valid(body)
    expected = problems(body)
    error = _refusal(body)
    if not expected:
        assert error is None, f"{body!r} is meaningful but refused: {error}"
        assert_decoded_as_written(body, parse_request(body))
    else:
        assert error is not None, f"{body!r} was accepted, yet: {sorted(expected)}"
        assert _named(error) in expected, (body, error.message, expected)


UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "KB", "MB", "GB", "TB")


@st.composite
def sizes(draw: st.DrawFn, low: int = 1) -> int | str:
    if draw(st.booleans()):
        return draw(st.integers(low, 2**40))
    return f"{draw(st.integers(low, 4096))}{draw(st.sampled_from(UNITS))}"


@st.composite
def meaningful_bodies(draw: st.DrawFn) -> dict[str, Any]:
    """Requests SPEC §3.1 describes, each asking for something, built field by field."""
    body: dict[str, Any] = {}
    kind = draw(st.sampled_from(["memory", "exclusive", "host"]))
    if kind == "memory":
        body["gpu_memory"] = draw(sizes())
    elif kind == "exclusive":
        body["exclusive"] = True
        if draw(st.booleans()):
            body["gpu_memory"] = draw(sizes())
    if kind != "host" and draw(st.booleans()):
        body["gpus"] = draw(st.integers(1, MAX_GPUS))
    if kind != "host" and body.get("gpus", 1) == 1 and draw(st.booleans()):
        body["gpu"] = draw(st.one_of(st.integers(0, MAX_GPUS - 1), st.text(PRINTABLE, min_size=1, max_size=MAX_TEXT)))
    if kind == "host" or draw(st.booleans()):
        body["cpu_cores"] = draw(st.integers(1 if kind == "host" else 0, MAX_CORES))
    if draw(st.booleans()):
        body["memory"] = draw(sizes(low=0))
    optional = {
        "priority": st.sampled_from(CLASSES),
        "preemption": st.sampled_from(PREEMPTIONS),
        "ttl": st.one_of(st.integers(1, 10**6), st.sampled_from(["1s", "1500ms", "10m", "1h", "2.5h"])),
        "wait": st.one_of(st.integers(0, 10**6), st.sampled_from(["0", "500ms", "30s", "10m"])),
        "deadline": st.sampled_from(["2026-11-30T10:00:00Z", "2026-11-30T10:00:00.250+01:00", "1999-01-01T00:00:00-05:00"]),
        "holder": st.fixed_dictionaries(
            {}, optional={"name": st.text(PRINTABLE, min_size=1, max_size=MAX_TEXT), "pid": st.integers(1, 2**22 - 1)}
        ),
        "bind": st.sampled_from(BINDS),
        "labels": st.dictionaries(st.text(PRINTABLE, min_size=1, max_size=20), st.text(PRINTABLE, max_size=MAX_TEXT), max_size=MAX_LABELS),
    }
    for name, strategy in optional.items():
        if draw(st.booleans()):
            body[name] = draw(strategy)
    return body


@settings(max_examples=300)
@given(meaningful_bodies())
def test_a_meaningful_request_is_document_valid_and_decoded_as_written(body: dict[str, Any]) -> None:
    assert VALID.is_valid(body), body
    assert not problems(body), problems(body)
    assert_decoded_as_written(body, parse_request(body))


# ----- anything else ------------------------------------------------------------------------


@given(JSON)
@example([{"cpu_cores": 1}])
@example("{}")
@example(None)
def test_any_json_value_is_a_request_or_an_invalid_request(value: Any) -> None:
    error = _refusal(value)
    if error is not None:
        _named(error)


@given(st.dictionaries(st.sampled_from((*FIELDS, "holder", "uid", "")), JSON, max_size=6))
def test_any_object_of_request_fields_is_a_request_or_an_invalid_request_naming_one(body: dict[str, Any]) -> None:
    error = _refusal(body)
    if error is None:
        request = parse_request(body)
        assert request.gpus or request.cpu_cores or request.memory, request
        assert request.priority in CLASSES
        assert request.preemption in PREEMPTIONS
        assert request.bind in (*BINDS, None)
        assert 0 <= request.gpus <= MAX_GPUS
        assert 0 <= request.cpu_cores <= MAX_CORES
        assert request.ttl is None or request.ttl >= 1
    else:
        _named(error)


@given(st.sampled_from(["gpu_memory", "memory"]), sizes(low=1))
def test_a_negative_size_is_refused_naming_its_field(name: str, size: int | str) -> None:
    body = {"cpu_cores": 1, name: -size if isinstance(size, int) else f"-{size}"}
    error = _refusal(body)
    assert error is not None
    assert _named(error) == name


@given(st.sampled_from(["ttl", "wait"]), st.integers(1, 10**9), st.sampled_from(["", "ms", "s", "m", "h"]))
def test_a_negative_duration_is_refused_naming_its_field(name: str, n: int, unit: str) -> None:
    for value in (-n, f"-{n}{unit}"):
        error = _refusal({"cpu_cores": 1, name: value})
        assert error is not None
        assert _named(error) == name


@pytest.mark.parametrize("name", ["gpus", "cpu_cores"])
@given(n=st.integers(max_value=-1))
def test_a_negative_count_is_refused_naming_its_field(name: str, n: int) -> None:
    error = _refusal({"exclusive": True, name: n})
    assert error is not None
    assert _named(error) == name


NOT_A_NUMBER = st.one_of(
    st.booleans(), st.floats(), st.lists(st.integers(0, 9), max_size=2), st.dictionaries(st.text(max_size=2), st.integers(), max_size=2)
)


@pytest.mark.parametrize("name", ["gpu_memory", "memory", "gpus", "cpu_cores", "ttl", "wait", "gpu"])
@given(value=NOT_A_NUMBER)
def test_a_bool_float_or_container_where_a_number_belongs_is_refused_naming_its_field(name: str, value: Any) -> None:
    body = {"gpu_memory": "1GiB", name: value} if name == "gpu" else {"exclusive": True, name: value}
    error = _refusal(body)
    assert error is not None
    assert _named(error) == name


@pytest.mark.parametrize(
    "name", ["gpu_memory", "memory", "gpus", "cpu_cores", "ttl", "wait", "gpu", "deadline", "holder", "bind", "priority", "preemption"]
)
def test_null_is_the_same_as_leaving_a_field_out(name: str) -> None:
    base = {"exclusive": True, "cpu_cores": 1, "memory": "1MiB"}
    left_out = {key: value for key, value in base.items() if key != name}
    assert parse_request({**base, name: None}) == parse_request(left_out)


@given(st.text(min_size=1, max_size=20).filter(lambda key: key not in FIELDS))
def test_an_unknown_field_is_refused_by_name(key: str) -> None:
    error = _refusal({"cpu_cores": 1, key: 1})
    assert error is not None
    assert _named(error) == key


def test_an_unknown_field_of_the_holder_is_refused_by_name_with_the_fields_it_may_have() -> None:
    """A lease's holder has a uid: a request copied from a lease's answer is told which field to drop."""
    error = _refusal({"cpu_cores": 1, "holder": {"name": "train", "uid": 1000, "pid": 4242}})
    assert error is not None
    assert _named(error) == "holder.uid"
    assert error.message.startswith("unknown field 'holder.uid'; a request's holder has: name, pid")
    error = _refusal({"cpu_cores": 1, "holder": {"pid": 0}})
    assert error is not None
    assert error.message == "holder.pid: must be a process id, an integer from 1 to 4194303"


# ----- bugs found here: each fails today ------------------------------------------------------


@pytest.mark.parametrize("name", ["ttl", "wait"])
def test_a_huge_integer_ttl_is_an_invalid_request(name: str) -> None:
    error = _refusal({"cpu_cores": 1, name: 10**400})
    assert error is not None
    assert _named(error) == name


@pytest.mark.parametrize("name", ["exclusive", "labels"])
def test_null_exclusive_or_labels_is_the_same_as_leaving_it_out(name: str) -> None:
    assert _refusal({"cpu_cores": 1, name: None}) is None


def test_a_label_value_that_is_not_text_is_refused_naming_its_label() -> None:
    error = _refusal({"cpu_cores": 1, "labels": {"team": "ml", "run": 7}})
    assert error is not None
    assert _named(error) == "labels"
    assert error.message == f"labels: the value of 'run' must be a string of at most {MAX_TEXT} characters"


@pytest.mark.parametrize("zero", [0, "0GiB", "0.0 MiB"])
def test_gpu_memory_of_0_for_a_gpu_is_refused_naming_gpu_memory_not_gpus(zero: int | str) -> None:
    """{"gpu_memory": 0, "gpus": 1} was refused with "gpus: needs gpu_memory per GPU": gpu_memory was given, as 0."""
    error = _refusal({"gpu_memory": zero, "gpus": 2})
    assert error is not None
    assert _named(error) == "gpu_memory"
    assert error.message == "gpu_memory: must be more than 0 with gpus (2), or give exclusive: true for whole GPUs"
    assert _refusal({"gpu_memory": zero, "gpus": 2, "exclusive": True}) is None
    error = _refusal({"gpus": 2})
    assert error is not None
    assert error.message == "gpus: needs gpu_memory per GPU, or exclusive: true"
