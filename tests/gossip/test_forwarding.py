"""A release forwarded by a member to the lease's own node: the owner decides, by the token or the member's admin;
and what a member reads of the others' documents: their leases, and where a refused request might fit."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from fakes import GIB, FakeClock, FakeGpuProbe

from gpubroker.broker.request import parse_request
from gpubroker.broker.service import Broker, Caller
from gpubroker.broker.store import Store
from gpubroker.config import Config
from gpubroker.errors import BrokerError
from gpubroker.gossip.cluster import ClusterState, decode_token
from gpubroker.gossip.coordinator import Coordinator
from gpubroker.gossip.documents import NodeDocument, listed_lease, summarize
from gpubroker.gossip.identity import Identity
from gpubroker.gossip.membership import MemberView
from gpubroker.gossip.mesh import SETTLE_AT_MOST, SETTLE_WITHIN, Mesh, MeshSettings, _Meta
from gpubroker.gossip.messages import Addr, MemberState
from gpubroker.gossip.transport import PeerServer
from gpubroker.ui.openapi import OPENAPI

NOW = 1_800_000_000.0


@pytest.fixture
async def owner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[Mesh, Broker]]:
    clock = FakeClock()
    config = Config(state_dir=tmp_path / "state", name="tower")
    broker = Broker(config, Store(config.state_dir, config.store_size, config.events_kept), FakeGpuProbe(clock, [24 * GIB]), clock)
    await broker.start()
    mesh = Mesh(MeshSettings(("127.0.0.1", 0), "127.0.0.1"), broker, identity=None, cluster=None)  # type: ignore[arg-type]
    monkeypatch.setattr(Mesh, "_name_of", lambda self, node: {"n-nuc": "nuc"}.get(node, node))
    try:
        yield mesh, broker
    finally:
        await broker.close()


async def granted(broker: Broker, labels: dict[str, str] | None = None) -> tuple[str, str]:
    lease, token = await broker.request(parse_request({"gpu_memory": "1GiB", "bind": "none", "labels": labels or {}}), Caller("tcp"))
    return lease.id, token


async def test_without_the_token_or_an_admin_a_forwarded_release_is_forbidden(owner: tuple[Mesh, Broker]) -> None:
    mesh, broker = owner
    lease_id, _ = await granted(broker)
    for request in (
        {"op": "release", "lease": lease_id, "token": "not-the-token"},
        {"op": "release", "lease": lease_id, "token": None, "admin": None},
        {"op": "release", "lease": lease_id, "admin": "the web UI of somebody I made up"},  # not a kind the owner knows
    ):
        answer: dict[str, Any] = await mesh._forwarded_release("n-nuc", request)
        assert answer["failure"]["error"]["code"] == "FORBIDDEN", request
    assert broker.get(lease_id)["state"] == "granted"


async def test_the_token_or_a_members_admin_releases_and_the_owner_names_the_member_itself(owner: tuple[Mesh, Broker]) -> None:
    mesh, broker = owner
    lease_id, token = await granted(broker)
    answer = await mesh._forwarded_release("n-nuc", {"op": "release", "lease": lease_id, "token": token})
    assert (answer["lease"]["state"], answer["lease"]["reason"]) == ("released", "released by its token")
    lease_id, _ = await granted(broker)
    answer = await mesh._forwarded_release("n-nuc", {"op": "release", "lease": lease_id, "admin": "the web UI"})
    assert answer["lease"]["reason"] == "released by the web UI of nuc"  # named by who sent it, not by what it says
    lease_id, _ = await granted(broker)
    answer = await mesh._forwarded_release("n-nuc", {"op": "release", "lease": lease_id, "admin": "root on the Unix socket"})
    assert answer["lease"]["reason"] == "released by root on the Unix socket of nuc"


async def test_a_lease_another_nodes_document_lists_reads_in_the_apis_shape_of_a_lease(owner: tuple[Mesh, Broker], tmp_path: Path) -> None:
    """What a member shows of this node's lease (GET /v1/leases/{id} and ?node= on the member) is the owner's own
    answer, as far as the document tells it, in the shape /openapi.json gives a lease."""
    mesh, broker = owner
    lease_id, _ = await granted(broker, {"project": "lora", "team": "vision"})
    body = summarize(broker.node_json(), broker.list_leases("granted", 100))
    cluster = ClusterState.init(tmp_path / "cluster", Identity.generate(), "nuc", now=NOW)
    member_view = Mesh(
        MeshSettings(("127.0.0.1", 0), "127.0.0.1"), broker, identity=None, cluster=cluster, clock=lambda: NOW, elapsed=lambda: 0.0
    )  # type: ignore[arg-type]
    member_view.view.apply(NodeDocument("n-tower", 1, 1, NOW, body, b""), now=0.0)  # the clocks agree: times are as the owner's
    listed = member_view.lease_of(lease_id)
    assert listed is not None
    own = broker.get(lease_id)
    shared = ("id", "state", "epoch", "priority", "preemption", "gpus", "granted_at", "expires_at", "labels")
    assert listed == {**{key: own[key] for key in shared}, "node": "n-tower", "holder": {"name": own["holder"]["name"]}}
    assert member_view.leases_of("n-tower", 10) == [listed]
    assert member_view.owner_of(lease_id) == "n-tower"
    assert member_view.lease_of("l-000000000000") is None
    schema = OPENAPI["components"]["schemas"]["Lease"]
    assert set(schema["required"]) <= set(listed)
    assert all(set(schema["properties"]["gpus"]["items"]["required"]) <= set(gpu) for gpu in listed["gpus"])


def test_a_listed_lease_from_an_older_broker_has_no_epochs_and_a_malformed_one_is_skipped() -> None:
    body = {"gpus": [{"index": 0, "uuid": "GPU-0"}]}
    older = {"id": "l-1", "holder": "train", "priority": "batch", "gpus": [[0, GIB]], "expires_at": "2026-11-30T10:00:00.000Z"}
    lease = listed_lease(body, "n-a", older)
    assert lease is not None
    assert (lease["epoch"], lease["gpus"]) == (None, [{"index": 0, "uuid": "GPU-0", "bytes": GIB, "epoch": None}])
    assert lease["labels"] == {}  # an older broker's document lists none
    for unreadable_labels in ("x", ["k", "v"], {"k": 1}, {"k": None}):
        lease = listed_lease(body, "n-a", {**older, "labels": unreadable_labels})
        assert lease is not None
        assert lease["labels"] == {}
    for unreadable in ("x", [1], [True, [2]], ["1", "2"]):  # epochs of a shape this reader does not know: not given
        lease = listed_lease(body, "n-a", {**older, "epochs": unreadable})
        assert lease is not None
        assert lease["epoch"] is None
    assert listed_lease(body, "n-a", {**older, "epochs": [7, [3]]})["gpus"][0]["epoch"] == 3  # type: ignore[index]
    for broken in ({**older, "gpus": [[0, GIB, 3]]}, {**older, "gpus": 5}, {"id": "l-2"}):
        assert listed_lease(body, "n-a", broken) is None


# -- forwarding to the owner over mutual TLS -------------------------------------------------------------

LEASE = {"id": "l-0123456789ab", "holder": "train", "priority": "batch", "gpus": [[0, GIB]], "expires_at": "2027-01-15T08:00:00.000Z"}


@dataclass
class FakeMembership:
    """The membership as the mesh reads it: each node's address and state, and since when (on this node's clock)."""

    views: dict[str, MemberView] = field(default_factory=dict)

    def set(self, node: str, addr: Addr, state: MemberState, since: float = NOW, meta: bytes = b"") -> None:
        self.views[node] = MemberView(node, addr, state, 1, meta, since)

    def member(self, node: str) -> MemberView | None:
        return self.views.get(node)

    def members(self) -> list[MemberView]:
        return list(self.views.values())


@dataclass
class Trio:
    """Three admitted members: `mesh` is node-a's, which forwards; node-b owns the lease; node-c is another member."""

    mesh: Mesh
    membership: FakeMembership
    b: Identity
    c: Identity
    cluster: ClusterState


@pytest.fixture
async def trio(tmp_path: Path) -> Trio:
    a, b, c = (Identity.load_or_create(tmp_path / name) for name in ("a", "b", "c"))
    cluster = ClusterState.init(tmp_path / "cluster", a, "node-a", now=NOW)
    for identity, name in ((b, "node-b"), (c, "node-c")):
        secret = decode_token(cluster.invite(("127.0.0.1", 9741), a, 600, NOW)).secret
        cluster.redeem(secret, identity.certificate_pem().decode(), name, NOW, a.node_id)
    membership = FakeMembership()
    clock = FakeClock(NOW)
    mesh = Mesh(MeshSettings(("127.0.0.1", 0), "127.0.0.1"), None, a, cluster, clock=clock.now, elapsed=clock.elapsed)  # type: ignore[arg-type]
    mesh._membership = membership  # type: ignore[assignment]
    body = {"name": "node-b", "gpus": [{"index": 0, "uuid": "GPU-0"}], "leases": [LEASE]}
    mesh.view.apply(NodeDocument(b.node_id, 1, 1, NOW, body, b""), NOW)
    return Trio(mesh, membership, b, c, cluster)


async def test_a_forwarded_release_is_answered_only_by_the_leases_own_node_not_by_another_member_now_at_its_address(
    trio: Trio,
) -> None:
    asked: list[dict[str, Any]] = []

    async def releases_anything(peer: str | None, request: dict[str, Any]) -> dict[str, Any]:
        asked.append(request)
        return {"lease": {"id": request.get("lease"), "state": "released"}}

    # node-b restarted elsewhere; node-c now listens where node-b did, and the view has not caught up yet.
    server = await PeerServer.start(("127.0.0.1", 0), trio.c, trio.cluster.members_der, releases_anything)
    try:
        trio.membership.set(trio.b.node_id, server.address, MemberState.ALIVE)
        with pytest.raises(BrokerError, match="held by node .*, which did not answer") as refused:
            await trio.mesh.forward_release(LEASE["id"], "the-token")
    finally:
        await server.close()
    assert refused.value.details["node"] == trio.b.node_id
    assert asked == []  # node-c never saw the request, let alone released anything in node-b's name


@pytest.mark.parametrize(("state", "said"), [(MemberState.LEFT, "left 40 s ago"), (MemberState.DEAD, "failed 40 s ago")])
async def test_a_release_of_a_lease_whose_node_is_gone_says_so_and_asks_nobody(trio: Trio, state: MemberState, said: str) -> None:
    trio.membership.set(trio.b.node_id, ("127.0.0.1", 9), state, since=NOW - 40)
    with pytest.raises(BrokerError) as refused:
        await trio.mesh.forward_release(LEASE["id"], "the-token")
    assert (
        str(refused.value)
        == f"lease {LEASE['id']} is held by node {trio.b.node_id}, which {said}; its leases cannot be released until it returns"
    )
    assert refused.value.code == "LEASE_CONFLICT"
    assert refused.value.details == {"node": trio.b.node_id, "state": state.value, "ago": 40.0, "lease": LEASE["id"]}


def removal_of(cluster: ClusterState, node: str, at: float) -> dict[str, Any]:
    """What a member where `node` was removed sends in a push-pull."""
    sent = cluster.export()
    del sent["members"][node]
    return {**sent, "removed": {**sent["removed"], node: at}}


async def test_a_removal_learnt_by_push_pull_forgets_the_removed_nodes_document_and_its_leases(trio: Trio) -> None:
    assert trio.mesh.lease_of(LEASE["id"]) is not None
    trio.mesh._merge_cluster(removal_of(trio.cluster, trio.b.node_id, NOW + 5))
    assert trio.mesh.view.knows(trio.b.node_id) is None
    assert trio.mesh.lease_of(LEASE["id"]) is None  # GET /v1/leases/{id}: not found, rather than still granted
    assert trio.mesh.leases_of(trio.b.node_id, 10) == []
    assert await trio.mesh.forward_release(LEASE["id"], "the-token") is None  # nothing is forwarded to it


async def test_a_removed_nodes_document_still_held_lists_no_lease(trio: Trio) -> None:
    trio.cluster.remove(trio.b.node_id, NOW + 5)  # the removal is known, the document not yet forgotten
    assert trio.mesh.view.knows(trio.b.node_id) is not None
    assert (trio.mesh.lease_of(LEASE["id"]), trio.mesh.owner_of(LEASE["id"]), trio.mesh.leases_of(trio.b.node_id, 10)) == (None, None, [])


def figures(total: int, leased: int) -> dict[str, int]:
    reserve = GIB
    return {
        "total": total,
        "observed": leased,
        "external": 0,
        "resident": 0,
        "leased": leased,
        "reserve": reserve,
        "schedulable": total - reserve - leased,
    }


def test_an_exclusive_request_is_hinted_only_at_gpus_without_leases_and_a_pinned_one_at_none(trio: Trio) -> None:
    c = trio.c.node_id
    trio.membership.set(trio.b.node_id, ("127.0.0.1", 9), MemberState.ALIVE)
    trio.membership.set(c, ("127.0.0.1", 10), MemberState.ALIVE)
    leased = {"name": "node-b", "gpus": [{"index": 0, "uuid": "GPU-b0", "figures": figures(24 * GIB, GIB)}], "leases": [LEASE]}
    empty = {"name": "node-c", "gpus": [{"index": 0, "uuid": "GPU-c0", "figures": figures(24 * GIB, 0)}], "leases": []}
    trio.mesh.view.apply(NodeDocument(trio.b.node_id, 1, 2, NOW, leased, b""), NOW)
    trio.mesh.view.apply(NodeDocument(c, 1, 1, NOW, empty, b""), NOW)

    def hinted(body: dict[str, Any]) -> list[str] | None:
        hint = trio.mesh.elsewhere(parse_request({"bind": "none", **body}))
        return None if hint is None else sorted(h["name"] for h in hint)

    assert hinted({"gpu_memory": "8GiB"}) == ["node-b", "node-c"]
    assert hinted({"exclusive": True}) == ["node-c"]  # node-b's GPU has 22 GiB schedulable, but a lease on it
    assert hinted({"exclusive": True, "gpu_memory": "8GiB"}) == ["node-c"]
    assert hinted({"exclusive": True, "gpu_memory": "30GiB"}) == []
    assert hinted({"gpu_memory": "8GiB", "gpu": 0}) is None  # GPU 0 of this node: no peer's GPU is that one
    # The room an exclusive request may count on is the published schedulable figure (rounded down), never one
    # worked out from figures rounded to the nearest (external published up to 32 MiB low, say).
    tight = {**empty, "gpus": [{"index": 0, "uuid": "GPU-c0", "figures": {**figures(24 * GIB, 0), "schedulable": 7 * GIB}}]}
    trio.mesh.view.apply(NodeDocument(c, 1, 2, NOW, tight, b""), NOW)
    assert hinted({"exclusive": True, "gpu_memory": "8GiB"}) == []


async def test_a_gpu_whose_reading_is_stale_here_is_said_stale_in_this_nodes_document(owner: tuple[Mesh, Broker]) -> None:
    _, broker = owner
    assert "stale" not in summarize(broker.node_json(), [])["gpus"][0]
    broker.clock.advance(broker.config.staleness + 1)  # type: ignore[attr-defined]  # no reading since: a hung driver
    assert summarize(broker.node_json(), [])["gpus"][0]["stale"] is True


def test_a_peers_gpu_whose_reading_is_stale_there_is_hinted_at_by_no_member(trio: Trio) -> None:
    """Its node refuses every request for it (SCHEDULER_STATE_STALE: a driver that stopped answering), whatever room
    its last figures show; its document says so, decided on that node's own clock."""
    trio.membership.set(trio.b.node_id, ("127.0.0.1", 9), MemberState.ALIVE)
    gpus = [{"index": 0, "uuid": "GPU-b0", "figures": figures(24 * GIB, 0), "stale": True}]
    trio.mesh.view.apply(NodeDocument(trio.b.node_id, 1, 2, NOW, {"name": "node-b", "gpus": gpus, "leases": []}, b""), NOW)
    assert trio.mesh.elsewhere(parse_request({"bind": "none", "gpu_memory": "8GiB"})) == []
    fresh = [{**gpus[0], "stale": False}]
    trio.mesh.view.apply(NodeDocument(trio.b.node_id, 1, 3, NOW, {"name": "node-b", "gpus": fresh, "leases": []}, b""), NOW)
    assert [h["name"] for h in trio.mesh.elsewhere(parse_request({"bind": "none", "gpu_memory": "8GiB"})) or []] == ["node-b"]


@dataclass
class Events:
    """The broker as the mesh tells it what happened."""

    recorded: list[tuple[str, str]] = field(default_factory=list)

    def record_event(self, kind: str, message: str, details: dict[str, Any]) -> None:
        self.recorded.append((kind, message))


def test_a_newcomer_that_ranks_first_does_not_take_over_from_the_coordinator_it_had_not_heard_of(trio: Trio) -> None:
    mesh, b, c = trio.mesh, trio.b.node_id, trio.c.node_id
    mesh.broker = Events()  # type: ignore[assignment]
    mesh.view.forget(b)
    mesh._started = NOW  # just started: it knows nobody yet, but node-b and node-c are members
    mesh._elect()
    assert mesh.coordinator == Coordinator(mesh.node_id, 0, 0)  # its own choice, provisional
    assert mesh.broker.recorded == []  # type: ignore[attr-defined]  # nor news to tell
    # The join's push-pull: node-b (priority 1, so node-a ranks first) and node-c are alive; node-b's document
    # announces the coordinator the cluster has had all along, at the epoch node-a would have chosen.
    for node, priority in ((b, 1), (c, 1)):
        trio.membership.set(node, ("127.0.0.1", 9), MemberState.ALIVE, meta=_Meta(node, "", priority).encode())
    mesh._elect()
    assert mesh.coordinator == Coordinator(mesh.node_id, 0, 0)  # node-c's document is still on its way
    mesh.view.apply(NodeDocument(b, 1, 2, NOW, {"name": "node-b", "coordinator": [b, 1, 1]}, b""), NOW)
    mesh._elect()
    assert mesh.coordinator == Coordinator(b, 1, 1)
    mesh.view.apply(NodeDocument(c, 1, 1, NOW, {"name": "node-c", "coordinator": [b, 1, 1]}, b""), NOW)
    mesh._elect()
    assert mesh.coordinator == Coordinator(b, 1, 1)  # the incumbent stays
    assert mesh.broker.recorded == [("mesh.coordinator", f"coordinator is {b} (epoch 1)")]  # type: ignore[attr-defined]


def test_a_node_that_hears_no_announcement_announces_its_own_choice_once_settled(trio: Trio) -> None:
    mesh, b = trio.mesh, trio.b.node_id
    mesh.broker = Events()  # type: ignore[assignment]
    mesh._started = NOW
    trio.membership.set(b, ("127.0.0.1", 9), MemberState.ALIVE)
    mesh._elect()
    assert mesh.coordinator is not None
    assert mesh.coordinator.epoch == 0  # node-c not heard of yet: it may be the one announcing a coordinator
    mesh.elapsed = lambda: NOW + SETTLE_WITHIN  # it may be down: after a while, this node's choice is announced anyway
    mesh._elect()
    best = min(mesh.node_id, b)
    assert mesh.coordinator == Coordinator(best, 0, 1)


def test_a_node_that_hears_members_alive_but_not_yet_their_documents_waits_for_them_longer(trio: Trio) -> None:
    """Past SETTLE_WITHIN, a member known to be alive still announces what it announces: a node that chose for
    itself at epoch 1 meanwhile would tie with the incumbent's epoch and take over by ranking first."""
    mesh, b = trio.mesh, trio.b.node_id
    mesh.broker = Events()  # type: ignore[assignment]
    mesh._started = NOW
    mesh.view.forget(b)
    trio.membership.set(b, ("127.0.0.1", 9), MemberState.ALIVE, meta=_Meta(b, "", 1).encode())  # node-a ranks first
    mesh.elapsed = lambda: NOW + SETTLE_AT_MOST - 1  # slow to reach: a lossy link, a busy peer
    mesh._elect()
    assert mesh.coordinator == Coordinator(mesh.node_id, 0, 0)  # still its own choice, unannounced
    mesh.elapsed = lambda: NOW + SETTLE_AT_MOST  # a peer whose documents never come cannot leave the cluster without one
    mesh._elect()
    assert mesh.coordinator == Coordinator(mesh.node_id, 0, 1)
    mesh.coordinator = Coordinator(mesh.node_id, 0, 0)  # as before: then node-b's document comes, in time
    mesh.view.apply(NodeDocument(b, 1, 2, NOW, {"name": "node-b", "coordinator": [b, 1, 1]}, b""), NOW)
    mesh._elect()
    assert mesh.coordinator == Coordinator(b, 1, 1)  # the incumbent stays


async def test_a_key_change_reports_every_member_and_those_not_reached_say_why(trio: Trio) -> None:
    """`gpubroker keys` prints each member's result and fails when one is not "ok": a member that was down must be
    among them, or the operator never learns that its keyring now differs."""
    asked: list[dict[str, Any]] = []

    async def takes_the_change(peer: str | None, request: dict[str, Any]) -> dict[str, Any]:
        asked.append(request)
        return {"ok": True}

    trio.mesh.broker = Events()  # type: ignore[assignment]
    server = await PeerServer.start(("127.0.0.1", 0), trio.b, trio.cluster.members_der, takes_the_change)
    try:
        trio.membership.set(trio.b.node_id, server.address, MemberState.ALIVE)
        trio.membership.set(trio.c.node_id, ("127.0.0.1", 9), MemberState.DEAD)
        answer = await trio.mesh.change_keys({"install": None})
        assert answer["members"] == {trio.b.node_id: "ok", trio.c.node_id: "not reached (dead)"}
        del trio.membership.views[trio.c.node_id]  # dead long enough for the membership to have dropped it
        answer = await trio.mesh.change_keys({"install": None})
        assert answer["members"] == {trio.b.node_id: "ok", trio.c.node_id: "not reached (not heard of)"}
    finally:
        await server.close()
    assert [request["op"] for request in asked] == ["keys", "keys"]  # node-c was not called


async def test_a_release_forwarded_from_a_removed_node_says_it_was_removed_rather_than_that_the_owner_did_not_answer(
    trio: Trio,
) -> None:
    trio.membership.set(trio.b.node_id, ("127.0.0.1", 9), MemberState.ALIVE)  # as it last heard, before its removal
    trio.mesh._removed = True
    with pytest.raises(BrokerError, match="this node was removed from the cluster") as refused:
        await trio.mesh.forward_release(LEASE["id"], "the-token")
    assert (refused.value.code, refused.value.details) == ("CAPABILITY_UNAVAILABLE", {"node": trio.b.node_id})
