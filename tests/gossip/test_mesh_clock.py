"""The mesh when a wall clock steps (NTP arriving on a box without a real-time clock) or disagrees with the others':
timers and ages are measured on the elapsed clock, and another machine's stamps are read against when they came; and
when a node starts from older state than the members remember of it (a VM restored from a snapshot)."""

from __future__ import annotations

import datetime as dt
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from fakes import GIB, FakeClock, FakeGpuProbe

from gpubroker.broker.service import Broker
from gpubroker.broker.store import Store
from gpubroker.config import Config
from gpubroker.gossip.cluster import ClusterState, decode_token
from gpubroker.gossip.documents import MAX_INTERVAL, NodeDocument, Publisher
from gpubroker.gossip.identity import Identity
from gpubroker.gossip.membership import Membership, MembershipConfig
from gpubroker.gossip.mesh import Asker, Mesh, MeshSettings
from gpubroker.gossip.messages import Ack, Addr, Alive, Compound, DocumentNotice, MemberState, Message, Ping
from gpubroker.gossip.transport import PeerServer, call_member
from gpubroker.ui.api import make_app
from gpubroker.units import rfc3339

PEER_ADDR = ("127.0.0.1", 9)
HOUR = 3600.0


@dataclass
class Sent:
    """The mesh's datagrams as it sends them: what went where, Compounds opened."""

    messages: list[tuple[Addr, Message]] = field(default_factory=list)

    def send(self, addr: Addr, messages: list[Message]) -> None:
        for message in messages:
            for part in message.parts if isinstance(message, Compound) else [message]:
                self.messages.append((addr, part))

    def pings(self) -> list[Ping]:
        return [m for addr, m in self.messages if addr == PEER_ADDR and isinstance(m, Ping)]


@dataclass
class Node:
    mesh: Mesh
    clock: FakeClock
    sent: Sent
    peer: str

    def run(self, seconds: float, answer: bool = True) -> None:
        """Time passes in steps of 0.1 s, the mesh ticking and publishing; the peer answers every ping if `answer`."""
        for _ in range(round(seconds / 0.1)):
            self.clock.advance(0.1)
            answered = len(self.sent.pings())
            self.mesh._tick()
            self.mesh.publish()
            if answer:
                for ping in self.sent.pings()[answered:]:
                    self.mesh._on_datagram(PEER_ADDR, Ack(ping.seq))

    def state(self) -> MemberState | None:
        member = self.mesh.membership.member(self.peer)
        return None if member is None else member.state


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Node]:
    """A member's mesh as `Mesh.run` sets it up, on fake clocks, without its loops, with one peer it has heard of."""
    clock = FakeClock()
    config = Config(state_dir=tmp_path / "state", name="tower")
    broker = Broker(config, Store(config.state_dir, config.store_size, config.events_kept), FakeGpuProbe(clock, [24 * GIB]), clock)
    await broker.start()
    me, peer = Identity.load_or_create(tmp_path / "me"), Identity.load_or_create(tmp_path / "peer")
    cluster = ClusterState.init(tmp_path / "cluster", me, "tower", now=clock.now())
    secret = decode_token(cluster.invite(("127.0.0.1", 9741), me, 600, clock.now())).secret
    cluster.redeem(secret, peer.certificate_pem().decode(), "nuc", clock.now(), me.node_id)
    mesh = Mesh(MeshSettings(("127.0.0.1", 0), "127.0.0.1"), broker, me, cluster, clock=clock.now, elapsed=clock.elapsed)
    mesh._membership = Membership(me.node_id, ("127.0.0.1", 1), MembershipConfig(tcp_fallback_ping=False), random.Random(0))
    mesh._publisher = Publisher(me.node_id, 1, me.public_key_bytes)
    sent = Sent()
    mesh._datagrams = sent  # type: ignore[assignment]
    mesh._on_datagram(PEER_ADDR, Alive(1, peer.node_id, PEER_ADDR))
    try:
        yield Node(mesh, clock, sent, peer.node_id)
    finally:
        for task in list(mesh._tasks):
            task.cancel()
        await broker.close()


async def test_a_step_of_the_wall_clock_back_neither_stops_the_probes_nor_holds_the_document_back(node: Node) -> None:
    node.run(5.0)
    assert node.state() is MemberState.ALIVE
    version = node.mesh._publisher.version  # type: ignore[union-attr]
    probes = len(node.sent.pings())
    node.clock.step(-HOUR)  # NTP corrects a clock an hour fast
    node.run(MAX_INTERVAL + 1)
    assert len(node.sent.pings()) >= probes + MAX_INTERVAL  # a probe a second, as before: failures are still found
    assert node.mesh._publisher.version > version  # type: ignore[union-attr]  # the peers' view of this node stays fresh


async def test_a_step_of_the_wall_clock_forward_neither_fails_a_suspect_at_once_nor_ages_every_view(node: Node) -> None:
    node.run(2.0)
    held = NodeDocument(node.peer, 1, 1, node.clock.now(), {"name": "nuc", "gpus": []}, b"")
    node.mesh.view.apply(held, node.mesh.elapsed())
    node.run(2.0, answer=False)  # the peer stops answering: it is suspected, and has some seconds to refute
    assert node.state() is MemberState.SUSPECT
    node.clock.step(HOUR)  # NTP corrects a clock an hour slow
    node.run(0.1, answer=False)
    assert node.state() is MemberState.SUSPECT
    peer = next(n for n in node.mesh.cluster_json()["nodes"] if n["id"] == node.peer)
    assert peer["age"] == pytest.approx(2.1)  # when this node received it, not an hour ago


def peer_document(peer: str, made_at: float) -> NodeDocument:
    """The peer's document as its own clock stamps it: a lease granted 90 s before it was made, due 330 s after."""
    lease = {
        "id": "l-0123456789ab",
        "holder": "train",
        "priority": "batch",
        "gpus": [[0, GIB]],
        "granted_at": rfc3339(made_at - 90),
        "expires_at": rfc3339(made_at + 330),
    }
    return NodeDocument(peer, 1, 1, made_at, {"name": "nuc", "gpus": [{"index": 0, "uuid": "GPU-0"}], "leases": [lease]}, b"")


@pytest.mark.parametrize("off", [HOUR, -HOUR])
async def test_a_peers_leases_are_read_on_this_nodes_clock_whatever_its_own_clock_says(node: Node, off: float) -> None:
    """A peer an hour fast (or slow) showed its lease granted an hour ahead and due in an hour (or long expired)."""
    node.run(1.0)
    node.mesh.view.apply(peer_document(node.peer, node.clock.now() + off), node.mesh.elapsed())
    node.run(10.0)  # the document is 10 s old here
    now = node.clock.now()
    lease = node.mesh.lease_of("l-0123456789ab")
    assert lease is not None
    assert (lease["granted_at"], lease["expires_at"]) == (rfc3339(now - 100), rfc3339(now + 320))
    assert [listed["expires_at"] for listed in node.mesh.leases_of(node.peer, 10)] == [rfc3339(now + 320)]


@pytest.mark.parametrize("off", [HOUR, -HOUR])
async def test_the_leases_page_shows_a_peers_lease_granted_and_due_as_it_is_whatever_the_peers_clock_says(node: Node, off: float) -> None:
    node.mesh.clock, node.mesh.elapsed = time.time, time.monotonic  # the page reads the real wall clock
    node.mesh.view.apply(peer_document(node.peer, time.time() + off), time.monotonic())
    client: TestClient[Any, Any] = TestClient(TestServer(make_app(node.mesh.broker, node.mesh)))
    await client.start_server()
    try:
        row = next(line for line in (await (await client.get("/leases")).text()).split("<tr") if "l-0123456789ab" in line)
    finally:
        await client.close()
    assert ">1 min ago</time>" in row, row  # granted
    assert ">in 5 min</time>" in row, row  # due


@pytest.mark.parametrize("off", [-3 * HOUR, 3 * HOUR])
async def test_a_node_whose_clock_is_hours_off_the_members_asks_to_join_and_gets_its_grant(node: Node, tmp_path: Path, off: float) -> None:
    """`up --ask` on a box without a real-time clock: its requests were refused as stale, for good and without a word,
    so the operator had nothing to approve. The member says its clock, and the request is stamped on it."""
    server = await PeerServer.start(("127.0.0.1", 0), node.mesh.identity, node.mesh.cluster.members_der, node.mesh._on_request)
    asker = Asker(
        MeshSettings(("127.0.0.1", 9741), "127.0.0.1", mdns=False),
        Identity.generate(),
        "pi",
        tmp_path / "pi",
        on_event=lambda kind, text: None,
        clock=lambda: node.clock.now() + off,
    )
    try:
        assert await asker._ask(server.address) is None  # not approved yet
        assert [p.node_id for p in node.mesh.cluster.pending_list()] == [asker.identity.node_id]
        node.mesh.approve(asker.identity.node_id)
        grant = await asker._ask(server.address)
    finally:
        await server.close()
    assert grant is not None
    assert grant.cluster_id == node.mesh.cluster.cluster_id


@pytest.mark.parametrize(
    "made_at",
    [dt.datetime.now(dt.UTC) + dt.timedelta(days=3), dt.datetime(1970, 1, 1, 0, 1, tzinfo=dt.UTC)],
    ids=["3-days-fast", "clock-not-yet-set"],
)
async def test_members_whose_clocks_were_days_apart_when_they_made_their_certificates_still_talk_over_mutual_tls(
    tmp_path: Path, made_at: dt.datetime
) -> None:
    """A box whose clock ran 3 days fast when it made its certificate (or, the same to a peer, a peer whose clock runs
    3 days slow): every TLS call between it and the others, both ways, was refused as "not yet valid"; and once its own
    clock was right, its next start made a new certificate, which no member had pinned. A board whose first start came
    before its clock was set made one that ended in 1980: renewed once NTP set the clock, it was refused by every member."""
    fast, other = Identity.load_or_create(tmp_path / "fast"), Identity.load_or_create(tmp_path / "other")
    pinned = {fast.node_id: fast.certificate_der(made_at), other.node_id: other.certificate_der()}
    fast = Identity.load_or_create(tmp_path / "fast")  # started again, its clock now right
    assert fast.certificate_der() == pinned[fast.node_id]

    async def who(peer: str | None, request: dict[str, Any]) -> dict[str, Any]:
        return {"peer": peer}

    servers = {
        node: await PeerServer.start(("127.0.0.1", 0), identity, lambda: pinned, who)
        for node, identity in ((fast.node_id, fast), (other.node_id, other))
    }
    try:
        assert await call_member(servers[fast.node_id].address, other, pinned, {"op": "who"}, expect=fast.node_id) == {
            "peer": other.node_id
        }
        assert await call_member(servers[other.node_id].address, fast, pinned, {"op": "who"}, expect=other.node_id) == {
            "peer": fast.node_id
        }
    finally:
        for server in servers.values():
            await server.close()


async def test_a_node_started_from_older_state_goes_on_above_the_document_the_members_hold_of_it(node: Node, tmp_path: Path) -> None:
    """A VM restored from a snapshot taken before later starts: the members held a document of a later generation,
    and ignored this node's documents, showing the old one's leases and figures, until its versions passed it."""
    node.run(1.0)
    publisher = node.mesh._publisher
    assert publisher is not None
    assert (publisher.generation, publisher.version) == (1, 1)
    node.mesh._on_datagram(PEER_ADDR, DocumentNotice(node.mesh.node_id, 3, 40))  # a member tells of the one it holds
    node.run(1.0)
    assert (publisher.generation, publisher.version) == (4, 1)
    saved = ClusterState.load(tmp_path / "cluster")
    assert saved is not None
    assert saved.generation == 4  # the next start goes on above it too
