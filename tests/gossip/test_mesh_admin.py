"""Changing the cluster between meshes in one process, over their real mutual TLS: keyring rotations that a member
missed, and removals."""

from __future__ import annotations

import asyncio
import random
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from fakes import FakeClock, FakeGpuProbe

from gpubroker.broker.request import parse_request
from gpubroker.broker.service import Broker, Caller, RefusalBudget
from gpubroker.broker.store import Store
from gpubroker.config import Config
from gpubroker.errors import BrokerError
from gpubroker.gossip import wire
from gpubroker.gossip.cluster import ClusterError, ClusterState, JoinGrant, decode_token
from gpubroker.gossip.documents import Publisher, sign_document, summarize
from gpubroker.gossip.identity import Identity
from gpubroker.gossip.keyring import key_id
from gpubroker.gossip.membership import Membership, MembershipConfig
from gpubroker.gossip.mesh import Mesh, MeshSettings, _Meta, ask_proof, join_cluster
from gpubroker.gossip.transport import PeerServer, call_member
from gpubroker.units import rfc3339

NOW = 1_800_000_000.0


@dataclass
class Events:
    """The broker as the mesh tells it what happened and reads its name: a node without GPUs."""

    config: Config
    recorded: list[tuple[str, str]] = field(default_factory=list)

    def node_json(self) -> dict[str, Any]:
        return {"node": {"name": self.config.name}, "gpus": [], "cpu": {}, "memory": {}, "queue": {}}

    def list_leases(self, state: str, limit: int) -> list[Any]:
        return []

    def record_event(self, kind: str, message: str, details: dict[str, Any]) -> None:
        self.recorded.append((kind, message))

    def kinds(self) -> list[str]:
        return [kind for kind, _ in self.recorded]


async def start(tmp_path: Path, identity: Identity, name: str, cluster: ClusterState, clock: FakeClock) -> Mesh:
    """A member's mesh as `Mesh.run` sets it up, without its loops, its first document published: a test drives its
    push-pulls and key changes."""
    mesh = Mesh(
        MeshSettings(("127.0.0.1", 0), "127.0.0.1", mdns=False),
        Events(Config(state_dir=tmp_path / name, name=name)),
        identity,
        cluster,
        clock=clock.now,
        elapsed=clock.elapsed,
    )  # type: ignore[arg-type]
    mesh._server = await PeerServer.start(("127.0.0.1", 0), identity, cluster.members_der, mesh._on_request, removed=cluster.removed_der)
    mesh._membership = Membership(
        identity.node_id,
        mesh._server.address,
        MembershipConfig(),
        random.Random(0),
        size_of=lambda m: len(wire.encode(m)) - wire.HEADER_SIZE,
    )
    body = summarize({"node": {"id": identity.node_id, "name": name}, "gpus": [], "cpu": {}, "memory": {}, "queue": {}}, [])
    made = Publisher(identity.node_id, 1, identity.public_key_bytes).next(body, clock.elapsed(), clock.now())
    assert made is not None
    mesh._own_document = sign_document(made, identity.sign)
    return mesh


async def stop(mesh: Mesh) -> None:
    for task in list(mesh._tasks):
        task.cancel()
    await asyncio.gather(*mesh._tasks, return_exceptions=True)
    if mesh._server is not None:
        await mesh._server.close()


@pytest.fixture
async def pair(tmp_path: Path) -> AsyncIterator[tuple[Mesh, Mesh]]:
    """node-a and node-b, members of one cluster, each with its own state directory."""
    a, b = (Identity.load_or_create(tmp_path / name) for name in ("a", "b"))
    cluster_a = ClusterState.init(tmp_path / "cluster-a", a, "node-a", now=NOW)
    secret = decode_token(cluster_a.invite(("127.0.0.1", 9741), a, 600, NOW)).secret
    grant = cluster_a.redeem(secret, b.certificate_pem().decode(), "node-b", NOW, a.node_id)
    cluster_b = ClusterState.adopt(tmp_path / "cluster-b", b, "node-b", JoinGrant.from_dict(grant.to_dict()), now=NOW)
    clock = FakeClock(NOW)
    meshes = (await start(tmp_path, a, "node-a", cluster_a, clock), await start(tmp_path, b, "node-b", cluster_b, clock))
    try:
        yield meshes
    finally:
        for mesh in meshes:
            await stop(mesh)


async def test_a_token_whose_member_does_not_answer_says_to_start_that_member_and_keeps_nothing(tmp_path: Path) -> None:
    a, b = (Identity.load_or_create(tmp_path / name) for name in ("a", "b"))
    with socket.socket() as closed:  # the member that issued the token, stopped
        closed.bind(("127.0.0.1", 0))
        seed = closed.getsockname()
    token = ClusterState.init(tmp_path / "cluster-a", a, "node-a", now=NOW).invite(seed, a, 600, NOW)
    with pytest.raises(
        ClusterError,
        match=rf"^the member that issued this token, 127\.0\.0\.1:{seed[1]}, does not answer \(cannot connect: .*\): start its broker",
    ):
        await join_cluster(token, b, "node-b", tmp_path / "cluster-b")
    assert ClusterState.load(tmp_path / "cluster-b") is None


async def test_a_member_down_during_a_rotation_adopts_it_and_the_removed_key_comes_back_nowhere(pair: tuple[Mesh, Mesh]) -> None:
    a, b = pair
    old = key_id(a.cluster.keyring.primary)
    # node-b is down (not heard of): `keys install NEW; keys use NEW; keys remove OLD` reach node-a alone.
    installed = await a.change_keys({"install": None})
    assert installed["members"] == {b.node_id: "not reached (not heard of)"}
    new = next(k["id"] for k in installed["keys"] if not k["primary"])
    await a.change_keys({"use": new})
    await a.change_keys({"remove": old})

    await a._push_pull(b.membership.addr)  # node-b is back: push-pulls either way, as each node's timer or join asks
    await b._push_pull(a.membership.addr)
    for mesh in (a, b):
        assert [(k["id"], k["primary"]) for k in mesh.keys_json()["keys"]] == [(new, True)], mesh.node_id
    assert "mesh.keys" in b.broker.kinds()  # type: ignore[attr-defined]  # it says it missed a change and took it
    reloaded = ClusterState.load(b.cluster.path.parent)
    assert reloaded is not None
    assert reloaded.keys_list() == [(new, True)]


async def test_a_rotation_with_every_member_up_is_made_on_each_and_says_so(pair: tuple[Mesh, Mesh]) -> None:
    """The README's rotation with node-b up: `keys remove OLD` reaches it with an order that already lists OLD as
    removed, so taking that order in removes it there; that is the change made, not "no installed key"."""
    a, b = pair
    await a._push_pull(b.membership.addr)  # node-b is alive in node-a's view: the changes are sent to it
    old = key_id(a.cluster.keyring.primary)
    installed = await a.change_keys({"install": None})
    assert installed["members"] == {b.node_id: "ok"}
    new = next(k["id"] for k in installed["keys"] if not k["primary"])
    assert (await a.change_keys({"use": new}))["members"] == {b.node_id: "ok"}
    assert (await a.change_keys({"remove": old}))["members"] == {b.node_id: "ok"}
    for mesh in (a, b):
        assert [(k["id"], k["primary"]) for k in mesh.keys_json()["keys"]] == [(new, True)], mesh.node_id


async def test_a_member_started_again_under_another_name_is_listed_by_it_beside_the_name_it_was_admitted_with(
    pair: tuple[Mesh, Mesh],
) -> None:
    a, b = pair
    b.membership.set_meta(b.clock(), _Meta("node-b2", "127.0.0.1:9740", 0).encode())  # `gpubroker up --name node-b2`
    await a._push_pull(b.membership.addr)
    listed = {m["id"]: (m["name"], m["admitted_as"], m["state"]) for m in a.nodes_json()["members"]}
    assert listed == {a.node_id: ("node-a", "node-a", "self"), b.node_id: ("node-b2", "node-b", "alive")}


async def test_a_member_heard_alive_whose_document_is_not_held_has_it_fetched_at_once(pair: tuple[Mesh, Mesh]) -> None:
    """A node started again showed its members with no figures and no leases until each announced its next document:
    on a change, or 10 s after the last one unchanged."""
    a, b = pair  # node-a published its document before node-b started: no notice of it will come
    await b._push_pull(a.membership.addr)  # node-b (re)starts and hears of node-a, alive
    await asyncio.gather(*b._tasks)
    assert b.view.knows(a.node_id) == (1, 1)


async def test_a_member_heard_alive_again_while_its_document_is_being_fetched_is_not_fetched_twice(pair: tuple[Mesh, Mesh]) -> None:
    a, b = pair
    b._own_document = b""  # it has made none yet: the fetch is tried again for a while
    await a._push_pull(b.membership.addr)  # node-a hears node-b alive, and fetches its document
    fetching = set(a._tasks)
    assert len(fetching) == 1
    for _ in range(3):
        a._member_event("alive", b.node_id)  # heard alive again meanwhile (a suspicion refuted, say)
    assert a._tasks == fetching


async def test_removing_or_approving_a_node_by_its_name_says_to_give_its_id(pair: tuple[Mesh, Mesh]) -> None:
    a, b = pair
    with pytest.raises(
        BrokerError, match=rf"^unknown node node-b: .*; node-b is the name of {b.node_id}: give the node's id, as `gpubroker nodes list`"
    ):
        await a.remove("node-b")
    with pytest.raises(BrokerError, match=rf"; node-b is the name of {b.node_id}: give the node's id"):
        a.approve("node-b")
    with pytest.raises(BrokerError, match=r"^unknown node nobody: neither a member nor asking to join$"):
        await a.remove("nobody")
    assert b.node_id in {m["id"] for m in a.nodes_json()["members"]}


async def test_a_removed_node_is_told_by_its_remover_and_stops_showing_its_cluster(pair: tuple[Mesh, Mesh]) -> None:
    a, b = pair
    await a._push_pull(b.membership.addr)  # node-a hears that node-b is alive, and where
    assert b.cluster_json()["removed"] is None
    await a.remove(b.node_id)
    assert a.broker.recorded[-1] == ("mesh.member.removed", f"node {b.node_id} was removed from the cluster (it was told)")  # type: ignore[attr-defined]
    assert "mesh.removed" in b.broker.kinds()  # type: ignore[attr-defined]
    assert b._removed  # its loops end: it gossips no more
    shown = b.cluster_json()
    assert shown["removed"] == rfc3339(a.cluster.removed[b.node_id])  # as every time the API gives
    assert [(n["id"], n["state"]) for n in shown["nodes"]] == [(b.node_id, "removed")]  # nobody shown alive any more
    assert shown["coordinator"] is None
    assert {m["id"]: m["state"] for m in b.nodes_json()["members"]} == {a.node_id: "unknown"}  # not the "alive" it last heard


async def test_a_node_removed_while_it_was_down_is_told_by_the_first_member_it_calls_and_stops(
    tmp_path: Path, pair: tuple[Mesh, Mesh]
) -> None:
    """Removed while down, it started again as a member: every member refused its calls, unanswered, and it went on
    alone, showing the members "unknown" and inviting nodes, with no word that it had been removed."""
    a, b = pair
    c_identity = Identity.load_or_create(tmp_path / "c")
    secret = decode_token(a.cluster.invite(("127.0.0.1", 9741), a.identity, 600, NOW)).secret
    grant = a.cluster.redeem(secret, c_identity.certificate_pem().decode(), "node-c", NOW, a.node_id)
    c_cluster = ClusterState.adopt(tmp_path / "cluster-c", c_identity, "node-c", JoinGrant.from_dict(grant.to_dict()), now=NOW)
    c = await start(tmp_path, c_identity, "node-c", c_cluster, clock := FakeClock(NOW))
    try:
        await c._push_pull(a.membership.addr)  # node-c knows node-b as a member, from node-a, and both as alive
        await b._push_pull(a.membership.addr)  # and node-b node-c
        await asyncio.gather(*a._tasks, *b._tasks, *c._tasks)  # the documents they fetch on sight
        await stop(b)  # node-b is down
        await a.remove(b.node_id)
        await asyncio.gather(*a._tasks)  # its push-pull with node-c
        said = a.broker.recorded[-1][1]  # type: ignore[attr-defined]
        assert said == f"node {b.node_id} was removed from the cluster (it could not be told now, and will be when it next calls a member)"
        assert c.cluster.is_removed(b.node_id)  # by node-a's push-pull: node-c keeps the certificate node-b was admitted with
        assert ClusterState.load(tmp_path / "cluster-c").removed_der().keys() == {b.node_id}  # type: ignore[union-attr]

        # node-b starts again with node-c as its seed: its join's push-pull is answered with the tombstones.
        seed = c._server.address  # type: ignore[union-attr]
        again = Mesh(MeshSettings(("127.0.0.1", 0), "127.0.0.1", (seed,), mdns=False), b.broker, b.identity, b.cluster, clock=clock.now)
        await asyncio.wait_for(again.run(), 5)  # the mesh stops, as when told while up
        assert again._removed
        assert b.cluster.is_removed(b.node_id)
        assert b.broker.recorded[-1] == ("mesh.removed", "this node was removed from its cluster; it stops gossiping")  # type: ignore[attr-defined]
        assert [(n["id"], n["state"]) for n in again.cluster_json()["nodes"]] == [(b.node_id, "removed")]
        assert c.broker.recorded[-1] == ("mesh.member.removed", f"node {b.node_id}, removed from the cluster, called and was told")  # type: ignore[attr-defined]
        answer = await c._on_request(b.node_id, {"op": "document", "node": c.node_id})
        assert answer.keys() == {"error", "removed", "cluster"}  # whatever it asks: nothing but its removal
    finally:
        await stop(c)


async def test_a_removed_node_that_calls_is_told_its_own_removal_and_nothing_else_whatever_it_asks(
    tmp_path: Path, pair: tuple[Mesh, Mesh]
) -> None:
    """Its certificate passes the handshake so that it can be told; every op it sent was answered with every tombstone
    the member held, so it learned which other nodes were removed, and when."""
    a, b = pair
    c = Identity.load_or_create(tmp_path / "c")
    secret = decode_token(a.cluster.invite(("127.0.0.1", 9741), a.identity, 600, NOW)).secret
    a.cluster.redeem(secret, c.certificate_pem().decode(), "node-c", NOW, a.node_id)
    a.cluster.remove(c.node_id, NOW + 1)  # another node, removed before
    await stop(b)  # node-b is down
    await a.remove(b.node_id)
    at = a.cluster.removed[b.node_id]
    members = b.cluster.members_der()  # node-b still takes itself for a member
    state = wire.encode(b.membership.push_pull_state())
    keys = a.keys_json()
    for request in (
        {"op": "push_pull", "state": state, "cluster": b.cluster.export(), "primary": "", "keys": b.cluster.keys_state()},
        {"op": "ping", "ping": b""},
        {"op": "document", "node": a.node_id},
        {"op": "release", "lease": "l-000000000000", "admin": "root"},
        {"op": "removed", "cluster": b.cluster.export()},
        {"op": "keys", "change": {"install": None}},
        {"op": "join", "secret": secret, "cert": b.identity.certificate_pem().decode()},
        {"op": "ask"},
    ):
        answer = await call_member(a._server.address, b.identity, members, request, expect=a.node_id)  # type: ignore[union-attr]
        assert answer == {"error": "this node was removed from the cluster", "removed": True, "cluster": {"removed": {b.node_id: at}}}
    assert a.keys_json() == keys  # nothing it asked was done
    assert not a.cluster.is_member(b.node_id)


async def test_a_removal_reaches_the_members_alive_at_once_not_at_their_next_push_pull(tmp_path: Path, pair: tuple[Mesh, Mesh]) -> None:
    """Until then they went on showing the removed node, and taking its connections, for up to 30 s."""
    a, b = pair
    c_identity = Identity.load_or_create(tmp_path / "c")
    secret = decode_token(a.cluster.invite(("127.0.0.1", 9741), a.identity, 600, NOW)).secret
    grant = a.cluster.redeem(secret, c_identity.certificate_pem().decode(), "node-c", NOW, a.node_id)
    clock = FakeClock(NOW)
    c = await start(
        tmp_path,
        c_identity,
        "node-c",
        ClusterState.adopt(tmp_path / "cluster-c", c_identity, "node-c", JoinGrant.from_dict(grant.to_dict()), now=NOW),
        clock,
    )
    try:
        await c._push_pull(a.membership.addr)  # node-c knows node-b as a member, from node-a
        assert b.node_id in c.cluster.members
        await a._push_pull(b.membership.addr)  # node-a hears both alive
        await a._push_pull(c.membership.addr)
        await a.remove(b.node_id)
        await asyncio.gather(*a._tasks)  # its push-pulls, run beside the removal
        assert c.cluster.is_removed(b.node_id)
    finally:
        await stop(c)


async def test_a_removed_node_administers_its_cluster_no_more_nor_starts_its_mesh_again(pair: tuple[Mesh, Mesh], tmp_path: Path) -> None:
    a, b = pair
    await a._push_pull(b.membership.addr)
    await a.remove(b.node_id)
    for action in (lambda: b.invite(600), lambda: b.approve(a.node_id)):
        with pytest.raises(BrokerError, match="this node was removed from its cluster"):
            action()
    with pytest.raises(BrokerError, match="this node was removed from its cluster"):
        await b.remove(a.node_id)  # what it last heard may be behind: it has no say in who is a member
    with pytest.raises(BrokerError, match="this node was removed from its cluster"):
        await b.change_keys({"install": None})
    assert not a.cluster.is_removed(a.node_id)

    again = Mesh(MeshSettings(("127.0.0.1", 0), "127.0.0.1", mdns=False), b.broker, b.identity, b.cluster, clock=b.clock)
    await asyncio.wait_for(again.run(), 5)  # after a restart: returns at once, opening nothing
    assert (again._removed, again._datagrams, again._server) == (True, None, None)
    assert again.cluster_json()["nodes"][0]["state"] == "removed"


async def test_an_export_that_marks_its_own_sender_removed_is_not_taken_from_it(pair: tuple[Mesh, Mesh]) -> None:
    """A node that was removed (and may not know it) has no say in who else is: what it last heard may be behind."""
    a, b = pair
    export = b.cluster.export()
    export["removed"] = {**export.get("removed", {}), b.node_id: NOW, a.node_id: NOW}  # as a stale or forged view
    answer = await a._on_request(b.node_id, {"op": "removed", "cluster": export})
    assert answer == {"removed": False}
    assert not a.cluster.is_removed(a.node_id)
    assert not a._removed


async def test_refused_joins_are_failures_kept_within_the_refusal_budget_and_an_admission_names_the_node(tmp_path: Path) -> None:
    """Anyone reaching the gossip port could ask to join with a wrong token: every refusal was an event, without a code,
    as many as were sent (pushing the leases' events out of those kept); an admission named no node id."""
    a, b = (Identity.load_or_create(tmp_path / name) for name in ("a", "b"))
    cluster = ClusterState.init(tmp_path / "cluster-a", a, "node-a", now=NOW)
    clock = FakeClock(NOW)
    config = Config(state_dir=tmp_path / "state", name="node-a")
    broker = Broker(config, Store(config.state_dir, config.store_size, config.events_kept), FakeGpuProbe(clock), clock)
    await broker.start()
    try:
        mesh = Mesh(MeshSettings(("127.0.0.1", 0), "127.0.0.1", mdns=False), broker, a, cluster, clock=clock.now, elapsed=clock.elapsed)
        before = broker.last_event_seq
        cert = b.certificate_pem().decode()
        for _ in range(int(RefusalBudget.BURST) + 50):
            assert "error" in mesh._join_request({"op": "join", "secret": b"guessed", "cert": cert, "name": "node-b"})
        secret = decode_token(cluster.invite(("127.0.0.1", 9741), a, 600, NOW)).secret
        assert "grant" in mesh._join_request({"op": "join", "secret": secret, "cert": cert, "name": "node-b"})
        await broker.store.commit([])
        events, _ = broker.events(before, 1000)
    finally:
        await broker.close()
    refused = [e for e in events if e["type"] == "mesh.join.refused"]
    assert len(refused) == RefusalBudget.BURST
    assert {e["code"] for e in refused} == {"UNAUTHORIZED"}
    assert refused[0]["details"] == {"reason": "this join token was not issued here (or expired long ago)"}
    assert events[-1]["type"] == "mesh.join.admitted"
    assert events[-1]["details"] == {"node": b.node_id, "name": "node-b"}
    assert b.node_id in events[-1]["message"]


async def test_refused_joins_do_not_spend_the_budget_of_this_nodes_own_refusals(tmp_path: Path) -> None:
    """Anyone reaching the gossip port spent the budget the broker's refusals share: a flood of wrong tokens from the
    network and a local program's refused request was not kept as an event, only counted."""
    a, b = (Identity.load_or_create(tmp_path / name) for name in ("a", "b"))
    cluster = ClusterState.init(tmp_path / "cluster-a", a, "node-a", now=NOW)
    clock = FakeClock(NOW)
    config = Config(state_dir=tmp_path / "state", name="node-a")
    broker = Broker(config, Store(config.state_dir, config.store_size, config.events_kept), FakeGpuProbe(clock), clock)
    await broker.start()
    try:
        mesh = Mesh(MeshSettings(("127.0.0.1", 0), "127.0.0.1", mdns=False), broker, a, cluster, clock=clock.now, elapsed=clock.elapsed)
        before = broker.last_event_seq
        cert = b.certificate_pem().decode()
        for _ in range(int(RefusalBudget.BURST) + 50):
            mesh._join_request({"op": "join", "secret": b"guessed", "cert": cert, "name": "node-b"})
        with pytest.raises(BrokerError):
            await broker.request(parse_request({"cpu_cores": 512, "bind": "none"}), Caller("tcp"))
        await broker.store.commit([])
        events, _ = broker.events(before, 1000)
    finally:
        await broker.close()
    assert [e["type"] for e in events][-1] == "lease.refused"


async def test_asks_to_join_are_kept_within_the_refusal_budget_and_a_node_that_asks_again_is_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Anyone reaching the gossip port could ask under a fresh identity each time, and each ask was a
    `mesh.node.pending` event, as many as were sent: the pending list forgets the oldest past 64, so each was new."""
    monkeypatch.setattr(RefusalBudget, "BURST", 5.0)
    a = Identity.load_or_create(tmp_path / "a")
    cluster = ClusterState.init(tmp_path / "cluster-a", a, "node-a", now=NOW)
    clock = FakeClock(NOW)
    config = Config(state_dir=tmp_path / "state", name="node-a")
    broker = Broker(config, Store(config.state_dir, config.store_size, config.events_kept), FakeGpuProbe(clock), clock)
    await broker.start()
    askers = [Identity.load_or_create(tmp_path / f"asker{i}") for i in range(8)]
    try:
        mesh = Mesh(MeshSettings(("127.0.0.1", 0), "127.0.0.1", mdns=False), broker, a, cluster, clock=clock.now, elapsed=clock.elapsed)

        def ask(asker: Identity) -> dict[str, Any]:
            at = clock.now()
            proof = asker.sign(ask_proof(a.fingerprint(), at))
            cert = asker.certificate_pem().decode()
            return mesh._ask_request({"op": "ask", "cert": cert, "name": "asker", "addr": ["127.0.0.1", 9741], "at": at, "proof": proof})

        before = broker.last_event_seq
        for asker in askers:
            assert ask(asker) == {"pending": True}
        clock.advance(1.0)  # the budget fills again
        ask(askers[-1])  # a node asks again until approved: one whose ask was not said is said now
        ask(askers[0])  # one said already is not said again
        await broker.store.commit([])
        events, _ = broker.events(before, 1000)
    finally:
        await broker.close()
    pending = [e["details"] for e in events if e["type"] == "mesh.node.pending"]
    assert [d["node"] for d in pending] == [asker.node_id for asker in (*askers[:5], askers[-1])]
    assert pending[-1]["not_kept_before"] == 3
    assert len(cluster.pending_list()) == 8  # every ask is pending, said or not


async def test_a_member_first_heard_of_is_said_to_have_joined_and_one_heard_again_to_be_alive(pair: tuple[Mesh, Mesh]) -> None:
    """`mesh.member.joined` said "is alive", as `mesh.member.alive` does: the two read the same in the events."""
    a, b = pair
    await a._push_pull(b.membership.addr)  # node-a hears of node-b for the first time
    a._member_event("alive", b.node_id)  # and alive again, after a suspicion refuted, say
    await asyncio.gather(*a._tasks)  # its document, fetched on sight
    name = a._name_of(b.node_id)
    said = [(kind, message) for kind, message in a.broker.recorded if kind.startswith("mesh.member.")]  # type: ignore[attr-defined]
    assert said == [
        ("mesh.member.joined", f"node {name} ({b.node_id}) joined: first heard of here, alive"),
        ("mesh.member.alive", f"node {name} ({b.node_id}) is alive"),
    ]
