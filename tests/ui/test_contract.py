"""Every answer of a real broker held to what /openapi.json says of it: the status listed for its operation, its
content type, and its body against the schema (the subset of JSON Schema the document uses)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import requests
from aiohttp.test_utils import TestClient, TestServer
from conftest import BrokerProcess, wait_for
from fakes import GIB, FakeClock, FakeGpuProbe

from gpubroker.broker.request import MAX_CORES, MAX_GPUS, MAX_LABELS, MAX_PID, MAX_TEXT
from gpubroker.broker.service import Broker
from gpubroker.broker.store import Store
from gpubroker.config import Config
from gpubroker.ui.api import make_app
from gpubroker.ui.auth import Guard, Sessions, hash_password
from gpubroker.ui.openapi import OPENAPI

TYPES: dict[str, type | tuple[type, ...]] = {
    "object": dict,
    "array": list,
    "string": str,
    "boolean": bool,
    "integer": int,
    "number": (int, float),
}


def schema_errors(schema: dict[str, Any], value: Any, where: str = "$") -> list[str]:
    """Where `value` breaks `schema`: type (and nullable), enum, required, properties, additionalProperties, items,
    oneOf, minimum, maximum, minLength, maxLength, maxProperties, pattern and $ref, as the document uses them."""
    while "$ref" in schema:
        schema = OPENAPI["components"]["schemas"][schema["$ref"].rpartition("/")[2]]
    if value is None:
        typed = any(word in schema for word in ("type", "oneOf", "enum", "properties"))
        return [f"{where}: null, which it may not be"] if typed and not schema.get("nullable") else []
    found: list[str] = []
    if "oneOf" in schema and sum(not schema_errors(choice, value, where) for choice in schema["oneOf"]) != 1:
        found.append(f"{where}: {value!r} matches not exactly one of oneOf")
    kind = schema.get("type")
    if kind is not None and (not isinstance(value, TYPES[kind]) or (isinstance(value, bool) and kind in ("integer", "number"))):
        return [*found, f"{where}: {value!r} is not {kind}"]
    if "enum" in schema and value not in schema["enum"]:
        found.append(f"{where}: {value!r} is not one of {schema['enum']}")
    if isinstance(value, int | float) and not isinstance(value, bool):
        if value < schema.get("minimum", value) or value > schema.get("maximum", value):
            found.append(f"{where}: {value!r} is out of range")
    if isinstance(value, str):
        if not schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", len(value)) or (
            "pattern" in schema and not re.search(schema["pattern"], value)
        ):
            found.append(f"{where}: {value!r} is not of the form asked")
    if isinstance(value, dict):
        found += [f"{where}: {name} is missing" for name in schema.get("required", []) if name not in value]
        if len(value) > schema.get("maxProperties", len(value)):
            found.append(f"{where}: more than {schema['maxProperties']} properties")
        properties, extra = schema.get("properties", {}), schema.get("additionalProperties", True)
        for name, item in value.items():
            if name in properties:
                found += schema_errors(properties[name], item, f"{where}.{name}")
            elif extra is False:
                found.append(f"{where}: {name} is not a property it may have")
            elif isinstance(extra, dict):
                found += schema_errors(extra, item, f"{where}.{name}")
    if isinstance(value, list) and "items" in schema:
        for index, item in enumerate(value):
            found += schema_errors(schema["items"], item, f"{where}[{index}]")
    return found


def operation(method: str, path: str) -> tuple[str, dict[str, Any]]:
    """The document's operation that serves this method and path (a concrete one, with ids filled in)."""
    for template, item in OPENAPI["paths"].items():
        if re.fullmatch(re.sub(r"\{[^}]+\}", "[^/]+", template), path) and method.lower() in item:
            return template, item[method.lower()]
    raise AssertionError(f"/openapi.json has no operation {method} {path}")


def contract_errors(method: str, path: str, status: int, content_type: str, body: bytes) -> list[str]:
    """How one answer departs from what the document says of its operation; empty when it keeps to it."""
    template, op = operation(method, path.partition("?")[0])
    what = f"{method} {template} answered {status}"
    response = op["responses"].get(str(status)) or op["responses"].get("default")
    if response is None:
        return [f"{what}, which it does not list (it lists {', '.join(sorted(op['responses']))}): {body[:300]!r}"]
    media = content_type.partition(";")[0].strip()
    if media not in response.get("content", {}):
        return [f"{what} as {media}, not as {', '.join(response.get('content', {}))}"]
    if media != "application/json":
        return []
    import json

    return [f"{what}: {problem}" for problem in schema_errors(response["content"][media]["schema"], json.loads(body))]


def undeclared_fields(path: str, body: Any) -> list[str]:
    """The fields of the leases an answer carries, or of /v1/node and its GPUs, that the document does not describe: a
    client made from the document would know nothing of them (an answer may gain fields, but each is described)."""
    schemas = OPENAPI["components"]["schemas"]
    if not isinstance(body, dict):
        return []
    found: set[str] = set()
    if path.partition("?")[0] == "/v1/node":
        found |= {f"Node.{name}" for name in body if name not in schemas["Node"]["properties"]}
        gpu = schemas["Node"]["properties"]["gpus"]["items"]["properties"]
        found |= {f"Node.gpus[].{name}" for item in body.get("gpus", []) for name in item if name not in gpu}
    leases = [body["lease"]] if isinstance(body.get("lease"), dict) else []
    leases += body.get("leases", []) if isinstance(body.get("leases"), list) else []
    found |= {f"Lease.{name}" for lease in leases for name in lease if name not in schemas["Lease"]["properties"]}
    return sorted(f"{name} is not described" for name in found)


class Api:
    """A broker over TCP whose every answer is checked against the document as it comes."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.session = requests.Session()
        self.broken: list[str] = []
        self.answered: set[tuple[str, str, int]] = set()

    def __call__(self, method: str, path: str, body: Any = None, *, headers: dict[str, str] | None = None) -> requests.Response:
        answer = self.session.request(method, self.url + path, json=body, headers=headers, timeout=15)
        self.broken += contract_errors(method, path, answer.status_code, answer.headers.get("Content-Type", ""), answer.content)
        if answer.ok and answer.headers.get("Content-Type", "").startswith("application/json"):
            self.broken += undeclared_fields(path, answer.json())
        self.answered.add((method, operation(method, path.partition("?")[0])[0], answer.status_code))
        return answer


@pytest.fixture
def api(broker_process: type[BrokerProcess], tmp_path: Path) -> Api:
    config = tmp_path / "gpubroker.toml"
    config.write_text("queue_limit = 1\n")
    return Api(broker_process("2x24GiB", ["--config", str(config)]).start().url)


def test_every_answer_of_a_lease_through_its_life_is_as_the_document_says(api: Api) -> None:
    granted = api("POST", "/v1/leases", {"gpu_memory": "20GiB", "gpu": 0, "holder": {"name": "train"}, "labels": {"a": "b"}})
    assert granted.status_code == 201
    lease = granted.json()["lease"]
    token = {"X-Lease-Token": lease["token"]}
    api("GET", f"/v1/leases/{lease['id']}")
    api("GET", "/v1/leases?state=granted")
    api("POST", f"/v1/leases/{lease['id']}/renew", {"ttl": "10m"}, headers=token)
    api("POST", f"/v1/leases/{lease['id']}/renew", {"ttl": "forever"}, headers=token)
    api("POST", f"/v1/leases/{lease['id']}/renew", headers={"X-Lease-Token": "not-its-token"})
    api("POST", "/v1/leases/l-000000000000/renew", headers=token)
    api("POST", f"/v1/leases/{lease['id']}/processes", {"pgid": 12345}, headers=token)  # never over TCP
    api("POST", f"/v1/leases/{lease['id']}/processes", {"pgid": "x"}, headers=token)
    for refused in (
        {"gpu_memory": "20GiB", "gpu": 0},  # no room now
        {"gpu_memory": "100GiB"},  # no room ever
        {"gpu_memory": "1GiB", "deadline": "2000-01-01T00:00:00Z"},
        {"gpu_memory": "20GiB", "gpu": 0, "wait": "100ms"},
        {"gpu_memory": "lots"},
        {"cpu_cores": 1, "labels": {"x": "y" * 100_000}},  # larger than max_body
    ):
        assert api("POST", "/v1/leases", refused).status_code >= 400, refused
    # A request that waits for GPU 0, shown as queued while it does; the next of its class finds the queue full.
    waited: dict[str, requests.Response] = {}
    waiter = threading.Thread(
        target=lambda: waited.update(
            answer=api("POST", "/v1/leases", {"gpu_memory": "20GiB", "gpu": 0, "wait": "3s", "priority": "background"})
        )
    )
    waiter.start()
    try:
        queued = []
        for _ in range(100):
            queued = [x for x in api("GET", "/v1/leases").json()["leases"] if x["state"] == "queued"]
            if queued:
                break
            time.sleep(0.05)
        assert queued
        api("GET", f"/v1/leases/{queued[0]['id']}")
        api("POST", f"/v1/leases/{queued[0]['id']}/renew")
        assert api("POST", "/v1/leases", {"gpu_memory": "20GiB", "gpu": 0, "wait": "20s", "priority": "background"}).status_code == 429
        api("GET", "/v1/node")
        api("GET", "/metrics")
        api("DELETE", f"/v1/leases/{queued[0]['id']}")  # not its requester's to cancel on TCP: its wait runs out
    finally:
        waiter.join(30)
    assert waited["answer"].status_code == 409
    assert api("DELETE", f"/v1/leases/{lease['id']}", headers=token).status_code == 200
    api("DELETE", f"/v1/leases/{lease['id']}", headers=token)  # released already
    api("DELETE", "/v1/leases/l-000000000000")
    short = api("POST", "/v1/leases", {"cpu_cores": 1, "ttl": 1}).json()["lease"]
    for _ in range(100):
        if api("GET", f"/v1/leases/{short['id']}").json()["lease"]["state"] == "expired":
            break
        time.sleep(0.05)
    api("GET", "/v1/leases?state=expired")
    api("GET", "/v1/leases?state=lost")
    api("GET", "/v1/leases?node=elsewhere")
    api("GET", "/v1/events?limit=1000")
    api("GET", "/v1/events?after=x")
    for method, path in (("GET", "/v1/node"), ("GET", "/v1/cluster"), ("GET", "/healthz"), ("GET", "/metrics")):
        api(method, path)
    for method, path in (  # a broker in no cluster; and on TCP no one changes the cluster
        ("GET", "/v1/cluster/nodes"),
        ("GET", "/v1/cluster/keys"),
        ("POST", "/v1/cluster/keys"),
        ("POST", "/v1/cluster/invites"),
        ("POST", "/v1/cluster/nodes/n-x/approve"),
        ("DELETE", "/v1/cluster/nodes/n-x"),
    ):
        api(method, path)
    assert api.broken == []
    codes = {status for _, _, status in api.answered}
    assert {200, 201, 400, 403, 404, 409, 413, 429} <= codes  # the drive went where it meant to


def test_an_answer_to_a_foreign_host_an_unread_coding_or_an_unmet_expectation_is_one_every_operation_lists(api: Api) -> None:
    for template, item in OPENAPI["paths"].items():
        for method in item:
            answer = api(method.upper(), template.replace("{id}", "l-000000000000"), headers={"Host": "rebound.example"})
            assert answer.status_code == 403, (method, template)
            answer = api(method.upper(), template.replace("{id}", "l-000000000000"), headers={"Content-Encoding": "foo"})
            assert answer.status_code == 415, (method, template)
            answer = api(method.upper(), template.replace("{id}", "l-000000000000"), headers={"Expect": "fancy"})
            assert answer.status_code == 417, (method, template)
    assert api.broken == []


async def test_an_answer_to_a_caller_not_signed_in_is_one_every_operation_lists(tmp_path: Path) -> None:
    clock = FakeClock()
    config = Config(state_dir=tmp_path / "state", name="tower", ui_password_hash=hash_password("a long password", n=2**4))
    broker = Broker(config, Store(config.state_dir, config.store_size, config.events_kept), FakeGpuProbe(clock, [24 * GIB]), clock)
    await broker.start()
    guard = Guard(config.ui_password_hash, "the-api-token", tls=False, sessions=Sessions())
    client: TestClient[Any, Any] = TestClient(TestServer(make_app(broker, guard=guard)))
    await client.start_server()
    broken: list[str] = []
    try:
        for template, item in OPENAPI["paths"].items():
            for method in item:
                path = template.replace("{id}", "l-000000000000")
                answer = await client.request(method.upper(), path, headers={"Host": "localhost"})
                assert answer.status == 401, (method, template)
                broken += contract_errors(method.upper(), path, answer.status, answer.headers.get("Content-Type", ""), await answer.read())
    finally:
        await client.close()
        await broker.close()
    assert broken == []


BEYOND_A_BOUND = [
    {"cpu_cores": MAX_CORES + 1},
    {"gpu_memory": "1GiB", "gpu": MAX_GPUS},
    {"gpu_memory": "1GiB", "gpu": "G" * (MAX_TEXT + 1)},
    {"cpu_cores": 1, "holder": {"name": "n" * (MAX_TEXT + 1)}},
    {"cpu_cores": 1, "holder": {"pid": MAX_PID + 1}},
    {"cpu_cores": 1, "labels": {f"k{i}": "v" for i in range(MAX_LABELS + 1)}},
    {"cpu_cores": 1, "labels": {"k": "v" * (MAX_TEXT + 1)}},
    {"cpu_cores": 1, "ttl": 0},
]


@pytest.mark.parametrize("body", BEYOND_A_BOUND)
def test_a_request_refused_for_going_past_a_bound_is_one_the_document_says_is_invalid(api: Api, body: dict[str, Any]) -> None:
    assert api("POST", "/v1/leases", body).json()["error"]["code"] == "INVALID_REQUEST"
    assert schema_errors({"$ref": "#/components/schemas/LeaseRequest"}, body) != []  # a client can know before it asks


@pytest.mark.parametrize("pgid", [1, MAX_PID + 1])
def test_a_process_group_refused_for_going_past_a_bound_is_one_the_document_says_is_invalid(api: Api, pgid: int) -> None:
    lease = api("POST", "/v1/leases", {"cpu_cores": 1, "bind": "none"}).json()["lease"]
    refused = api("POST", f"/v1/leases/{lease['id']}/processes", {"pgid": pgid}, headers={"X-Lease-Token": lease["token"]})
    assert refused.json()["error"]["code"] == "INVALID_REQUEST"
    schema = OPENAPI["paths"]["/v1/leases/{id}/processes"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert schema_errors(schema, {"pgid": pgid}) != []  # a client can know before it asks


def test_a_gpu_that_cannot_be_read_is_answered_as_the_document_says_and_shown_by_status(
    broker_process: type[BrokerProcess], tmp_path: Path
) -> None:
    """GPU 1 fallen off the bus: /v1/node, /healthz, /metrics and `gpubroker status` name it and why, GPU 0 is brokered."""
    sim = tmp_path / "gpus.toml"
    sim.write_text('[[gpu]]\nmemory = "24GiB"\n[[gpu]]\nmemory = "24GiB"\nunreadable = "GPU is lost (Xid 79)"\n')
    broker = broker_process(str(sim)).start()
    api = Api(broker.url)
    unreadable = {"index": 1, "uuid": "GPU-sim-1", "error": "simulated: GPU is lost (Xid 79)"}

    assert api("POST", "/v1/leases", {"gpu_memory": "1GiB", "bind": "none"}).status_code == 201
    refused = api("POST", "/v1/leases", {"gpu_memory": "1GiB", "gpu": 1, "bind": "none"})
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "DRIVER_ERROR"
    assert "GPU 1 (GPU-sim-1) cannot be read: simulated: GPU is lost (Xid 79)" in refused.json()["error"]["message"]
    node = api("GET", "/v1/node").json()
    assert ([g["index"] for g in node["gpus"]], node["unreadable_gpus"]) == ([0], [{**unreadable, "leases": []}])
    assert api("GET", "/healthz").json()["unreadable_gpus"] == [unreadable]
    assert 'gpubroker_gpu_unreadable{index="1",uuid="GPU-sim-1"} 1.0' in api("GET", "/metrics").text
    assert api.broken == []
    assert "(GPU 1 (GPU-sim-1) cannot be read: simulated: GPU is lost (Xid 79))" in broker.ready_line

    status = subprocess.run([sys.executable, "-m", "gpubroker", "status"], env=broker.env, capture_output=True, text=True, timeout=30)
    lines = status.stdout.splitlines()
    at = lines.index("GPU 1  GPU-sim-1  UNREADABLE: simulated: GPU is lost (Xid 79)")
    assert lines[at + 1] == "  not offered until it can be read again"
    assert lines[at - 1].startswith("  total 24.0")  # after GPU 0, in the node's order


def test_a_leased_gpu_the_driver_no_longer_lists_is_answered_missing_as_the_document_says_and_shown_by_status(
    broker_process: type[BrokerProcess], tmp_path: Path
) -> None:
    """GPU 1 gone from the driver's list (the simulation file edited down) with a lease on it: /v1/node, /healthz,
    /metrics, the ready line and `gpubroker status` show it missing with its lease and bytes, until it is listed again."""
    sim = tmp_path / "gpus.toml"
    both = '[[gpu]]\nmemory = "24GiB"\n[[gpu]]\nmemory = "24GiB"\nname = "RTX 4090"\n'
    sim.write_text(both)
    broker = broker_process(str(sim)).start()
    api = Api(broker.url)
    held = api("POST", "/v1/leases", {"gpu_memory": "4GiB", "gpu": 1, "bind": "none"}).json()["lease"]
    sim.write_text('[[gpu]]\nmemory = "24GiB"\n')
    wait_for(lambda: api("GET", "/v1/node").json()["missing_gpus"], timeout=60)

    node = api("GET", "/v1/node").json()
    [missing] = node["missing_gpus"]
    assert {k: v for k, v in missing.items() if k != "since"} == {
        "index": 1, "uuid": "GPU-sim-1", "name": "RTX 4090", "leases": [held["id"]], "bytes": 4 * GIB,
    }  # fmt: skip
    assert [g["index"] for g in node["gpus"]] == [0]
    assert api("GET", "/healthz").json()["missing_gpus"] == [{k: v for k, v in missing.items() if k != "leases"}]
    assert 'gpubroker_gpu_missing{index="1",uuid="GPU-sim-1"} 1.0' in api("GET", "/metrics").text
    assert api("POST", "/v1/leases", {"gpu_memory": "1GiB", "gpu": "GPU-sim-1", "bind": "none"}).status_code == 409
    assert api.broken == []

    status = subprocess.run([sys.executable, "-m", "gpubroker", "status"], env=broker.env, capture_output=True, text=True, timeout=30)
    lines = status.stdout.splitlines()
    at = lines.index(f"GPU 1  RTX 4090  GPU-sim-1  MISSING since {missing['since']}: no longer listed by the driver")
    assert lines[at + 1] == f"  leases {held['id']} hold 4.0 GiB on it and stay until released or expired; nothing is granted on it"
    assert lines[at - 1].startswith("  total 24.0")  # after GPU 0, in the node's order
    as_json = subprocess.run(
        [sys.executable, "-m", "gpubroker", "status", "--json"], env=broker.env, capture_output=True, text=True, timeout=30
    )
    assert json.loads(as_json.stdout)["node"]["missing_gpus"] == [missing]

    broker.stop()
    broker.start()
    said = f"(GPU-sim-1 is no longer listed by the driver: leases {held['id']} hold 4.0 GiB on it)"
    assert said in broker.ready_line, broker.ready_line
    sim.write_text(both)
    wait_for(lambda: not api("GET", "/v1/node").json()["missing_gpus"], timeout=60)
    assert api("GET", "/healthz").json()["missing_gpus"] == []
    status = subprocess.run([sys.executable, "-m", "gpubroker", "status"], env=broker.env, capture_output=True, text=True, timeout=30)
    assert "MISSING" not in status.stdout
