"""The web UI without a browser: pages rendered from the API's figures, and the live event stream.

Pages are read from a real broker process on a simulation file; the stream's timing
(heartbeat, cap, view changes) is tested in process, where its constants can be made small.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from dataclasses import replace
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from conftest import BrokerProcess, wait_for
from emitted import event_types
from fakes import GIB, FakeClock, FakeGpuProbe

from gpubroker.broker.service import Broker
from gpubroker.broker.store import Store
from gpubroker.client import ClientError
from gpubroker.config import Config
from gpubroker.gossip.documents import summarize
from gpubroker.ui import pages, stream
from gpubroker.ui.api import make_app
from gpubroker.ui.pages import NAMES_SHOWN, names_text

SIMULATION = """
[[gpu]]
name = "NVIDIA GeForce RTX 4090"
memory = "24GiB"

[[gpu]]
name = "NVIDIA GeForce RTX 3090"
memory = "24GiB"

[[process]]
gpu = 0
pid = 900001
name = "ollama"
used = "6GiB"
"""
SCRIPT = "<script>alert(1)</script>"
PAGES = ("/", "/node", "/leases", "/events", "/mesh")


class Segments(HTMLParser):
    """The bar segments of the Cluster page, by GPU uuid: [(kind, label, bytes)]."""

    def __init__(self) -> None:
        super().__init__()
        self.gpu: str | None = None
        self.found: dict[str, list[tuple[str, str, int]]] = {}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attr = dict(attrs)
        if "data-uuid" in attr:
            self.gpu = attr["data-uuid"]
            self.found[str(self.gpu)] = []
        if "data-bytes" in attr and self.gpu is not None:
            self.found[self.gpu].append((str(attr["data-kind"]), str(attr["data-label"]), int(str(attr["data-bytes"]))))


@pytest.fixture
def broker(broker_process: type[BrokerProcess], tmp_path: Path) -> BrokerProcess:
    """A lone broker with ollama on GPU 0 and one granted lease whose holder's name is markup."""
    sim = tmp_path / "gpus.toml"
    sim.write_text(SIMULATION)
    started = broker_process(str(sim)).start()
    started.client(tcp=True).call("POST", "/v1/leases", {"gpu_memory": "4GiB", "gpu": 0, "holder": {"name": SCRIPT}})
    return started


def page(broker: BrokerProcess, path: str) -> str:
    return broker.client(tcp=True).text(path)


# ----- pages ---------------------------------------------------------------------------


async def test_every_page_answers_html_and_its_assets_are_served(broker: BrokerProcess) -> None:
    async with aiohttp.ClientSession(broker.url) as session:
        for path in (*PAGES, "/fragment/cluster", "/leases?state=granted", "/events?code=GPU_OOM"):
            async with session.get(path) as answer:
                assert answer.status == 200, path
                assert answer.content_type == "text/html", path
                assert "</" in await answer.text()
        for path, kind in (("/static/style.css", "text/css"), ("/static/live.js", "javascript")):
            async with session.get(path) as answer:
                assert answer.status == 200, path
                assert kind in answer.content_type, path
        async with session.get("/fragment/nowhere") as answer:
            assert answer.status == 404
            assert (await answer.json())["error"]["code"] == "NOT_FOUND"
        async with session.get("/", headers={"Host": "evil.example"}) as answer:
            assert answer.status == 403  # the Host check covers the pages too
    shell = page(broker, "/")
    assert 'href="/static/style.css"' in shell
    assert 'src="/static/live.js"' in shell
    assert "lease.granted" in shell  # the event types live.js listens for


def test_the_cluster_page_shows_every_gpu_with_bar_segments_equal_to_the_cluster_figures(broker: BrokerProcess) -> None:
    cluster = broker.client(tcp=True).call("GET", "/v1/cluster")
    parser = Segments()
    parser.feed(page(broker, "/"))
    gpus = {gpu["uuid"]: gpu for node in cluster["nodes"] for gpu in node["gpus"]}
    assert set(parser.found) == set(gpus) == {"GPU-sim-0", "GPU-sim-1"}
    for uuid, gpu in gpus.items():
        by_kind: dict[str, int] = {}
        for kind, _, size in parser.found[uuid]:
            by_kind[kind] = by_kind.get(kind, 0) + size
        expected = {k: v for k, v in gpu["figures"].items() if k in ("external", "resident", "leased", "reserve", "schedulable") and v}
        assert by_kind == expected, uuid
    first = parser.found["GPU-sim-0"]
    assert ("external", "ollama", 6 * GIB) in first
    assert ("leased", SCRIPT, 4 * GIB) in first
    assert "6.0 external (ollama 6.0)" in page(broker, "/")
    assert "1 node · 2 GPUs" in page(broker, "/")


def test_two_hundred_small_leases_are_drawn_as_one_part_of_the_bar_and_counted_not_named_one_by_one(broker: BrokerProcess) -> None:
    client = broker.client(tcp=True)
    for number in range(200):
        client.call("POST", "/v1/leases", {"gpu_memory": "64MiB", "gpu": 1, "holder": {"name": f"job-{number:03d}"}, "bind": "none"})
    leased = next(gpu for gpu in client.call("GET", "/v1/node")["gpus"] if gpu["index"] == 1)["figures"]["leased"]
    assert leased == 200 * 64 * 2**20
    parser = Segments()
    parser.feed(page(broker, "/"))
    drawn = parser.found["GPU-sim-1"]
    # Each alone is 0.26% of the bar, a pixel that its border paints over: together they were a blank stretch.
    assert [part for part in drawn if part[0] == "leased"] == [("leased", "200 holders", leased)]
    assert all(size >= 24 * GIB // 100 for _, _, size in drawn)
    assert "12.5 leased (job-000 0.1, job-001 0.1, job-002 0.1, job-003 0.1, job-004 0.1, job-005 0.1, job-006 0.1, " in page(broker, "/")
    assert "job-007 0.1 and 192 more 12.0)" in page(broker, "/")
    assert "job-199" not in page(broker, "/")


def test_a_gpus_line_of_figures_names_its_largest_holders_not_its_first() -> None:
    """Past NAMES_SHOWN the rest are counted: the lease holding most of the GPU was counted among them, unnamed, when it
    came late in the list."""
    named = [(f"small-{i}", GIB // 10) for i in range(NAMES_SHOWN)] + [("training", 20 * GIB)]
    assert names_text(named) == ", ".join(f"small-{i} 0.1" for i in range(NAMES_SHOWN - 1)) + ", training 20.0 and 1 more 0.1"
    assert names_text(named[:3]) == "small-0 0.1, small-1 0.1, small-2 0.1"


def test_a_holder_name_with_markup_is_shown_escaped_on_every_page(broker: BrokerProcess) -> None:
    for path in PAGES:
        html = page(broker, path)
        assert SCRIPT not in html, path
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page(broker, "/leases")
    assert "&lt;script&gt;" in page(broker, "/")


def test_a_leases_labels_are_shown_escaped_under_its_holder(broker: BrokerProcess) -> None:
    labels = {"team": "vision", "<b>k</b>": "javascript:x"}
    broker.client(tcp=True).call("POST", "/v1/leases", {"cpu_cores": 1, "holder": {"name": "labelled"}, "labels": labels})
    html = page(broker, "/leases")
    assert '<span class="label">team=vision</span>' in html
    assert '<span class="label">&lt;b&gt;k&lt;/b&gt;=javascript:x</span>' in html
    assert "<b>k</b>" not in html


def test_the_node_page_lists_processes_with_their_lease_or_no_lease(broker: BrokerProcess) -> None:
    html = page(broker, "/node")
    for text in ("GPU-sim-0", "GPU-sim-1", "900001 ollama · 6.0 GiB", "no lease", "CPU cores", "host memory", "schedulable"):
        assert text in html, text


def test_the_events_page_filters_by_code(broker: BrokerProcess) -> None:
    tcp = broker.client(tcp=True)
    with pytest.raises(ClientError):
        tcp.call("POST", "/v1/leases", {"gpu_memory": "20GiB", "gpu": 0})  # ollama holds 6 GiB of GPU 0
    wait_for(lambda: any(e.get("code") for e in tcp.call("GET", "/v1/events", query={"limit": 1000})["events"]))
    everything = page(broker, "/events")
    assert 'data-type="lease.granted"' in everything
    filtered = page(broker, "/events?code=INSUFFICIENT_SCHEDULABLE_VRAM")
    assert 'data-code="INSUFFICIENT_SCHEDULABLE_VRAM"' in filtered
    assert 'data-type="lease.granted"' not in filtered
    assert "data-code=" not in filtered.replace('data-code="INSUFFICIENT_SCHEDULABLE_VRAM"', "")


def test_the_mesh_page_of_a_lone_broker_says_how_to_make_a_cluster(broker: BrokerProcess) -> None:
    assert "gpubroker init" in page(broker, "/mesh")


# ----- the stream, against the real process ------------------------------------------------


async def read_messages(answer: aiohttp.ClientResponse, count: int, within: float = 3.0) -> list[dict[str, str]]:
    """The next `count` SSE blocks (messages or comments) as {field: value}; a comment is {"comment": text}."""
    found: list[dict[str, str]] = []
    block: dict[str, str] = {}
    async with asyncio.timeout(within):
        while len(found) < count:
            line = (await answer.content.readline()).decode().rstrip("\n")
            if not line:
                if block:
                    found.append(block)
                block = {}
            elif line.startswith(":"):
                block["comment"] = line[1:].strip()
            else:
                name, _, value = line.partition(": ")
                block[name] = value
    return found


async def test_a_new_lease_reaches_an_open_stream_within_3_seconds(broker: BrokerProcess) -> None:
    async with aiohttp.ClientSession(broker.url) as session, session.get("/v1/stream") as answer:
        assert answer.status == 200
        assert answer.content_type == "text/event-stream"
        assert (await read_messages(answer, 1))[0]["comment"] == "connected"
        await asyncio.to_thread(broker.client(tcp=True).call, "POST", "/v1/leases", {"gpu_memory": "1GiB", "holder": {"name": "late"}})
        async with asyncio.timeout(3):  # a cluster message may come first: the lease changed the figures
            while (message := (await read_messages(answer, 1))[0]).get("event") != "lease.granted":
                pass
        event = json.loads(message["data"])
        assert int(message["id"]) == event["seq"]
        assert event["type"] == "lease.granted"


# ----- the stream, in process ----------------------------------------------------------------


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[tuple[TestClient[Any, Any], Broker, FakeGpuProbe]]:
    clock = FakeClock()
    probe = FakeGpuProbe(clock, [24 * GIB])
    config = replace(Config(state_dir=tmp_path / "state", name="tower"))
    broker = Broker(config, Store(config.state_dir, config.store_size, config.events_kept), probe, clock)
    await broker.start()
    client: TestClient[Any, Any] = TestClient(TestServer(make_app(broker)))
    await client.start_server()
    try:
        yield client, broker, probe
    finally:
        await client.close()
        await broker.close()


async def lease(client: TestClient[Any, Any], more: dict[str, Any] | None = None) -> dict[str, Any]:
    answer = await client.post("/v1/leases", json={"gpu_memory": "1GiB", **(more or {})})
    assert answer.status == 201
    made: dict[str, Any] = (await answer.json())["lease"]
    return made


async def test_the_stream_replays_the_events_after_last_event_id_then_sends_heartbeats(
    served: tuple[TestClient[Any, Any], Broker, FakeGpuProbe], monkeypatch: pytest.MonkeyPatch
) -> None:
    client, broker, _ = served
    monkeypatch.setattr(stream, "HEARTBEAT_EVERY", 0.1)
    for _ in range(3):
        await lease(client)
    await broker.store.commit([])  # the writer is first in, first out: every event is on disk now
    granted = [e for e in broker.events(0, 100)[0] if e["type"] == "lease.granted"]
    assert len(granted) == 3
    for resume in ({"headers": {"Last-Event-ID": str(granted[0]["seq"])}}, {"params": {"after": str(granted[0]["seq"])}}):
        async with client.get("/v1/stream", **resume) as answer:
            messages = await read_messages(answer, 4)
            assert messages[0] == {"retry": "2000", "comment": "connected"}
            assert [(m["id"], m["event"]) for m in messages[1:3]] == [(str(e["seq"]), "lease.granted") for e in granted[1:]]
            assert json.loads(messages[1]["data"])["seq"] == granted[1]["seq"]
            assert messages[3] == {"comment": "heartbeat"}


async def test_a_stream_resumed_past_the_newest_event_sends_this_stores_events_from_the_first(
    served: tuple[TestClient[Any, Any], Broker, FakeGpuProbe],
) -> None:
    """A browser that saw event 5000 of a store reconnects to the broker started again on a new or wiped one, whose
    events are numbered from 1 again: it was resumed after the newest, and missed what the new store said first
    (its `broker.started` among them), so the page stayed as it was until something else happened."""
    client, broker, _ = served
    await lease(client)
    await broker.store.commit([])
    kept = broker.events(0, 100)[0]
    assert kept[0]["type"] == "broker.started"
    for resume in ({"headers": {"Last-Event-ID": "5000"}}, {"params": {"after": "5000"}}):
        async with client.get("/v1/stream", **resume) as answer:
            messages = await read_messages(answer, 1 + len(kept))
        assert [(m["id"], m["event"]) for m in messages[1:]] == [(str(e["seq"]), e["type"]) for e in kept]
    newest = broker.last_event_seq
    async with client.get("/v1/stream", headers={"Last-Event-ID": str(newest)}) as answer:  # this store's newest: nothing again
        assert (await read_messages(answer, 1))[0]["comment"] == "connected"
        await lease(client)
        async with asyncio.timeout(3):  # a cluster message (no id) may come first: the lease changed the figures
            while "id" not in (message := (await read_messages(answer, 1))[0]):
                pass
        assert (message["id"], message["event"]) == (str(newest + 1), "lease.granted")


async def test_a_stream_with_a_malformed_resume_point_is_refused_in_the_one_error_shape(
    served: tuple[TestClient[Any, Any], Broker, FakeGpuProbe],
) -> None:
    client, _, _ = served
    for resume in ({"headers": {"Last-Event-ID": "soon"}}, {"params": {"after": "-1"}}):
        answer = await client.get("/v1/stream", **resume)
        assert answer.status == 400
        assert set((await answer.json())["error"]) == {"code", "message", "details"}


async def test_streams_beyond_the_cap_are_refused_with_429_until_one_closes(
    served: tuple[TestClient[Any, Any], Broker, FakeGpuProbe], monkeypatch: pytest.MonkeyPatch
) -> None:
    client, _, _ = served
    monkeypatch.setattr(stream, "MAX_STREAMS", 2)
    first = await client.get("/v1/stream")
    second = await client.get("/v1/stream")
    await read_messages(first, 1)
    await read_messages(second, 1)
    refused = await client.get("/v1/stream")
    assert refused.status == 429
    error = (await refused.json())["error"]
    assert error["code"] == "QUEUE_FULL"
    assert error["details"] == {"open": 2, "limit": 2}
    assert "MAX_STREAMS 2" in error["message"]
    first.close()
    async with asyncio.timeout(3):
        while (again := await client.get("/v1/stream")).status == 429:
            again.release()
            await asyncio.sleep(0.05)
    assert again.status == 200
    again.close()
    second.close()


async def test_a_cluster_message_is_sent_when_the_view_changes_and_only_then(
    served: tuple[TestClient[Any, Any], Broker, FakeGpuProbe], monkeypatch: pytest.MonkeyPatch
) -> None:
    client, broker, probe = served
    monkeypatch.setattr(stream, "CLUSTER_EVERY", 0.05)
    monkeypatch.setattr(stream, "HEARTBEAT_EVERY", 0.3)
    async with client.get("/v1/stream") as answer:
        await read_messages(answer, 1)
        assert await read_messages(answer, 1) == [{"comment": "heartbeat"}]  # nothing changed: no cluster message
        probe.external(0, 6 * GIB)
        await broker.sample()
        message = (await read_messages(answer, 1))[0]
        assert message["event"] == "cluster"
        assert "id" not in message  # a view is not an event: it must not move Last-Event-ID
        summary = json.loads(message["data"])
        assert summary["nodes"][0]["gpus"][0]["external"] == 6 * GIB


async def cluster_with_a_peer(client: TestClient[Any, Any], broker: Broker, monkeypatch: pytest.MonkeyPatch, peer: dict[str, Any]) -> str:
    """The Cluster page's region for this node and one peer, "far", as the mesh's view would give them."""
    view = {
        "nodes": [
            {"id": broker.node_id, "name": "tower", "state": "alive", "self": True, "age": 0.0, **broker.node_json()},
            {"id": "n-far", "name": "far", "self": False, **peer},
        ],
        "coordinator": None,
    }
    monkeypatch.setattr(pages, "cluster_view", lambda app: view)
    return await (await client.get("/fragment/cluster")).text()


async def test_the_cluster_totals_leave_out_nodes_that_are_down(
    served: tuple[TestClient[Any, Any], Broker, FakeGpuProbe], monkeypatch: pytest.MonkeyPatch
) -> None:
    client, broker, _ = served
    gone = {"gpus": [{"index": 0, "uuid": "GPU-far", "name": "far", "figures": {"total": 48 * GIB, "schedulable": 47 * GIB}}], "leases": []}
    text = await cluster_with_a_peer(client, broker, monkeypatch, {"state": "dead", "age": 30.0, "document": gone})
    assert "2 nodes (1 down, not counted) · 1 GPU · 24.0 GiB total" in text


async def test_the_cluster_totals_leave_out_the_room_of_a_gpu_whose_reading_is_stale(
    served: tuple[TestClient[Any, Any], Broker, FakeGpuProbe], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stale GPU's room cannot be granted (SCHEDULER_STATE_STALE): the totals offered it as schedulable."""
    client, broker, _ = served
    gpu = {"index": 0, "uuid": "GPU-far", "name": "far", "figures": {"total": 48 * GIB, "schedulable": 47 * GIB}, "stale": True}
    text = await cluster_with_a_peer(client, broker, monkeypatch, {"state": "alive", "age": 1.0, "document": {"gpus": [gpu], "leases": []}})
    assert "2 nodes · 2 GPUs (1 stale, not counted) · 24.0 GiB total" in text
    assert "47.0 GiB schedulable" not in text.split('<div class="cards">')[0]
    broker.clock.advance(broker.config.staleness + 1)  # type: ignore[attr-defined]  # this node's own GPU goes stale too
    text = await cluster_with_a_peer(client, broker, monkeypatch, {"state": "alive", "age": 1.0, "document": {"gpus": [gpu], "leases": []}})
    assert "2 nodes · 2 GPUs (2 stale, not counted) · 0.0 GiB total" in text


async def test_a_peers_gpu_its_driver_cannot_read_is_shown_on_the_cluster_page_from_its_document(
    served: tuple[TestClient[Any, Any], Broker, FakeGpuProbe], monkeypatch: pytest.MonkeyPatch
) -> None:
    client, broker, _ = served
    peer = broker.node_json()
    peer["unreadable_gpus"] = [{"index": 1, "uuid": None, "error": "GPU is <lost>", "leases": ["l-on-it"]}]
    document = summarize(peer, [])
    document["unreadable_gpus"].append({"index": "2", "error": 7})  # an entry not in a known shape is left out, not shown
    text = await cluster_with_a_peer(client, broker, monkeypatch, {"state": "alive", "age": 1.0, "document": document})
    assert text.count("cannot be read") == 1
    assert "GPU 1 (UUID unknown) cannot be read: GPU is &lt;lost&gt;; not offered until it can be read again" in text


async def test_a_leased_gpu_the_driver_no_longer_lists_is_shown_missing_on_the_node_and_cluster_pages_until_released(
    served: tuple[TestClient[Any, Any], Broker, FakeGpuProbe],
) -> None:
    """The leases' memory on a card gone from the driver is shown where the card was, and the totals say they leave
    it out: they read as if that memory were nowhere."""
    client, broker, probe = served
    probe.sizes = [24 * GIB, 24 * GIB]
    await broker.sample()
    held = await lease(client, {"gpu_memory": "4GiB", "gpu": 1})
    probe.sizes = [24 * GIB]
    await broker.sample()
    [gone] = broker.node_json()["missing_gpus"]
    said = f'GPU 1 · NVIDIA GeForce RTX 4090 (GPU-fake-1) is no longer listed by the driver, since <time datetime="{gone["since"]}"'
    held_there = f"leases {held['id']} hold 4.0 GiB on it and stay until released or expired; nothing is granted on it"
    for page in ("node", "cluster"):
        text = await (await client.get(f"/fragment/{page}")).text()
        assert text.count(said) == 1, text
        assert held_there in text
    cluster = await (await client.get("/fragment/cluster")).text()
    assert "1 node · 1 GPU (1 missing, 4.0 GiB leased on it, not counted) · 24.0 GiB total" in cluster
    assert "<td>1 (no longer listed)</td>" in await (await client.get("/fragment/leases")).text()  # its lease, where it is listed

    answer = await client.delete(f"/v1/leases/{held['id']}", headers={"X-Lease-Token": held["token"]})
    assert answer.status == 200
    for page in ("node", "cluster"):
        assert "no longer listed" not in await (await client.get(f"/fragment/{page}")).text()


async def test_a_peers_gpu_its_leases_hold_and_its_driver_no_longer_lists_is_shown_on_the_cluster_page_from_its_document(
    served: tuple[TestClient[Any, Any], Broker, FakeGpuProbe], monkeypatch: pytest.MonkeyPatch
) -> None:
    client, broker, _ = served
    peer = broker.node_json()
    gone = {"index": 1, "uuid": "GPU-far-1", "name": "RTX <4090>", "since": "2026-11-30T10:00:00.000Z", "bytes": 8 * GIB}
    peer["missing_gpus"] = [{**gone, "leases": [f"l-{i:012x}" for i in range(20)]}]
    on_it = {"id": "l-000000000000", "state": "granted", "holder": {"name": "train"}, "priority": "batch", "epoch": 1,
             "gpus": [{"index": 1, "uuid": "GPU-far-1", "bytes": 8 * GIB, "epoch": 1}], "expires_at": "2026-11-30T11:00:00.000Z"}  # fmt: skip
    document = summarize(peer, [on_it])
    text = await cluster_with_a_peer(client, broker, monkeypatch, {"state": "alive", "age": 1.0, "document": document})
    assert "GPU 1 · RTX &lt;4090&gt; (GPU-far-1) is no longer listed by the driver, since <time" in text
    assert "l-00000000000f and 4 more hold 8.0 GiB on it" in text
    assert "2 nodes · 2 GPUs (1 missing, 8.0 GiB leased on it, not counted) · 48.0 GiB total" in text
    assert "<td>1 (no longer listed)</td>" in await (await client.get("/fragment/leases")).text()  # its lease on the Leases page


async def test_a_gpu_whose_reading_is_stale_is_marked_on_the_cluster_page_here_and_on_a_peer(
    served: tuple[TestClient[Any, Any], Broker, FakeGpuProbe], monkeypatch: pytest.MonkeyPatch
) -> None:
    client, broker, _ = served
    fresh = summarize(broker.node_json(), [])
    assert (await cluster_with_a_peer(client, broker, monkeypatch, {"state": "alive", "age": 1.0, "document": fresh})).count("stale:") == 0
    broker.clock.advance(broker.config.staleness + 1)  # type: ignore[attr-defined]  # no reading since: a hung driver
    stale = summarize(broker.node_json(), [])  # the peer's document says so, as its node decided
    assert (await cluster_with_a_peer(client, broker, monkeypatch, {"state": "alive", "age": 1.0, "document": stale})).count("stale:") == 2


async def test_a_gpu_under_external_pressure_is_marked_on_the_cluster_page_here_and_on_a_peer(
    served: tuple[TestClient[Any, Any], Broker, FakeGpuProbe], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its figures read as any other GPU's there, room to offer where requests are refused."""
    client, broker, probe = served
    calm = summarize(broker.node_json(), [])
    assert (await cluster_with_a_peer(client, broker, monkeypatch, {"state": "alive", "age": 1.0, "document": calm})).count(
        "external pressure:"
    ) == 0
    await lease(client, {"gpu_memory": "20GiB"})
    probe.external(0, 6 * GIB)  # grown 3 GiB into what the lease declared and the reserve
    await broker.sample()
    pressed = summarize(broker.node_json(), [])  # the peer's document says so, as its node decided
    text = await cluster_with_a_peer(client, broker, monkeypatch, {"state": "alive", "age": 1.0, "document": pressed})
    assert text.count("external pressure:") == 2


async def test_the_node_page_marks_a_gpu_under_external_pressure_and_one_whose_reading_is_stale(
    served: tuple[TestClient[Any, Any], Broker, FakeGpuProbe],
) -> None:
    """As `gpubroker status` does: the figures of a GPU whose requests are refused must not read as room to offer."""
    client, broker, probe = served
    assert "warning" not in await (await client.get("/fragment/node")).text()
    await lease(client, {"gpu_memory": "20GiB"})
    probe.external(0, 6 * GIB)  # grown 3 GiB into what the lease declared and the reserve
    await broker.sample()
    text = await (await client.get("/fragment/node")).text()
    assert "external pressure: external usage has grown 3.0 GiB into leased or reserved memory" in text
    assert "stale:" not in text
    broker.clock.advance(broker.config.staleness + 1)  # type: ignore[attr-defined]  # no reading since: a hung driver
    assert "stale:" in await (await client.get("/fragment/node")).text()


async def test_an_ended_lease_on_the_leases_page_has_no_expiry_ahead(served: tuple[TestClient[Any, Any], Broker, FakeGpuProbe]) -> None:
    client, broker, _ = served
    held = await lease(client)
    ended = await lease(client)
    answer = await client.delete(f"/v1/leases/{ended['id']}", headers={"X-Lease-Token": ended["token"]})
    assert answer.status == 200
    text = await (await client.get("/fragment/leases")).text()
    rows = {lease_id: next(row for row in text.split("<tr") if lease_id in row) for lease_id in (held["id"], ended["id"])}
    expiry = {lease_id: row.split("<td>")[8] for lease_id, row in rows.items()}  # holder, node, GPU, bytes, class, preemption, age, expiry
    assert expiry[held["id"]].startswith("<time")
    assert expiry[ended["id"]].startswith("—")


async def test_a_waiting_request_on_the_leases_page_shows_the_gpu_it_waits_for_its_position_and_why(
    served: tuple[TestClient[Any, Any], Broker, FakeGpuProbe],
) -> None:
    """As `gpubroker leases` does: a queued row read "GPU —" and "queued", with no word of its place or of what holds it."""
    client, broker, _ = served
    await lease(client, {"gpu_memory": "20GiB"})
    waiting = []
    asks = ({"gpu_memory": "8GiB", "gpu": 0}, {"gpu_memory": "2GiB"}, {"exclusive": True})  # the second would fit but for the first
    for more in asks:
        waiting.append(asyncio.create_task(client.post("/v1/leases", json={"wait": "1m", **more})))
        for _ in range(500):  # queued in order: each asks once the one before waits
            if len(broker.waiters) == len(waiting):
                break
            await asyncio.sleep(0.01)
        assert len(broker.waiters) == len(waiting), "a request did not join the queue"
    text = await (await client.get("/fragment/leases")).text()
    pinned, anywhere, whole = (next(row for row in text.split("<tr") if waiter.id in row) for waiter in broker.waiters)
    assert pinned.split("<td>")[3:5] == ["0</td>", "8.0 GiB</td>"]  # holder, node, GPU, bytes
    assert anywhere.split("<td>")[3:5] == ["any 1</td>", "2.0 GiB</td>"]
    assert whole.split("<td>")[3:5] == ["any 1</td>", "whole</td>"]  # a whole GPU, whatever its size: not "0.0 GiB"
    assert "position 1: GPU 0 (" in pinned
    assert "position 2: GPU 0 (" in anywhere
    assert "claimed by requests waiting ahead" in anywhere
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)


async def test_the_sign_in_page_of_a_node_without_a_password_says_there_is_nothing_to_sign_in_to(
    served: tuple[TestClient[Any, Any], Broker, FakeGpuProbe],
) -> None:
    client, _, _ = served
    text = await (await client.get("/login")).text()
    assert "no UI password" in text
    assert 'action="/login"' not in text  # no form that could never succeed


def test_every_event_type_the_broker_records_is_one_the_pages_listen_for() -> None:
    """A browser's EventSource hands a page only the named events it listens for: a type missing here never shows
    live (a refused sign-in, a GPU gone), and the page's resume point does not move past it."""
    recorded = event_types()
    assert len(recorded) > 25  # the scan finds them
    assert recorded <= set(stream.EVENT_TYPES), sorted(recorded - set(stream.EVENT_TYPES))


def test_a_lease_using_more_than_it_declared_is_credited_on_the_bar_with_what_it_counts() -> None:
    """`leased` counts the larger of what a lease declared and what its processes use: so does its part of the bar."""
    gpu = {
        "index": 0, "uuid": "GPU-0", "name": "RTX 4090", "processes": [],
        "figures": {"total": 24 * GIB, "external": 0, "resident": 0, "leased": 5 * GIB, "reserve": GIB, "schedulable": 18 * GIB},
        "leases": [{"id": "l-1", "holder": "trainer", "bytes": 2 * GIB, "used": 5 * GIB}, {"id": "l-2", "holder": None, "bytes": GIB, "used": 0}],
    }  # fmt: skip
    [shown] = pages.node_gpus({"self": True, "gpus": [gpu]})
    assert shown["holders"] == [("trainer", 5 * GIB), ("l-2", GIB)]


async def test_a_stream_over_tcp_ends_once_what_it_sent_goes_unacknowledged_for_two_heartbeats(
    served: tuple[TestClient[Any, Any], Broker, FakeGpuProbe],
) -> None:
    """A client gone without closing (asleep, off the Wi-Fi) would hold its slot while the kernel retried for minutes."""
    client, _, _ = served
    async with client.get("/v1/stream") as answer:
        await read_messages(answer, 1)
        handlers = [c for c in client.server.runner.server.connections if c.transport is not None]  # type: ignore[union-attr]
        [sock] = [h.transport.get_extra_info("socket") for h in handlers]
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == int(2 * stream.HEARTBEAT_EVERY * 1000)


async def test_a_stream_whose_client_reads_nothing_ends_at_once_when_the_broker_stops(
    served: tuple[TestClient[Any, Any], Broker, FakeGpuProbe],
) -> None:
    """Blocked writing to a client that reads nothing, a stream never saw the broker stop: the stop waited for it
    (60 s, then until the client went), past systemd's stop timeout."""
    client, _, _ = served
    app = client.server.app
    assert app is not None
    streams = app[stream.STREAMS]
    with socket.create_connection((client.host, client.port)) as reader:
        reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        reader.sendall(b"GET /v1/stream?after=0 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        await asyncio.to_thread(reader.recv, 1)  # the stream has begun; from now on the client reads nothing
        [transport] = [c.transport for c in client.server.runner.server.connections if c.transport is not None]  # type: ignore[union-attr]
        transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        async with asyncio.timeout(30):
            while transport.get_write_buffer_size() == 0:  # the client's buffers are full: the stream waits to write
                made = await lease(client, {"holder": {"name": "x" * 256}})
                await client.delete(f"/v1/leases/{made['id']}", headers={"X-Lease-Token": made["token"]})
        assert streams.open == 1
        await stream.close_streams(app)
        async with asyncio.timeout(3):
            while True:
                if streams.open == 0:
                    break
                await asyncio.sleep(0.01)
        assert not streams.transports  # nor does it keep the connection


async def test_a_stream_resumed_past_what_the_broker_keeps_says_how_many_events_it_missed(tmp_path: Path) -> None:
    """GET /v1/events says `dropped`; the stream skipped them without a word, so a follower never knew it had a gap."""
    clock = FakeClock()
    config = Config(state_dir=tmp_path / "state", name="tower", events_kept=1)
    broker = Broker(config, Store(config.state_dir, config.store_size, config.events_kept), FakeGpuProbe(clock, [24 * GIB]), clock)
    await broker.start()
    client: TestClient[Any, Any] = TestClient(TestServer(make_app(broker)))
    await client.start_server()
    try:
        for _ in range(80):
            made = await lease(client)
            await client.delete(f"/v1/leases/{made['id']}", headers={"X-Lease-Token": made["token"]})
        await broker.store.commit([])  # every event is on disk, and the oldest are dropped
        first = broker.events(0, 1)[0][0]["seq"]
        assert first > 2
        async with client.get("/v1/stream", headers={"Last-Event-ID": "1"}) as answer:
            messages = await read_messages(answer, 3)
        assert messages[1]["event"] == "dropped"
        assert "id" not in messages[1]  # not an event: it must not move Last-Event-ID
        assert json.loads(messages[1]["data"]) == {"dropped": first - 2, "after": 1, "next": first}
        assert (messages[2]["id"], messages[2]["event"]) == (str(first), broker.events(0, 1)[0][0]["type"])
    finally:
        await client.close()
        await broker.close()


async def test_a_stream_resumed_before_an_event_whose_write_failed_says_nothing_was_dropped(
    served: tuple[TestClient[Any, Any], Broker, FakeGpuProbe],
) -> None:
    """A write that fails (a full disk) takes its events' seqs with it: the stream said `dropped` for that hole, as if
    events kept had been lost."""
    client, broker, _ = served
    before = broker.last_event_seq
    broker.record_event("test.lost", "its write fails", details={"value": object()})  # a value the store cannot write
    broker.record_event("test.kept", "written")
    await broker.store.commit([])
    async with client.get("/v1/stream", headers={"Last-Event-ID": str(before)}) as answer:
        messages = await read_messages(answer, 2)
    assert (messages[1]["id"], messages[1]["event"]) == (str(before + 2), "test.kept")


async def test_the_events_page_says_when_it_shows_only_the_newest_and_where_the_rest_are(
    served: tuple[TestClient[Any, Any], Broker, FakeGpuProbe], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A burst of more events than the page shows moved the page on past them without a word."""
    client, broker, _ = served
    monkeypatch.setattr(pages, "EVENTS_SHOWN", 5)
    monkeypatch.setattr(pages, "EVENTS_SCANNED", 20)
    for _ in range(12):
        made = await lease(client)
        await client.delete(f"/v1/leases/{made['id']}", headers={"X-Lease-Token": made["token"]})
    await broker.store.commit([])
    region = await (await client.get("/fragment/events")).text()
    assert region.count('<li class="event"') == 5
    assert "the newest 5 events are shown" in region
    assert "gpubroker events" in region
    none = await (await client.get("/fragment/events?code=QUEUE_FULL")).text()
    assert "no events with code QUEUE_FULL among the newest 20" in none
    few = await (await client.get("/fragment/events", params={"code": ""})).text()
    assert "the newest 5 events are shown" in few


async def test_the_events_page_shows_details_as_key_and_value_memory_in_gib_and_a_long_one_cut_and_whole_below(
    served: tuple[TestClient[Any, Any], Broker, FakeGpuProbe],
) -> None:
    """Details were Python's text of each value (`figures={'total': 25769803776, ...}`), bytes as digits, and a
    refusal naming every GPU it considered ran on for lines."""
    client, broker, _ = served
    assert (await client.post("/v1/leases", json={"gpu_memory": "100GiB"})).status == 409
    considered = [{"gpu": f"GPU-{i}", "holder": SCRIPT} for i in range(10)]
    broker.record_event("test.long", "many", details={"considered": considered, "bytes": [GIB, 2 * GIB]})
    await broker.store.commit([])
    region = await (await client.get("/fragment/events")).text()
    assert '<code title="107374182400 bytes">need: 100.0 GiB</code>' in region
    assert ">figures: 24.0 GiB total · 0.0 observed · 0.0 external · 0.0 resident · 0.0 leased · 1.0 reserve · 23.0 schedulable<" in region
    assert "<code>priority: interactive</code>" in region
    assert "bytes: 1.0 GiB, 2.0 GiB" in region
    whole = json.dumps(considered, separators=(",", ":"))
    cut = f"<details><summary><code>considered: {pages.e(whole[: pages.DETAIL_SHOWN])}…</code></summary><code>{pages.e(whole)}</code>"
    assert cut in region
    assert "need=" not in region
    assert "{'" not in region
    assert SCRIPT not in region


async def test_a_stream_on_the_unix_socket_whose_client_reads_nothing_ends_after_two_heartbeats(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TCP gives up on such a client (TCP_USER_TIMEOUT); on the Unix socket, a program that opened a stream and stopped
    reading held one of the MAX_STREAMS slots for as long as it lived."""
    monkeypatch.setattr(stream, "HEARTBEAT_EVERY", 0.2)
    clock = FakeClock()
    config = Config(state_dir=tmp_path / "state", name="tower")
    broker = Broker(config, Store(config.state_dir, config.store_size, config.events_kept), FakeGpuProbe(clock, [24 * GIB]), clock)
    await broker.start()
    app = make_app(broker)
    runner = web.AppRunner(app)
    await runner.setup()
    path = tmp_path / "api.sock"
    await web.UnixSite(runner, str(path)).start()
    streams = app[stream.STREAMS]
    try:
        with socket.socket(socket.AF_UNIX) as reader:
            reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            reader.connect(str(path))
            reader.sendall(b"GET /v1/stream HTTP/1.1\r\nHost: localhost\r\n\r\n")
            await asyncio.to_thread(reader.recv, 1)  # the stream has begun; from now on the client reads nothing
            assert streams.open == 1
            async with asyncio.timeout(10):
                while streams.open:
                    broker.record_event("test.filler", "x" * 4000, details={})
                    await asyncio.sleep(0.01)
    finally:
        await runner.cleanup()
        await broker.close()


async def test_the_leases_page_says_when_it_shows_only_some_of_this_nodes_leases_and_where_the_rest_are(
    served: tuple[TestClient[Any, Any], Broker, FakeGpuProbe], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the most the page lists, the rest of the leases (the oldest ended first, then granted ones) went unshown
    without a word."""
    client, broker, _ = served
    monkeypatch.setattr(pages, "LEASES_SHOWN", 5)
    held = [await lease(client) for _ in range(4)]
    for _ in range(3):
        ended = await lease(client)
        await client.delete(f"/v1/leases/{ended['id']}", headers={"X-Lease-Token": ended["token"]})
    await broker.store.commit([])
    region = await (await client.get("/fragment/leases")).text()
    assert region.count('<span class="holder">') == 5
    assert all(made["id"] in region for made in held)  # the live ones come first
    assert "more than 5 leases: the first 5 are shown" in region
    assert "gpubroker leases" in region
    granted = await (await client.get("/fragment/leases?state=granted")).text()
    assert granted.count('<span class="holder">') == 4  # filtered before it is cut: all there is, and no word of more
    assert "more than 5" not in granted


def far_with_one_lease(broker: Broker, state: str, **document: Any) -> dict[str, Any]:
    """The mesh's view of this node and a peer, "far", in `state`, whose document lists one granted lease, l-far-1
    (`document`: more of its fields)."""
    now = broker.clock.now()
    granted = {
        "id": "l-far-1", "state": "granted", "holder": {"name": "far-job"}, "priority": "batch", "preemption": None,
        "gpus": [{"index": 0, "uuid": "GPU-far", "bytes": GIB}], "granted_at": now, "expires_at": now + 60,
    }  # fmt: skip
    far = {**summarize(broker.node_json(), [granted]), **document}
    return {
        "nodes": [
            {"id": broker.node_id, "name": "tower", "state": "alive", "self": True, "age": 0.0, **broker.node_json()},
            {"id": "n-far", "name": "far", "self": False, "state": state, "age": 1.0, "document": far},
        ],
        "coordinator": None,
    }


async def test_the_leases_page_says_a_down_nodes_leases_are_as_it_last_listed_them(
    served: tuple[TestClient[Any, Any], Broker, FakeGpuProbe], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dead node's last document still lists its leases: they read "granted" as if known now, past their expiry too."""
    client, broker, _ = served
    for state, said in (("dead", True), ("left", True), ("suspect", False), ("alive", False)):
        view = far_with_one_lease(broker, state)
        monkeypatch.setattr(pages, "cluster_view", lambda app, view=view: view)
        text = await (await client.get("/fragment/leases")).text()
        assert "l-far-1" in text
        assert (f"as last seen: far is {state}" in text) is said, state


async def test_the_leases_page_says_how_many_leases_a_peers_document_does_not_list(
    served: tuple[TestClient[Any, Any], Broker, FakeGpuProbe], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A document lists as many leases as LEASES_ROOM holds and counts the rest: the page showed those it lists as all."""
    client, broker, _ = served
    view = far_with_one_lease(broker, "alive", leases_not_listed=40)
    monkeypatch.setattr(pages, "cluster_view", lambda app: view)
    text = await (await client.get("/fragment/leases")).text()
    assert "l-far-1" in text
    assert "far lists 1 of its 41 granted leases in its document" in text
    assert "gpubroker leases" in text
    assert "far lists" not in await (await client.get("/fragment/leases?node=tower")).text()
    assert "far lists" in await (await client.get("/fragment/leases?node=far")).text()
