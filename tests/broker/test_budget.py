"""Which lease owns a GPU process: the rules of `Owners`, on hand-made leases and processes."""

from __future__ import annotations

from dataclasses import replace

from gpubroker.broker.budget import GpuLeases, Owners
from gpubroker.broker.lease import Holder, Lease, LeasedGpu
from gpubroker.broker.probes import GpuProcess

MIB = 2**20


def lease(
    lease_id: str,
    holder: int | None,
    pgids: tuple[int, ...] = (),
    started: float | None = None,
    epoch: int = 1,
    pgid_started: tuple[float | None, ...] = (),
) -> Lease:
    return Lease(
        id=lease_id, node="n-test", state="granted", epoch=epoch, priority="batch", preemption="never", bind="none",
        holder=Holder(name=lease_id, pid=holder, start_time=started), gpus=[LeasedGpu(0, "GPU-0", MIB, 1)], exclusive=False,
        cpu_cores=0, memory=0, labels={}, token_hash="", requested_at=0.0, granted_at=0.0, expires_at=60.0, ttl=60.0,
        pgids=list(pgids), pgid_started=list(pgid_started),
    )  # fmt: skip


def owners(*leases: Lease) -> Owners:
    held = GpuLeases()
    for one in leases:
        held.add(one, MIB)
    return Owners(held)


def owner(of: Owners, process: GpuProcess) -> str | None:
    found = of.of(process)
    return None if found is None else found[0].id


def test_the_nearest_lease_in_a_process_line_owns_it_and_the_first_held_where_two_are_as_near() -> None:
    outer, inner, twin = lease("l-outer", 100), lease("l-inner", 200), lease("l-twin", 200)
    of = owners(outer, inner, twin)
    work = GpuProcess(300, "work", MIB, pgid=300, ancestors=(200, 100, 1))
    assert owner(of, work) == "l-inner"  # its parent holds l-inner and l-twin; l-inner was held first
    assert owner(of, GpuProcess(201, "beside", MIB, pgid=201, ancestors=(100, 1))) == "l-outer"
    assert owner(of, GpuProcess(999, "elsewhere", MIB, pgid=999, ancestors=(1,))) is None


def test_a_registered_group_comes_before_a_holder_at_the_same_place_and_after_every_holder_when_its_leader_is_gone() -> None:
    shell = lease("l-outer", 100, pgids=(150,))
    exec_d = lease("l-inner", 150)  # the shell that led group 150 exec'd the inner `gpubroker lease`
    of = owners(shell, exec_d)
    assert owner(of, GpuProcess(160, "background work", MIB, pgid=150, ancestors=(150, 100, 1))) == "l-outer"
    grouped = owners(lease("l-group", None, pgids=(500,)), lease("l-holder", 100))
    orphan = GpuProcess(501, "orphan", MIB, pgid=500, ancestors=(100, 1))  # its group's leader 500 is gone
    assert owner(grouped, orphan) == "l-holder"


def test_a_process_that_reuses_a_holders_pid_is_not_its_lease_s() -> None:
    of = owners(lease("l-old", 100, started=1000.0))
    assert owner(of, GpuProcess(100, "same", MIB, pgid=100, ancestors=(1,), started=(1000.0, 0.0))) == "l-old"
    assert owner(of, GpuProcess(100, "reused", MIB, pgid=100, ancestors=(1,), started=(2000.0, 0.0))) is None
    assert owner(of, GpuProcess(101, "child of reused", MIB, pgid=101, ancestors=(100, 1), started=(2001.0, 2000.0, 0.0))) is None


def test_a_group_whose_leader_started_after_it_was_registered_is_another_with_its_id_and_no_lease_s() -> None:
    """A group's id is its leader's pid, reused once the whole group is gone: the later group's memory was the lease's."""
    of = owners(lease("l-group", None, pgids=(500, 600), pgid_started=(1000.0,)))  # 600: stored by an earlier version
    member = GpuProcess(501, "work", MIB, pgid=500, ancestors=(1,), started=(1001.0, 0.0), leader_started=1000.0)
    assert owner(of, member) == "l-group"
    assert owner(of, replace(member, leader_started=None)) == "l-group"  # its leader alone exited: the group lives on
    assert owner(of, replace(member, leader_started=2000.0)) is None
    assert owner(of, replace(member, pgid=600, leader_started=2000.0)) == "l-group"  # by its id alone, as before


def test_the_first_held_of_two_as_near_owns_a_process_whatever_order_a_restarted_broker_holds_them_in() -> None:
    """A restarted broker holds its leases in the store's order, by their random ids: the process's memory went to
    whichever id sorted first, and moved from one lease to the other across a restart."""
    first, second = lease("l-ffff", 200, epoch=7), lease("l-0000", 200, epoch=8)
    of = owners(second, first)  # as loaded: "l-0000" sorts first
    assert owner(of, GpuProcess(300, "work", MIB, pgid=300, ancestors=(200, 1))) == "l-ffff"
    grouped = owners(lease("l-0000", None, pgids=(500,), epoch=8), lease("l-ffff", None, pgids=(500,), epoch=7))
    assert owner(grouped, GpuProcess(501, "work", MIB, pgid=500, ancestors=(1,))) == "l-ffff"
