"""Every operation of the served /openapi.json, fuzzed against a real broker process (SPEC §3.6, §4).

For each generated request: no server error, every refusal in the one error shape
with a code SPEC §3.6 allows for its status, a rejected request changes nothing
(events aside), and a granted lease is released at once so none pile up.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import requests
import schemathesis
from conftest import BrokerProcess
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import Case, GenerationMode
from schemathesis.specs.openapi.checks import content_type_conformance, response_schema_conformance

from gpubroker.broker.request import FIELDS
from gpubroker.ui.openapi import OPENAPI
from gpubroker.units import parse_duration

# SPEC §3.6, status by status; 405 is the broker's answer to a wrong method, in the same shape.
DECISIONS = {
    "INSUFFICIENT_SCHEDULABLE_VRAM",
    "EXTERNAL_GPU_PRESSURE",
    "CAPABILITY_UNAVAILABLE",
    "LEASE_CONFLICT",
    "RESIDENCY_CONFLICT",
    "EVICTION_NOT_ALLOWED",
    "DEADLINE_CANNOT_BE_MET",
    "LEASE_TIMEOUT",
}
CODES_BY_STATUS = {
    400: {"INVALID_REQUEST"},
    401: {"UNAUTHORIZED"},
    403: {"FORBIDDEN"},
    404: {"NOT_FOUND"},
    405: {"INVALID_REQUEST"},
    409: DECISIONS,
    413: {"INVALID_REQUEST"},
    429: {"QUEUE_FULL"},
}
OPERATIONS = [f"{method.upper()} {path}" for path, item in OPENAPI["paths"].items() for method in item]
# An endless stream has no answer to judge: tests/ui/test_pages.py holds /v1/stream to its contract.
STREAMS = [f"{method.upper()} {path}" for path, item in OPENAPI["paths"].items() for method, op in item.items() if op.get("x-stream")]
FUZZED = [op for op in OPERATIONS if op not in STREAMS]
# Negative mode needs something that can be made invalid: a body, or a query parameter with a type or a choice.
NEGATABLE = [
    f"{method.upper()} {path}"
    for path, item in OPENAPI["paths"].items()
    for method, operation in item.items()
    if not operation.get("x-stream")
    and (
        "requestBody" in operation
        or any(p["schema"].get("type") == "integer" or "enum" in p["schema"] for p in operation.get("parameters", []))
    )
]
# Every operation in positive mode, and in negative mode where something can be made invalid.
RUNS = [(op, mode) for op in FUZZED for mode in GenerationMode if mode is GenerationMode.POSITIVE or op in NEGATABLE]
ON_A_LEASE = [(op, mode) for op, mode in RUNS if "{id}" in op]
MAX_WAIT = 0.25  # a generated `wait` is cut to this, so a request that cannot fit fails fast with LEASE_TIMEOUT
TIMEOUT = 15.0  # an answer slower than this is a hang
HEALTH = list(HealthCheck)


class Api:
    """The broker under fuzzing, over TCP, with the snapshot a rejected request must leave unchanged."""

    def __init__(self, broker: BrokerProcess) -> None:
        self.broker = broker
        self.url = broker.url
        self.session = requests.Session()

    def send(self, method: str, path: str, body: Any = None, *, raw: bytes | None = None, **kwargs: Any) -> requests.Response:
        data = raw if raw is not None else (json.dumps(body) if body is not None else None)
        return self.session.request(method, self.url + path, data=data, timeout=TIMEOUT, **kwargs)

    def snapshot(self) -> dict[str, Any]:
        """Every lease and waiting request as listed, and the leased figures of every budget; events are not state."""
        leases = self.send("GET", "/v1/leases", params={"limit": 100_000})
        node = self.send("GET", "/v1/node")
        assert leases.status_code == node.status_code == 200, (leases.text, node.text)
        figures = node.json()
        return {
            "leases": sorted(json.dumps(lease, sort_keys=True) for lease in leases.json()["leases"]),
            "gpus": [(gpu["uuid"], gpu["figures"]["leased"]) for gpu in figures["gpus"]],
            "cpu": figures["cpu"]["leased"],
            "memory": figures["memory"]["leased"],
            "queue": figures["queue"],
        }

    def lease(self, body: dict[str, Any] | None = None) -> dict[str, Any]:
        answer = self.send("POST", "/v1/leases", body or {"gpu_memory": "1GiB", "holder": {"name": "fuzz-target"}})
        assert answer.status_code == 201, answer.text
        lease: dict[str, Any] = answer.json()["lease"]
        return lease

    def release(self, lease: dict[str, Any]) -> None:
        answer = self.send("DELETE", f"/v1/leases/{lease['id']}", headers={"X-Lease-Token": lease["token"]})
        assert answer.status_code == 200, answer.text
        assert answer.json()["lease"]["state"] == "released"


def assert_one_error_shape(response: requests.Response | Any) -> str:
    """A refusal is `{"error": {"code", "message", "details"}}` with a code its status allows; its code is returned."""
    status = response.status_code
    assert status < 500, f"server error {status} for {response.request.method} {response.request.url}: {response.text[:500]}"
    try:
        body = response.json()
    except ValueError:
        raise AssertionError(f"{status} is not JSON: {response.text[:500]}") from None
    assert isinstance(body, dict), body
    assert set(body) == {"error"}, body
    error = body["error"]
    assert isinstance(error, dict), body
    assert set(error) == {"code", "message", "details"}, body
    assert isinstance(error["message"], str), body
    assert error["message"], body
    assert isinstance(error["details"], dict), body
    assert status in CODES_BY_STATUS, f"status {status} is not one SPEC §3.6 gives: {body}"
    assert error["code"] in CODES_BY_STATUS[status], f"{error['code']} answered with {status}: {body}"
    content_type = response.headers.get("content-type") or ""  # schemathesis keeps lists under lower-case names
    content_type = content_type[0] if isinstance(content_type, list) else content_type
    assert content_type.startswith("application/json"), response.headers
    code: str = error["code"]
    return code


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    """One broker process for the whole module: fuzzing is many requests, not many starts."""
    broker = BrokerProcess(tmp_path_factory.mktemp("fuzz"), "2x24GiB").start()
    try:
        yield Api(broker)
    finally:
        broker.stop()


@pytest.fixture(scope="module")
def schema(api: Api) -> Any:
    return schemathesis.openapi.from_url(api.url + "/openapi.json")


@pytest.fixture
def held(api: Api) -> Iterator[dict[str, Any]]:
    """A live lease to aim at, released afterwards (only while a test uses it: a held lease can make a deadline wait)."""
    lease = api.lease()
    yield lease
    api.release(lease)


def _operation(schema: Any, name: str) -> Any:
    method, path = name.split(" ", 1)
    return schema[path][method]


def _tame(body: Any) -> None:
    """Cut a `wait` to MAX_WAIT: a request that cannot fit would otherwise block for as long as it asks."""
    if isinstance(body, dict) and "wait" in body:
        try:
            wait = parse_duration(body["wait"])
        except Exception:  # refused by the broker anyway; the decoders' own tests cover what they raise
            return
        if wait > MAX_WAIT:
            body["wait"] = f"{int(MAX_WAIT * 1000)}ms"


def _judge(api: Api, before: dict[str, Any], response: Any, what: str) -> bool:
    """Hold one answer to the contract; True when it was accepted. A grant is released at once."""
    if response.status_code >= 400:
        assert_one_error_shape(response)
        assert api.snapshot() == before, f"rejected ({response.status_code}: {response.text[:300]}) but the state changed: {what}"
        return False
    assert response.status_code in (200, 201), f"{response.status_code} for {what}: {response.text[:500]}"
    if response.status_code == 201:
        lease = response.json()["lease"]
        assert lease["state"] == "granted", lease
        assert lease["token"], lease
        api.release(lease)
    return True


def _exercise(api: Api, case: Case, *, on_accept: Callable[[Any], None] | None = None) -> None:
    """Send one generated case and hold the broker to the contract."""
    _tame(case.body)
    before = api.snapshot()
    what = case.as_curl_command(base_url=api.url)
    try:
        response = case.call(base_url=api.url, session=api.session, timeout=TIMEOUT)
    except requests.Timeout:
        raise AssertionError(f"no answer within {TIMEOUT}s: {what}") from None
    if response.status_code < 400:
        case.validate_response(response, checks=[response_schema_conformance, content_type_conformance])
    if _judge(api, before, response, what) and on_accept is not None:
        on_accept(response)


def _fuzz(api: Api, strategy: Any, examples: int, **kwargs: Any) -> None:
    @settings(max_examples=examples, deadline=None, suppress_health_check=HEALTH)
    @given(case=strategy)
    def run(case: Case) -> None:
        _exercise(api, case, **kwargs)

    run()


# ----- the document ---------------------------------------------------------------


def test_the_served_document_is_the_one_the_fuzzing_covers(api: Api, schema: Any) -> None:
    served = api.send("GET", "/openapi.json").json()
    assert served["paths"].keys() == OPENAPI["paths"].keys()
    fuzzed = sorted(f"{op.ok().method.upper()} {op.ok().path}" for op in schema.get_all_operations())
    assert fuzzed == sorted(OPERATIONS)
    assert len(OPERATIONS) == 18
    assert STREAMS == ["GET /v1/stream"]


# ----- every operation, generated from the document ----------------------------------


@pytest.mark.parametrize("operation", FUZZED)
def test_every_operation_answers_schema_valid_input_without_a_server_error(api: Api, schema: Any, operation: str) -> None:
    _fuzz(api, _operation(schema, operation).as_strategy(generation_mode=GenerationMode.POSITIVE), 8)


@pytest.mark.parametrize("operation", NEGATABLE)
def test_every_operation_rejects_schema_invalid_input_in_the_one_error_shape(api: Api, schema: Any, operation: str) -> None:
    _fuzz(api, _operation(schema, operation).as_strategy(generation_mode=GenerationMode.NEGATIVE), 12)


@pytest.mark.slow
@pytest.mark.parametrize(("operation", "mode"), RUNS)
def test_every_operation_survives_a_long_fuzzing_run(api: Api, schema: Any, operation: str, mode: GenerationMode) -> None:
    _fuzz(api, _operation(schema, operation).as_strategy(generation_mode=mode), 120)


@pytest.mark.parametrize(("operation", "mode"), ON_A_LEASE)
def test_a_live_lease_is_unchanged_by_generated_requests_without_its_token(
    api: Api, schema: Any, held: dict[str, Any], operation: str, mode: GenerationMode
) -> None:
    # A generated token is never the lease's, so nothing but a GET may succeed (and a GET changes nothing).
    strategy = _operation(schema, operation).as_strategy(generation_mode=mode, path_parameters={"id": held["id"]})

    def only_reads(response: requests.Response) -> None:
        assert operation.startswith("GET "), f"{operation} succeeded without the lease's token: {response.text[:300]}"

    _fuzz(api, strategy, 10, on_accept=only_reads)
    assert api.send("GET", f"/v1/leases/{held['id']}").json()["lease"]["state"] == "granted"


@pytest.mark.parametrize("mode", list(GenerationMode))
def test_a_renewal_with_the_right_token_changes_the_lease_only_when_its_body_is_valid(
    api: Api, schema: Any, held: dict[str, Any], mode: GenerationMode
) -> None:
    strategy = _operation(schema, "POST /v1/leases/{id}/renew").as_strategy(
        generation_mode=mode, path_parameters={"id": held["id"]}, headers={"X-Lease-Token": held["token"]}
    )

    def renewed(response: requests.Response) -> None:
        lease = response.json()["lease"]
        assert lease["id"] == held["id"]
        assert lease["state"] == "granted"
        assert lease["ttl"] >= 1

    _fuzz(api, strategy, 10, on_accept=renewed)


# ----- meaningful requests: grants and decisions ------------------------------------------

_UNITS = ("B", "KiB", "MiB", "GiB", "KB", "MB", "GB")


@st.composite
def meaningful_requests(draw: st.DrawFn) -> dict[str, Any]:
    """Requests the broker can decide on: some fit the 2x24GiB node, some do not."""
    body: dict[str, Any] = {}
    unit = draw(st.sampled_from(_UNITS))
    scale = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9}[unit]
    wanted = draw(st.sampled_from(["gpu", "exclusive", "cpu", "memory"]))
    if wanted == "gpu":
        body["gpu_memory"] = f"{draw(st.integers(1, 30 * 2**30 // scale))}{unit}"
        body["gpus"] = draw(st.integers(1, 3))
    elif wanted == "exclusive":
        body["exclusive"] = True
        body["gpus"] = draw(st.integers(1, 3))
    elif wanted == "cpu":
        body["cpu_cores"] = draw(st.integers(1, 64))
    else:
        body["memory"] = draw(st.integers(1, 2**40))
    if body.get("gpus") == 1 and draw(st.booleans()):
        body["gpu"] = draw(st.sampled_from([0, 1, 2, "GPU-sim-0", "GPU-sim-1", "GPU-nope"]))
    for name, values in (
        ("priority", st.sampled_from(["production", "interactive", "background", "benchmark", "maintenance"])),
        ("preemption", st.sampled_from(["never", "drain", "interrupt"])),
        ("ttl", st.sampled_from([1, "2s", "10m", "1h"])),
        ("wait", st.sampled_from([0, "0s", "100ms"])),
        ("holder", st.builds(lambda name: {"name": name}, st.text("abcdefgh-", min_size=1, max_size=12))),
        ("labels", st.dictionaries(st.text("abc", min_size=1, max_size=4), st.text("xyz", max_size=4), max_size=3)),
        ("deadline", st.sampled_from(["2000-01-01T00:00:00Z", "2099-01-01T00:00:00+01:00"])),
    ):
        if draw(st.booleans()):
            body[name] = draw(values)
    return body


@settings(max_examples=25, deadline=None, suppress_health_check=HEALTH)
@given(body=meaningful_requests())
def test_a_meaningful_request_is_granted_or_refused_with_a_decision(api: Api, body: dict[str, Any]) -> None:
    before = api.snapshot()
    answer = api.send("POST", "/v1/leases", body)
    if answer.status_code == 201:
        lease = answer.json()["lease"]
        assert len(lease["gpus"]) == body.get("gpus", 0)
        assert lease["cpu_cores"] == body.get("cpu_cores", 0)
        assert lease["token"]
        api.release(lease)
        return
    code = assert_one_error_shape(answer)
    assert code in DECISIONS, answer.text
    assert api.snapshot() == before


_JUNK = st.deferred(
    lambda: st.one_of(
        st.floats(allow_nan=False),
        st.booleans(),
        st.none(),
        st.text(max_size=12),
        st.sampled_from(["", "NaN", "Infinity", "production", "caller", "GPU-sim-0"]),
        st.lists(_JUNK, max_size=2),
        st.dictionaries(st.sampled_from(["name", "pid", "k", ""]), _JUNK, max_size=2),
    )
)
_NUMBERS = st.one_of(st.integers(-(2**70), 2**70), st.sampled_from([2**53 + 1, 2**60, 2**60 + 1, 2**63, 10**400, -(10**400)]))
_SIZES = st.one_of(
    st.from_regex(r"\A[-+ ]?[0-9٣²]{1,24}([.,][0-9]{0,4})?[ \t]?(B|KiB|MiB|GiB|TiB|KB|MB|GB|TB|gib|kb|PB|b)?[ \n]?\Z"),
    st.sampled_from(["9" * 400, "9" * 400 + "GiB", "1" * 309 + "B", "1024PiB", "0.0000001GiB"]),
)
_DURATIONS = st.one_of(
    st.from_regex(r"\A[-+ ]?[0-9٣²]{1,24}([.,][0-9]{0,4})?[ \t]?(ms|s|m|h|M|H|d|us)?[ \n]?\Z"),
    st.sampled_from(["9" * 400, "9" * 400 + "ms", "1" + "0" * 17 + "h", "315360001"]),
)
_TIMES = st.one_of(
    st.from_regex(
        r"\A-?[0-9]{1,5}-[0-9]{2}-[0-9]{2}[Tt ][0-9]{2}(:[0-9]{2}(:[0-9]{2}(\.[0-9]{1,9})?)?)?([Zz]|[+-][0-9]{2}(:?[0-9]{2})?)?\Z"
    ),
    st.sampled_from(["0001-01-01T00:00:00+01:00", "9999-12-31T23:59:59-14:00", "20261130T100000Z", "2026-W48-1T10:00Z"]),
)
_BY_FIELD = {
    "gpu_memory": st.one_of(_SIZES, _NUMBERS),
    "memory": st.one_of(_SIZES, _NUMBERS),
    "ttl": st.one_of(_DURATIONS, _NUMBERS),
    "wait": st.one_of(_DURATIONS, _NUMBERS),
    "deadline": _TIMES,
    "gpus": _NUMBERS,
    "cpu_cores": _NUMBERS,
    "gpu": st.one_of(_NUMBERS, st.text(max_size=300)),
    "holder": st.fixed_dictionaries({}, optional={"name": st.text(max_size=300), "pid": _NUMBERS, "uid": _NUMBERS}),
    "labels": st.dictionaries(st.text(max_size=3), st.one_of(st.text(max_size=300), _NUMBERS), max_size=40),
}
_HOSTILE = st.lists(
    st.sampled_from((*FIELDS, "extra")).flatmap(lambda name: st.tuples(st.just(name), st.one_of(_BY_FIELD.get(name, _JUNK), _JUNK))),
    min_size=1,
    max_size=2,
).map(dict)


_BASES = st.sampled_from([{"cpu_cores": 1}, {"gpu_memory": "1GiB"}, {"exclusive": True}, {"memory": "1MiB"}, {}])


def _hostile(api: Api, base: dict[str, Any], hostile: dict[str, Any]) -> None:
    # Values the document's generator never makes (huge and negative numbers, odd digits and units, near-RFC-3339
    # times), put into a request that is otherwise sound so that each reaches its own decoder.
    body = {**base, **hostile}
    _tame(body)
    before = api.snapshot()
    try:
        answer = api.send("POST", "/v1/leases", body)
    except requests.Timeout:
        raise AssertionError(f"no answer within {TIMEOUT}s to {body!r}") from None
    _judge(api, before, answer, repr(body))


@settings(max_examples=60, deadline=None, suppress_health_check=HEALTH)
@given(base=_BASES, hostile=_HOSTILE)
def test_hostile_request_bodies_are_decided_or_refused_in_the_one_error_shape(
    api: Api, base: dict[str, Any], hostile: dict[str, Any]
) -> None:
    _hostile(api, base, hostile)


@pytest.mark.slow
@settings(max_examples=400, deadline=None, suppress_health_check=HEALTH)
@given(base=_BASES, hostile=_HOSTILE)
def test_hostile_request_bodies_survive_a_long_fuzzing_run(api: Api, base: dict[str, Any], hostile: dict[str, Any]) -> None:
    _hostile(api, base, hostile)


# ----- malformed, oversized and negative input ----------------------------------------------


@pytest.mark.parametrize("raw", [b"{", b"not json", b"\xff\xfe", b"[1, 2", b'{"cpu_cores": NaN}', b'{"cpu_cores": 1}{', b"[" * 20_000])
def test_a_malformed_body_is_an_invalid_request(api: Api, held: dict[str, Any], raw: bytes) -> None:
    before = api.snapshot()
    for path in ("/v1/leases", f"/v1/leases/{held['id']}/renew", f"/v1/leases/{held['id']}/processes"):
        answer = api.send("POST", path, raw=raw, headers={"X-Lease-Token": held["token"], "Content-Type": "application/json"})
        assert answer.status_code == 400, (path, answer.text)
        assert assert_one_error_shape(answer) == "INVALID_REQUEST"
    assert api.snapshot() == before


def test_a_body_over_max_body_is_refused_with_413(api: Api, held: dict[str, Any]) -> None:
    before = api.snapshot()
    huge = json.dumps({"cpu_cores": 1, "labels": {"pad": "x" * (64 * 2**10)}}).encode()
    for path in ("/v1/leases", f"/v1/leases/{held['id']}/renew", f"/v1/leases/{held['id']}/processes"):
        answer = api.send("POST", path, raw=huge, headers={"X-Lease-Token": held["token"]})
        assert answer.status_code == 413, (path, answer.text)
        assert assert_one_error_shape(answer) == "INVALID_REQUEST"
        assert answer.json()["error"]["details"]["max_body"] == 64 * 2**10
    assert api.snapshot() == before


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"gpu_memory": -1}, "gpu_memory"),
        ({"gpu_memory": "-1GiB"}, "gpu_memory"),
        ({"memory": -(2**30)}, "memory"),
        ({"gpus": -1, "exclusive": True}, "gpus"),
        ({"cpu_cores": -4}, "cpu_cores"),
        ({"cpu_cores": 1, "ttl": -1}, "ttl"),
        ({"cpu_cores": 1, "ttl": "-5m"}, "ttl"),
        ({"cpu_cores": 1, "wait": -1}, "wait"),
        ({"cpu_cores": 1, "wait": "-100ms"}, "wait"),
        ({"gpu_memory": "1GiB", "gpu": -1}, "gpu"),
        ({"cpu_cores": 1, "holder": {"pid": -1}}, "holder.pid"),
        ({"cpu_cores": 1, "holder": {"pid": 0}}, "holder.pid"),
        ({"gpu_memory": 1.5}, "gpu_memory"),
        ({"cpu_cores": True}, "cpu_cores"),
        ({"cpu_cores": [1]}, "cpu_cores"),
        ({"cpu_cores": 1, "wait": {"s": 1}}, "wait"),
    ],
)
def test_a_negative_or_mistyped_figure_is_an_invalid_request_naming_its_field(api: Api, body: dict[str, Any], field: str) -> None:
    before = api.snapshot()
    answer = api.send("POST", "/v1/leases", body)
    assert answer.status_code == 400, answer.text
    assert assert_one_error_shape(answer) == "INVALID_REQUEST"
    assert answer.json()["error"]["details"].get("field") == field
    assert api.snapshot() == before


@pytest.mark.parametrize("ttl", [-1, "-1s", 0, "0ms", 1.5, True, "soon"])
def test_a_renewal_with_a_bad_ttl_is_an_invalid_request_and_changes_nothing(api: Api, held: dict[str, Any], ttl: Any) -> None:
    before = api.snapshot()
    answer = api.send("POST", f"/v1/leases/{held['id']}/renew", {"ttl": ttl}, headers={"X-Lease-Token": held["token"]})
    assert answer.status_code == 400, answer.text
    assert assert_one_error_shape(answer) == "INVALID_REQUEST"
    assert api.snapshot() == before


@pytest.mark.parametrize("pgid", [-1, 0, 1, 2**22, "1234", True, None, 1.5])
def test_a_bad_process_group_is_an_invalid_request_even_with_the_right_token(api: Api, held: dict[str, Any], pgid: Any) -> None:
    before = api.snapshot()
    answer = api.send("POST", f"/v1/leases/{held['id']}/processes", {"pgid": pgid}, headers={"X-Lease-Token": held["token"]})
    assert answer.status_code == 400, answer.text
    assert assert_one_error_shape(answer) == "INVALID_REQUEST"
    assert api.snapshot() == before


@pytest.mark.parametrize(
    "query",
    [
        "/v1/leases?limit=0",
        "/v1/leases?limit=-1",
        "/v1/leases?limit=100001",
        "/v1/leases?limit=ten",
        "/v1/leases?state=lost",
        "/v1/events?after=-1",
        "/v1/events?limit=0",
        "/v1/events?limit=1001",
        "/v1/events?after=1.5",
    ],
)
def test_a_query_out_of_range_is_an_invalid_request(api: Api, query: str) -> None:
    answer = api.send("GET", query)
    assert answer.status_code == 400, answer.text
    assert assert_one_error_shape(answer) == "INVALID_REQUEST"
    assert answer.json()["error"]["details"]["field"] in ("limit", "state", "after")


@pytest.mark.parametrize(
    ("method", "path"), [("GET", "/nope"), ("GET", "/v1"), ("POST", "/v1/lease"), ("GET", "/v1/leases/x/y/z"), ("DELETE", "/v2")]
)
def test_an_unknown_path_is_not_found_in_the_one_error_shape(api: Api, method: str, path: str) -> None:
    answer = api.send(method, path)
    assert answer.status_code == 404, answer.text
    assert assert_one_error_shape(answer) == "NOT_FOUND"
    assert answer.json()["error"]["details"]["path"] == path


@pytest.mark.parametrize(
    ("method", "path"),
    [("PUT", "/v1/leases"), ("PATCH", "/v1/leases/l-x"), ("DELETE", "/v1/node"), ("POST", "/healthz"), ("GET", "/v1/leases/l-x/renew")],
)
def test_a_wrong_method_is_refused_in_the_one_error_shape(api: Api, method: str, path: str) -> None:
    before = api.snapshot()
    answer = api.send(method, path, {"cpu_cores": 1})
    assert answer.status_code == 405, answer.text
    assert assert_one_error_shape(answer) == "INVALID_REQUEST"
    assert method in answer.json()["error"]["message"]
    assert api.snapshot() == before


@pytest.mark.parametrize(
    "host",
    [
        "evil.example",
        "evil.example:80",
        "127.0.0.2",
        "localhost.evil.example",
        "[::2]:9740",
        "",
        "[::1",
        "localhost:abc",
        "[::1]x",
        "localhost:1:2",
    ],
)
def test_a_foreign_host_header_on_tcp_is_forbidden(api: Api, host: str) -> None:
    before = api.snapshot()
    for method, path, body in (("GET", "/v1/node", None), ("POST", "/v1/leases", {"cpu_cores": 1}), ("GET", "/openapi.json", None)):
        answer = api.send(method, path, body, headers={"Host": host})
        assert answer.status_code == 403, (host, path, answer.text)
        assert assert_one_error_shape(answer) == "FORBIDDEN"
    assert api.snapshot() == before


def test_the_broker_own_names_are_accepted_as_host(api: Api) -> None:
    for host in ("localhost", f"localhost:{api.broker.port}", f"127.0.0.1:{api.broker.port}", "[::1]", "LOCALHOST"):
        answer = api.send("GET", "/healthz", headers={"Host": host})
        assert answer.status_code == 200, (host, answer.text)


def test_bind_caller_over_tcp_without_a_holder_pid_is_an_invalid_request(api: Api) -> None:
    before = api.snapshot()
    answer = api.send("POST", "/v1/leases", {"cpu_cores": 1, "bind": "caller"})
    assert answer.status_code == 400, answer.text
    assert assert_one_error_shape(answer) == "INVALID_REQUEST"
    assert answer.json()["error"]["details"]["field"] == "bind"
    assert api.snapshot() == before


def test_a_request_that_cannot_fit_now_waits_its_wait_then_times_out_unchanged(api: Api, held: dict[str, Any]) -> None:
    before = api.snapshot()
    started = time.monotonic()
    answer = api.send("POST", "/v1/leases", {"gpu_memory": "23GiB", "gpus": 2, "wait": "200ms"})  # 1 GiB of one GPU is held
    assert 0.15 <= time.monotonic() - started < TIMEOUT
    assert answer.status_code == 409, answer.text
    assert assert_one_error_shape(answer) == "LEASE_TIMEOUT"
    assert api.snapshot() == before


def test_a_request_no_gpu_here_could_ever_hold_is_refused_at_once_even_when_it_would_wait(api: Api) -> None:
    before = api.snapshot()
    answer = api.send("POST", "/v1/leases", {"gpu_memory": "30GiB", "wait": "1h"})
    assert answer.status_code == 409, answer.text
    assert assert_one_error_shape(answer) == "CAPABILITY_UNAVAILABLE"
    assert "can lease at most 23.0 GiB" in answer.json()["error"]["message"]
    assert api.snapshot() == before


# ----- inputs that once made server errors: each stays a test


@pytest.mark.parametrize(
    ("path", "body"),
    [("/v1/leases", {"cpu_cores": 1, "ttl": 10**400}), ("/v1/leases", {"cpu_cores": 1, "wait": 10**400}), ("renew", {"ttl": 10**400})],
)
def test_a_huge_integer_duration_is_refused_not_a_server_error(api: Api, held: dict[str, Any], path: str, body: dict[str, Any]) -> None:
    target = f"/v1/leases/{held['id']}/renew" if path == "renew" else path
    answer = api.send("POST", target, body, headers={"X-Lease-Token": held["token"]})
    assert answer.status_code == 400, answer.text
    assert assert_one_error_shape(answer) == "INVALID_REQUEST"


@pytest.mark.parametrize("body", [{"gpu_memory": "9" * 400}, {"memory": "9" * 400 + "GiB"}])
def test_a_size_with_hundreds_of_digits_is_refused_not_a_server_error(api: Api, body: dict[str, Any]) -> None:
    answer = api.send("POST", "/v1/leases", body)
    assert answer.status_code == 400, answer.text
    assert assert_one_error_shape(answer) == "INVALID_REQUEST"


@pytest.mark.parametrize(
    "body",
    [
        {"cpu_cores": 1, "deadline": "0001-01-01T00:00:00+01:00"},
        {"gpu_memory": "100GiB", "deadline": "9999-12-31T23:59:59-14:00"},
    ],
)
def test_a_deadline_beyond_year_9999_in_utc_is_refused_not_a_server_error(api: Api, body: dict[str, Any]) -> None:
    answer = api.send("POST", "/v1/leases", body)
    assert_one_error_shape(answer)


@pytest.mark.parametrize("query", ["/v1/events?after=%C2%B2", "/v1/leases?limit=%C2%B2", "/v1/events?limit=%E2%91%A0"])
def test_a_query_integer_in_superscript_digits_is_refused_not_a_server_error(api: Api, query: str) -> None:
    answer = api.send("GET", query)
    assert answer.status_code == 400, answer.text
    assert assert_one_error_shape(answer) == "INVALID_REQUEST"


@pytest.mark.parametrize("method", ["DELETE", "POST"])
def test_a_token_that_is_not_utf8_is_forbidden_not_a_server_error(api: Api, held: dict[str, Any], method: str) -> None:
    path = f"/v1/leases/{held['id']}" + ("/renew" if method == "POST" else "")
    answer = api.send(method, path, headers={"X-Lease-Token": b"\xff\xfe"})
    assert answer.status_code == 403, answer.text
    assert assert_one_error_shape(answer) == "FORBIDDEN"


@pytest.mark.parametrize(
    "body",
    [
        {"cpu_cores": 1, "labels": {"k": "\ud800"}},
        pytest.param({"cpu_cores": 1, "holder": {"name": "\udfff"}}, marks=pytest.mark.slow),
        pytest.param({"gpu_memory": "1GiB", "gpu": "GPU-\ud800"}, marks=pytest.mark.slow),  # refused, but its event is stored
    ],
)
def test_a_lone_surrogate_in_a_request_does_not_stop_the_store(broker_process: type[BrokerProcess], body: dict[str, Any]) -> None:
    # Its own broker: today this request leaves the broker unable to commit anything ever again.
    broker = broker_process("2x24GiB").start()
    session = requests.Session()
    try:
        with contextlib.suppress(requests.Timeout):  # the request itself may be the one left hanging
            first = session.post(broker.url + "/v1/leases", data=json.dumps(body), timeout=1.5)
            assert first.status_code < 500, first.text
        second = session.post(broker.url + "/v1/leases", data=json.dumps({"cpu_cores": 1}), timeout=1.5)
        assert second.status_code == 201, second.text
    finally:
        broker.kill()  # a stuck writer would make a graceful stop wait out its grace
