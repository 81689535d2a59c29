"""A release forwarded by a member to the lease's own node: the owner decides, by the token or the member's admin."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from fakes import GIB, FakeClock, FakeGpuProbe

from gpubroker.broker.request import parse_request
from gpubroker.broker.service import Broker, Caller
from gpubroker.broker.store import Store
from gpubroker.config import Config
from gpubroker.gossip.documents import NodeDocument, listed_lease, summarize
from gpubroker.gossip.mesh import Mesh, MeshSettings
from gpubroker.ui.openapi import OPENAPI


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


async def test_a_lease_another_nodes_document_lists_reads_in_the_apis_shape_of_a_lease(owner: tuple[Mesh, Broker]) -> None:
    """What a member shows of this node's lease (GET /v1/leases/{id} and ?node= on the member) is the owner's own
    answer, as far as the document tells it, in the shape /openapi.json gives a lease."""
    mesh, broker = owner
    lease_id, _ = await granted(broker, {"project": "lora", "team": "vision"})
    body = summarize(broker.node_json(), broker.list_leases("granted", 100))
    member_view = Mesh(MeshSettings(("127.0.0.1", 0), "127.0.0.1"), broker, identity=None, cluster=None)  # type: ignore[arg-type]
    member_view.view.apply(NodeDocument("n-tower", 1, 1, 0.0, body, b""), now=0.0)
    listed = member_view.lease_of(lease_id)
    assert listed is not None
    own = broker.get(lease_id)
    shared = ("id", "state", "epoch", "priority", "preemption", "gpus", "granted_at", "expires_at", "labels")
    assert listed == {**{key: own[key] for key in shared}, "node": "n-tower", "holder": {"name": own["holder"]["name"]}}
    assert member_view.leases_of("tower", 10) == [listed] == member_view.leases_of("n-tower", 10)
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
