"""The HTTP API of one node against a real broker process: shapes, identities, metrics, documents; what it reads of
the other members, in process against a mesh that holds their documents."""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import pwd
import re
import socket as sockets
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from conftest import BrokerProcess
from emitted import event_types
from fakes import GIB, FakeClock, FakeGpuProbe
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from gpubroker.broker.service import Broker
from gpubroker.broker.store import RECOVERED_AFTER, Store, Write
from gpubroker.client import ClientError
from gpubroker.config import Config
from gpubroker.errors import FailureCode, InvalidRequest, StoreFull
from gpubroker.gossip.cluster import ClusterState, decode_token
from gpubroker.gossip.documents import NodeDocument
from gpubroker.gossip.identity import Identity
from gpubroker.gossip.membership import MemberView
from gpubroker.gossip.mesh import Mesh, MeshSettings
from gpubroker.gossip.messages import MemberState
from gpubroker.ui.api import decode_json, loopback_peer_uid, make_app
from gpubroker.ui.metrics import Metrics
from gpubroker.ui.openapi import OPENAPI

# JSON values as json.dumps writes them: a dictionary's keys are each given once.
JSON_VALUES = st.recursive(
    st.one_of(
        st.none(), st.booleans(), st.integers(-(2**64), 2**64), st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8)
    ),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=10,
)


@pytest.fixture
def broker(broker_process: type[BrokerProcess]) -> BrokerProcess:
    return broker_process("2x24GiB").start()


def test_on_the_unix_socket_the_holder_is_the_kernels_word_not_the_body(broker: BrokerProcess) -> None:
    lease = broker.client().call("POST", "/v1/leases", {"gpu_memory": "1GiB", "holder": {"name": "me", "pid": 1}})["lease"]
    assert lease["bind"] == "caller"
    assert lease["holder"] == {"name": "me", "pid": os.getpid(), "uid": os.getuid()}
    broker.client().call("DELETE", f"/v1/leases/{lease['id']}")  # its own Unix user needs no token


def test_on_tcp_a_lease_lives_by_its_ttl_and_only_its_token_acts_on_it(broker: BrokerProcess) -> None:
    tcp = broker.client(tcp=True)
    lease = tcp.call("POST", "/v1/leases", {"gpu_memory": "1GiB", "ttl": "2m"})["lease"]
    assert lease["bind"] == "none"
    assert lease["holder"]["uid"] is None
    for method, path in (("POST", f"/v1/leases/{lease['id']}/renew"), ("DELETE", f"/v1/leases/{lease['id']}")):
        with pytest.raises(ClientError) as refused:
            tcp.call(method, path, headers={"X-Lease-Token": "wrong"})
        assert (refused.value.status, refused.value.code) == (403, "FORBIDDEN")
    renewed = tcp.call("POST", f"/v1/leases/{lease['id']}/renew", {"ttl": "10m"}, headers={"X-Lease-Token": lease["token"]})["lease"]
    assert renewed["ttl"] == 600
    released = tcp.call("DELETE", f"/v1/leases/{lease['id']}", headers={"X-Lease-Token": lease["token"]})["lease"]
    assert released["state"] == "released"
    assert "token" not in released
    with pytest.raises(ClientError) as again:
        tcp.call("DELETE", f"/v1/leases/{lease['id']}", headers={"X-Lease-Token": lease["token"]})
    assert again.value.code == "LEASE_CONFLICT"
    with pytest.raises(ClientError) as unknown:
        tcp.call("DELETE", "/v1/leases/l-unknown", headers={"X-Lease-Token": lease["token"]})
    assert (unknown.value.status, unknown.value.code) == (404, "NOT_FOUND")


def test_a_process_group_id_that_cannot_be_one_is_refused_naming_the_range(broker: BrokerProcess) -> None:
    client = broker.client()
    lease = client.call("POST", "/v1/leases", {"cpu_cores": 1, "bind": "none"})["lease"]
    for pgid in (1, 2**22, "4242"):
        with pytest.raises(ClientError) as refused:
            client.call("POST", f"/v1/leases/{lease['id']}/processes", {"pgid": pgid})
        assert (refused.value.status, refused.value.code) == (400, "INVALID_REQUEST")
        assert refused.value.message == 'register a process group as {"pgid": N} with N a process group id, an integer from 2 to 4194303'
    client.call("DELETE", f"/v1/leases/{lease['id']}")


def test_the_lease_shape_has_every_field_the_api_promises(broker: BrokerProcess) -> None:
    lease = broker.client(tcp=True).call("POST", "/v1/leases", {"gpu_memory": "2GiB", "labels": {"project": "lora"}})["lease"]
    for field in ("id", "state", "epoch", "env", "gpus", "priority", "preemption", "bind", "holder", "token", "expires_at", "granted_at"):
        assert field in lease, field
    assert set(lease["gpus"][0]) == {"index", "uuid", "bytes", "epoch"}
    assert lease["labels"] == {"project": "lora"}


def test_leases_are_listed_by_state_and_limited(broker: BrokerProcess) -> None:
    tcp = broker.client(tcp=True)
    made = [tcp.call("POST", "/v1/leases", {"gpu_memory": "1GiB"})["lease"] for _ in range(3)]
    tcp.call("DELETE", f"/v1/leases/{made[0]['id']}", headers={"X-Lease-Token": made[0]["token"]})
    granted = tcp.call("GET", "/v1/leases", query={"state": "granted"})["leases"]
    assert sorted(x["id"] for x in granted) == sorted(x["id"] for x in made[1:])
    assert [x["id"] for x in tcp.call("GET", "/v1/leases", query={"state": "released"})["leases"]] == [made[0]["id"]]
    assert len(tcp.call("GET", "/v1/leases", query={"limit": 1})["leases"]) == 1
    with pytest.raises(ClientError) as elsewhere:  # no node of that name: said so, not answered with an empty list
        tcp.call("GET", "/v1/leases", query={"node": "elsewhere"})
    assert elsewhere.value.code == "NOT_FOUND"


def test_events_are_served_after_a_sequence_number(broker: BrokerProcess) -> None:
    tcp = broker.client(tcp=True)
    first = tcp.call("GET", "/v1/events")
    tcp.call("POST", "/v1/leases", {"gpu_memory": "1GiB"})
    later = tcp.call("GET", "/v1/events", query={"after": first["next"]})
    assert [e["type"] for e in later["events"]] == ["lease.granted"]
    assert later["next"] == later["events"][-1]["seq"] > first["next"]
    event = later["events"][0]
    assert {"seq", "time", "type", "message", "details", "node", "lease", "gpu"} <= set(event)


def test_events_asked_for_past_the_newest_resume_from_the_newest(broker: BrokerProcess) -> None:
    tcp = broker.client(tcp=True)
    newest = tcp.call("GET", "/v1/events")["next"]
    beyond = tcp.call("GET", "/v1/events", query={"after": newest + 1000})
    store = beyond.pop("store")  # the same for every answer from this store
    assert beyond == {"events": [], "next": newest, "dropped": 0}  # not newest + 1000, which would skip what comes next
    assert tcp.call("GET", "/v1/events")["store"] == store
    tcp.call("POST", "/v1/leases", {"gpu_memory": "1GiB"})
    later = tcp.call("GET", "/v1/events", query={"after": beyond["next"]})["events"]  # the grant's event rode its commit
    assert [e["type"] for e in later] == ["lease.granted"]


def test_metrics_show_the_seven_figures_per_gpu_uuid_and_requests_by_result(broker: BrokerProcess) -> None:
    tcp = broker.client(tcp=True)
    tcp.call("POST", "/v1/leases", {"gpu_memory": "1GiB"})
    for body in ({"gpu_memory": "23GiB", "gpus": 2}, {"gpu_memory": "100GiB"}, {"gpu_memory": "-1GiB"}):  # no room now; ever; nonsense
        with pytest.raises(ClientError):
            tcp.call("POST", "/v1/leases", body)
    text = tcp.text("/metrics")
    for name in ("total", "observed", "external", "resident", "leased", "reserve", "schedulable"):
        assert f'gpubroker_gpu_{name}_bytes{{index="0",name="Simulated GPU",uuid="GPU-sim-0"}}' in text, name
    assert 'gpubroker_requests_total{code="GRANTED"} 1.0' in text
    assert 'gpubroker_requests_total{code="INSUFFICIENT_SCHEDULABLE_VRAM"} 1.0' in text
    assert 'gpubroker_requests_total{code="CAPABILITY_UNAVAILABLE"} 1.0' in text
    assert 'gpubroker_requests_total{code="INVALID_REQUEST"} 1.0' in text
    assert 'gpubroker_leases{priority="interactive",state="granted"} 1.0' in text
    assert "gpubroker_grant_latency_seconds_bucket" in text
    assert 'gpubroker_queue_depth{priority="background"} 0.0' in text


def test_every_request_result_is_a_series_from_the_start_so_its_first_one_is_an_increase(broker: BrokerProcess) -> None:
    tcp = broker.client(tcp=True)
    text = tcp.text("/metrics")
    for code in ("GRANTED", *FailureCode):  # a series that first appears at 1 is no increase to rate() or increase()
        assert f'gpubroker_requests_total{{code="{code}"}} 0.0' in text, code
    with pytest.raises(ClientError):
        tcp.call("POST", "/v1/leases", {"gpu_memory": "100GiB"})
    assert 'gpubroker_requests_total{code="CAPABILITY_UNAVAILABLE"} 1.0' in tcp.text("/metrics")


def test_the_openapi_document_names_every_endpoint(broker: BrokerProcess) -> None:
    document = broker.client(tcp=True).call("GET", "/openapi.json")
    assert set(document["paths"]) == {
        "/v1/leases", "/v1/leases/{id}", "/v1/leases/{id}/renew", "/v1/leases/{id}/processes",
        "/v1/node", "/v1/cluster", "/v1/events", "/metrics", "/healthz", "/v1/cluster/invites",
        "/v1/cluster/nodes", "/v1/cluster/nodes/{id}", "/v1/cluster/keys", "/v1/cluster/nodes/{id}/approve",
        "/v1/stream",
    }  # fmt: skip
    assert broker.client(tcp=True).call("GET", "/healthz")["ok"] is True


def test_a_waiting_request_is_cancelled_when_its_client_disconnects(broker: BrokerProcess) -> None:
    from conftest import wait_for

    tcp = broker.client(tcp=True)
    tcp.call("POST", "/v1/leases", {"gpu_memory": "20GiB", "gpu": 0})
    tcp.call("POST", "/v1/leases", {"gpu_memory": "20GiB", "gpu": 1})
    body = json.dumps({"gpu_memory": "10GiB", "wait": "1m"}).encode()
    with sockets.create_connection(("127.0.0.1", broker.port)) as raw:
        raw.sendall(
            b"POST /v1/leases HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        wait_for(lambda: len(tcp.call("GET", "/v1/leases", query={"state": "queued"})["leases"]) == 1)
    wait_for(lambda: tcp.call("GET", "/v1/leases", query={"state": "queued"})["leases"] == [])

    def waiting_events() -> list[str]:
        events = tcp.call("GET", "/v1/events", query={"limit": 1000})["events"]
        return [e["type"] for e in events if e["type"] in ("lease.queued", "lease.cancelled")]

    wait_for(lambda: len(waiting_events()) == 2)
    assert waiting_events() == ["lease.queued", "lease.cancelled"]


def test_a_user_stamped_to_a_class_gets_it_over_tcp_too(broker_process: type[BrokerProcess], tmp_path: Path) -> None:
    """Over TCP nobody names the caller, but the kernel lists who owns its end of a loopback connection: a stamp on a
    user must not be escaped by asking on the TCP port instead of the socket."""
    me = pwd.getpwuid(os.getuid()).pw_name
    config = tmp_path / "stamp.toml"
    config.write_text(f'[[stamp]]\nuser = "{me}"\npriority = "background"\n')
    stamped = broker_process("1x24GiB", ["--config", str(config)]).start()
    for client in (stamped.client(), stamped.client(tcp=True)):
        lease = client.call("POST", "/v1/leases", {"memory": 1, "priority": "production", "bind": "none"})["lease"]
        assert lease["priority"] == "background"
    assert lease["holder"]["uid"] is None  # it authorises nothing: only its token acts on a lease made over TCP


def test_the_owner_of_a_loopback_tcp_callers_end_is_read_from_the_kernel() -> None:
    for family, host in ((sockets.AF_INET, "127.0.0.1"), (sockets.AF_INET6, "::1")):
        try:
            server = sockets.socket(family, sockets.SOCK_STREAM)
            server.bind((host, 0))
        except OSError:
            continue  # no IPv6 here
        with server, sockets.socket(family, sockets.SOCK_STREAM) as caller:
            server.listen()
            caller.connect(server.getsockname()[:2])
            accepted, _ = server.accept()
            with accepted:
                assert loopback_peer_uid(accepted) == os.getuid()
            assert loopback_peer_uid(caller) == os.getuid()  # either end: the table lists both


def test_host_and_origin_are_checked_on_tcp_only_as_the_kernel_names_a_socket_caller(broker: BrokerProcess) -> None:
    body = json.dumps({"gpu_memory": "1GiB", "bind": "none"}).encode()
    request = (
        b"POST /v1/leases HTTP/1.1\r\nHost: evil.example\r\nOrigin: http://evil.example\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
        + body
    )

    def status(sock: sockets.socket) -> bytes:
        sock.sendall(request)
        return sock.recv(64).split(b"\r\n", 1)[0]

    with sockets.socket(sockets.AF_UNIX) as unix:
        unix.connect(str(broker.socket))
        assert status(unix) == b"HTTP/1.1 201 Created"
    with sockets.create_connection(("127.0.0.1", broker.port)) as tcp:
        assert status(tcp) == b"HTTP/1.1 403 Forbidden"


def _refusals(broker: BrokerProcess, count: int) -> list[dict[str, Any]]:
    """The refusals kept, once `count` of them are on disk (they ride the writer's next commit)."""
    client = broker.client()
    deadline = time.monotonic() + 10
    while True:
        events = client.call("GET", "/v1/events", query={"after": 0, "limit": 1000})["events"]
        kept = [e for e in events if e["type"] == "request.refused"]
        if len(kept) >= count or time.monotonic() > deadline:
            return kept
        time.sleep(0.02)


def _send(broker: BrokerProcess, method: str, path: str, raw: bytes | None = None, host: str = "localhost") -> tuple[int, str]:
    """One request as bytes (no client library to tidy it), over TCP: its answer's status and error code."""
    with sockets.create_connection(("127.0.0.1", broker.port)) as sock:
        head = f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\nContent-Length: {len(raw or b'')}\r\n"
        sock.sendall(head.encode() + b"\r\n" + (raw or b""))
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    status = int(answer.split(b" ", 2)[1])
    return status, json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"]


def test_every_refusal_of_the_api_is_kept_as_an_event_with_its_code(broker: BrokerProcess) -> None:
    refused = [
        _send(broker, "POST", "/v1/leases", b"{"),
        _send(broker, "DELETE", "/v1/leases/l-000000000000"),
        _send(broker, "GET", "/v1/node", host="attacker.example"),
        _send(broker, "PUT", "/v1/leases"),
        _send(broker, "POST", "/v1/leases", json.dumps({"cpu_cores": 1, "x" * 5000: 1}).encode()),
    ]
    kept = _refusals(broker, len(refused))
    assert [e["code"] for e in kept] == [code for _, code in refused]
    assert [e["code"] for e in kept] == ["INVALID_REQUEST", "NOT_FOUND", "FORBIDDEN", "INVALID_REQUEST", "INVALID_REQUEST"]
    assert kept[1]["details"]["path"] == "/v1/leases/l-000000000000"
    assert kept[1]["message"].startswith("DELETE /v1/leases/l-000000000000: ")
    assert len(kept[4]["details"]["field"]) == 257  # a caller's text is kept cut short: 256 and an ellipsis
    assert len(kept[4]["message"]) < 1100


def test_a_refusal_of_text_that_is_not_utf_8_is_kept_as_its_escapes(broker: BrokerProcess) -> None:
    status, _ = _send(broker, "POST", "/v1/leases", b'{"cpu_cores": 1, "\\ud800": 1}')  # a lone surrogate, as JSON escapes it
    assert status == 400
    (kept,) = _refusals(broker, 1)
    assert kept["details"]["field"] == "\\ud800"


def test_a_flood_of_refusals_is_kept_at_a_bounded_rate_and_counted(broker: BrokerProcess) -> None:
    for _ in range(300):
        _send(broker, "DELETE", "/v1/leases/l-000000000000")
    time.sleep(0.2)  # the budget refills: the next refusal is kept, and says how many were not
    _send(broker, "DELETE", "/v1/leases/l-000000000001")
    deadline = time.monotonic() + 10
    while (kept := _refusals(broker, 1))[-1]["details"]["path"] != "/v1/leases/l-000000000001":
        assert time.monotonic() < deadline, "the last refusal was not kept"
        time.sleep(0.02)
    assert 100 <= len(kept) < 300
    assert len(kept) + sum(e["details"].get("not_kept_before", 0) for e in kept) == 301  # every one kept or counted


def _raw(broker: BrokerProcess, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Bytes sent as they are, and the answer read to its end (the broker closes the connection after it)."""
    with sockets.create_connection(("127.0.0.1", broker.port)) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split(" ")[1]), headers, body


def _raw_lease_request(broker: BrokerProcess, body: bytes, headers: str = "") -> tuple[int, bytes]:
    """`POST /v1/leases` with this body as it is, and `headers` (each line ending in CRLF) beside the usual ones."""
    status, _, answer = _raw(
        broker,
        b"POST /v1/leases HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Type: application/json\r\n"
        + f"{headers}Content-Length: {len(body)}\r\n\r\n".encode()
        + body,
    )
    return status, answer


@pytest.mark.parametrize(
    "request_line",
    [
        "GET /v1/events?after=\u0663 HTTP/1.1".encode(),  # a byte no URL may hold
        b"GET /v1/node HTTP/1.1 extra",
        b"G\x01T /v1/node HTTP/1.1",
        b"GET /v1/node HTTP/9.9",
        b"GET /" + b"a" * 20_000 + b" HTTP/1.1",
    ],
)
def test_a_request_the_http_parser_cannot_read_gets_the_one_error_shape(broker: BrokerProcess, request_line: bytes) -> None:
    status, headers, body = _raw(broker, request_line + b"\r\nHost: localhost\r\n\r\n")
    assert 400 <= status < 500
    assert headers["content-type"].startswith("application/json")
    error = json.loads(body)["error"]
    assert error["code"] == "INVALID_REQUEST"
    assert error["message"].startswith("the request cannot be read as HTTP: ")
    assert error["details"] == {"status": status}
    assert _raw(broker, b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")[0] == 200  # and it serves on


def _refused(client: Any, method: str, path: str, body: Any = None) -> ClientError:
    with pytest.raises(ClientError) as refused:
        client.call(method, path, body)
    assert (refused.value.status, refused.value.code) == (400, "INVALID_REQUEST"), refused.value
    return refused.value


def test_a_query_parameter_the_operation_does_not_take_or_given_twice_is_refused_naming_it(broker: BrokerProcess) -> None:
    """`GET /v1/leases?stat=granted` (a typo) listed every lease, and `?state=granted&state=ended` read the first state
    alone: the API's operations take the query parameters their OpenAPI document gives them, each once."""
    client = broker.client()
    client.call("POST", "/v1/leases", {"cpu_cores": 1, "bind": "none"})
    typo = _refused(client, "GET", "/v1/leases?stat=released")
    assert typo.message == "unknown query parameter 'stat' for GET /v1/leases; it takes: state, node, limit"
    assert typo.details == {"field": "stat", "allowed": ["state", "node", "limit"]}
    twice = _refused(client, "GET", "/v1/leases?state=released&state=granted")
    assert twice.message == "query parameter 'state' given 2 times for GET /v1/leases; give it once"
    none = _refused(client, "DELETE", "/v1/leases/l-000000000000?force=1")
    assert none.message == "unknown query parameter 'force' for DELETE /v1/leases/{id}; it takes none"
    assert _refused(client, "GET", "/v1/events?after=0&limit=5&since=0").details["allowed"] == ["after", "limit"]
    assert client.call("GET", "/v1/leases?state=released&limit=5&node=") == {"leases": []}
    # Pages, /metrics and /healthz are not the API's: a browser's or a scraper's parameters are theirs.
    assert client.call("GET", "/healthz?cache=1")["ok"] is True
    assert _raw(broker, b"GET /metrics?x=1 HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")[0] == 200
    with pytest.raises(ClientError) as unknown:  # a path that is not one is still NOT_FOUND, whatever its query
        client.call("GET", "/v1/nothing?x=1")
    assert unknown.value.code == "NOT_FOUND"


def test_a_body_in_a_content_coding_the_broker_does_not_read_is_415_naming_the_ones_it_does(broker: BrokerProcess) -> None:
    """`Content-Encoding: foo` (or `gzip, gzip`) was ignored, the body read as plain; `br` and `zstd` were 400 with a hint
    to install a Python package, meant for the server's owner."""
    plain = b'{"gpu_memory": "1GiB", "bind": "none"}'
    for coding in ("foo", "gzip, gzip", "compress", "br", "zstd"):
        status, answer = _raw_lease_request(broker, plain, f"Content-Encoding: {coding}\r\n")
        error = json.loads(answer)["error"]
        assert (status, error["code"]) == (415, "INVALID_REQUEST"), coding
        assert error["message"].endswith("is not one this broker reads: send the body plain, or as gzip or deflate"), error["message"]
        assert "install" not in error["message"]
    for coding, body in (("gzip", gzip.compress(plain)), ("deflate", zlib.compress(plain)), ("identity", plain)):
        status, answer = _raw_lease_request(broker, body, f"Content-Encoding: {coding}\r\n")
        assert status == 201, (coding, answer)
    assert len(broker.client().call("GET", "/v1/leases")["leases"]) == 3  # none but these was granted


def test_a_body_that_gives_a_key_twice_or_is_not_utf_8_is_refused_saying_so(broker: BrokerProcess) -> None:
    """`{"gpu_memory": "1GiB", "gpu_memory": "20GiB"}` asked for 20 GiB, and a body with a byte that is not UTF-8 was
    refused as "not valid JSON"."""
    for raw, key in (
        (b'{"gpu_memory": "1GiB", "gpu_memory": "20GiB"}', "gpu_memory"),
        (b'{"gpu_memory": "1GiB", "holder": {"name": "a", "name": "b"}}', "name"),
        (b'{"cpu_cores": 1, "labels": {"k": "1", "j": "2", "k": "3"}}', "k"),
    ):
        status, answer = _raw_lease_request(broker, raw)
        error = json.loads(answer)["error"]
        assert (status, error["code"]) == (400, "INVALID_REQUEST")
        assert error["message"] == f"the body gives the key {key!r} more than once in one object; give each key once"
        assert error["details"] == {"key": key}
    raw = '{"gpu_memory": "1GiB", "holder": {"name": "caf\u00e9"}}'.encode("latin-1")
    status, _, answer = _raw(
        broker,
        b"POST /v1/leases HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n" + f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw,
    )
    error = json.loads(answer)["error"]
    assert status == 400
    at = raw.index(b"\xe9")  # é as Latin-1 writes it: a UTF-8 lead byte, and a quote where its next byte belongs
    assert error["message"] == f"the body is not UTF-8 text, as JSON must be: invalid continuation byte (e9) at byte offset {at}"
    assert error["details"] == {"offset": at}
    assert broker.client().call("GET", "/v1/leases") == {"leases": []}  # none was granted


def test_a_body_that_is_not_json_or_that_json_cannot_hold_is_refused_saying_where_or_why() -> None:
    """Every one of these was "the body is not valid JSON": a typo without its place, and valid JSON nested too deep
    or holding an integer of thousands of digits, as if it were not JSON."""
    for raw, said, details in (
        (b'{"gpu_memory": "1GiB" "ttl": "1m"}', "the body is not valid JSON: Expecting ',' delimiter at line 1 column 23", {"offset": 22}),
        (b'{"gpu_memory":\n  1GiB}', "the body is not valid JSON: Expecting ',' delimiter at line 2 column 4", {"offset": 18}),
        (
            '{"name": "caf\u00e9" x}'.encode(),
            "the body is not valid JSON: Expecting ',' delimiter at line 1 column 17",
            {"offset": 17},
        ),  # é: 2 bytes
        (b'{"ttl": NaN}', "the body is not valid JSON: NaN is no JSON value", {}),
        (b"[1, -Infinity]", "the body is not valid JSON: -Infinity is no JSON value", {}),
        (b"", "the body is not valid JSON: it is empty", {"offset": 0}),
        (b"[" * 30_000 + b"]" * 30_000, "the body nests arrays or objects too deeply to be read", {}),
        (b'{"cpu_cores": ' + b"9" * 5000 + b"}", "the body holds an integer of more than 4300 digits", {}),
    ):
        with pytest.raises(InvalidRequest) as refused:
            decode_json(raw)
        assert (refused.value.message, refused.value.details) == (said, details)


@given(JSON_VALUES)
def test_a_body_decodes_as_json_loads_decodes_it_when_no_key_is_given_twice(value: Any) -> None:
    raw = json.dumps(value, ensure_ascii=False).encode()
    assert decode_json(raw) == json.loads(raw)


# Where an object may sit in a body: inside an array beside other values, or as the value of an object's key.
WRAPPERS = st.lists(st.one_of(st.tuples(st.just("array"), JSON_VALUES), st.tuples(st.just("object"), st.text(max_size=6))), max_size=4)


@given(st.text(max_size=8), st.dictionaries(st.text(max_size=6), JSON_VALUES, max_size=3), WRAPPERS)
def test_a_key_given_twice_in_any_object_at_any_depth_is_refused_naming_it(key: str, others: dict[str, Any], wrappers: list[Any]) -> None:
    others.pop(key, None)
    pairs = [f"{json.dumps(name)}: {json.dumps(value)}" for name, value in others.items()]
    body = "{" + ", ".join([f"{json.dumps(key)}: 1", *pairs, f"{json.dumps(key)}: 2"]) + "}"
    for kind, beside in wrappers:
        body = f"[{json.dumps(beside)}, {body}]" if kind == "array" else "{" + f"{json.dumps(beside)}: {body}" + "}"
    with pytest.raises(InvalidRequest) as refused:
        decode_json(body.encode())
    assert refused.value.details == {"key": key}
    assert refused.value.message == f"the body gives the key {key!r} more than once in one object; give each key once"


@given(JSON_VALUES, st.data(), st.sampled_from([b"\xff", b"\xc0", b"\x80", b"\xed\xa0", b"\xf8"]))
def test_a_body_with_a_byte_that_is_not_utf_8_is_refused_naming_its_offset(value: Any, data: Any, bad: bytes) -> None:
    raw = json.dumps(value, ensure_ascii=False).encode()
    at = data.draw(st.integers(0, len(raw)))
    body = raw[:at] + bad + raw[at:]
    with pytest.raises(InvalidRequest) as refused:
        decode_json(body)
    assert refused.value.message.startswith("the body is not UTF-8 text, as JSON must be: ")
    # The offset of the first byte that starts no character: the bad one, or the start of a character it cut.
    with pytest.raises(UnicodeDecodeError) as undecodable:
        body.decode("utf-8", "surrogatepass")
    assert refused.value.details == {"offset": undecodable.value.start}
    assert abs(undecodable.value.start - at) <= 3  # a character it cut, or the rest of one it completed
    assert refused.value.message.endswith(f" at byte offset {undecodable.value.start}")


def test_a_request_the_http_parser_cannot_read_is_one_line_in_the_log_not_a_traceback(broker: BrokerProcess) -> None:
    assert _raw(broker, "GET /v1/events?after=\u0663 HTTP/1.1\r\nHost: localhost\r\n\r\n".encode())[0] == 400
    deadline = time.monotonic() + 10
    while not any("cannot read" in line for line in broker.output):
        assert time.monotonic() < deadline, "".join(broker.output)
        time.sleep(0.02)
    assert not any("Traceback" in line for line in broker.output), "".join(broker.output)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/cluster/invites", {"ttl": "0s"}),
        ("/v1/cluster/invites", {"ttl": 0}),
        ("/v1/cluster/invites", {"ttl": ""}),
        ("/v1/cluster/keys", {"install": 123}),
        ("/v1/cluster/keys", {"install": {"a": 1}}),
        ("/v1/cluster/keys", {"use": None}),
        ("/v1/cluster/keys", {"remove": ["x"]}),
    ],
)
def test_a_cluster_change_with_a_value_of_the_wrong_kind_is_an_invalid_request(broker: BrokerProcess, path: str, body: Any) -> None:
    with pytest.raises(ClientError) as refused:
        broker.client().call("POST", path, body)  # root on the socket: an admin, so only the body is judged
    assert (refused.value.status, refused.value.code) == (400, "INVALID_REQUEST")


async def test_a_connection_that_never_finishes_its_request_is_answered_and_closed_and_the_file_limit_is_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Half-sent requests must not hold their file descriptors for long (an hour, by aiohttp's default)."""
    import asyncio
    import resource

    from conftest import free_port

    from gpubroker import daemon
    from gpubroker.config import Config
    from gpubroker.ui import api

    monkeypatch.setattr(api, "IDLE_TIMEOUT", 0.5)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))
        daemon.raise_open_files_limit()
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == (hard if hard != resource.RLIM_INFINITY else 2**20)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    port = free_port()
    config = Config(
        state_dir=tmp_path / "state", name="tower", socket=tmp_path / "api.sock", listen=f"127.0.0.1:{port}", simulate_gpus="1x24GiB"
    )
    ready = asyncio.Event()
    serving = asyncio.create_task(daemon.serve(config, on_ready=lambda _: ready.set()))
    try:
        await asyncio.wait_for(ready.wait(), 20)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /v1/node HTTP/1.1\r\nHost: localhost\r\nX-Never: ")  # and no more
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), 10) == b""  # closed by the broker, well before the test's patience
        writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/leases HTTP/1.1\r\nHost: localhost\r\nContent-Length: 100\r\n\r\n{")  # a body that stops short
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 20)  # answered, not left waiting
        length = int(next(line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")).split(b":")[1])
        answer = head + await asyncio.wait_for(reader.readexactly(length), 5)
        assert answer.startswith(b"HTTP/1.1 400 "), answer
        assert b"Connection: close" in head
        assert b'"INVALID_REQUEST"' in answer
        assert b"it did not all arrive within 0.5s" in answer
        writer.close()
    finally:
        serving.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await serving


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"cpu_cores": 1, "holder": {"name": "evil\u001b[2J"}}, "holder.name"),
        ({"cpu_cores": 1, "holder": {"name": "a\nlease l-000 released by root"}}, "holder.name"),
        ({"cpu_cores": 1, "labels": {"k": "v\r"}}, "labels"),
        ({"cpu_cores": 1, "labels": {"\u0085": "v"}}, "labels"),
        ({"cpu_cores": 1, "holder": {"name": "job\u202e"}}, "holder.name"),  # reverses the figures printed after it
        ({"cpu_cores": 1, "holder": {"name": "a\u2028b"}}, "holder.name"),
        ({"cpu_cores": 1, "labels": {"k": "hidden\u200b"}}, "labels"),
        ({"cpu_cores": 1, "holder": {"name": "\u3164"}}, "holder.name"),  # a Hangul filler: a name that shows as nothing
        ({"cpu_cores": 1, "labels": {"k": "a\U000e0001"}}, "labels"),  # a tag character
    ],
)
def test_a_name_or_label_with_a_control_character_is_refused_so_no_terminal_prints_one(
    broker: BrokerProcess, body: dict[str, Any], field: str
) -> None:
    with pytest.raises(ClientError) as refused:
        broker.client().call("POST", "/v1/leases", body)
    assert (refused.value.code, refused.value.details["field"]) == ("INVALID_REQUEST", field)
    assert "must be printable text, without control, bidirectional or invisible formatting characters" in refused.value.message
    assert broker.client().call("GET", "/v1/leases")["leases"] == []


def test_leases_of_a_node_nobody_knows_is_not_found_and_an_empty_node_is_this_one(broker: BrokerProcess) -> None:
    client = broker.client()
    mine = client.call("POST", "/v1/leases", {"cpu_cores": 1, "bind": "none"})["lease"]
    assert [lease["id"] for lease in client.call("GET", "/v1/leases", query={"node": ""})["leases"]] == [mine["id"]]
    with pytest.raises(ClientError) as unknown:
        client.call("GET", "/v1/leases", query={"node": "typo"})
    assert (unknown.value.code, unknown.value.details) == ("NOT_FOUND", {"node": "typo"})


def test_a_missing_static_file_is_not_found_and_a_wrong_method_names_the_allowed_ones(broker: BrokerProcess) -> None:
    for path in ("/static/nonexist.js", "/static/", "/static/../pyproject.toml", "/static/%2e%2e/README.md"):
        status, headers, body = _raw(broker, f"GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n".encode())
        assert (status, json.loads(body)["error"]["code"]) == (404, "NOT_FOUND"), path
    status, headers, body = _raw(broker, b"GET /static/style.css HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
    assert (status, headers["content-type"].split(";")[0]) == (200, "text/css")
    status, headers, body = _raw(broker, b"PUT /v1/leases HTTP/1.1\r\nHost: localhost\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
    assert (status, json.loads(body)["error"]["code"]) == (405, "INVALID_REQUEST")
    assert headers["allow"] == "GET, HEAD, POST"


# ----- other members' leases, in process --------------------------------------------------------------

NOW = 1_800_000_000.0


class Members:
    """The membership as the mesh reads it: each node's state."""

    def __init__(self) -> None:
        self.views: dict[str, MemberView] = {}

    def set(self, node: str, state: MemberState) -> None:
        self.views[node] = MemberView(node, ("127.0.0.1", 9741), state, 1, b"", NOW)

    def member(self, node: str) -> MemberView | None:
        return self.views.get(node)

    def members(self) -> list[MemberView]:
        return list(self.views.values())


def lease_record(lease_id: str) -> dict[str, Any]:
    return {"id": lease_id, "holder": "train", "priority": "batch", "gpus": [[0, GIB]], "expires_at": "2027-01-15T08:00:00.000Z"}


async def test_another_node_is_found_by_its_id_its_admitted_name_or_its_new_name_and_a_shared_name_by_who_is_alive(
    tmp_path: Path,
) -> None:
    a, renamed, namesake = (Identity.load_or_create(tmp_path / name) for name in ("a", "renamed", "namesake"))
    cluster = ClusterState.init(tmp_path / "cluster", a, "tower", now=NOW)
    for identity, name in ((renamed, "nuc"), (namesake, "gpu-box")):
        secret = decode_token(cluster.invite(("127.0.0.1", 9741), a, 600, NOW)).secret
        cluster.redeem(secret, identity.certificate_pem().decode(), name, NOW, a.node_id)
    clock = FakeClock(NOW)
    config = Config(state_dir=tmp_path / "state", name="tower")
    broker = Broker(config, Store(config.state_dir, config.store_size, config.events_kept), FakeGpuProbe(clock), clock, a.node_id)
    await broker.start()
    mesh = Mesh(MeshSettings(("127.0.0.1", 0), "127.0.0.1"), broker, a, cluster, clock=clock.now, elapsed=clock.elapsed)
    members = Members()
    mesh._membership = members  # type: ignore[assignment]
    # The node admitted as "nuc" was restarted with --name gpu-box, its document says so; another member, now dead,
    # was admitted as "gpu-box" (an old identity of a machine that rejoined under its name).
    body = {"name": "gpu-box", "gpus": [{"index": 0, "uuid": "GPU-0"}], "leases": [lease_record("l-0000000000aa")]}
    mesh.view.apply(NodeDocument(renamed.node_id, 2, 1, NOW, body, b""), NOW)
    members.set(renamed.node_id, MemberState.ALIVE)
    members.set(namesake.node_id, MemberState.DEAD)
    client: TestClient[Any, Any] = TestClient(TestServer(make_app(broker, mesh)))
    await client.start_server()

    async def listed(node: str) -> tuple[int, Any]:
        answer = await client.get("/v1/leases", params={"node": node})
        found = await answer.json()
        return answer.status, [lease["id"] for lease in found["leases"]] if answer.status == 200 else found["error"]

    try:
        for name in ("gpu-box", "nuc", renamed.node_id):
            assert await listed(name) == (200, ["l-0000000000aa"]), name  # "gpu-box": the live one of the two
        assert await listed("tower") == (200, [])  # this node's own, none
        members.set(namesake.node_id, MemberState.ALIVE)
        status, error = await listed("gpu-box")
        matching = sorted([renamed.node_id, namesake.node_id])
        assert (status, error["code"], error["details"]) == (400, "INVALID_REQUEST", {"node": "gpu-box", "matching": matching})
        assert await listed(namesake.node_id) == (200, [])  # its document is not held yet
    finally:
        await client.close()
        await broker.close()


async def test_healthz_and_metrics_say_when_the_store_cannot_be_written(tmp_path: Path) -> None:
    clock = FakeClock(NOW)
    config = Config(state_dir=tmp_path / "state", name="tower", store_size=2**20)
    store = Store(config.state_dir, config.store_size, config.events_kept, clock=clock.elapsed)
    broker = Broker(config, store, FakeGpuProbe(clock), clock)
    await broker.start()
    client: TestClient[Any, Any] = TestClient(TestServer(make_app(broker)))
    await client.start_server()

    async def health() -> tuple[Any, str]:
        answer = await (await client.get("/healthz")).json()
        failures = [line for line in (await (await client.get("/metrics")).text()).splitlines() if line.startswith("gpubroker_store_")]
        return answer["store_error"], failures[0]

    try:
        assert await health() == (None, "gpubroker_store_write_failures_total 0.0")
        with pytest.raises(StoreFull):  # more than the 1 MiB the store may grow to
            await broker.store.commit([Write("meta", f"big{i}".encode(), {"pad": "x" * 200_000}) for i in range(8)])
        said, failures = await health()
        assert said == "the state store is full (1.0 MiB)"
        assert failures == "gpubroker_store_write_failures_total 1.0"
        await broker.store.commit([Write("meta", b"small", 1)])  # one write that fits is not yet "written again"
        assert await health() == (said, "gpubroker_store_write_failures_total 1.0")
        clock.advance(RECOVERED_AFTER)
        await broker.store.commit([Write("meta", b"small", 2)])  # none has failed for a while: said so, and the count stays
        assert await health() == (None, "gpubroker_store_write_failures_total 1.0")
    finally:
        await client.close()
        await broker.close()


# What Prometheus 2 and 3 send when they scrape, and what they get: OpenMetrics, which they ask for first.
PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8,application/openmetrics-text;version=0.0.1;q=0.75,"
    "text/plain;version=1.0.0;escaping=allow-utf-8;q=0.5,text/plain;version=0.0.4;q=0.4,*/*;q=0.1",
)


async def test_metrics_answer_openmetrics_to_a_scraper_that_asks_for_it_and_versioned_text_to_others(tmp_path: Path) -> None:
    """The text format was sent as a bare text/plain whatever was asked: no version, and never OpenMetrics."""
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families

    clock = FakeClock(NOW)
    config = Config(state_dir=tmp_path / "state", name="tower")
    broker = Broker(config, Store(config.state_dir, config.store_size, config.events_kept), FakeGpuProbe(clock), clock)
    await broker.start()
    client: TestClient[Any, Any] = TestClient(TestServer(make_app(broker)))
    await client.start_server()
    try:
        for accept in ("", "text/plain", "*/*"):  # curl, a browser, an old scraper
            answer = await client.get("/metrics", headers={"Accept": accept} if accept else {})
            assert answer.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8", accept
            assert any(f.name == "gpubroker_requests" for f in text_string_to_metric_families(await answer.text()))
        for accept in PROMETHEUS_ACCEPT:
            answer = await client.get("/metrics", headers={"Accept": accept})
            assert answer.headers["Content-Type"].startswith("application/openmetrics-text; version=1.0.0;")
            assert answer.headers["Vary"] == "Accept"
            text = await answer.text()
            assert text.endswith("# EOF\n")
            families = {f.name: f for f in openmetrics_families(text)}
            assert families["gpubroker_requests"].type == "counter"
            assert families["gpubroker_grant_latency_seconds"].type == "histogram"
            assert families["gpubroker_gpu_schedulable_bytes"].samples[0].labels["uuid"] == "GPU-fake-0"
    finally:
        await client.close()
        await broker.close()


async def test_every_metrics_help_says_what_its_series_is_in_its_unit_and_a_counter_since_when(tmp_path: Path) -> None:
    """A dashboard's reader has the HELP text and no SPEC: the figures' said "the total figure of each GPU (SPEC §2)"."""
    clock = FakeClock(NOW)
    config = Config(state_dir=tmp_path / "state", name="tower")
    broker = Broker(config, Store(config.state_dir, config.store_size, config.events_kept), FakeGpuProbe(clock), clock)
    await broker.start()
    try:
        families = list(text_string_to_metric_families(Metrics(broker).render().decode()))
    finally:
        await broker.close()
    for family in families:
        assert "SPEC" not in family.documentation, family.name
        assert "§" not in family.documentation, family.name
        if family.name.endswith("_bytes"):
            assert "bytes" in family.documentation, family.name
        if family.name.endswith("_seconds"):
            assert "seconds" in family.documentation, family.name
        if family.type in ("counter", "histogram"):  # kept in memory: a restart starts them again from 0
            assert family.documentation.endswith("since the broker started"), family.name


def readme_metrics() -> set[str]:
    """The series the README's Metrics section names, `gpubroker_gpu_{total,observed}_bytes` read as two."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text().split("### Metrics\n", 1)[1].split("\n### ", 1)[0]
    documented = set()
    for match in re.finditer(r"`(gpubroker_[a-z_]*)(?:\{([a-z,]+)\}([a-z_]*))?", readme):
        head, alternatives, tail = match.groups()
        documented |= {f"{head}{each}{tail}" for each in alternatives.split(",")} if alternatives and tail else {head}
    return documented


async def test_the_readmes_metrics_are_the_series_the_broker_serves(tmp_path: Path) -> None:
    """The README's list had no names and left out unattributed, external pressure, over-declared and driver_ok."""
    clock = FakeClock(NOW)
    config = Config(state_dir=tmp_path / "state", name="tower")
    broker = Broker(config, Store(config.state_dir, config.store_size, config.events_kept), FakeGpuProbe(clock), clock)
    await broker.start()
    try:
        served = set(re.findall(r"^# TYPE (\S+) ", Metrics(broker).render().decode(), re.MULTILINE))
    finally:
        await broker.close()
    assert served == readme_metrics()


EVENT_NAME = r"`?((?:broker|lease|gpu|mesh|request|ui)\.[a-z_]+(?:\.[a-z_]+)*)`?"


def test_the_readmes_events_are_every_type_the_code_records_and_no_other() -> None:
    """The README listed no event types, and the OpenAPI document a few, ending in "...": a user could not know what to
    watch for. Every type recorded is in the README's Events table, and every type named anywhere in it or in the
    OpenAPI document is one recorded."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    table = readme.split("### Events\n", 1)[1].split("\n### ", 1)[0]
    listed = re.findall(r"^\| `([^`]+)` \|", table, re.MULTILINE)
    recorded = event_types()
    assert len(listed) == len(set(listed))
    assert set(listed) == recorded, (sorted(recorded - set(listed)), sorted(set(listed) - recorded))
    named = set(re.findall(f"`{EVENT_NAME}`", readme))
    assert named <= recorded, sorted(named - recorded)
    schema = json.dumps(OPENAPI["components"]["schemas"]["Event"])
    named = set(re.findall(EVENT_NAME, schema))
    assert named
    assert named <= recorded, sorted(named - recorded)


async def test_an_event_whose_write_failed_is_not_said_to_be_dropped_to_those_reading_after_it(tmp_path: Path) -> None:
    """A write that fails (a full disk) takes its events' seqs with it: reading past that hole, `/v1/events` said the
    events there were "no longer kept (events_kept)", and `gpubroker events --follow` printed so at every failed write."""
    clock = FakeClock(NOW)
    config = Config(state_dir=tmp_path / "state", name="tower")
    broker = Broker(config, Store(config.state_dir, config.store_size, config.events_kept), FakeGpuProbe(clock), clock)
    await broker.start()
    client: TestClient[Any, Any] = TestClient(TestServer(make_app(broker)))
    await client.start_server()
    try:
        before = broker.last_event_seq
        broker.record_event("test.lost", "its write fails", details={"value": object()})  # a value the store cannot write
        broker.record_event("test.kept", "written")
        await broker.store.commit([])
        answer = await (await client.get("/v1/events", params={"after": str(before)})).json()
        assert [(e["seq"], e["type"]) for e in answer["events"]] == [(before + 2, "test.kept")]
        assert answer["dropped"] == 0
    finally:
        await client.close()
        await broker.close()


async def test_grant_latency_tells_grants_apart_from_under_a_millisecond_to_waits_of_many_minutes(tmp_path: Path) -> None:
    clock = FakeClock(NOW)
    config = Config(state_dir=tmp_path / "state", name="tower")
    broker = Broker(config, Store(config.state_dir, config.store_size, config.events_kept), FakeGpuProbe(clock), clock)
    await broker.start()
    try:
        waits = (0.0004, 0.003, 2.0, 45.0, 240.0, 1200.0)  # a grant at once; a wait of seconds, a minute, minutes
        for seconds in waits:
            broker.stats.record("GRANTED", seconds)
        text = Metrics(broker).render().decode()
    finally:
        await broker.close()
    (latency,) = [family for family in text_string_to_metric_families(text) if family.name == "gpubroker_grant_latency_seconds"]
    finite = [sample.value for sample in latency.samples if sample.name.endswith("_bucket") and sample.labels["le"] != "+Inf"]
    assert [finite.count(float(n)) > 0 for n in range(1, len(waits) + 1)] == [True] * len(waits)  # each in a bucket of its own


async def test_metrics_say_when_each_gpus_figures_were_read_and_whether_they_are_too_old_to_decide_on(tmp_path: Path) -> None:
    clock = FakeClock(NOW)
    config = Config(state_dir=tmp_path / "state", name="tower")
    broker = Broker(config, Store(config.state_dir, config.store_size, config.events_kept), FakeGpuProbe(clock), clock)
    await broker.start()
    metrics = Metrics(broker)

    def gauges() -> dict[str, float]:
        families = text_string_to_metric_families(metrics.render().decode())
        names = ("gpubroker_gpu_observed_timestamp_seconds", "gpubroker_gpu_stale")
        return {s.name: s.value for f in families for s in f.samples if s.name in names and s.labels["uuid"] == "GPU-fake-0"}

    try:
        assert gauges() == {"gpubroker_gpu_observed_timestamp_seconds": NOW, "gpubroker_gpu_stale": 0.0}
        clock.advance(config.staleness + 1)  # the probe stopped answering: the figures are those of then, and say so
        assert gauges() == {"gpubroker_gpu_observed_timestamp_seconds": NOW, "gpubroker_gpu_stale": 1.0}
    finally:
        await broker.close()


async def test_the_over_declared_metric_counts_the_leases_using_too_much_on_each_gpu_now(
    tmp_path: Path, live_pid: Callable[[], int]
) -> None:
    """A lease over its declaration on one GPU is not over it on its other GPU, nor once its use is back within it."""
    pid = live_pid()  # the holder
    from gpubroker.broker.probes import GpuProcess
    from gpubroker.broker.request import parse_request
    from gpubroker.broker.service import Caller

    clock = FakeClock(NOW)
    probe = FakeGpuProbe(clock, [24 * GIB, 24 * GIB])
    config = Config(state_dir=tmp_path / "state", name="tower")
    broker = Broker(config, Store(config.state_dir, config.store_size, config.events_kept), probe, clock)
    await broker.start()
    metrics = Metrics(broker)

    def over() -> dict[str, float]:
        families = text_string_to_metric_families(metrics.render().decode())
        return {s.labels["uuid"]: s.value for f in families for s in f.samples if s.name == "gpubroker_leases_over_declared"}

    try:
        body = {"gpu_memory": "4GiB", "gpus": 2, "holder": {"name": "greedy", "pid": pid}}
        await broker.request(parse_request(body), Caller("tcp"))
        probe.processes = {0: [GpuProcess(pid, "python", 6 * GIB)], 1: [GpuProcess(pid, "python", 2 * GIB)]}
        broker.apply_sample(probe.sample(), None)
        assert over() == {"GPU-fake-0": 1.0, "GPU-fake-1": 0.0}
        probe.processes = {0: [GpuProcess(pid, "python", 3 * GIB)], 1: [GpuProcess(pid, "python", 2 * GIB)]}
        broker.apply_sample(probe.sample(), None)
        assert over() == {"GPU-fake-0": 0.0, "GPU-fake-1": 0.0}
    finally:
        await broker.close()


async def test_a_unix_callers_start_time_is_read_once_for_its_connection_on_its_first_lease_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lease's holder carries when its process started (against a later process with its pid): read from /proc on
    the connection's first lease request and kept for its next ones, never for renewals, releases or reads."""
    from aiohttp import ClientSession, UnixConnector, web

    from gpubroker.broker import holders
    from gpubroker.ui import api

    reads: list[int] = []
    read = holders.start_time

    def start_time(pid: int) -> float | None:
        reads.append(pid)
        return read(pid)

    monkeypatch.setattr(api.holders, "start_time", start_time)
    clock = FakeClock()
    config = Config(state_dir=tmp_path / "state", name="tower")
    broker = Broker(config, Store(config.state_dir, config.store_size, config.events_kept), FakeGpuProbe(clock, [24 * GIB]), clock)
    await broker.start()
    runner = web.AppRunner(make_app(broker))
    await runner.setup()
    path = tmp_path / "api.sock"
    await web.UnixSite(runner, str(path)).start()
    try:
        async with ClientSession(connector=UnixConnector(path=str(path), limit=1)) as session:
            assert (await session.get("http://localhost/v1/node")).status == 200
            assert reads == []
            granted = []
            for _ in range(2):
                async with session.post("http://localhost/v1/leases", json={"gpu_memory": "1GiB", "bind": "none"}) as answer:
                    assert answer.status == 201
                    granted.append((await answer.json())["lease"])
            first = granted[0]
            assert (await session.post(f"http://localhost/v1/leases/{first['id']}/renew")).status == 200
            assert (await session.delete(f"http://localhost/v1/leases/{first['id']}")).status == 200
        assert reads == [os.getpid()]
        assert broker.leases[granted[1]["id"]].holder.start_time == read(os.getpid())
    finally:
        await runner.cleanup()
        await broker.close()


async def test_a_refused_call_on_a_lease_is_an_event_found_by_that_lease(tmp_path: Path) -> None:
    """A refused renewal or release named its lease in `details.lease` alone: an event filter on `lease` missed it."""
    clock = FakeClock(NOW)
    config = Config(state_dir=tmp_path / "state", name="tower")
    broker = Broker(config, Store(config.state_dir, config.store_size, config.events_kept), FakeGpuProbe(clock), clock)
    await broker.start()
    client: TestClient[Any, Any] = TestClient(TestServer(make_app(broker)))
    await client.start_server()
    try:
        before = broker.last_event_seq
        assert (await client.post("/v1/leases/l-gone/renew", json={})).status == 404
        assert (await client.get("/v1/leases", params={"state": "nothing"})).status == 400
        await broker.store.commit([])
        answer = await (await client.get("/v1/events", params={"after": str(before)})).json()
        assert [(e["type"], e.get("lease")) for e in answer["events"]] == [("request.refused", "l-gone"), ("request.refused", None)]
    finally:
        await client.close()
        await broker.close()
