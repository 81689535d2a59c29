"""Invariants as properties: whatever happens, no accelerator is leased beyond what it had, and nothing is granted twice."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path
from typing import Any

from fakes import GIB, FakeClock, FakeGpuProbe
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from gpubroker.broker.probes import GpuProcess
from gpubroker.broker.request import parse_request
from gpubroker.broker.service import Broker, Caller
from gpubroker.broker.store import Store
from gpubroker.config import CLASSES, Config
from gpubroker.errors import BrokerError

TCP = Caller("tcp")
SIZES = st.integers(min_value=1, max_value=30).map(lambda n: n * GIB // 2)


class BrokerMachine(RuleBasedStateMachine):
    """Requests, concurrent bursts, releases, restarts, expiry and external usage, in any order."""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.dir = Path(tempfile.mkdtemp(prefix="gpubroker-prop-"))
        self.clock = FakeClock()
        self.probe = FakeGpuProbe(self.clock, [24 * GIB, 12 * GIB])
        self.config = Config(state_dir=self.dir, name="prop", reserve=GIB, store_size=64 * 2**20)
        self.live: dict[str, tuple[str, int]] = {}  # id -> (token, epoch)
        self.ended: set[str] = set()
        self.seen_ids: set[str] = set()
        self.top_epoch = 0
        self.holders = 0
        self.work: dict[str, tuple[int, int, int]] = {}  # lease id -> (GPU index, holder pid, what its process uses)
        self.broker = self._start()

    def _start(self) -> Broker:
        broker = Broker(self.config, Store(self.dir, self.config.store_size), self.probe, self.clock)
        self.loop.run_until_complete(broker.start())
        return broker

    def _granted(self, lease: Any, token: str) -> None:
        assert lease.id not in self.seen_ids, f"lease id {lease.id} granted twice"
        assert lease.epoch > self.top_epoch, "a new grant's epoch is not above every earlier one"
        self.seen_ids.add(lease.id)
        self.top_epoch = lease.epoch
        self.live[lease.id] = (token, lease.epoch)
        self._never_beyond_room({gpu.index for gpu in lease.gpus})

    def _never_beyond_room(self, granted_on: set[int]) -> None:
        """Where a grant was just made, everything leased fits in total - external - reserve."""
        for budget in self.broker.budgets():
            if budget.reading.index not in granted_on:
                continue  # external growth may press on old leases: that is pressure, not a bad grant
            f = budget.figures
            assert f.leased <= f.total - f.external - f.reserve, f"GPU {budget.reading.index} leased beyond its room: {f}"

    async def _ask(self, size: int, priority: str, pin: int | None, cores: int = 0) -> set[int]:
        """The accelerators the request was granted on (none if refused)."""
        self.holders += 1
        holder = {"name": "work", "pid": 500000 + self.holders}
        body: dict[str, Any] = {"gpu_memory": size, "priority": priority, "bind": "none", "ttl": 60, "holder": holder}
        if cores:
            body |= {"cpu_cores": cores, "memory": cores * 2**20}
        if pin is not None:
            body["gpu"] = pin
        try:
            lease, token = await self.broker.request(parse_request(body), TCP)
        except BrokerError:
            return set()
        self._granted(lease, token)
        return {gpu.index for gpu in lease.gpus}

    @rule(size=SIZES, priority=st.sampled_from(CLASSES), pin=st.none() | st.integers(0, 1), cores=st.integers(0, 1))
    def request(self, size: int, priority: str, pin: int | None, cores: int) -> None:
        self.loop.run_until_complete(self._ask(size, priority, pin, cores))

    @rule(sizes=st.lists(SIZES, min_size=2, max_size=8))
    def concurrent_requests(self, sizes: list[int]) -> None:
        async def burst() -> list[set[int]]:
            return await asyncio.gather(*(self._ask(size, "interactive", None) for size in sizes))

        granted_on = self.loop.run_until_complete(burst())
        self._never_beyond_room(set().union(*granted_on))

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        lease_id = data.draw(st.sampled_from(list(self.live)))  # in grant order: ids are random
        token, _ = self.live.pop(lease_id)
        self.loop.run_until_complete(self.broker.release(lease_id, TCP, token))
        self.ended.add(lease_id)

    @rule(index=st.integers(0, 1), size=st.integers(0, 16).map(lambda n: n * GIB))
    def external_usage_changes(self, index: int, size: int) -> None:
        self.probe.external(index, size)
        self.loop.run_until_complete(self.broker.sample())

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data(), share=st.integers(0, 4), sized=st.booleans())
    def a_leases_work_uses_memory(self, data: st.DataObject, share: int, sized: bool) -> None:
        """A lease's holder uses up to what it declared, listed with its size or (some containers) without."""
        lease = self.broker.leases[data.draw(st.sampled_from(list(self.live)))]
        if not lease.gpus or lease.holder.pid is None:
            return
        gpu = lease.gpus[0]
        used = gpu.bytes * share // 4
        for index, processes in self.probe.processes.items():
            processes[:] = [p for p in processes if p.pid != lease.holder.pid]
            self.probe.unlisted[index] = sum(u for i, pid, u in self._unsized() if i == index and pid != lease.holder.pid)
        self.probe.processes.setdefault(gpu.index, []).append(GpuProcess(lease.holder.pid, "work", used if sized else None))
        if not sized:
            self.probe.unlisted[gpu.index] = self.probe.unlisted.get(gpu.index, 0) + used
        self.work[lease.id] = (gpu.index, lease.holder.pid, 0 if sized else used)
        self.loop.run_until_complete(self.broker.sample())

    def _unsized(self) -> list[tuple[int, int, int]]:
        return [work for lease_id, work in self.work.items() if lease_id in self.live]

    @invariant()
    def no_byte_is_counted_both_leased_and_external(self) -> None:
        """Where every process's use fits its lease, external is exactly what the leases' work does not use."""
        for budget in self.broker.budgets():
            index = budget.reading.index
            listed = self.probe.processes.get(index, [])
            mine = {lease.holder.pid for lease in budget.leases}
            if any(p.bytes is None for p in listed if p.pid not in mine):
                continue  # an unsized process of a lease that ended: not known to be anyone's
            leased_use = sum(p.bytes or 0 for p in listed if p.pid in mine)
            leased_use += sum(used for i, pid, used in self._unsized() if i == index and pid in mine)
            truth = sum(p.bytes or 0 for p in listed) + self.probe.unlisted.get(index, 0)
            if truth > budget.reading.total:
                continue  # the driver's figure is capped at the card's size: the parts cannot be told apart
            assert budget.figures.external == truth - leased_use, f"GPU {index}: {budget.figures}"

    @rule(seconds=st.sampled_from([1, 30, 61]))
    def time_passes(self, seconds: int) -> None:
        self.clock.advance(seconds)

        async def sweep() -> None:
            self.broker.sweep()

        self.loop.run_until_complete(sweep())
        for lease_id in [x for x in self.live if x not in self.broker.leases]:
            del self.live[lease_id]
            self.ended.add(lease_id)
        self.loop.run_until_complete(self.broker.sample())

    @rule()
    def restart(self) -> None:
        self.loop.run_until_complete(self.broker.close())
        self.broker = self._start()

    @invariant()
    def the_broker_holds_exactly_the_leases_granted_and_not_ended(self) -> None:
        assert set(self.broker.leases) == set(self.live)
        for lease_id, (_, epoch) in self.live.items():
            assert self.broker.leases[lease_id].epoch == epoch

    @invariant()
    def the_host_budget_counts_exactly_the_live_leases(self) -> None:
        host = self.broker.host_budget()
        live = self.broker.leases.values()
        assert (host.leased_cores, host.leased_memory) == (sum(x.cpu_cores for x in live), sum(x.memory for x in live))
        assert host.leased_cores <= host.cores

    def teardown(self) -> None:
        self.loop.run_until_complete(self.broker.close())
        self.loop.close()
        shutil.rmtree(self.dir, ignore_errors=True)


BrokerMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_no_accelerator_is_ever_leased_beyond_its_room_and_no_lease_is_granted_twice = BrokerMachine.TestCase
