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
from gpubroker.gossip.mesh import Mesh, MeshSettings


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


async def granted(broker: Broker) -> tuple[str, str]:
    lease, token = await broker.request(parse_request({"gpu_memory": "1GiB", "bind": "none"}), Caller("tcp"))
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
