"""The broker of one node, in process: a real LMDB store, a fake GPU probe and a clock the test moves."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pwd
import signal
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from fakes import GIB, FakeClock, FakeGpuProbe

from gpubroker.broker import holders
from gpubroker.broker.probes import GpuProcess, UnreadableGpu, describe_process
from gpubroker.broker.request import parse_request
from gpubroker.broker.service import Broker, Caller
from gpubroker.broker.store import PRUNE_EVERY, Store, StoreDamaged, Write, seq_key
from gpubroker.config import Config, Stamp
from gpubroker.daemon import config_warnings
from gpubroker.errors import BrokerError, FailureCode, Forbidden, NotFound, StoreFull
from gpubroker.units import parse_time, rfc3339

MIB = 2**20
TCP = Caller("tcp")
ME = Caller("unix", uid=os.getuid(), pid=os.getpid())


class Node:
    """One broker on a temporary state directory, restartable on the same store."""

    def __init__(self, tmp: Path, clock: FakeClock, probe: FakeGpuProbe, config: Config) -> None:
        self.tmp, self.clock, self.probe, self.config = tmp, clock, probe, config
        self.broker: Broker

    async def start(self) -> Broker:
        store = Store(self.config.state_dir, self.config.store_size, self.config.events_kept)
        self.broker = Broker(self.config, store, self.probe, self.clock)
        await self.broker.start()
        return self.broker

    async def restart(self) -> Broker:
        await self.broker.close()
        return await self.start()

    async def ask(self, caller: Caller = TCP, **body: Any) -> tuple[dict[str, Any], str]:
        body.setdefault("bind", "none")
        lease, token = await self.broker.request(parse_request(body), caller)
        return lease.to_json(), token

    async def refused(self, caller: Caller = TCP, **body: Any) -> BrokerError:
        with pytest.raises(BrokerError) as caught:
            await self.ask(caller, **body)
        return caught.value

    async def sample(self) -> None:
        await self.broker.sample()

    def gpu(self, index: int = 0) -> dict[str, Any]:
        gpu: dict[str, Any] = self.broker.node_json()["gpus"][index]
        return gpu

    async def event_once(self, type_: str) -> dict[str, Any]:
        """The one event of this type, once it is recorded (some are recorded by a task of their own): within 10 s."""
        for _ in range(200):
            found = await self.events(type_)
            if found:
                break
            await asyncio.sleep(0.05)
        (event,) = found
        return event

    async def events(self, type_: str | None = None) -> list[dict[str, Any]]:
        await self.broker.store.commit([])  # the writer is first in, first out: earlier events are now on disk
        found, _ = self.broker.events(0, 1000)
        return [e for e in found if type_ is None or e["type"] == type_]


@pytest.fixture
async def make_node(tmp_path: Path) -> AsyncIterator[Callable[..., Any]]:
    nodes: list[Node] = []

    async def make(sizes: list[int] | None = None, **settings: Any) -> Node:
        clock = FakeClock()
        probe = FakeGpuProbe(clock, sizes or [24 * GIB])
        config = replace(Config(state_dir=tmp_path / f"state{len(nodes)}", name="tower"), **settings)
        node = Node(tmp_path, clock, probe, config)
        await node.start()
        nodes.append(node)
        return node

    yield make
    for node in nodes:
        await node.broker.close()


async def settle() -> None:
    """Let grants made by a scan finish their commits (the writer thread is real)."""
    for _ in range(50):
        await asyncio.sleep(0.005)


async def test_the_figures_show_total_external_reserve_and_schedulable(make_node: Callable[..., Any]) -> None:
    node = await make_node()
    node.probe.external(0, 6 * GIB)
    await node.sample()
    gpu = node.gpu()
    assert gpu["figures"] == {
        "total": 24 * GIB, "observed": 6 * GIB, "external": 6 * GIB, "resident": 0,
        "leased": 0, "reserve": 1 * GIB, "schedulable": 17 * GIB,
    }  # fmt: skip
    assert gpu["processes"] == [{"pid": 900001, "name": "ollama", "bytes": 6 * GIB, "lease": None}]
    assert gpu["unattributed"] == 0


async def test_a_request_beyond_schedulable_is_refused_naming_the_figures(make_node: Callable[..., Any]) -> None:
    node = await make_node()
    node.probe.external(0, 6 * GIB)
    await node.sample()
    error = await node.refused(gpu_memory="18GiB")
    assert error.code is FailureCode.INSUFFICIENT_SCHEDULABLE_VRAM
    assert error.status == 409
    assert error.message == "GPU 0 (RTX 4090, 24.0 GiB): 6.0 external (ollama 6.0), 0.0 leased, 1.0 reserve → 17.0 schedulable; needs 18.0"
    assert error.details["need"] == 18 * GIB
    assert error.details["figures"]["schedulable"] == 17 * GIB
    assert (await node.events("lease.refused"))[-1]["code"] == "INSUFFICIENT_SCHEDULABLE_VRAM"


async def test_a_grant_says_the_cpu_cores_and_memory_it_holds_where_it_said_no_gpu(make_node: Callable[..., Any]) -> None:
    node = await make_node()
    await node.ask(cpu_cores=1, memory="1GiB")
    await node.ask(gpu_memory="2GiB", memory="2GiB")
    said = [event["message"].partition("(interactive): ")[2] for event in await node.events("lease.granted")]
    assert said == ["1 CPU core, 1.0 GiB memory", "GPU 0 2.0 GiB (GPU epoch 1), 2.0 GiB memory"]


async def test_a_near_miss_says_by_how_much_when_the_figures_read_alike(make_node: Callable[..., Any]) -> None:
    node = await make_node()
    node.probe.external(0, 6 * GIB - 10 * MIB)  # 17 GiB and 10 MiB schedulable: "17.0"
    await node.sample()
    error = await node.refused(gpu_memory=f"{17 * 1024 + 20}MiB")  # "17.0" too
    assert error.message.endswith("→ 17.0 schedulable; needs 17.0 (10 MiB more than the 17.0 left)")
    assert (await node.refused(gpu_memory="18GiB")).message.endswith("→ 17.0 schedulable; needs 18.0")  # told apart already


async def test_a_request_larger_than_any_gpu_says_by_how_much_when_the_figures_read_alike(make_node: Callable[..., Any]) -> None:
    node = await make_node()
    memory = node.broker.host.memory
    gpu = await node.refused(gpu_memory=23 * GIB + 1)  # "23.0 GiB asked for"; at most 23.0 GiB can be leased
    assert gpu.code is FailureCode.CAPABILITY_UNAVAILABLE
    assert gpu.message.endswith("(its total less the 1.0 GiB reserve) (1 byte more than the 23.0 it can lease)")
    host = await node.refused(memory=memory + 2 * MIB)
    assert host.code is FailureCode.CAPABILITY_UNAVAILABLE
    assert host.message.endswith("(2 MiB more than the " + f"{memory / GIB:.1f} in all)")


async def test_a_request_too_large_for_the_gpu_it_pins_names_that_gpu_not_the_largest(make_node: Callable[..., Any]) -> None:
    node = await make_node(sizes=[12 * GIB, 40 * GIB])
    error = await node.refused(gpu_memory="18GiB", gpu=0)
    assert error.code is FailureCode.CAPABILITY_UNAVAILABLE
    assert "the GPU pinned, GPU 0 (RTX 4090, 12.0 GiB), can lease at most 11.0 GiB" in error.message
    assert "largest" not in error.message


async def test_a_request_for_several_gpus_is_measured_against_the_last_one_it_needs(make_node: Callable[..., Any]) -> None:
    node = await make_node(sizes=[24 * GIB, 40 * GIB])
    node.probe.external(0, 6 * GIB - 10 * MIB)  # 17 GiB and 10 MiB schedulable on GPU 0, 39 GiB on GPU 1
    await node.sample()
    error = await node.refused(gpu_memory=f"{17 * 1024 + 20}MiB", gpus=2)
    assert error.message.endswith("needs 2 GPUs with 17.0 each (10 MiB more than the 17.0 left)")


async def test_whole_gpus_held_by_leases_are_a_lease_conflict_naming_them(make_node: Callable[..., Any]) -> None:
    node = await make_node(sizes=[24 * GIB, 24 * GIB, 24 * GIB])
    held = [(await node.ask(gpu_memory="1GiB", gpu=index))[0]["id"] for index in (0, 1)]
    error = await node.refused(exclusive=True, gpus=2)
    assert error.code is FailureCode.LEASE_CONFLICT
    assert error.message == (
        f"GPU 0 (RTX 4090, 24.0 GiB) held by {held[0]}; GPU 1 (RTX 4090, 24.0 GiB) held by {held[1]}; "
        "GPU 2 (RTX 4090, 24.0 GiB): 0.0 external, 0.0 leased, 1.0 reserve → 23.0 schedulable; needs 2 whole GPUs"
    )
    assert "0.0 each" not in (await node.refused(exclusive=True, gpus=3)).message


async def test_a_wait_that_runs_out_gives_the_figures_its_message_gives(make_node: Callable[..., Any]) -> None:
    node = await make_node()
    node.probe.external(0, 6 * GIB)
    await node.sample()
    waiting = asyncio.create_task(node.refused(gpu_memory="18GiB", wait="300ms"))
    await asyncio.sleep(0.05)
    node.probe.external(0, 8 * GIB)  # the figures move while it waits
    await node.sample()
    error = await waiting
    assert error.code is FailureCode.LEASE_TIMEOUT
    assert "8.0 external (ollama 8.0)" in error.message
    assert error.details["figures"]["external"] == 8 * GIB
    assert error.details["figures"]["schedulable"] == 15 * GIB


async def test_several_gpus_too_large_for_all_but_some_name_the_gpu_that_decides(make_node: Callable[..., Any]) -> None:
    node = await make_node([24 * GIB, 12 * GIB, 40 * GIB])
    error = await node.refused(gpu_memory="30GiB", gpus=2)
    assert error.code is FailureCode.CAPABILITY_UNAVAILABLE
    assert error.message == (
        "30.0 GiB asked for on 2 GPUs; only 1 GPU here can lease that much; the next largest, GPU 0 (RTX 4090, 24.0 GiB), "
        "can lease at most 23.0 GiB (its total less the 1.0 GiB reserve)"
    )
    assert error.details["index"] == 0


async def test_an_exclusive_request_larger_than_any_gpu_names_the_bytes_it_asked_for(make_node: Callable[..., Any]) -> None:
    node = await make_node([24 * GIB])
    error = await node.refused(exclusive=True, gpu_memory="30GiB")
    assert error.code is FailureCode.CAPABILITY_UNAVAILABLE
    assert error.message == (
        "the whole GPU with at least 30.0 GiB asked for on 1 GPU; the largest here, GPU 0 (RTX 4090, 24.0 GiB), "
        "can lease at most 23.0 GiB (its total less the 1.0 GiB reserve)"
    )
    assert error.details["need"] == 30 * GIB


async def test_a_gpu_pinned_by_its_index_as_a_string_is_that_gpu(make_node: Callable[..., Any]) -> None:
    node = await make_node(sizes=[24 * GIB, 24 * GIB])
    lease, _ = await node.ask(gpu_memory="1GiB", gpu="1")
    assert [gpu["index"] for gpu in lease["gpus"]] == [1]


async def test_a_lease_without_gpus_hides_every_gpu_from_its_work(make_node: Callable[..., Any]) -> None:
    node = await make_node()
    lease, _ = await node.ask(cpu_cores=1)
    assert lease["env"] == {"CUDA_VISIBLE_DEVICES": "", "GPUBROKER_LEASE": lease["id"]}


async def test_a_request_that_fits_is_granted_with_the_gpu_uuid_in_its_environment(make_node: Callable[..., Any]) -> None:
    node = await make_node()
    node.probe.external(0, 6 * GIB)
    await node.sample()
    lease, token = await node.ask(gpu_memory="16GiB")
    assert lease["state"] == "granted"
    assert lease["env"] == {"CUDA_VISIBLE_DEVICES": "GPU-fake-0", "GPUBROKER_LEASE": lease["id"], "GPUBROKER_GPU_MEMORY": str(16 * GIB)}
    assert lease["gpus"] == [{"index": 0, "uuid": "GPU-fake-0", "bytes": 16 * GIB, "epoch": 1}]
    assert token
    assert "token" not in node.broker.get(lease["id"])
    assert node.gpu()["figures"]["schedulable"] == 1 * GIB


async def test_a_lease_of_several_gpus_lists_them_in_index_order_whichever_was_fuller(make_node: Callable[..., Any]) -> None:
    """Best fit chooses the GPUs; their order is the driver's, so the work's CUDA device 0 is the lowest index, as
    nvidia-smi numbers them."""
    node = await make_node([24 * GIB, 24 * GIB, 24 * GIB])
    node.probe.external(2, 4 * GIB)  # GPU 2 is the fullest, then GPU 1: best fit would list 2 first
    node.probe.external(1, 2 * GIB)
    await node.sample()
    lease, _ = await node.ask(gpu_memory="10GiB", gpus=2)
    assert [g["index"] for g in lease["gpus"]] == [1, 2]
    assert lease["env"]["CUDA_VISIBLE_DEVICES"] == "GPU-fake-1,GPU-fake-2"
    assert lease["env"]["GPUBROKER_GPU_MEMORY"] == str(10 * GIB)


async def test_external_growth_is_pressure_refusing_new_requests_but_revoking_nothing(make_node: Callable[..., Any]) -> None:
    node = await make_node()
    node.probe.external(0, 6 * GIB)
    await node.sample()
    lease, token = await node.ask(gpu_memory="16GiB")
    node.probe.external(0, 9 * GIB)
    await node.sample()
    assert node.gpu()["figures"]["schedulable"] == 0
    started = await node.events("gpu.pressure.started")
    assert len(started) == 1
    assert started[0]["code"] == "EXTERNAL_GPU_PRESSURE"
    assert started[0]["gpu"] == "GPU-fake-0"
    assert node.broker.get(lease["id"])["state"] == "granted"
    error = await node.refused(gpu_memory="1GiB")
    assert error.code is FailureCode.EXTERNAL_GPU_PRESSURE
    await node.broker.release(lease["id"], TCP, token)
    await node.sample()
    assert node.gpu()["figures"]["schedulable"] == 14 * GIB
    assert node.gpu()["figures"]["leased"] == 0
    assert len(await node.events("gpu.pressure.ended")) == 1


async def test_a_refusal_says_which_gpus_are_pressed_and_by_how_much_whichever_its_code(make_node: Callable[..., Any]) -> None:
    """External usage grown 1 GiB into a lease on the 12 GiB GPU: its figures add up to 13 GiB, and a refusal that names
    it says why, also where the 24 GiB GPU, not pressed, makes the code INSUFFICIENT_SCHEDULABLE_VRAM."""
    node = await make_node([24 * GIB, 12 * GIB])
    await node.ask(gpu_memory="20GiB", gpu=0)
    await node.ask(gpu_memory="8GiB", gpu=1)
    node.probe.external(1, 4 * GIB, name="plex")
    await node.sample()
    pressed = (
        "4.0 external (plex 4.0), 8.0 leased, 1.0 reserve → 0.0 schedulable (external usage has grown 1.0 into leased or reserved memory)"
    )
    error = await node.refused(gpu_memory="5GiB")
    assert error.code is FailureCode.INSUFFICIENT_SCHEDULABLE_VRAM
    assert f"GPU 1 (RTX 4090, 12.0 GiB): {pressed}; needs 5.0" in error.message
    error = await node.refused(gpu_memory="5GiB", gpu=1)
    assert (error.code, error.message) == (FailureCode.EXTERNAL_GPU_PRESSURE, f"GPU 1 (RTX 4090, 12.0 GiB): {pressed}; needs 5.0")


async def test_waiting_requests_are_granted_in_class_order(make_node: Callable[..., Any]) -> None:
    node = await make_node()
    held, token = await node.ask(gpu_memory="20GiB")
    background = asyncio.create_task(node.ask(gpu_memory="15GiB", priority="background", wait="1m"))
    await settle()
    production = asyncio.create_task(node.ask(gpu_memory="15GiB", priority="production", wait="1m"))
    await settle()
    queued = node.broker.list_leases("queued", 100)
    assert [q["priority"] for q in queued] == ["production", "background"]
    await node.broker.release(held["id"], TCP, token)
    lease, _ = await asyncio.wait_for(production, 5)
    assert lease["priority"] == "production"
    await settle()
    assert not background.done()
    assert [q["priority"] for q in node.broker.list_leases("queued", 100)] == ["background"]
    background.cancel()
    with pytest.raises(asyncio.CancelledError):
        await background


async def test_events_reach_the_writer_in_the_order_of_their_seqs_so_a_follower_misses_none(make_node: Callable[..., Any]) -> None:
    """A follower reads events after the last seq it saw: one handed to the disk after a higher seq (a waiter's grant,
    an expiry, a holder's exit) would be passed over for good."""
    node = await make_node(default_ttl=5.0)
    handed: list[int] = []
    commit, submit = node.broker.store.commit, node.broker.store.submit

    def seqs(writes: list[Write]) -> None:
        handed.extend(int.from_bytes(w.key, "big") for w in writes if w.table == "events")

    node.broker.store.commit = lambda writes, *a, **k: (seqs(writes), commit(writes, *a, **k))[1]  # type: ignore[method-assign]
    node.broker.store.submit = lambda writes: (seqs(writes), submit(writes))[1]  # type: ignore[method-assign]
    held, token = await node.ask(gpu_memory="20GiB")
    waiting = asyncio.create_task(node.ask(gpu_memory="15GiB", wait="1m"))
    await settle()
    await node.broker.release(held["id"], TCP, token)  # the waiter is granted on the way...
    node.broker.record_event("mesh.keys", "an event from the mesh at that moment")  # ...and another event comes at once
    await asyncio.wait_for(waiting, 5)
    behind = asyncio.create_task(node.ask(gpu_memory="15GiB", wait="1m"))  # waits for the room of the lease just granted
    await settle()
    node.clock.advance(10)
    await node.sample()  # readings as fresh as the clock, so that the request behind can be granted
    node.broker.sweep()  # an expiry that grants the request behind it, and again another event at once
    node.broker.record_event("mesh.keys", "and another")
    await asyncio.wait_for(behind, 5)
    await node.events()
    assert handed == sorted(handed), handed


async def test_queue_full_names_the_users_whose_requests_fill_the_queue(make_node: Callable[..., Any]) -> None:
    """One user flooding a class's queue shuts everyone else out of it: the refusal says who it is."""
    node = await make_node(queue_limit=3)
    await node.ask(gpu_memory="20GiB")
    flooder = Caller("unix", uid=os.getuid(), pid=None)
    waiting = [asyncio.create_task(node.ask(flooder, gpu_memory="10GiB", wait="1m")) for _ in range(2)]
    waiting.append(asyncio.create_task(node.ask(gpu_memory="10GiB", wait="1m")))  # over TCP: nobody named it
    await settle()
    error = await node.refused(Caller("unix", uid=os.getuid() + 1, pid=None), gpu_memory="10GiB", wait="1m")
    assert error.code is FailureCode.QUEUE_FULL
    me = pwd.getpwuid(os.getuid()).pw_name
    assert error.message == (
        f"3 interactive requests already wait on node tower ({me} 2, anonymous (tcp) 1); the queue holds 3 (queue_limit): "
        "ask again once some of them are granted or cancelled"
    )
    assert error.details["waiting_by_user"] == {me: 2, "anonymous (tcp)": 1}
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)


async def test_the_seventeenth_waiting_request_of_a_class_gets_queue_full(make_node: Callable[..., Any]) -> None:
    node = await make_node()
    await node.ask(gpu_memory="20GiB")
    waiting = [asyncio.create_task(node.ask(gpu_memory="10GiB", priority="background", wait="1m")) for _ in range(16)]
    await settle()
    assert len(node.broker.waiters) == 16
    error = await node.refused(gpu_memory="10GiB", priority="background", wait="1m")
    assert error.code is FailureCode.QUEUE_FULL
    assert error.status == 429
    other_class = asyncio.create_task(node.ask(gpu_memory="10GiB", priority="benchmark", wait="1m"))
    await settle()
    assert len(node.broker.waiters) == 17  # each class has its own queue
    for task in [*waiting, other_class]:
        task.cancel()
    await asyncio.gather(*waiting, other_class, return_exceptions=True)
    assert node.broker.waiters == []
    assert len(await node.events("lease.cancelled")) == 17


async def test_a_request_that_fits_now_is_granted_though_its_class_queue_is_full(make_node: Callable[..., Any]) -> None:
    """A full queue refuses a place in it, not a grant: with a wait, a request that needs none is granted as without."""
    node = await make_node([24 * GIB, 24 * GIB], queue_limit=2)
    await node.ask(gpu_memory="20GiB", gpu=0)
    waiting = [asyncio.create_task(node.ask(gpu_memory="10GiB", gpu=0, priority="background", wait="1m")) for _ in range(2)]
    await settle()
    lease, _ = await node.ask(gpu_memory="10GiB", gpu=1, priority="background", wait="1m")
    assert lease["state"] == "granted"
    lease, _ = await node.ask(gpu_memory="1GiB", priority="background", deadline=rfc3339(node.clock.now() + 60))
    assert [gpu["index"] for gpu in lease["gpus"]] == [1]  # GPU 0 is claimed by the requests waiting ahead
    error = await node.refused(gpu_memory="10GiB", gpu=0, priority="background", wait="1m")
    assert error.code is FailureCode.QUEUE_FULL  # one that must wait still finds the queue full
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)


async def test_a_waiter_blocks_its_own_class_and_lower_but_not_a_higher_one(make_node: Callable[..., Any]) -> None:
    node = await make_node()
    await node.ask(gpu_memory="20GiB")
    waiter = asyncio.create_task(node.ask(gpu_memory="15GiB", priority="background", wait="1m"))
    await settle()
    error = await node.refused(gpu_memory="1GiB", priority="benchmark")
    assert error.code is FailureCode.INSUFFICIENT_SCHEDULABLE_VRAM
    assert "claimed by requests waiting ahead" in error.message
    lease, _ = await node.ask(gpu_memory="1GiB", priority="interactive")
    assert lease["state"] == "granted"
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)


async def test_a_request_waiting_for_cpu_cores_is_not_passed_by_a_lower_class_that_fits(make_node: Callable[..., Any]) -> None:
    """Claim order holds for the host's cores as for a GPU: a background request for the one free core would keep a
    production request for two waiting for as long as small requests came."""
    node = await make_node()
    cores = node.broker.host.cores
    held, token = await node.ask(cpu_cores=cores - 1)
    big = asyncio.create_task(node.ask(cpu_cores=2, priority="production", wait="1m"))
    await settle()
    (waiter,) = node.broker.waiters
    error = await node.refused(cpu_cores=1, priority="background")
    assert error.code is FailureCode.LEASE_CONFLICT
    assert error.message == (
        f"CPU cores: {cores} in all, {cores - 1} leased → 1 schedulable; claimed by requests waiting ahead "
        f"({waiter.id} production); needs 1"
    )
    assert error.details["waiting_ahead"] == {"CPU cores": [f"{waiter.id} production"]}
    small = asyncio.create_task(node.ask(cpu_cores=1, priority="background", wait="1m"))
    await settle()
    queued = {lease["priority"]: lease for lease in node.broker.list_leases("queued", 10)}
    assert queued["background"]["waiting_behind"] == [waiter.id]
    await node.broker.release(held["id"], TCP, token)
    lease, _ = await asyncio.wait_for(big, 5)
    assert lease["cpu_cores"] == 2
    assert not small.done()  # the one core left is not enough for both: the production request had it first
    small.cancel()
    await asyncio.gather(small, return_exceptions=True)


async def test_a_request_the_node_can_never_serve_is_refused_so_though_the_cores_it_asks_for_are_claimed(
    make_node: Callable[..., Any],
) -> None:
    """A claim is no reason to wait for a GPU the node does not have, or for more than it has: such a request would wait
    its whole wait in the queue, claiming cores whenever they ran short."""
    node = await make_node()
    cores = node.broker.host.cores
    await node.ask(cpu_cores=cores - 1)
    big = asyncio.create_task(node.ask(cpu_cores=2, priority="production", wait="1m"))
    await settle()
    for never in (
        {"gpu": 7, "gpu_memory": "1GiB"},
        {"gpu_memory": "30GiB"},
        {"gpus": 2, "gpu_memory": "1GiB"},
        {"memory": node.broker.host.memory + GIB},
    ):
        error = await asyncio.wait_for(node.refused(cpu_cores=1, wait="1h", **never), 5)  # at once, not queued
        assert error.code is FailureCode.CAPABILITY_UNAVAILABLE, (never, error.message)
    assert len(node.broker.waiters) == 1
    big.cancel()
    await asyncio.gather(big, return_exceptions=True)


async def test_a_request_waiting_for_a_gpu_holds_back_no_core_it_has_room_for(make_node: Callable[..., Any]) -> None:
    """Waiting for a GPU, a request that has the cores and memory it asks for leaves them to the requests behind it."""
    node = await make_node()
    await node.ask(gpu_memory="20GiB")
    big = asyncio.create_task(node.ask(gpu_memory="15GiB", cpu_cores=1, memory="1GiB", priority="production", wait="1m"))
    await settle()
    lease, _ = await node.ask(cpu_cores=1, memory="1GiB", priority="background")
    assert lease["state"] == "granted"
    big.cancel()
    await asyncio.gather(big, return_exceptions=True)


async def test_host_memory_is_claimed_in_class_order_too(make_node: Callable[..., Any]) -> None:
    node = await make_node()
    total = node.broker.host.memory
    held, token = await node.ask(memory=total - GIB)
    big = asyncio.create_task(node.ask(memory="2GiB", priority="interactive", wait="1m"))
    await settle()
    error = await node.refused(memory="512MiB", priority="interactive")  # an earlier one of its own class waits for it
    assert error.code is FailureCode.LEASE_CONFLICT
    assert "claimed by requests waiting ahead" in error.message
    lease, _ = await node.ask(memory="512MiB", priority="production")  # a higher class is not held back by it
    assert lease["state"] == "granted"
    big.cancel()
    await asyncio.gather(big, return_exceptions=True)


async def test_a_waiting_request_holds_back_no_gpu_too_small_ever_to_hold_it(make_node: Callable[..., Any]) -> None:
    """A production request for 10 GiB waits for the 24 GiB GPU alone: the 8 GiB one can lease at most 7 GiB, so a
    background request is granted there, now or once room is made, and waits behind nothing."""
    node = await make_node([24 * GIB, 8 * GIB])
    await node.ask(gpu_memory="20GiB", gpu=0)
    held, token = await node.ask(gpu_memory="7GiB", gpu=1)
    big = asyncio.create_task(node.ask(gpu_memory="10GiB", priority="production", wait="1m"))
    await settle()
    small = asyncio.create_task(node.ask(gpu_memory="2GiB", gpu=1, priority="background", wait="1m"))
    await settle()
    queued = {lease["request"]["gpu_memory"]: lease for lease in node.broker.list_leases("queued", 10)}
    assert queued[2 * GIB]["waiting_behind"] == []
    await node.broker.release(held["id"], TCP, token)
    lease, _ = await asyncio.wait_for(small, 5)
    assert [gpu["index"] for gpu in lease["gpus"]] == [1]
    lease, _ = await node.ask(gpu_memory="1GiB", priority="background")
    assert [gpu["index"] for gpu in lease["gpus"]] == [1]
    big.cancel()
    await asyncio.gather(big, return_exceptions=True)


async def test_a_refusal_is_told_by_the_gpu_that_could_hold_the_request_not_by_a_smaller_one_with_more_room(
    make_node: Callable[..., Any],
) -> None:
    """The 8 GiB card has more room than the 24 GiB one, but could never hold 10 GiB: the refusal, its figures and its
    event are the 24 GiB card's."""
    node = await make_node([24 * GIB, 8 * GIB])
    await node.ask(gpu_memory="20GiB", gpu=0)
    error = await node.refused(gpu_memory="10GiB")
    assert error.code is FailureCode.INSUFFICIENT_SCHEDULABLE_VRAM
    assert error.message == (
        "GPU 0 (RTX 4090, 24.0 GiB): 0.0 external, 20.0 leased, 1.0 reserve → 3.0 schedulable; "
        "GPU 1 (RTX 4090, 8.0 GiB): 0.0 external, 0.0 leased, 1.0 reserve → 7.0 schedulable; needs 10.0"
    )
    assert (error.details["gpu"], error.details["figures"]["schedulable"]) == ("GPU-fake-0", 3 * GIB)
    (event,) = [e for e in await node.events() if e["type"] == "lease.refused"]
    assert event["gpu"] == "GPU-fake-0"


async def test_a_refusal_for_a_gpu_claimed_ahead_names_the_request_that_claims_it_and_the_other_gpus_figures(
    make_node: Callable[..., Any],
) -> None:
    node = await make_node([24 * GIB, 12 * GIB])
    await node.ask(gpu_memory="20GiB", gpu=0)
    await node.ask(gpu_memory="10GiB", gpu=1)
    big = asyncio.create_task(node.ask(gpu_memory="15GiB", priority="production", wait="1m"))
    await settle()
    (waiter,) = node.broker.waiters
    error = await node.refused(gpu_memory="2GiB", priority="background")
    assert error.code is FailureCode.INSUFFICIENT_SCHEDULABLE_VRAM
    assert f"3.0 schedulable; claimed by requests waiting ahead ({waiter.id} production); GPU 1 (" in error.message
    assert error.message.endswith("1.0 reserve → 1.0 schedulable; needs 2.0")
    assert error.details["waiting_ahead"] == {"GPU-fake-0": [f"{waiter.id} production"]}
    big.cancel()
    await asyncio.gather(big, return_exceptions=True)


async def test_a_queued_request_shows_its_position_and_what_it_waits_behind(make_node: Callable[..., Any]) -> None:
    node = await make_node()
    await node.ask(gpu_memory="20GiB")
    first = asyncio.create_task(node.ask(gpu_memory="15GiB", priority="background", wait="1m"))
    await settle()
    second = asyncio.create_task(node.ask(gpu_memory="15GiB", priority="background", wait="1m"))
    await settle()
    one, two = node.broker.list_leases("queued", 10)
    assert (one["position"], two["position"]) == (1, 2)
    assert two["waiting_behind"] == [one["id"]]
    assert "3.0 schedulable; needs 15.0" in one["reason"]
    # A request ahead that wants no GPU holds none back: it is not named as one a GPU request waits behind.
    await node.ask(cpu_cores=node.broker.host.cores)
    cores = asyncio.create_task(node.ask(cpu_cores=1, priority="interactive", wait="1m"))
    await settle()
    queued = {lease["id"]: lease for lease in node.broker.list_leases("queued", 10)}
    assert [lease["request"]["cpu_cores"] for lease in queued.values()].count(1) == 1
    assert queued[two["id"]]["waiting_behind"] == [one["id"]]
    for task in (first, second, cores):
        task.cancel()
    await asyncio.gather(first, second, cores, return_exceptions=True)


async def test_a_wait_that_runs_out_is_lease_timeout(make_node: Callable[..., Any]) -> None:
    node = await make_node()
    await node.ask(gpu_memory="20GiB")
    error = await node.refused(gpu_memory="15GiB", wait="50ms")
    assert error.code is FailureCode.LEASE_TIMEOUT
    assert node.broker.waiters == []


async def test_a_deadline_already_passed_or_hopeless_fails_at_once(make_node: Callable[..., Any]) -> None:
    node = await make_node()
    passed = await node.refused(gpu_memory="1GiB", deadline=rfc3339(node.clock.now() - 1))
    assert passed.code is FailureCode.DEADLINE_CANNOT_BE_MET
    await node.ask(gpu_memory="20GiB", ttl="1h", preemption="never")
    deadline = rfc3339(node.clock.now() + 60)
    hopeless = await node.refused(gpu_memory="15GiB", deadline=deadline)
    assert hopeless.code is FailureCode.DEADLINE_CANNOT_BE_MET
    # What failed leads (the deadline), then why: the room's figures, which alone read as a plain refusal.
    said, _, why = hopeless.message.partition("; as things stand, ")
    assert said == f"the deadline {deadline} cannot be met: what holds the room is held past it and may not be preempted"
    assert why.startswith("GPU 0 (RTX 4090, 24.0 GiB)"), why
    assert "3.0 schedulable; needs 15.0" in why, why
    assert node.broker.waiters == []


async def test_a_request_for_cores_with_a_deadline_waits_for_cores_held_by_a_lease_that_ends_before_it(
    make_node: Callable[..., Any],
) -> None:
    """The cores are held by a lease due to end before the deadline: the request may be granted in time, so it waits.
    It was refused at once: the cores were counted as held by every lease, not only by those held past the deadline."""
    node = await make_node()
    cores = node.broker.host.cores
    await node.ask(cpu_cores=cores, ttl="10s", preemption="never")
    waiting = asyncio.create_task(node.ask(cpu_cores=1, deadline=rfc3339(node.clock.now() + 60)))
    await settle()
    assert len(node.broker.waiters) == 1, waiting
    await node.ask(cpu_cores=0, memory="1MiB", ttl="1h", preemption="never")  # host memory held past the deadline
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    error = await node.refused(memory=node.broker.host.memory, deadline=rfc3339(node.clock.now() + 60))
    assert error.code is FailureCode.DEADLINE_CANNOT_BE_MET  # all of it can never be had in time: 1 MiB is held past it


async def test_a_waiting_request_whose_deadline_becomes_hopeless_fails_then_not_at_its_deadline(
    make_node: Callable[..., Any],
) -> None:
    """It waited for a lease due to expire before its deadline; once that lease was renewed past it, it waited on to the
    deadline for room that could not come in time (SPEC §3.3: it fails at once)."""
    node = await make_node()
    held, token = await node.ask(gpu_memory="20GiB", ttl="10s", preemption="never")
    deadline = rfc3339(node.clock.now() + 60)
    waiting = asyncio.create_task(node.refused(gpu_memory="15GiB", deadline=deadline))
    behind = asyncio.create_task(node.ask(gpu_memory="2GiB", wait="1h"))  # fits, but the request ahead claims the GPU
    await asyncio.sleep(0.1)
    assert len(node.broker.waiters) == 2  # the lease may end in time: it waits
    await node.broker.renew(held["id"], TCP, token, 3600.0)
    async with asyncio.timeout(2):
        error = await waiting
        granted, _ = await behind
    assert error.code is FailureCode.DEADLINE_CANNOT_BE_MET
    said, _, why = error.message.partition("; as things stand, ")
    assert said == f"the deadline {deadline} cannot be met: what holds the room is held past it and may not be preempted"
    assert "3.0 schedulable; needs 15.0" in why, why
    assert granted["state"] == "granted"
    queued = [e for e in await node.events("lease.queued") if e["details"]["wait"] == 0]  # the request with the deadline
    (refused,) = await node.events("lease.refused")
    assert (refused["lease"], refused["code"]) == (queued[0]["lease"], "DEADLINE_CANNOT_BE_MET")
    assert node.broker.waiters == []


async def test_a_lease_not_renewed_expires_on_the_next_sweep(make_node: Callable[..., Any]) -> None:
    node = await make_node()
    lease, token = await node.ask(gpu_memory="4GiB", ttl="30s")
    node.clock.advance(20)
    await node.broker.renew(lease["id"], TCP, token, None)
    node.clock.advance(29)
    node.broker.sweep()
    assert node.broker.get(lease["id"])["state"] == "granted"
    node.clock.advance(2)
    node.broker.sweep()
    ended = node.broker.get(lease["id"])
    assert ended["state"] == "expired"
    assert "not renewed" in ended["reason"]
    assert node.gpu()["figures"]["leased"] == 0
    await settle()
    assert [e["lease"] for e in await node.events("lease.expired")] == [lease["id"]]


async def test_events_of_a_lease_without_a_holder_name_say_it_has_none(make_node: Callable[..., Any]) -> None:
    node = await make_node()
    lease, token = await node.ask(gpu_memory="4GiB")
    await node.broker.release(lease["id"], TCP, token)
    messages = [e["message"] for e in await node.events() if e.get("lease") == lease["id"]]
    assert len(messages) == 2
    assert all("None" not in m and "an unnamed holder" in m for m in messages), messages


async def test_only_its_user_root_or_its_token_may_renew_or_release(make_node: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> None:
    node = await make_node()
    monkeypatch.setattr(os, "geteuid", lambda: 0)  # the broker runs as root: no stranger below is its own user
    owner = Caller("unix", uid=1000, pid=os.getpid())
    lease, token = await node.ask(owner, gpu_memory="4GiB")
    for stranger in (Caller("unix", uid=1001, pid=1), TCP):
        with pytest.raises(Forbidden):
            await node.broker.renew(lease["id"], stranger, None, None)
        with pytest.raises(Forbidden):
            await node.broker.release(lease["id"], stranger, "not-the-token")
    await node.broker.renew(lease["id"], Caller("unix", uid=1000, pid=2), None, None)
    await node.broker.renew(lease["id"], Caller("unix", uid=0, pid=3), None, None)
    await node.broker.renew(lease["id"], TCP, token, None)
    released = await node.broker.release(lease["id"], TCP, token)
    assert released.state == "released"


async def test_the_brokers_own_user_may_renew_and_release_any_lease_of_its_broker_as_root_may(
    make_node: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A user running a broker of their own was refused releasing a lease another user took on it, though the same
    release of a lease on another node of the cluster, forwarded there, is an admin's."""
    node = await make_node()
    monkeypatch.setattr(os, "geteuid", lambda: 1000)  # the broker runs as uid 1000
    lease, _ = await node.ask(Caller("unix", uid=1001, pid=os.getpid()), gpu_memory="4GiB")
    with pytest.raises(Forbidden):
        await node.broker.renew(lease["id"], Caller("unix", uid=1002, pid=1), None, None)
    await node.broker.renew(lease["id"], Caller("unix", uid=1000, pid=2), None, None)
    released = await node.broker.release(lease["id"], Caller("unix", uid=1000, pid=2), None)
    try:
        called = f"user {pwd.getpwuid(1000).pw_name} (uid 1000)"
    except KeyError:  # no such user here: the uid alone
        called = "uid 1000"
    assert (released.state, released.reason) == ("released", f"released by {called}")


async def test_a_refusal_to_act_on_a_lease_names_its_unix_user_and_what_would_do(
    make_node: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another user's release was refused with "lease L belongs to gpubroker": the holder name, the caller's word
    (the CLI's own by default), and no user; nor did it say that a token was given and was not the lease's."""
    node = await make_node()
    monkeypatch.setattr(os, "geteuid", lambda: 0)  # the broker runs as root: the stranger below is not its own user
    nobody = pwd.getpwnam("nobody").pw_uid
    lease, _ = await node.ask(Caller("unix", uid=nobody, pid=os.getpid()), gpu_memory="4GiB", holder={"name": "gpubroker"})
    with pytest.raises(Forbidden) as refused:
        await node.broker.release(lease["id"], Caller("unix", uid=1001, pid=1), None)
    assert str(refused.value) == (
        f"lease {lease['id']} (gpubroker) belongs to user nobody (uid {nobody}): only that user, root or the broker's own user "
        "on the Unix socket, an admin (the API token, the web UI signed in), or its token (X-Lease-Token; "
        f"`gpubroker release {lease['id']} --token T`), may release it"
    )
    over_tcp, _ = await node.ask(gpu_memory="4GiB")
    with pytest.raises(
        Forbidden,
        match=r"belongs to no Unix user \(it was asked for over TCP\): only root or the broker's own user on .*; the token given is not its$",
    ):
        await node.broker.renew(over_tcp["id"], Caller("unix", uid=1001, pid=1), "not-the-token", None)


async def test_a_refused_renewal_or_registration_names_its_own_form_not_the_release_command(
    make_node: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A renewal refused FORBIDDEN suggested `gpubroker release ID --token T`: following it would end the lease."""
    node = await make_node()
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    lease, _ = await node.ask(gpu_memory="4GiB")
    stranger = Caller("unix", uid=1001, pid=1)
    with pytest.raises(Forbidden) as renewal:
        await node.broker.renew(lease["id"], stranger, None, None)
    assert renewal.value.message.endswith(f"or its token (X-Lease-Token; POST /v1/leases/{lease['id']}/renew), may renew it")
    with pytest.raises(Forbidden) as registration:
        await node.broker.register_group(lease["id"], stranger, None, os.getpgrp())
    assert registration.value.message.endswith(
        f"or its token (X-Lease-Token; POST /v1/leases/{lease['id']}/processes), may register a process group with it"
    )
    assert "release" not in renewal.value.message + registration.value.message


async def test_a_waiting_request_its_requester_may_not_cancel_by_id_is_told_how_it_can_be(
    make_node: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A requester over TCP deleting its own waiting request was told that the "lease" takes its X-Lease-Token, which
    a request has only once granted: ending its waiting POST cancels it, or its user or root on the socket by id."""
    node = await make_node()
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    await node.ask(gpu_memory="20GiB")
    waiting = asyncio.create_task(node.ask(gpu_memory="15GiB", wait="1m", holder={"name": "train"}))
    await settle()
    (waiter,) = node.broker.waiters
    with pytest.raises(Forbidden) as refused:
        await node.broker.release(waiter.id, TCP, None)
    assert refused.value.message == (
        f"request {waiter.id} (train) waits to be granted and has no token yet (it belongs to no Unix user (it was asked for "
        "over TCP)): its requester cancels it by ending its waiting POST /v1/leases (closing its connection); by its id "
        f"(DELETE /v1/leases/{waiter.id}, `gpubroker release {waiter.id}`) only root or the broker's own user on the Unix "
        "socket, or an admin (the API token, the web UI signed in), may cancel it"
    )
    assert "X-Lease-Token" not in refused.value.message
    assert node.broker.waiters == [waiter]  # refused: it waits on
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)


async def test_an_unknown_lease_is_not_found(make_node: Callable[..., Any]) -> None:
    node = await make_node()
    with pytest.raises(NotFound):
        await node.broker.release("l-nope", TCP, None)
    with pytest.raises(NotFound):
        node.broker.get("l-nope")


async def test_a_reading_older_than_the_staleness_limit_is_never_decided_on(make_node: Callable[..., Any]) -> None:
    node = await make_node()
    node.clock.advance(5.5)
    error = await node.refused(gpu_memory="1GiB")
    assert error.code is FailureCode.SCHEDULER_STATE_STALE
    assert error.status == 503
    await node.sample()
    lease, _ = await node.ask(gpu_memory="1GiB")
    assert lease["state"] == "granted"


async def test_without_a_driver_gpu_requests_fail_while_cpu_and_memory_are_brokered(make_node: Callable[..., Any]) -> None:
    node = await make_node()
    node.probe.error = "no NVIDIA driver: NVML Shared Library Not Found"
    await node.sample()
    error = await node.refused(gpu_memory="1GiB")
    assert error.code is FailureCode.DRIVER_ERROR
    assert "no NVIDIA driver" in error.message
    lease, _ = await node.ask(cpu_cores=1, memory="64MiB")
    assert (lease["cpu_cores"], lease["memory"], lease["gpus"]) == (1, 64 * 2**20, [])
    assert node.broker.node_json()["gpus"] == []


async def test_whole_gpus_held_by_leases_are_the_conflict_where_every_free_gpu_is_too_small_for_the_request(
    make_node: Callable[..., Any],
) -> None:
    """An exclusive request for at least 8 GiB on a 24, a 12 and an 8 GiB GPU, the two large ones with a lease each:
    the leases are what keep it out, the 8 GiB GPU (7 GiB at most) being too small, not a lack of schedulable room."""
    node = await make_node(sizes=[24 * GIB, 12 * GIB, 8 * GIB])
    held = [(await node.ask(gpu_memory="1GiB", gpu=index))[0]["id"] for index in (0, 1)]
    error = await node.refused(exclusive=True, gpu_memory="8GiB")
    assert error.code is FailureCode.LEASE_CONFLICT
    assert error.message == (
        f"GPU 0 (RTX 4090, 24.0 GiB) held by {held[0]}; GPU 1 (RTX 4090, 12.0 GiB) held by {held[1]}; "
        "GPU 2 (RTX 4090, 8.0 GiB): 0.0 external, 0.0 leased, 1.0 reserve → 7.0 schedulable; "
        "needs the whole GPU, with at least 8.0"
    )
    whole, _ = await node.ask(exclusive=True, gpu=2)
    error = await node.refused(gpu_memory="1GiB", gpu=2)
    assert (error.code, error.message) == (
        FailureCode.LEASE_CONFLICT,
        f"GPU 2 (RTX 4090, 8.0 GiB) held whole by {whole['id']}; needs 1.0",
    )


async def test_cpu_and_memory_beyond_what_is_left_are_refused_with_figures(make_node: Callable[..., Any]) -> None:
    node = await make_node()
    cores = node.broker.host.cores
    await node.ask(cpu_cores=cores)
    error = await node.refused(cpu_cores=1)
    assert error.code is FailureCode.LEASE_CONFLICT
    assert f"{cores} leased" in error.message
    too_many = await node.refused(cpu_cores=cores + 1)
    assert too_many.code is FailureCode.CAPABILITY_UNAVAILABLE


async def test_an_exclusive_request_on_a_gpu_with_a_lease_says_what_holds_it_and_that_it_needs_the_whole_gpu(
    make_node: Callable[..., Any],
) -> None:
    node = await make_node()
    lease, _ = await node.ask(gpu_memory="1GiB")
    error = await node.refused(exclusive=True)
    assert error.code is FailureCode.LEASE_CONFLICT
    assert error.message.endswith(f"held by {lease['id']}; needs the whole GPU"), error.message


async def test_an_exclusive_request_for_more_than_the_whole_gpu_has_left_says_how_much_it_needs(
    make_node: Callable[..., Any],
) -> None:
    """The message said only "needs the whole GPU" after 17.0 schedulable: the 18 GiB the request asked for at least
    was in no word of it."""
    node = await make_node()
    node.probe.external(0, 6 * GIB)
    await node.sample()
    error = await node.refused(exclusive=True, gpu_memory="18GiB")
    assert error.code is FailureCode.INSUFFICIENT_SCHEDULABLE_VRAM
    assert error.message.endswith("→ 17.0 schedulable; needs the whole GPU, with at least 18.0"), error.message


async def test_a_renewal_or_registration_overtaken_by_a_release_is_a_conflict_not_a_success(make_node: Callable[..., Any]) -> None:
    """A renewal whose write was on its way to disk when the lease was released answered 200 with the lease released and
    its old expiry: `gpubroker lease -- CMD`, which renews, took it as renewed and kept its work going."""
    node = await make_node()
    lease, token = await node.ask(gpu_memory="1GiB", ttl="1h")
    renewal = asyncio.create_task(node.broker.renew(lease["id"], TCP, token, 7200.0))
    await asyncio.sleep(0)  # the renewal's write is handed to the writer; the release comes while it syncs
    await node.broker.release(lease["id"], TCP, token)
    with pytest.raises(BrokerError) as caught:
        await renewal
    assert caught.value.code is FailureCode.LEASE_CONFLICT
    assert caught.value.message.startswith(f"lease {lease['id']} is released (released by"), caught.value.message
    assert caught.value.details == {"lease": lease["id"], "state": "released"}
    work = subprocess.Popen(["sleep", "30"], process_group=0)
    try:
        other, other_token = await node.ask(gpu_memory="1GiB", ttl="1h")
        caller = Caller("unix", uid=os.getuid(), pid=None)
        commit, handed, released = node.broker.store.commit, asyncio.Event(), asyncio.Event()

        async def held(writes: list[Write], *args: Any, **kwargs: Any) -> None:
            node.broker.store.commit = commit  # type: ignore[method-assign]
            synced = commit(writes, *args, **kwargs)
            handed.set()
            await released.wait()  # the registration goes on only once the lease is released, however fast the disk
            await synced

        node.broker.store.commit = held  # type: ignore[method-assign]
        registration = asyncio.create_task(node.broker.register_group(other["id"], caller, other_token, work.pid))
        await asyncio.wait_for(handed.wait(), 10)  # its processes are read in a thread, then its write is handed over
        await node.broker.release(other["id"], TCP, other_token)
        released.set()
        with pytest.raises(BrokerError) as caught:
            await registration
        assert caught.value.code is FailureCode.LEASE_CONFLICT
    finally:
        work.kill()
        work.wait()
    await node.restart()
    assert {node.broker.get(lease["id"])["state"], node.broker.get(other["id"])["state"]} == {"released"}


async def test_live_leases_are_listed_in_the_order_they_were_granted_after_a_restart_too(make_node: Callable[..., Any]) -> None:
    """A restarted broker listed them in the store's order, by their random ids: `limit` cut an arbitrary few."""
    node = await make_node()
    granted = [(await node.ask(gpu_memory="1GiB"))[0]["id"] for _ in range(8)]
    assert [lease["id"] for lease in node.broker.list_leases("granted", 100)] == granted
    await node.restart()
    assert [lease["id"] for lease in node.broker.list_leases("granted", 100)] == granted
    assert [lease["id"] for lease in node.broker.list_leases(None, 3)] == granted[:3]


async def test_a_full_store_still_keeps_every_release_and_expiry_with_its_event(make_node: Callable[..., Any]) -> None:
    """A full store refused releases too, though its message said to release leases, and an expiry was made in memory
    alone: its event was lost, and after a restart the lease was said to have expired while the broker was down."""
    node = await make_node(store_size=2**20)
    labels = {f"k{i}": "v" * 200 for i in range(16)}
    held: list[tuple[dict[str, Any], str]] = []
    with contextlib.suppress(StoreFull):
        while True:
            held.append(await node.ask(gpu_memory=1, ttl="10s" if len(held) < 8 else "1h", labels=labels))
    full = await node.refused(gpu_memory=1, ttl="1h", labels=labels)
    assert full.code is FailureCode.STORE_FULL
    assert full.message.endswith("fills it too); releases, renewals and expiries are still kept meanwhile"), full.message
    renewed = await node.broker.renew(held[-1][0]["id"], TCP, held[-1][1], 7200.0)  # a renewal too: refused, its work was stopped
    assert renewed.ttl == 7200.0
    assert len(held) > 50
    released = held[8:40]
    for lease, token in released:
        assert (await node.broker.release(lease["id"], TCP, token)).state == "released"
    node.clock.advance(11)
    node.broker.sweep()
    await node.sample()
    ended = {event["lease"]: event["type"] for event in await node.events() if event["type"] in ("lease.released", "lease.expired")}
    assert ended == {lease["id"]: "lease.released" for lease, _ in released} | {lease["id"]: "lease.expired" for lease, _ in held[:8]}
    with pytest.raises(StoreFull):  # the store is still full for anything else: what ended moved to the history
        await node.ask(gpu_memory=1, ttl="1h", labels=labels)
    await node.restart()
    for lease, _ in held[:8]:
        assert node.broker.get(lease["id"])["reason"].startswith("not renewed before its expiry "), node.broker.get(lease["id"])
    assert {node.broker.get(lease["id"])["state"] for lease, _ in released} == {"released"}
    assert {node.broker.get(lease["id"])["state"] for lease, _ in held[40:]} == {"granted"}


async def test_a_renewal_the_store_refuses_leaves_the_lease_as_it_was(make_node: Callable[..., Any]) -> None:
    node = await make_node()
    lease, token = await node.ask(gpu_memory="1GiB", ttl="4s")
    commit = node.broker.store.commit

    def full(writes: list[Write], *args: Any, **kwargs: Any) -> asyncio.Future[None]:
        refused: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        refused.set_exception(StoreFull("the state store is full (1.0 MiB); nothing was changed", {}))
        return refused

    node.broker.store.commit = full  # type: ignore[method-assign]
    with pytest.raises(StoreFull):
        await node.broker.renew(lease["id"], TCP, token, 3600.0)
    work = subprocess.Popen(["sleep", "30"], process_group=0)
    try:
        with pytest.raises(StoreFull):  # nor is a process group registered that the store did not take
            await node.broker.register_group(lease["id"], Caller("unix", uid=os.getuid(), pid=None), token, work.pid)
    finally:
        work.kill()
        work.wait()
    assert node.broker.leases[lease["id"]].pgids == []
    node.broker.store.commit = commit  # type: ignore[method-assign]
    kept = node.broker.get(lease["id"])
    assert (kept["ttl"], kept["expires_at"]) == (4.0, lease["expires_at"])  # "nothing was changed", in memory too
    node.clock.advance(5)
    node.broker.sweep()
    assert node.broker.get(lease["id"])["state"] == "expired"


async def test_a_step_of_the_wall_clock_neither_ends_a_lease_early_nor_keeps_it_past_its_ttl(make_node: Callable[..., Any]) -> None:
    """NTP on an edge box without a real-time clock steps the wall clock by hours: TTLs are elapsed time."""
    node = await make_node()
    early, _ = await node.ask(gpu_memory="1GiB", ttl="10m")
    node.clock.step(3600)  # an hour forward
    node.broker.sweep()
    assert node.broker.get(early["id"])["state"] == "granted"  # 0 s of its 10 min have passed
    await node.sample()  # the readings are taken again (every sample_interval), on the stepped clock
    late, _ = await node.ask(gpu_memory="1GiB", ttl="5s")
    node.clock.step(-7200)  # two hours back
    node.clock.advance(6)
    node.broker.sweep()
    assert node.broker.get(late["id"])["state"] == "expired"  # its 5 s have passed, whatever the wall clock says
    assert node.broker.get(early["id"])["state"] == "granted"
    node.clock.advance(600)
    node.broker.sweep()
    assert node.broker.get(early["id"])["state"] == "expired"


async def test_a_step_of_the_wall_clock_neither_ages_a_reading_nor_keeps_one_fresh(make_node: Callable[..., Any]) -> None:
    """A reading's age is elapsed time too: the wall clock stepped forward does not refuse on a fresh reading,
    and stepped back it does not let the broker decide on the reading of a probe that stopped answering."""
    node = await make_node()
    node.clock.step(3600)  # an hour forward, just after a reading
    lease, _ = await node.ask(gpu_memory="1GiB")
    assert lease["state"] == "granted"
    assert (node.gpu()["age"], node.gpu()["stale"], node.broker.stale) == (0.0, False, False)
    node.clock.advance(10)  # the probe has not answered since
    node.clock.step(-7200)  # and the wall clock goes two hours back
    error = await node.refused(gpu_memory="1GiB")
    assert error.code is FailureCode.SCHEDULER_STATE_STALE
    assert "read 10.0s ago" in error.message
    assert (node.gpu()["age"], node.gpu()["stale"], node.broker.stale) == (10.0, True, True)
    await node.sample()  # a reading on the stepped clock is fresh
    lease, _ = await node.ask(gpu_memory="1GiB")
    assert lease["state"] == "granted"


async def test_epochs_only_grow_across_restarts(make_node: Callable[..., Any]) -> None:
    node = await make_node()
    first, _ = await node.ask(gpu_memory="1GiB")
    second, token = await node.ask(gpu_memory="1GiB")
    await node.broker.release(second["id"], TCP, token)
    await node.restart()
    kept = node.broker.get(first["id"])
    assert (kept["state"], kept["epoch"], kept["gpus"][0]["epoch"]) == ("granted", first["epoch"], first["gpus"][0]["epoch"])
    assert node.broker.get(second["id"])["state"] == "released"
    third, _ = await node.ask(gpu_memory="1GiB")
    assert third["epoch"] > second["epoch"]
    assert third["gpus"][0]["epoch"] > second["gpus"][0]["epoch"]


async def test_a_restart_with_a_larger_reserve_or_without_production_says_what_becomes_of_the_leases_kept(
    make_node: Callable[..., Any],
) -> None:
    """A config changed between two runs: leases it would no longer grant are kept, and the start says so, where
    the figures showed 20.0 leased and 8.0 reserve on a 24.0 GiB GPU without a word."""
    node = await make_node()
    lease, _ = await node.ask(gpu_memory="20GiB", priority="production")
    assert config_warnings(node.config, node.broker) == []
    node.config = replace(node.config, reserve=8 * GIB, production_eligible=False)
    await node.restart()
    await node.sample()
    assert config_warnings(node.config, node.broker) == [
        "GPU 0 (RTX 4090, 24.0 GiB): the leases kept on it (20.0 GiB) and reserve (8.0 GiB) come to more than the GPU: "
        "the leases keep their memory, and nothing more is leased there until enough of them end",
        f"production_eligible is false, yet 1 production lease is kept ({lease['id']}): each goes on until it ends; "
        "no new production request is served",
    ]
    assert node.broker.get(lease["id"])["state"] == "granted"


async def test_a_stamp_that_makes_requests_production_where_none_is_served_is_warned_of(make_node: Callable[..., Any]) -> None:
    """Every request it stamped was refused CAPABILITY_UNAVAILABLE, and nothing at start said why."""
    node = await make_node(production_eligible=False, stamps=(Stamp("production", holder="train-*"), Stamp("background", user="root")))
    assert config_warnings(node.config, node.broker) == [
        "[[stamp]] makes the requests of holder 'train-*' production, and production_eligible is false: every one of them "
        "is refused CAPABILITY_UNAVAILABLE"
    ]
    refused = await node.refused(cpu_cores=1, holder={"name": "train-7"})
    assert refused.code is FailureCode.CAPABILITY_UNAVAILABLE


async def test_a_stored_record_that_is_no_lease_stops_the_start_saying_the_store_is_damaged(make_node: Callable[..., Any]) -> None:
    node = await make_node()
    lease, _ = await node.ask(gpu_memory="1GiB")
    await node.broker.store.commit([Write("leases", b"l-garbled", {"id": "l-garbled", "gpus": 7})])
    with pytest.raises(StoreDamaged) as damaged:
        await node.restart()
    assert f"the state store in {node.config.state_dir / 'store'} is damaged" in str(damaged.value)
    assert "a stored record cannot be read" in str(damaged.value)
    node.broker.store.stop()
    store = Store(node.config.state_dir, node.config.store_size)
    assert {record["id"] for record in store.load().leases} == {lease["id"], "l-garbled"}  # nothing was written over them
    store.stop()


async def test_a_kept_event_that_is_no_event_stops_the_start_saying_the_store_is_damaged(make_node: Callable[..., Any]) -> None:
    """The start reads the events since the last one for the waits the broker's end cut short: one it cannot read
    stopped it with a traceback (KeyError, AttributeError), where a lease record it cannot read says the store is damaged."""
    node = await make_node()
    seq = node.broker._event_seq
    await node.broker.store.commit([Write("events", seq_key(seq + 1), {"seq": seq + 1, "type": "lease.queued", "lease": "l-1"})])
    with pytest.raises(StoreDamaged, match="a stored record cannot be read: KeyError"):
        await node.restart()
    node.broker.store.stop()
    store = Store(node.config.state_dir, node.config.store_size)
    store.start()
    await store.commit([Write("events", seq_key(seq + 1), 7)])
    store.stop()
    with pytest.raises(StoreDamaged, match="a stored record cannot be read: AttributeError"):
        await node.start()
    node.broker.store.stop()


async def test_a_store_a_newer_version_wrote_starts_keeping_its_leases_and_says_what_it_leaves_out(
    make_node: Callable[..., Any], capsys: pytest.CaptureFixture[str]
) -> None:
    node = await make_node()
    lease, _ = await node.ask(gpu_memory="1GiB")
    record = node.broker.leases[lease["id"]].to_record()
    newer = {**record, "affinity": "numa0", "holder": {**record["holder"], "cgroup": "/x"}}
    await node.broker.store.commit([Write("leases", lease["id"].encode(), newer)])
    capsys.readouterr()
    await node.restart()
    assert node.broker.get(lease["id"])["state"] == "granted"
    said = capsys.readouterr().err
    assert "the store holds lease fields this version does not know (affinity, holder.cgroup), written by a newer gpubroker" in said


async def test_a_lease_stays_on_its_card_by_uuid_when_the_driver_numbers_the_cards_anew(make_node: Callable[..., Any]) -> None:
    """A card removed, or the cards' order changed (at a reboot, say): each lease still counts on its own card,
    never on whichever card now has its index, so no card is leased twice over."""
    node = await make_node([24 * GIB, 24 * GIB])
    node.probe.uuids = ["GPU-a", "GPU-b"]
    await node.sample()
    on_b, _ = await node.ask(gpu_memory="20GiB", gpu=1)
    assert on_b["gpus"][0]["uuid"] == "GPU-b"
    node.probe.sizes, node.probe.uuids = [24 * GIB], ["GPU-b"]  # GPU-a is gone: GPU-b is GPU 0 now
    await node.sample()
    assert (node.gpu(0)["uuid"], node.gpu(0)["figures"]["leased"], node.gpu(0)["figures"]["schedulable"]) == ("GPU-b", 20 * GIB, 3 * GIB)
    error = await node.refused(gpu_memory="20GiB")
    assert error.code is FailureCode.INSUFFICIENT_SCHEDULABLE_VRAM
    assert not await node.events("gpu.missing")  # the card the lease is on is still there

    node.probe.sizes, node.probe.uuids = [24 * GIB, 24 * GIB], ["GPU-b", "GPU-a"]  # the order changed, across a restart
    await node.restart()
    assert [(g["uuid"], g["figures"]["leased"]) for g in node.broker.node_json()["gpus"]] == [("GPU-b", 20 * GIB), ("GPU-a", 0)]

    node.probe.sizes, node.probe.uuids = [24 * GIB], ["GPU-a"]  # the leased card is gone: its lease stays, counted on no other
    await node.sample()
    assert (node.gpu(0)["uuid"], node.gpu(0)["figures"]["leased"]) == ("GPU-a", 0)
    assert node.broker.get(on_b["id"])["state"] == "granted"
    [missing] = await node.events("gpu.missing")
    assert (missing["gpu"], missing["code"], missing["details"]) == ("GPU-b", "DRIVER_ERROR", {"leases": [on_b["id"]], "bytes": 20 * GIB})
    assert on_b["id"] in missing["message"]
    await node.sample()
    assert len(await node.events("gpu.missing")) == 1  # said once, not at every sample
    node.probe.sizes, node.probe.uuids = [24 * GIB, 24 * GIB], ["GPU-a", "GPU-b"]
    await node.sample()
    [found] = await node.events("gpu.found")
    assert (found["gpu"], found["message"]) == ("GPU-b", "GPU-b is listed by the driver again, as GPU 1")
    assert node.gpu(1)["figures"]["leased"] == 20 * GIB


async def test_a_leased_gpu_the_driver_stops_listing_is_said_in_the_log_and_again_when_it_is_back(
    make_node: Callable[..., Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """As a card that cannot be read is: a leased card gone from the driver's list (or from a simulation file being
    edited) changes what the node can grant, and a service's journal is where an operator looks."""
    node = await make_node([24 * GIB, 24 * GIB])
    lease, _ = await node.ask(gpu_memory="20GiB", gpu=1)
    capsys.readouterr()
    node.probe.sizes = [24 * GIB]
    await node.sample()
    await node.sample()
    node.probe.sizes = [24 * GIB, 24 * GIB]
    await node.sample()
    assert capsys.readouterr().err.splitlines() == [
        f"gpubroker: GPU-fake-1 is no longer listed by the driver; leases {lease['id']} hold 20.0 GiB on it "
        "and stay until released or expired, counted on no other GPU",
        "gpubroker: GPU-fake-1 is listed by the driver again, as GPU 1",
    ]


async def test_a_leased_gpu_the_driver_stops_listing_is_shown_missing_until_it_is_back_or_no_lease_holds_it(
    make_node: Callable[..., Any],
) -> None:
    """The node's answer shows the card its leases still hold memory on, as the driver last listed it, since when,
    with those leases and their bytes: the node would otherwise read as if that memory were nowhere."""
    node = await make_node([24 * GIB, 24 * GIB])
    first, first_token = await node.ask(gpu_memory="4GiB", gpu=1)
    second, second_token = await node.ask(gpu_memory="2GiB", gpu=1)
    assert node.broker.node_json()["missing_gpus"] == []
    node.probe.sizes = [24 * GIB]
    await node.sample()
    went = rfc3339(node.clock.now())
    missing = {
        "index": 1, "uuid": "GPU-fake-1", "name": "NVIDIA GeForce RTX 4090", "since": went,
        "leases": sorted([first["id"], second["id"]]), "bytes": 6 * GIB,
    }  # fmt: skip
    node.clock.advance(5)
    await node.sample()
    assert node.broker.node_json()["missing_gpus"] == [missing]  # since it went, not since the last reading
    assert [g["uuid"] for g in node.broker.node_json()["gpus"]] == ["GPU-fake-0"]
    error = await node.refused(gpu_memory="1GiB", gpu="GPU-fake-1")  # nothing is granted on it
    assert error.code is FailureCode.CAPABILITY_UNAVAILABLE

    await node.restart()  # found missing anew, and named as its leases name it: not listed since this start
    restarted = {**missing, "name": None, "since": rfc3339(node.clock.now())}
    assert node.broker.node_json()["missing_gpus"] == [restarted]
    node.probe.sizes = [24 * GIB, 24 * GIB]
    await node.sample()
    assert node.broker.node_json()["missing_gpus"] == []

    node.probe.sizes = [24 * GIB]
    await node.sample()
    went = rfc3339(node.clock.now())
    await node.broker.release(first["id"], TCP, first_token)
    assert node.broker.node_json()["missing_gpus"] == [{**missing, "since": went, "leases": [second["id"]], "bytes": 2 * GIB}]
    await node.broker.release(second["id"], TCP, second_token)
    assert node.broker.node_json()["missing_gpus"] == []  # no lease holds it: nothing of it is left to show


async def test_a_gpu_that_cannot_be_read_is_not_offered_while_the_others_are_brokered(make_node: Callable[..., Any]) -> None:
    """One card fallen off the bus (Xid 79) no longer stops the node: the card that can be read keeps its figures
    and its grants, the other is refused by name, its lease stays, counted on no other card."""
    node = await make_node([24 * GIB, 24 * GIB])
    on_0, _ = await node.ask(gpu_memory="4GiB", gpu=0)
    on_1, _ = await node.ask(gpu_memory="8GiB", gpu=1)
    lost = "nvmlDeviceGetMemoryInfo on GPU 1: GPU is lost (NVML error 15)"
    node.probe.unreadable = {1: lost}
    await node.sample()

    assert node.broker.driver_error is None
    assert [(g["index"], g["figures"]["leased"]) for g in node.broker.node_json()["gpus"]] == [(0, 4 * GIB)]
    assert node.broker.node_json()["unreadable_gpus"] == [{"index": 1, "uuid": "GPU-fake-1", "error": lost, "leases": [on_1["id"]]}]
    granted, _ = await node.ask(gpu_memory="10GiB")
    assert granted["gpus"][0]["index"] == 0
    error = await node.refused(gpu_memory="1GiB", gpu=1)
    assert (error.code, error.status) == (FailureCode.DRIVER_ERROR, 503)
    assert error.message == f"GPU 1 (GPU-fake-1) cannot be read: {lost}; it is not offered until it can be read again"
    error = await node.refused(gpu_memory="1GiB", gpu="GPU-fake-1")
    assert error.code is FailureCode.DRIVER_ERROR
    error = await node.refused(gpu_memory="1GiB", gpus=2)  # only with the card that cannot be read
    assert error.code is FailureCode.DRIVER_ERROR
    assert error.message == f"2 GPUs asked for; 1 can be read; GPU 1 (GPU-fake-1) cannot be read: {lost}"
    error = await node.refused(gpu_memory="20GiB")  # decided on the card that can be read, naming the other
    assert error.code is FailureCode.INSUFFICIENT_SCHEDULABLE_VRAM
    assert error.message.endswith("needs 20.0; GPU 1 (GPU-fake-1) cannot be read")
    assert node.broker.get(on_1["id"])["state"] == "granted"

    [unreadable] = await node.events("gpu.unreadable")
    assert (unreadable["gpu"], unreadable["code"]) == ("GPU-fake-1", "DRIVER_ERROR")
    assert unreadable["message"] == (
        f"GPU 1 (GPU-fake-1) cannot be read: {lost}; it is not offered, and leases {on_1['id']} hold 8.0 GiB on it "
        "and stay until released or expired, counted on no other GPU"
    )
    assert unreadable["details"] == {"index": 1, "uuid": "GPU-fake-1", "error": lost, "leases": [on_1["id"]], "bytes": 8 * GIB}
    assert not await node.events("gpu.missing")  # the card is listed; why it is not offered is said once
    node.probe.unreadable = {1: "nvmlDeviceGetMemoryInfo on GPU 1: Unknown Error (NVML error 999)"}
    await node.sample()
    await node.sample()
    assert len(await node.events("gpu.unreadable")) == 1  # said once, not at every sample

    node.probe.unreadable = {}
    await node.sample()
    [readable] = await node.events("gpu.readable")
    assert (readable["gpu"], readable["message"]) == ("GPU-fake-1", "GPU 1 (GPU-fake-1) can be read again")
    assert node.broker.node_json()["unreadable_gpus"] == []
    assert node.gpu(1)["figures"]["leased"] == 8 * GIB
    again, _ = await node.ask(gpu_memory="1GiB", gpu=1)
    assert again["gpus"][0]["uuid"] == "GPU-fake-1"
    await node.sample()
    assert len(await node.events("gpu.readable")) == 1
    assert on_0["id"] != on_1["id"]


async def test_a_node_whose_only_gpu_cannot_be_read_says_one_gpu_was_asked_for(make_node: Callable[..., Any]) -> None:
    node = await make_node([24 * GIB])
    node.probe.unreadable = {0: "nvmlDeviceGetMemoryInfo on GPU 0: GPU is lost (NVML error 15)"}
    await node.sample()
    error = await node.refused(gpu_memory="1GiB")
    assert error.message.startswith("1 GPU asked for; 0 can be read; GPU 0 (GPU-fake-0) cannot be read")


async def test_a_missing_card_listed_again_but_unreadable_is_said_found(make_node: Callable[..., Any]) -> None:
    """A leased card the driver stopped listing that comes back unreadable is listed again: `gpu.found` says so,
    and `gpu.unreadable` why it is not offered; read again, it says `gpu.readable`. Each once."""
    node = await make_node([24 * GIB, 24 * GIB])
    lease, _ = await node.ask(gpu_memory="8GiB", gpu=1)
    node.probe.sizes = [24 * GIB]
    await node.sample()
    node.probe.sizes, node.probe.unreadable = [24 * GIB, 24 * GIB], {1: "nvmlDeviceGetMemoryInfo on GPU 1: GPU is lost (NVML error 15)"}
    await node.sample()
    await node.sample()
    node.probe.unreadable = {}
    await node.sample()

    said = [(e["type"], e.get("gpu")) for e in await node.events() if e["type"].startswith("gpu.")]
    assert said == [
        ("gpu.missing", "GPU-fake-1"),
        ("gpu.unreadable", "GPU-fake-1"),
        ("gpu.found", "GPU-fake-1"),
        ("gpu.readable", "GPU-fake-1"),
    ]
    [found] = await node.events("gpu.found")
    assert found["message"] == "GPU-fake-1 is listed by the driver again, as GPU 1, which cannot be read"
    assert node.broker.get(lease["id"])["state"] == "granted"


async def test_a_request_waiting_for_a_gpu_that_cannot_be_read_is_granted_once_it_can(make_node: Callable[..., Any]) -> None:
    node = await make_node([24 * GIB, 24 * GIB])
    node.probe.unreadable = {1: "nvmlDeviceGetHandleByIndex on GPU 1: GPU is lost (NVML error 15)"}
    await node.sample()
    waiting = asyncio.create_task(node.ask(gpu_memory="1GiB", gpu=1, wait="60s"))
    await settle()
    assert not waiting.done()

    node.probe.unreadable = {}
    await node.sample()

    lease, _ = await asyncio.wait_for(waiting, 5)
    assert lease["gpus"][0]["index"] == 1


async def test_a_request_kept_out_only_by_a_card_that_cannot_be_read_holds_back_no_other_card(make_node: Callable[..., Any]) -> None:
    node = await make_node([24 * GIB, 24 * GIB])
    node.probe.unreadable = {1: "nvmlDeviceGetHandleByIndex on GPU 1: GPU is lost (NVML error 15)"}
    await node.sample()
    both = asyncio.create_task(node.ask(gpu_memory="4GiB", gpus=2, wait="1h", priority="production"))
    await settle()
    assert not both.done()

    small, token = await node.ask(gpu_memory="4GiB")  # behind it, of a lower class: GPU 0 is not held back for it
    assert small["gpus"][0]["index"] == 0
    await node.broker.release(small["id"], TCP, token)  # the release's scan holds nothing back for it either
    assert (await node.ask(gpu_memory="4GiB"))[0]["gpus"][0]["index"] == 0

    node.probe.unreadable = {}
    await node.sample()  # the card is back: the request is granted, and claims as any waiter again meanwhile
    lease, _ = await asyncio.wait_for(both, 5)
    assert sorted(g["index"] for g in lease["gpus"]) == [0, 1]


async def test_a_gpu_whose_uuid_cannot_be_read_is_named_by_its_index_and_its_leases_said_missing(
    make_node: Callable[..., Any],
) -> None:
    node = await make_node([24 * GIB, 24 * GIB])
    on_1, _ = await node.ask(gpu_memory="8GiB", gpu=1)
    node.probe.sizes, node.probe.uuids = [24 * GIB], ["GPU-fake-0"]  # the lost card's UUID is not read: it is not listed by it
    lost = "nvmlDeviceGetHandleByIndex on GPU 1: GPU is lost (NVML error 15)"
    broker = node.broker
    broker.apply_sample(node.probe.sample(), None, unreadable=[UnreadableGpu(1, None, lost)])

    assert broker.node_json()["unreadable_gpus"] == [{"index": 1, "uuid": None, "error": lost, "leases": []}]
    error = await node.refused(gpu_memory="1GiB", gpu=1)
    assert (error.code, error.message) == (
        FailureCode.DRIVER_ERROR,
        f"GPU 1 (UUID unknown) cannot be read: {lost}; it is not offered until it can be read again",
    )
    [unreadable] = await node.events("gpu.unreadable")
    assert "gpu" not in unreadable
    assert unreadable["message"] == f"GPU 1 (UUID unknown) cannot be read: {lost}; it is not offered until it can be read again"
    [missing] = await node.events("gpu.missing")
    assert missing["message"].startswith(
        f"GPU-fake-1 is not among the GPUs read (GPU 1 (UUID unknown) cannot be read: {lost}); leases {on_1['id']}"
    )


async def test_a_request_with_a_deadline_for_a_gpu_that_cannot_be_read_waits_for_it(make_node: Callable[..., Any]) -> None:
    """A card the driver cannot read now may be read again before the deadline: nothing holds its room past it."""
    node = await make_node([24 * GIB, 24 * GIB])
    node.probe.unreadable = {1: "nvmlDeviceGetMemoryInfo on GPU 1: GPU is lost (NVML error 15)"}
    await node.sample()
    waiting = asyncio.create_task(node.ask(gpu_memory="1GiB", gpu=1, deadline=rfc3339(node.clock.now() + 60)))
    await settle()
    assert not waiting.done(), waiting.exception()

    node.probe.unreadable = {}
    await node.sample()

    lease, _ = await asyncio.wait_for(waiting, 5)
    assert lease["gpus"][0]["index"] == 1


async def test_a_request_with_a_deadline_on_a_stale_reading_waits_for_a_fresh_one(make_node: Callable[..., Any]) -> None:
    node = await make_node()
    node.clock.advance(node.config.staleness + 1)  # the probe has not answered since
    waiting = asyncio.create_task(node.ask(gpu_memory="1GiB", deadline=rfc3339(node.clock.now() + 60)))
    await settle()
    assert not waiting.done(), waiting.exception()

    await node.sample()

    lease, _ = await asyncio.wait_for(waiting, 5)
    assert lease["state"] == "granted"


async def test_a_request_pinned_by_uuid_to_a_gpu_whose_uuid_cannot_be_read_waits_for_it(make_node: Callable[..., Any]) -> None:
    """Not even the lost card's handle could be had, so nothing says it is not the GPU asked for by UUID: the
    request is refused as a fault of the driver, and waits, not told there is no such GPU."""
    node = await make_node([24 * GIB, 24 * GIB])
    lost = "nvmlDeviceGetHandleByIndex on GPU 1: GPU is lost (NVML error 15)"
    node.probe.sizes, node.probe.uuids = [24 * GIB], ["GPU-fake-0"]
    node.broker.apply_sample(node.probe.sample(), None, unreadable=[UnreadableGpu(1, None, lost)])

    error = await node.refused(gpu_memory="1GiB", gpu="GPU-fake-1")
    assert (error.code, error.message) == (
        FailureCode.DRIVER_ERROR,
        f"GPU 1 (UUID unknown) cannot be read: {lost}; it is not offered until it can be read again",
    )
    waiting = asyncio.create_task(node.ask(gpu_memory="1GiB", gpu="GPU-fake-1", wait="60s"))
    await settle()
    assert not waiting.done(), waiting.exception()

    node.probe.sizes, node.probe.uuids = [24 * GIB, 24 * GIB], None
    await node.sample()

    lease, _ = await asyncio.wait_for(waiting, 5)
    assert lease["gpus"][0]["uuid"] == "GPU-fake-1"


async def test_a_production_request_on_a_node_not_eligible_is_capability_unavailable(make_node: Callable[..., Any]) -> None:
    node = await make_node(production_eligible=False)
    error = await node.refused(gpu_memory="1GiB", priority="production")
    assert error.code is FailureCode.CAPABILITY_UNAVAILABLE
    assert "not production_eligible" in error.message


async def test_a_stamped_caller_gets_the_stamped_class_whatever_it_asked(make_node: Callable[..., Any]) -> None:
    node = await make_node(stamps=(Stamp("background", holder="tdarr*"),))
    lease, _ = await node.ask(gpu_memory="1GiB", priority="production", holder={"name": "tdarr-node"})
    assert lease["priority"] == "background"
    other, _ = await node.ask(gpu_memory="1GiB", priority="production", holder={"name": "comfyui"})
    assert other["priority"] == "production"


async def test_a_process_group_is_registered_only_by_a_uid_the_kernel_named_that_owns_it(make_node: Callable[..., Any]) -> None:
    """A lease's groups are signalled when it ends: its token alone must not let anyone have others' processes killed."""
    node = await make_node()
    lease, token = await node.ask(gpu_memory="1GiB")  # over TCP: nobody named its holder's uid
    work = subprocess.Popen(["sleep", "30"], process_group=0)  # a group of this test's own uid
    try:
        someone_else = Caller("unix", uid=os.getuid() + 1, pid=None)
        for caller, pgid, says in [
            (someone_else, work.pid, f"uid {os.getuid() + 1} may register only its own"),
            (TCP, work.pid, "only on the Unix socket"),
            (ME, os.getpgrp(), "the broker's own"),
        ]:
            with pytest.raises(Forbidden, match=says):
                await node.broker.register_group(lease["id"], caller, token, pgid)
        assert node.broker.leases[lease["id"]].pgids == []
        owner = Caller("unix", uid=os.getuid(), pid=None)
        assert (await node.broker.register_group(lease["id"], owner, token, work.pid)).pgids == [work.pid]
    finally:
        work.kill()
        work.wait()


def test_a_group_is_signalled_only_while_it_is_all_the_uid_s_that_owned_it_when_registered() -> None:
    """A group id is reused once its group is gone: a group of anyone but its registered owner is left alone."""
    work = subprocess.Popen(["sleep", "30"], process_group=0)
    try:
        assert holders.signalable_groups([work.pid], [os.getuid()], []) == [work.pid]
        assert holders.signalable_groups([work.pid], [os.getuid() + 1], []) == []
        assert holders.signalable_groups([os.getpgrp()], [os.getuid()], []) == []  # never the broker's own
    finally:
        work.kill()
        work.wait()
    assert holders.signalable_groups([work.pid], [os.getuid()], []) == []  # gone


def test_a_group_with_the_id_of_one_that_ended_is_not_signalled_and_one_whose_leader_alone_exited_is() -> None:
    """A group's id is its leader's pid, reused once the whole group is gone: a later group with it, even of the same
    uid, is left alone. A group whose leader exited while others of it live on is still the group registered."""
    work = subprocess.Popen(["sleep", "30"], process_group=0)
    shell = subprocess.Popen(["sh", "-c", "sleep 30 & read line"], process_group=0, stdin=subprocess.PIPE)
    try:
        registered = holders.group_started(work.pid)
        assert registered == holders.start_time(work.pid)
        assert holders.signalable_groups([work.pid], [os.getuid()], [registered]) == [work.pid]
        # No test can have the kernel reuse a pid: this live group stands in for a later one, the registered group's
        # leader having started 5 s before its own did.
        assert holders.signalable_groups([work.pid], [os.getuid()], [registered - 5]) == []
        assert holders.signalable_groups([work.pid], [os.getuid()], [None]) == [work.pid]  # an earlier version's: by id
        led = holders.group_started(shell.pid)
        assert shell.stdin is not None
        shell.stdin.close()
        shell.wait()  # its leader gone, the sleep it left in the background keeps the group and its id
        assert holders.start_time(shell.pid) is None
        assert holders.signalable_groups([shell.pid], [os.getuid()], [led]) == [shell.pid]
        assert holders.signalable_groups([shell.pid], [os.getuid()], [holders.group_started(shell.pid)]) == [shell.pid]
    finally:
        work.kill()
        work.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(shell.pid, signal.SIGKILL)
        shell.wait()


async def test_a_group_with_the_id_of_a_registered_one_is_neither_the_lease_s_memory_nor_stopped_when_it_ends(
    make_node: Callable[..., Any],
) -> None:
    """Once a registered group is gone, its id may be a later, unrelated group's: that group's GPU memory was the
    lease's, not external, and the lease's end signalled it."""
    node = await make_node()
    lease, token = await node.ask(gpu_memory="2GiB")  # over TCP: its holder is no process, these are no descendants of it
    owner = Caller("unix", uid=os.getuid(), pid=None)
    leader = subprocess.Popen(["sleep", "30"], process_group=0)
    member = subprocess.Popen(["sleep", "30"], process_group=leader.pid)  # of the group, not below its leader
    try:
        await node.broker.register_group(lease["id"], owner, token, leader.pid)
        name, pgid, ancestors, started, led = describe_process(member.pid)
        assert (pgid, led) == (leader.pid, holders.start_time(leader.pid))
        node.probe.processes[0] = [GpuProcess(member.pid, name, GIB, pgid, ancestors, started, led)]
        await node.sample()
        assert [p["lease"] for p in node.gpu()["processes"]] == [lease["id"]]
        # No test can have the kernel reuse a pid: this live group stands in for a later one, the group registered
        # having been led by a process that started 5 s before this one's leader did.
        node.broker.leases[lease["id"]].pgid_started[0] -= 5
        await node.sample()
        gpu = node.gpu()
        assert ([p["lease"] for p in gpu["processes"]], gpu["figures"]["external"]) == ([None], GIB)
        await node.broker.release(lease["id"], owner, token)
        await settle()
        assert (leader.poll(), member.poll()) == (None, None)
        assert await node.events("lease.work_stopped") == []
    finally:
        for process in (leader, member):
            process.kill()
            process.wait()


async def test_groups_a_store_holds_are_kept_at_start_only_if_still_as_they_were_registered(make_node: Callable[..., Any]) -> None:
    node = await make_node()
    earlier, _ = await node.ask(cpu_cores=1)
    mine, my_token = await node.ask(Caller("unix", uid=os.getuid(), pid=os.getpid()), cpu_cores=1)
    groups = [subprocess.Popen(["sleep", "30"], process_group=0) for _ in range(3)]
    try:
        old = node.broker.leases[earlier["id"]]  # as an earlier broker kept it: a group and no owner
        old.pgids.append(groups[0].pid)
        await node.broker.store.commit([Write("leases", old.id.encode(), old.to_record())])
        for group in groups[1:]:
            await node.broker.register_group(mine["id"], ME, my_token, group.pid)
        groups[2].kill()
        groups[2].wait()  # gone: its id may be anyone's next
        await node.restart()
        assert node.broker.leases[earlier["id"]].pgids == []
        assert (node.broker.leases[mine["id"]].pgids, node.broker.leases[mine["id"]].pgid_uids) == ([groups[1].pid], [os.getuid()])
        dropped = await node.events("lease.groups_dropped")
        assert sorted((e["lease"], e["details"]["pgids"]) for e in dropped) == sorted(
            [(earlier["id"], [groups[0].pid]), (mine["id"], [groups[2].pid])]
        )
        await node.restart()
        assert node.broker.leases[mine["id"]].pgids == [groups[1].pid]  # what was dropped stays dropped
    finally:
        for group in groups:
            group.kill()
            group.wait()


async def test_memory_still_used_after_release_is_reported_and_counts_as_external(
    make_node: Callable[..., Any], live_pid: Callable[[], int]
) -> None:
    node = await make_node()
    pid = live_pid()  # the holder
    lease, token = await node.ask(gpu_memory="8GiB", holder={"name": "trainer", "pid": pid})
    node.probe.processes[0] = [GpuProcess(pid, "python", 8 * GIB)]
    await node.sample()
    assert node.gpu()["processes"][0]["lease"] == lease["id"]
    assert node.gpu()["figures"]["external"] == 0
    await node.broker.release(lease["id"], TCP, token)
    node.clock.advance(5)
    await node.sample()
    assert await node.events("gpu.memory_not_reclaimed") == []
    node.clock.advance(6)
    await node.sample()
    await settle()
    reported = await node.events("gpu.memory_not_reclaimed")
    assert len(reported) == 1
    assert reported[0]["code"] == "GPU_MEMORY_NOT_RECLAIMED"
    assert reported[0]["lease"] == lease["id"]
    assert node.gpu()["figures"]["external"] == 8 * GIB


async def test_a_step_of_the_wall_clock_neither_reports_memory_as_not_reclaimed_early_nor_holds_the_report_back(
    make_node: Callable[..., Any], live_pid: Callable[[], int]
) -> None:
    """`reclaim_grace` is elapsed time: NTP stepping the clock an hour forward just after a release reported its work's
    memory as "still in use 3600s after release" at once; an hour back kept the report back for an hour."""
    node = await make_node()
    pid = live_pid()  # the holder

    async def reported() -> list[tuple[str, str]]:
        await settle()
        return [(e["lease"], e["message"].split(" is ", 1)[1]) for e in await node.events("gpu.memory_not_reclaimed")]

    for step in (3600, -7200):  # an hour forward, then two back
        lease, token = await node.ask(gpu_memory="8GiB", holder={"name": "trainer", "pid": pid})
        node.probe.processes[0] = [GpuProcess(pid, "python", 8 * GIB)]
        await node.sample()
        await node.broker.release(lease["id"], TCP, token)
        before = await reported()
        node.clock.step(step)
        node.clock.advance(1)
        await node.sample()
        assert await reported() == before, step
        node.clock.advance(10)
        await node.sample()
        assert await reported() == [*before, (lease["id"], "still in use 11s after release; it counts as external until it is gone")]
        node.probe.processes[0] = []  # its memory is freed at last
        await node.sample()


async def test_a_worker_keeping_its_memory_from_lease_to_lease_leaves_one_reclaim_not_one_per_lease(
    make_node: Callable[..., Any], live_pid: Callable[[], int]
) -> None:
    """A worker that leases, releases and leases again for each job, its memory kept loaded throughout, must not
    grow the broker's reclaims (and their reports) by one per job for as long as it runs."""
    node = await make_node()
    pid = live_pid()  # the holder
    node.probe.processes[0] = [GpuProcess(pid, "worker", 8 * GIB)]
    for _ in range(20):
        lease, token = await node.ask(gpu_memory="8GiB", holder={"name": "worker", "pid": pid})
        await node.sample()
        await node.broker.release(lease["id"], TCP, token)  # released faster than it is sampled, too
        lease, token = await node.ask(gpu_memory="8GiB", holder={"name": "worker", "pid": pid})
        await node.broker.release(lease["id"], TCP, token)
        node.clock.advance(1)
        await node.sample()
    assert len(node.broker._reclaims) == 1
    node.clock.advance(20)
    await node.sample()
    await settle()
    [reported] = await node.events("gpu.memory_not_reclaimed")
    assert reported["lease"] == lease["id"]  # the last lease's, the one whose memory is still in use
    again, _ = await node.ask(gpu_memory="8GiB", holder={"name": "worker", "pid": pid})
    await node.sample()  # its memory is a live lease's again: nothing is left over
    assert node.broker._reclaims == []
    assert node.gpu()["processes"][0]["lease"] == again["id"]


async def test_a_process_that_reuses_a_lease_holders_pid_is_not_taken_for_its_work(make_node: Callable[..., Any]) -> None:
    """A pid is reused once its process is gone. A lease by `holder.pid` over TCP lives by its TTL after its holder
    exits, and a later process with that pid (and its children) was counted as the lease's work, not as external;
    after a release, one was reported as the lease's memory not reclaimed."""
    node = await make_node()
    holder = subprocess.Popen(["sleep", "60"])
    try:
        started = holders.start_time(holder.pid)
        assert started is not None
        lease, token = await node.ask(gpu_memory="4GiB", holder={"name": "trainer", "pid": holder.pid})
        mine = GpuProcess(holder.pid, "python", 3 * GIB, started=(started,))
        node.probe.processes[0] = [mine]
        await node.sample()
        assert node.gpu()["processes"][0]["lease"] == lease["id"]
        later = started + 100  # the holder has exited, and another process has its pid
        node.probe.processes[0] = [
            GpuProcess(holder.pid, "ffmpeg", 2 * GIB, started=(later,)),
            GpuProcess(holder.pid + 1, "ffmpeg-worker", GIB, ancestors=(holder.pid, 1), started=(later + 1, later, 0.0)),
        ]
        await node.sample()
        gpu = node.gpu()
        assert [p["lease"] for p in gpu["processes"]] == [None, None]
        assert (gpu["figures"]["external"], gpu["figures"]["leased"]) == (3 * GIB, 4 * GIB)
        node.probe.processes[0] = [mine]
        await node.sample()
        await node.broker.release(lease["id"], TCP, token)
        node.probe.processes[0] = [GpuProcess(holder.pid, "ffmpeg", 2 * GIB, started=(later,))]  # its memory freed, the pid reused
        node.clock.advance(11)
        await node.sample()
        await settle()
        assert await node.events("gpu.memory_not_reclaimed") == []
        assert node.broker._reclaims == []
    finally:
        holder.kill()
        holder.wait()


async def test_a_holder_using_more_than_declared_is_reported_and_counted_at_its_use(
    make_node: Callable[..., Any], live_pid: Callable[[], int]
) -> None:
    node = await make_node()
    pid = live_pid()  # the holder
    lease, _ = await node.ask(gpu_memory="10GiB", holder={"name": "greedy", "pid": pid})
    node.probe.processes[0] = [GpuProcess(pid, "python", 12 * GIB)]
    await node.sample()
    await settle()
    assert node.gpu()["figures"]["leased"] == 12 * GIB
    assert node.gpu()["figures"]["external"] == 0
    over = await node.events("lease.over_declared")
    assert len(over) == 1
    assert over[0]["details"] == {"declared": 10 * GIB, "observed": 12 * GIB}


async def test_a_lease_using_more_than_declared_on_its_second_gpu_too_is_reported_there_too(
    make_node: Callable[..., Any], live_pid: Callable[[], int]
) -> None:
    """Over its declaration on each of two GPUs, one after the other: each GPU is reported, not only the first."""
    node = await make_node([24 * GIB, 24 * GIB])
    pid = live_pid()  # the holder
    await node.ask(gpu_memory="4GiB", gpus=2, holder={"name": "greedy", "pid": pid})
    node.probe.processes = {0: [GpuProcess(pid, "python", 6 * GIB)], 1: [GpuProcess(pid, "python", 2 * GIB)]}
    await node.sample()
    node.probe.processes[1] = [GpuProcess(pid, "python", 7 * GIB)]
    await node.sample()
    await settle()
    over = await node.events("lease.over_declared")
    assert [(e["gpu"], e["details"]["observed"]) for e in over] == [("GPU-fake-0", 6 * GIB), ("GPU-fake-1", 7 * GIB)]


async def test_a_lease_taken_inside_another_leases_work_owns_its_own_processes_memory(
    make_node: Callable[..., Any], live_pid: Callable[[], int]
) -> None:
    """Nested leases (`gpubroker lease -- CMD` inside another's CMD): each process is its nearest lease's, never the
    outer lease's too. The outer lease used to take every process below its holder: 8 GiB used within the 8 declared
    was 12 leased, 4 GiB counted twice, and the outer lease said over-declared."""
    node = await make_node()
    outer_pid, inner_pid = live_pid(), live_pid()  # the CLIs holding the leases
    outer, _ = await node.ask(gpu_memory="4GiB", holder={"name": "outer", "pid": outer_pid})
    inner, _ = await node.ask(gpu_memory="4GiB", holder={"name": "inner", "pid": inner_pid})
    # outer's CLI runs the shell 101 (its CMD, group 101), which runs 104 in the background and the inner CLI, whose
    # CMD 103 has a group of its own; 105 is a child of 103 that left for a group of its own.
    node.broker.leases[outer["id"]].pgids.append(101)
    node.broker.leases[inner["id"]].pgids.append(103)
    node.probe.processes[0] = [
        GpuProcess(104, "outer-work", 2 * GIB, pgid=101, ancestors=(101, outer_pid, 1)),
        GpuProcess(103, "inner-work", 3 * GIB, pgid=103, ancestors=(inner_pid, 101, outer_pid, 1)),
        GpuProcess(105, "inner-child", GIB, pgid=105, ancestors=(103, inner_pid, 101, outer_pid, 1)),
    ]
    await node.sample()
    await settle()
    gpu = node.gpu()
    assert {p["pid"]: p["lease"] for p in gpu["processes"]} == {104: outer["id"], 103: inner["id"], 105: inner["id"]}
    assert [(lease["id"], lease["used"]) for lease in gpu["leases"]] == [(outer["id"], 2 * GIB), (inner["id"], 4 * GIB)]
    assert (gpu["figures"]["external"], gpu["figures"]["leased"]) == (0, 8 * GIB)
    assert await node.events("lease.over_declared") == []
    # The shell exec'd the inner CLI: it is both the outer CMD's group leader and the inner lease's holder. Work it
    # ran in the background before is in the outer group; the inner CMD is in its own.
    node.broker.leases[outer["id"]].pgids[:] = [inner_pid]
    node.probe.processes[0] = [
        GpuProcess(104, "outer-work", 4 * GIB, pgid=inner_pid, ancestors=(inner_pid, outer_pid, 1)),
        GpuProcess(103, "inner-work", 4 * GIB, pgid=103, ancestors=(inner_pid, outer_pid, 1)),
    ]
    await node.sample()
    await settle()
    gpu = node.gpu()
    assert {p["pid"]: p["lease"] for p in gpu["processes"]} == {104: outer["id"], 103: inner["id"]}
    assert (gpu["figures"]["external"], gpu["figures"]["leased"]) == (0, 8 * GIB)
    assert await node.events("lease.over_declared") == []


async def test_a_lease_using_more_than_it_declared_is_not_external_pressure(
    make_node: Callable[..., Any], live_pid: Callable[[], int]
) -> None:
    """EXTERNAL_GPU_PRESSURE is external usage growing into leased or reserved memory (SPEC §3.6): a lease's own
    processes overusing its room leave no room, and the refusal names that lease, not outside usage."""
    node = await make_node([12 * GIB])
    pid = live_pid()  # the holder
    lease, _ = await node.ask(gpu_memory="2GiB", holder={"name": "hog", "pid": pid})
    node.probe.processes[0] = [GpuProcess(pid, "hog", 23 * GIB // 2)]
    await node.sample()
    gpu = node.gpu()
    assert (gpu["figures"]["external"], gpu["figures"]["leased"], gpu["figures"]["schedulable"]) == (0, 23 * GIB // 2, 0)
    assert gpu["pressure"] is False
    assert gpu["leases"] == [{"id": lease["id"], "holder": "hog", "bytes": 2 * GIB, "used": 23 * GIB // 2}]
    assert await node.events("gpu.pressure.started") == []
    error = await node.refused(gpu_memory="256MiB")
    assert error.code is FailureCode.INSUFFICIENT_SCHEDULABLE_VRAM
    assert "11.5 leased" in error.message
    assert error.details["leases"] == gpu["leases"]  # what each lease declared and what its processes use
    node.probe.external(0, GIB)  # 1 GiB outside fits beside the 2 GiB declared and the 1 GiB reserve: still no pressure
    await node.sample()
    assert node.gpu()["pressure"] is False


async def test_a_gpu_smaller_than_the_reserve_is_not_pressed_and_says_it_can_lease_nothing(make_node: Callable[..., Any]) -> None:
    node = await make_node([GIB // 2])
    assert node.gpu()["pressure"] is False
    assert await node.events("gpu.pressure.started") == []
    for body in ({"gpu_memory": "100MiB"}, {"exclusive": True}):
        error = await node.refused(**body)
        assert error.code is FailureCode.CAPABILITY_UNAVAILABLE
        assert "can lease nothing (its total less the 1.0 GiB reserve)" in error.message
    assert "the whole GPU asked for" in (await node.refused(exclusive=True)).message
    node.probe.external(0, GIB // 4)  # external usage inside reserved memory: that is pressure
    await node.sample()
    assert node.gpu()["pressure"] is True


async def test_a_process_list_the_driver_cannot_give_leaves_memory_unattributed(make_node: Callable[..., Any]) -> None:
    node = await make_node()
    node.probe.external(0, 3 * GIB)
    node.probe.processes_listed = False
    await node.sample()
    gpu = node.gpu()
    assert gpu["figures"]["external"] == 3 * GIB
    assert gpu["unattributed"] == 3 * GIB
    assert gpu["processes"] == []


async def test_a_leases_process_whose_size_the_driver_does_not_give_is_not_external_too(
    make_node: Callable[..., Any], live_pid: Callable[[], int]
) -> None:
    """Where NVML lists a process but not its memory (some containers, WDDM), a lease's process's memory was external
    (unattributed) besides the lease's declared bytes: counted twice, on an 8 GiB card it was external pressure with
    nothing on it but the lease's own work using what it declared. The lease is taken to use up to what it declared
    of what no size accounts for; what is left over cannot be said to be unexplained, so it is not measured."""
    node = await make_node([8 * GIB])
    pid = live_pid()  # the holder
    lease, _ = await node.ask(gpu_memory="4GiB", holder={"name": "trainer", "pid": pid})
    node.probe.processes[0] = [GpuProcess(pid, "python", None)]
    node.probe.unlisted[0] = 4 * GIB
    await node.sample()
    await settle()
    gpu = node.gpu()
    assert gpu["processes"] == [{"pid": pid, "name": "python", "bytes": None, "lease": lease["id"]}]
    assert (gpu["figures"]["external"], gpu["figures"]["leased"], gpu["figures"]["schedulable"]) == (0, 4 * GIB, 3 * GIB)
    assert gpu["unattributed"] is None
    assert gpu["pressure"] is False
    assert await node.events("gpu.pressure.started") == []
    node.probe.unlisted[0] = 5 * GIB + GIB // 2  # more than it declared: what it uses past that is not known to be its
    node.probe.external(0, GIB // 2, name="Xorg", pid=900002)
    await node.sample()
    gpu = node.gpu()
    assert (gpu["figures"]["external"], gpu["figures"]["leased"], gpu["figures"]["schedulable"]) == (2 * GIB, 4 * GIB, GIB)
    assert gpu["unattributed"] is None


async def test_a_lease_bound_to_its_caller_ends_when_the_caller_dies(make_node: Callable[..., Any]) -> None:
    node = await make_node()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        caller = Caller("unix", uid=os.getuid(), pid=child.pid)
        lease, _ = await node.ask(caller, gpu_memory="2GiB", bind="caller")
        assert lease["bind"] == "caller"
        assert lease["holder"]["pid"] == child.pid
        child.kill()
        child.wait()
        for _ in range(200):
            if node.broker.get(lease["id"])["state"] != "granted":
                break
            await asyncio.sleep(0.005)
        ended = node.broker.get(lease["id"])
        assert ended["state"] == "released"
        assert ended["reason"] == f"holder pid {child.pid} exited"
    finally:
        child.kill()
        child.wait()


async def test_a_holder_that_died_while_the_broker_was_down_is_released_on_start(make_node: Callable[..., Any]) -> None:
    node = await make_node()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    caller = Caller("unix", uid=os.getuid(), pid=child.pid)
    lease, _ = await node.ask(caller, gpu_memory="2GiB", bind="caller")
    await node.broker.close()
    child.kill()
    child.wait()
    await node.start()
    ended = node.broker.get(lease["id"])
    assert ended["state"] == "released"
    assert "exited while the broker was down" in ended["reason"]


async def test_a_step_of_the_wall_clock_between_two_runs_leaves_a_living_holder_its_lease_and_its_groups(
    make_node: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Start times are the kernel's ticks since boot plus the boot time read at the broker's start, which NTP setting the
    clock moves: a broker started again after such a step took every caller-bound holder for gone, released its lease
    and stopped its work, and would take every registered group for a later one with its id."""
    node = await make_node()
    lease, token = await node.ask(ME, gpu_memory="2GiB", bind="caller")
    work = subprocess.Popen(["sleep", "30"], process_group=0)
    try:
        await node.broker.register_group(lease["id"], ME, token, work.pid)
        held = node.broker.leases[lease["id"]].holder.start_time
        (led,) = node.broker.leases[lease["id"]].pgid_started
        assert held is not None
        assert led is not None
        await node.broker.close()
        booted = holders._BOOTED
        monkeypatch.setattr(holders, "_BOOTED", booted + 3600)  # the clock was set an hour on between the two runs
        await node.start()
        assert node.broker.get(lease["id"])["state"] == "granted"
        assert node.broker.leases[lease["id"]].holder.start_time == held + 3600
        assert (node.broker.leases[lease["id"]].pgids, node.broker.leases[lease["id"]].pgid_started) == ([work.pid], [led + 3600])
        await node.broker.close()
        monkeypatch.setattr(holders, "_BOOTED", booted)  # and back: the moved time was kept, with the clock it is on
        await node.start()
        assert node.broker.get(lease["id"])["state"] == "granted"
        assert node.broker.leases[lease["id"]].holder.start_time == held
        assert (node.broker.leases[lease["id"]].pgids, node.broker.leases[lease["id"]].pgid_started) == ([work.pid], [led])
    finally:
        work.kill()
        work.wait()


async def test_a_lease_keeps_its_time_left_across_a_restart_whatever_steps_of_the_wall_clock_came_before_or_after_its_grant(
    make_node: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Expiries are wall-clock times on disk: a restart after NTP set the clock an hour on expired every lease not
    renewed since and stopped its work; and a lease granted after a step during the run must not be moved by it again."""
    node = await make_node()
    before, _ = await node.ask(ME, gpu_memory="1GiB", bind="caller", ttl="10m")
    node.clock.step(3600)  # NTP sets the clock an hour on while the broker runs,
    after, _ = await node.ask(ME, gpu_memory="1GiB", bind="caller", ttl="10m")  # and a lease is granted after it
    await node.broker.close()
    node.clock.advance(60)  # a minute down,
    node.clock.step(1800)  # and the clock set on again: the new process reads the boot time moved by both steps
    monkeypatch.setattr(holders, "_BOOTED", holders._BOOTED + 5400)
    await node.start()
    for lease in (before, after):
        assert node.broker.get(lease["id"])["state"] == "granted", lease["id"]  # 9 of their 10 minutes are left
    node.clock.advance(9 * 60 - 1)
    node.broker.sweep()
    assert [node.broker.get(lease["id"])["state"] for lease in (before, after)] == ["granted", "granted"]
    node.clock.advance(2)
    node.broker.sweep()
    assert [node.broker.get(lease["id"])["state"] for lease in (before, after)] == ["expired", "expired"]


async def test_after_a_reboot_no_holder_is_taken_for_alive_and_no_group_is_signalled(
    make_node: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a reboot the pids and process groups a lease names may be anyone's: a group with a registered id, owned by
    the same user, was kept and stopped with the lease."""
    node = await make_node()
    work = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        lease, token = await node.ask(ME, gpu_memory="2GiB", bind="caller")
        await node.broker.register_group(lease["id"], ME, token, work.pid)
        await node.broker.close()
        boot_id, booted = holders.boot_clock()
        monkeypatch.setattr(holders, "boot_clock", lambda: ("another-boot", booted))  # this process and its group stand in for new ones
        await node.start()
        ended = node.broker.get(lease["id"])
        assert ended["state"] == "released"
        assert ended["reason"].startswith(f"holder pid {os.getpid()} is gone: the machine restarted since")
        assert [e["details"]["pgids"] for e in await node.events("lease.groups_dropped")] == [[work.pid]]
        await settle()
        assert work.poll() is None  # not signalled: it is not the lease's work
    finally:
        work.kill()
        work.wait()


async def test_a_full_store_fails_requests_clearly_and_stays_readable(make_node: Callable[..., Any]) -> None:
    node = await make_node(store_size=256 * 2**10, events_kept=50, leases_kept=10)
    labels = {f"k{i}": "x" * 200 for i in range(30)}
    granted = []
    full: StoreFull | None = None
    for _ in range(200):
        try:
            lease, _ = await node.ask(cpu_cores=0, memory="1MiB", labels=labels)
        except StoreFull as error:
            full = error
            break
        granted.append(lease["id"])
    assert full is not None, "200 grants of 6 KiB each fitted in a 256 KiB store"
    assert full.status == 507
    assert "store is full" in full.message
    assert len(node.broker.leases) == len(granted)  # the refused grant left nothing behind
    await node.restart()
    assert sorted(node.broker.leases) == sorted(granted)


async def test_a_release_whose_caller_goes_away_mid_commit_still_frees_the_room(make_node: Callable[..., Any]) -> None:
    node = await make_node()
    lease, token = await node.ask(gpu_memory="20GiB")
    release = asyncio.create_task(node.broker.release(lease["id"], TCP, token))
    await asyncio.sleep(0)  # handed to the writer
    release.cancel()
    await asyncio.gather(release, return_exceptions=True)
    await settle()
    assert node.broker.get(lease["id"])["state"] == "released"
    assert lease["id"] not in node.broker.leases
    assert node.gpu()["figures"]["leased"] == 0
    again, _ = await node.ask(gpu_memory="20GiB")
    assert again["state"] == "granted"


async def test_a_broker_closing_finishes_a_release_whose_caller_went_away_and_stops_its_groups(make_node: Callable[..., Any]) -> None:
    node = await make_node(kill_grace=0.5)
    lease, token = await node.ask(Caller("unix", uid=os.getuid(), pid=os.getpid()), cpu_cores=1)
    work = subprocess.Popen(["sleep", "30"], process_group=0)
    try:
        await node.broker.register_group(lease["id"], ME, token, work.pid)
        release = asyncio.create_task(node.broker.release(lease["id"], ME, token))
        await asyncio.sleep(0)  # handed to the writer
        release.cancel()
        await asyncio.gather(release, return_exceptions=True)
        await node.broker.close()  # at once: the release lands while the broker closes
        assert lease["id"] not in node.broker.leases
        assert work.wait(timeout=5) == -15  # its group was stopped before the broker was done
    finally:
        work.kill()
        work.wait()


async def test_a_broker_killed_while_it_stopped_a_leases_groups_stops_them_when_it_starts_again(
    make_node: Callable[..., Any],
) -> None:
    """Between SIGTERM and SIGKILL the stop lives in the broker's memory: a broker killed then must finish it at its
    next start, or work that ignores SIGTERM goes on without its lease."""
    node = await make_node(kill_grace=30.0)
    lease, token = await node.ask(Caller("unix", uid=os.getuid(), pid=os.getpid()), cpu_cores=1)
    work = subprocess.Popen(["sh", "-c", 'trap "" TERM; sleep 30'], process_group=0)
    try:
        await node.broker.register_group(lease["id"], ME, token, work.pid)
        await node.broker.release(lease["id"], ME, token)  # SIGTERM, ignored; SIGKILL due 30 s later
        for task in list(node.broker._tasks):  # kill -9 of the broker: what was in its memory is gone
            task.cancel()
        await asyncio.gather(*node.broker._tasks, return_exceptions=True)
        node.broker.store.stop()
        if node.broker._watch is not None:
            node.broker._watch.close()
        assert work.poll() is None
        node.config = replace(node.config, kill_grace=0.5)
        node.clock.advance(5)
        await node.start()
        assert await asyncio.to_thread(work.wait, 10) == -signal.SIGKILL
    finally:
        if work.poll() is None:
            work.kill()
        work.wait()


async def test_refusals_are_kept_as_events_at_a_bounded_rate_and_the_rest_counted(make_node: Callable[..., Any]) -> None:
    node = await make_node()
    for _ in range(150):  # more cores than the node has: each a refusal, all at one moment
        await node.refused(cpu_cores=512)
    assert len(await node.events("lease.refused")) == 100
    node.clock.advance(1)
    await node.refused(cpu_cores=512)
    kept = await node.events("lease.refused")
    assert (len(kept), kept[-1]["details"]["not_kept_before"]) == (101, 50)


async def test_a_broker_whose_store_is_full_still_starts_and_serves_what_it_holds(make_node: Callable[..., Any]) -> None:
    node = await make_node(store_size=256 * 2**10, events_kept=100_000)
    lease, token = await node.ask(cpu_cores=1)
    with contextlib.suppress(StoreFull):
        for i in range(100_000):  # small events until not even one more fits
            await node.broker.store.commit([node.broker._event("test.filler", f"filler {i}")])
    await node.restart()  # room is kept beyond its file for all but new leases: its start is recorded
    assert node.broker.start_warning is None
    assert node.broker.get(lease["id"])["state"] == "granted"
    with pytest.raises(StoreFull):
        await node.ask(cpu_cores=1)
    assert (await node.broker.release(lease["id"], TCP, token)).state == "released"
    await node.restart()
    assert node.broker.get(lease["id"])["state"] == "released"


async def test_a_store_from_an_earlier_version_full_at_start_is_named_only_once_its_name_is_kept(
    make_node: Callable[..., Any],
) -> None:
    """Its start could not write the store's name, so each start made up another: a follower (`events --follow`) took
    the same store, started again, for another and printed every event again from the first."""
    node = await make_node(store_size=256 * 2**10, events_kept=100_000)
    await node.broker.store.commit([Write("meta", b"store_id", None)])  # as an earlier version left it: no name
    for batch in (100, 1):  # small events until not even one more fits
        with contextlib.suppress(StoreFull):
            while True:
                await node.broker.store.commit([node.broker._event("test.filler", "filler") for _ in range(batch)])
    names = [(await node.restart()).store_id for _ in range(2)]
    assert names[0]
    assert names[1] == names[0]  # named once, in the room a full store keeps for all but new leases
    node.config = replace(node.config, store_size=2 * 2**20)
    assert (await node.restart()).store_id == names[0]


async def test_a_release_the_full_store_refuses_leaves_the_lease_as_it_was(make_node: Callable[..., Any]) -> None:
    node = await make_node(store_size=256 * 2**10, events_kept=50, leases_kept=10)
    labels = {f"k{i}": "x" * 200 for i in range(30)}
    tokens = {}
    with contextlib.suppress(StoreFull):
        for _ in range(200):
            lease, token = await node.ask(cpu_cores=0, memory="1MiB", labels=labels)
            tokens[lease["id"]] = token
    refused = None
    for lease_id, token in tokens.items():  # each release writes the lease into the history: one will not fit
        try:
            await node.broker.release(lease_id, TCP, token)
        except StoreFull:
            refused = lease_id, token
            break
    assert refused is not None, "every release fitted in the full store"
    lease_id, token = refused
    assert node.broker.get(lease_id)["state"] == "granted"
    assert lease_id in [lease["id"] for lease in node.broker.list_leases("granted", 1000)]
    assert node.broker.host_budget().leased_memory == len(node.broker.leases) * 2**20  # its room is still held
    await node.restart()  # what the broker holds is what the disk holds
    assert node.broker.get(lease_id)["state"] == "granted"


async def test_a_waiting_request_cancelled_by_its_id_tells_its_requester_who_cancelled_it(make_node: Callable[..., Any]) -> None:
    node = await make_node()
    await node.ask(gpu_memory="20GiB")
    waiting = asyncio.create_task(node.ask(gpu_memory="15GiB", wait="1m"))
    await settle()
    (waiter,) = node.broker.waiters
    with pytest.raises(NotFound) as answer:
        await node.broker.release(waiter.id, Caller("unix", uid=0, pid=None), None)  # root
    assert answer.value.details["cancelled"] is True
    with pytest.raises(BrokerError) as told:
        await waiting
    assert told.value.code is FailureCode.LEASE_TIMEOUT
    assert told.value.details["cancelled"] is True
    assert "cancelled by user root (uid 0) before it could be granted" in told.value.message


async def test_a_waiting_request_whose_client_goes_away_is_cancelled(make_node: Callable[..., Any]) -> None:
    node = await make_node()
    await node.ask(gpu_memory="20GiB")
    task = asyncio.create_task(node.ask(gpu_memory="15GiB", wait="1m"))
    await settle()
    assert len(node.broker.waiters) == 1
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert node.broker.waiters == []
    await settle()
    assert len(await node.events("lease.cancelled")) == 1


async def test_deadline_times_are_read_as_rfc3339(make_node: Callable[..., Any]) -> None:
    node = await make_node()
    at = rfc3339(node.clock.now() + 3600)
    lease, _ = await node.ask(gpu_memory="1GiB", deadline=at)
    assert lease["state"] == "granted"
    assert parse_time(at) == pytest.approx(node.clock.now() + 3600, abs=0.001)


async def test_the_loop_keeps_granting_while_a_gpu_reading_is_stuck_in_the_driver(make_node: Callable[..., Any]) -> None:
    import threading

    node = await make_node()
    entered, release = threading.Event(), threading.Event()
    real_sample = node.probe.sample

    def stuck_sample() -> Any:
        entered.set()
        release.wait(10)  # a driver call that hangs: it must hang a thread, never the loop
        return real_sample()

    node.probe.sample = stuck_sample  # type: ignore[method-assign]
    reading = asyncio.create_task(node.sample())
    try:
        await asyncio.wait_for(asyncio.to_thread(entered.wait, 5), 6)
        lease, _ = await asyncio.wait_for(node.ask(gpu_memory="1GiB"), 5)
        assert lease["state"] == "granted"
        assert not reading.done()
    finally:
        release.set()
        await reading


async def test_epochs_still_grow_after_the_leases_that_held_them_left_the_history(make_node: Callable[..., Any]) -> None:
    node = await make_node(leases_kept=2)
    made = [await node.ask(gpu_memory="64MiB") for _ in range(PRUNE_EVERY + 2)]
    for lease, token in reversed(made):  # the highest epochs end first, so they are the ones the history drops
        await node.broker.release(lease["id"], TCP, token)
    assert made[-1][0]["id"] not in node.broker.ended
    await node.restart()
    assert made[-1][0]["id"] not in node.broker.ended  # gone from the store too, not only from memory
    fresh, _ = await node.ask(gpu_memory="1GiB")
    assert fresh["epoch"] > made[-1][0]["epoch"]
    assert fresh["gpus"][0]["epoch"] > made[-1][0]["gpus"][0]["epoch"]


async def test_a_grant_whose_client_goes_away_while_it_syncs_is_released_and_stays_released(make_node: Callable[..., Any]) -> None:
    node = await make_node()
    task = asyncio.create_task(node.ask(gpu_memory="10GiB", holder={"name": "gone"}))
    await asyncio.sleep(0)  # the grant is decided and handed to the writer; its client goes before the answer
    task.cancel()
    assert (await asyncio.gather(task, return_exceptions=True))[0].__class__ is asyncio.CancelledError
    await settle()
    assert node.broker.leases == {}  # the room is free at once
    [ended] = node.broker.list_leases(None, 10)
    assert (ended["state"], ended["reason"]) == ("released", "the requester disconnected before the grant was answered")
    await node.restart()
    assert node.broker.leases == {}
    assert [lease["state"] for lease in node.broker.list_leases(None, 10)] == ["released"]
    lease, _ = await node.ask(gpu_memory="23GiB")  # and all of it can be granted again
    assert lease["state"] == "granted"


async def test_the_history_and_the_event_log_stay_bounded_in_the_store(make_node: Callable[..., Any]) -> None:
    node = await make_node(leases_kept=5, events_kept=40)
    released = []
    for _ in range(3 * PRUNE_EVERY):
        lease, token = await node.ask(gpu_memory="64MiB")
        await node.broker.release(lease["id"], TCP, token)
        released.append(lease["id"])
    newest = released[:-6:-1]
    assert [lease["id"] for lease in node.broker.list_leases("released", 100)] == newest  # exactly leases_kept
    found = await node.events()
    assert 40 <= len(found) < 40 + PRUNE_EVERY  # dropped a group at a time
    assert found[-1]["seq"] - found[0]["seq"] == len(found) - 1  # the newest, with no hole
    await node.restart()
    assert [lease["id"] for lease in node.broker.list_leases("released", 100)] == newest
    on_disk = node.broker.store.load()
    assert 5 <= len(on_disk.ended) < 5 + PRUNE_EVERY


async def test_events_an_older_broker_wrote_are_served_as_they_were_written(make_node: Callable[..., Any]) -> None:
    node = await make_node()
    await node.broker.close()
    old = Store(node.config.state_dir, node.config.store_size)  # a store from before event times were kept as numbers
    old.start()
    seq = old.load().last_event + 1
    written = {"seq": seq, "time": "2026-11-01T12:00:00.000Z", "type": "broker.stopped", "message": "broker stopped", "details": {}}
    await old.commit([Write("events", seq_key(seq), {**written, "node": node.broker.node_id})])
    old.stop()
    await node.start()
    found = await node.events()
    assert {k: found[-2][k] for k in written} == written
    assert (found[-1]["type"], found[-1]["time"]) == ("broker.started", rfc3339(node.clock.now()))


async def test_the_started_event_counts_the_live_leases_in_words_that_agree(make_node: Callable[..., Any]) -> None:
    node = await make_node()
    await node.ask(gpu_memory="1GiB")
    await node.restart()
    assert (await node.events())[-1]["message"] == f"broker {node.config.name} started with 1 live lease"  # not "1 live leases"
    await node.ask(gpu_memory="1GiB")
    await node.restart()
    assert (await node.events())[-1]["message"] == f"broker {node.config.name} started with 2 live leases"


async def test_the_budgets_a_grant_or_release_changes_are_computed_again_once_it_is_answered(make_node: Callable[..., Any]) -> None:
    node = await make_node(sizes=[24 * GIB, 24 * GIB])
    lease, token = await node.ask(gpu_memory="10GiB")
    index = lease["gpus"][0]["index"]
    await asyncio.sleep(0)  # the loop's next turn: the answer has left
    assert node.broker._stale == set()  # the next request finds them ready: no budget to compute before deciding
    assert node.broker._budgets is not None
    assert node.broker._budgets[index].figures.leased == 10 * GIB
    await node.broker.release(lease["id"], TCP, token)
    assert node.broker._stale == {lease["gpus"][0]["uuid"]}  # not before the answer: it did not wait for them
    await asyncio.sleep(0)
    assert node.broker._stale == set()
    assert node.broker._budgets[index].figures.leased == 0


async def test_a_sample_that_fails_unexpectedly_leaves_the_broker_running_and_saying_so(
    make_node: Callable[..., Any], capsys: pytest.CaptureFixture[str]
) -> None:
    node = await make_node(sample_interval=0.1)
    failing = [OSError(24, "Too many open files")] * 3

    def sample() -> list[Any]:
        if failing:
            raise failing.pop()
        return FakeGpuProbe.sample(node.probe)

    node.probe.sample = sample  # type: ignore[method-assign]
    running = asyncio.create_task(node.broker.run())
    try:
        for _ in range(100):
            await asyncio.sleep(0.05)
            if not failing:
                break
        await asyncio.sleep(0.3)  # a sample that works again
        assert not running.done()
        assert not failing
    finally:
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running
    said = capsys.readouterr().err
    assert said.count("a sample of the GPUs and the host failed, and is tried again: OSError: [Errno 24] Too many open files") == 1


async def test_a_holder_pid_naming_the_broker_or_its_ancestors_is_refused(make_node: Callable[..., Any]) -> None:
    """Their descendants are most of the machine's processes: a lease held in their name would take all that
    memory out of `external`, and blind the pressure check."""
    node = await make_node()
    for pid in (1, os.getpid(), os.getppid()):
        for bind in ("caller", "none"):
            error = await node.refused(gpu_memory="1GiB", bind=bind, holder={"pid": pid})
            assert (error.code, error.details) == (FailureCode.INVALID_REQUEST, {"field": "holder.pid"}), (pid, bind)
    assert node.broker.list_leases(None, 10) == []


async def test_a_holder_pid_that_is_not_a_running_process_is_refused_naming_that_pid(make_node: Callable[..., Any]) -> None:
    """With bind: none, a pid nobody ran was taken: the next process given that pid had its GPU memory counted as the
    lease's, not as external. A thread's id was taken for a holder that had exited."""
    node = await make_node()
    gone = subprocess.Popen(["true"])
    gone.wait()
    for bind in ("caller", "none"):
        error = await node.refused(gpu_memory="1GiB", bind=bind, holder={"pid": gone.pid})
        assert (error.code, error.details) == (FailureCode.INVALID_REQUEST, {"field": "holder.pid"})
        assert error.message.startswith(f"holder.pid {gone.pid} is not a running process"), error.message
    done = threading.Event()
    thread = threading.Thread(target=done.wait, args=(30,))
    thread.start()
    try:
        assert thread.native_id is not None
        for bind in ("caller", "none"):
            error = await node.refused(gpu_memory="1GiB", bind=bind, holder={"pid": thread.native_id})
            assert error.message == f"holder.pid {thread.native_id} is a thread of process {os.getpid()}, not a process: give {os.getpid()}"
    finally:
        done.set()
        thread.join()
    assert node.broker.list_leases(None, 10) == []
    error = await node.refused(gpu_memory="1GiB", bind="caller")  # no pid at all
    assert (error.code, error.details) == (FailureCode.INVALID_REQUEST, {"field": "bind"})


async def test_a_waiting_request_whose_holder_exits_is_cancelled_at_once_and_frees_its_place(make_node: Callable[..., Any]) -> None:
    """Bound to a holder pid that exited while it waited, it kept its place, claiming the GPU from the requests behind it,
    until its wait ran out, or, were room freed first, was refused INVALID_REQUEST (400) for a body that was valid."""
    node = await make_node()
    await node.ask(gpu_memory="20GiB")  # 3 GiB left
    holder = subprocess.Popen(["sleep", "30"])
    try:
        bound = asyncio.create_task(node.refused(gpu_memory="10GiB", bind="caller", holder={"pid": holder.pid}, wait="1h"))
        behind = asyncio.create_task(node.ask(gpu_memory="2GiB", wait="1h"))  # fits, but the request ahead claims the GPU
        await asyncio.sleep(0.1)
        assert len(node.broker.waiters) == 2
        holder.kill()
        holder.wait()
        async with asyncio.timeout(5):
            error = await bound
            lease, _ = await behind
    finally:
        holder.kill()
        holder.wait()
    assert error.code is FailureCode.LEASE_TIMEOUT
    assert error.message.endswith(f"cancelled: its holder pid {holder.pid} exited while it waited"), error.message
    assert error.details == {"lease": error.details["lease"], "cancelled": True, "holder_pid": holder.pid}
    assert lease["state"] == "granted"
    (cancelled,) = await node.events("lease.cancelled")
    assert (cancelled["lease"], cancelled["message"]) == (error.details["lease"], error.message)
    assert await node.events("lease.refused") == []  # its story ends with lease.cancelled, once
    assert node.broker.waiters == []


async def test_a_stale_reading_is_shown_as_stale_and_a_wait_that_ends_on_it_says_its_age_then(make_node: Callable[..., Any]) -> None:
    node = await make_node()
    assert (node.gpu()["stale"], node.gpu()["age"], node.broker.stale) == (False, 0.0, False)
    node.clock.advance(10)  # no sample since: the probe hangs, say
    assert (node.gpu()["stale"], node.gpu()["age"], node.broker.stale) == (True, 10.0, True)
    waiting = asyncio.create_task(node.refused(gpu_memory="1GiB", wait="300ms"))
    await asyncio.sleep(0.1)
    node.clock.advance(5)
    error = await asyncio.wait_for(waiting, 5)
    assert error.code is FailureCode.LEASE_TIMEOUT
    assert "GPU 0 read 15.0s ago" in error.message  # its age when the wait ended, not when it began


async def test_renewing_a_queued_request_is_a_conflict_that_says_it_waits(make_node: Callable[..., Any]) -> None:
    node = await make_node()
    await node.ask(gpu_memory="20GiB")
    waiting = asyncio.create_task(node.ask(gpu_memory="10GiB", wait="1m"))
    await settle()
    (queued,) = node.broker.list_leases("queued", 10)
    with pytest.raises(BrokerError) as refused:
        await node.broker.renew(queued["id"], TCP, None, None)
    assert (refused.value.code, refused.value.details["state"]) == (FailureCode.LEASE_CONFLICT, "queued")
    assert "is queued, not granted (position 1)" in refused.value.message
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting


async def test_once_stopping_a_request_that_would_wait_is_answered_at_once_not_queued(make_node: Callable[..., Any]) -> None:
    node = await make_node()
    await node.ask(gpu_memory="20GiB")
    node.broker.stop_waiting()  # SIGTERM: and then a request whose body was still on its way arrives
    error = await asyncio.wait_for(node.refused(gpu_memory="10GiB", wait="1h"), 5)
    assert (error.code, error.details["stopping"]) == (FailureCode.LEASE_TIMEOUT, True)
    assert node.broker.waiters == []
    lease, _ = await node.ask(cpu_cores=1)  # one that fits now is still granted, and made durable before the broker closes
    assert lease["state"] == "granted"


async def test_a_request_refused_as_the_broker_stops_is_named_in_its_events_lease(make_node: Callable[..., Any]) -> None:
    """Its message and details named the request, and its event had no `lease`: found by neither a filter on it nor the UI."""
    node = await make_node()
    await node.ask(gpu_memory="20GiB")
    node.broker.stop_waiting()
    error = await asyncio.wait_for(node.refused(gpu_memory="10GiB", wait="1h"), 5)
    await node.broker.store.commit([])
    (event,) = [e for e in await node.events() if e["type"] == "lease.refused"]
    assert event["lease"] == error.details["lease"]


async def test_the_refusal_that_ends_a_wait_names_the_request_and_is_kept_whatever_the_refusal_budget(
    make_node: Callable[..., Any],
) -> None:
    """A wait that runs out, and one a clean stop (SIGTERM) ends, each end with a `lease.refused` naming the request,
    kept even when refusals are not (a flood of bad requests spent their budget): its `lease.queued` was kept."""
    node = await make_node()
    await node.ask(gpu_memory="20GiB")
    node.broker.refusals.tokens = 0  # the clock the test moves never fills it again
    timed_out = await node.refused(gpu_memory="10GiB", wait="10ms")
    assert timed_out.code is FailureCode.LEASE_TIMEOUT
    waiting = asyncio.create_task(node.ask(gpu_memory="10GiB", wait="1h"))
    await settle()
    (queued,) = node.broker.list_leases("queued", 10)
    await node.restart()  # close() refuses the waiting request as SIGTERM does
    with pytest.raises(BrokerError) as stopped:
        await waiting
    assert (stopped.value.code, stopped.value.details["stopping"]) == (FailureCode.LEASE_TIMEOUT, True)
    events = await node.events()
    waits = [e["lease"] for e in events if e["type"] == "lease.queued"]
    assert waits[1] == queued["id"]
    ends = [(e["type"], e.get("code"), e["lease"]) for e in events if e.get("lease") in waits and e["type"] != "lease.queued"]
    assert ends == [("lease.refused", "LEASE_TIMEOUT", waits[0]), ("lease.refused", "LEASE_TIMEOUT", waits[1])]
    assert "is stopping" in events[-2]["message"]
    assert (events[-1]["type"], events[-1]["details"]["waits_cancelled"]) == ("broker.started", 0)  # none is cut short


async def test_waits_an_earlier_version_ended_are_not_said_cancelled_by_the_first_start_after_an_upgrade(
    make_node: Callable[..., Any],
) -> None:
    """An earlier version's refusal at the end of a wait named no request (and past the refusal budget was not kept):
    its run's waits, all ended, were said cancelled by the broker stopping, even after a clean stop."""
    node = await make_node()
    await node.ask(gpu_memory="20GiB")
    await node.refused(gpu_memory="10GiB", wait="10ms")
    await node.broker.close()
    store = Store(node.config.state_dir, node.config.store_size)
    loaded = store.load()
    store.start()
    refused = next(e for e in store.events_newest_first() if e["type"] == "lease.refused")
    clock = {k: v for k, v in loaded.meta["clock"].items() if k in ("boot_id", "booted")}  # as an earlier version kept it
    await store.commit([Write("events", seq_key(refused["seq"]), {**refused, "lease": None}), Write("meta", b"clock", clock)])
    store.stop()
    await node.start()
    assert await node.events("lease.cancelled") == []
    assert (await node.events())[-1]["details"]["waits_cancelled"] == 0


async def test_several_gpus_too_large_for_all_but_some_readable_ones_name_the_gpu_that_decides(make_node: Callable[..., Any]) -> None:
    """With a card that cannot be read, the one named is still the one that decides, and not called the largest."""
    node = await make_node([24 * GIB, 12 * GIB, 40 * GIB, 40 * GIB])
    lost = "nvmlDeviceGetMemoryInfo on GPU 3: GPU is lost (NVML error 15)"
    node.probe.unreadable = {3: lost}
    await node.sample()
    error = await node.refused(gpu_memory="30GiB", gpus=2)
    assert error.code is FailureCode.DRIVER_ERROR
    assert error.message == (
        "30.0 GiB asked for on 2 GPUs; only 1 GPU that can be read can lease that much; the next largest, "
        f"GPU 0 (RTX 4090, 24.0 GiB), can lease at most 23.0 GiB; GPU 3 (GPU-fake-3) cannot be read: {lost}"
    )


async def test_work_a_lease_left_running_is_stopped_with_an_event_and_its_reason_saying_by_which_signal(
    make_node: Callable[..., Any],
) -> None:
    """The holder gone, its work ignoring SIGTERM: the broker kills it, and says so where its user looks."""
    node = await make_node(kill_grace=0.3)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    work = subprocess.Popen(["sh", "-c", 'trap "" TERM; echo ready; exec sleep 30'], process_group=0, stdout=subprocess.PIPE)
    try:
        assert work.stdout is not None
        assert work.stdout.readline() == b"ready\n"  # SIGTERM is ignored from here on
        lease, token = await node.ask(Caller("unix", uid=os.getuid(), pid=holder.pid), cpu_cores=1, bind="caller")
        await node.broker.register_group(lease["id"], ME, token, work.pid)
        holder.kill()
        holder.wait()
        assert await asyncio.to_thread(work.wait, 10) == -signal.SIGKILL
        event = await node.event_once("lease.work_stopped")
        assert event["lease"] == lease["id"]
        assert event["details"] == {"pgids": [work.pid], "signal": "SIGKILL", "killed": [work.pid], "grace": 0.3}
        assert f"holder pid {holder.pid} exited" in event["message"]
        assert f"process group {work.pid} killed (SIGKILL) 0.3s after SIGTERM" in event["message"]
        reason = node.broker.get(lease["id"])["reason"]
        assert (
            reason == f"holder pid {holder.pid} exited; its work was stopped: process group {work.pid} killed (SIGKILL) 0.3s after SIGTERM"
        )
        await node.restart()
        assert node.broker.get(lease["id"])["reason"] == reason  # kept with the lease on disk
    finally:
        for process in (holder, work):
            if process.poll() is None:
                process.kill()
            process.wait()
        if work.stdout is not None:
            work.stdout.close()


async def test_work_that_ends_on_sigterm_is_said_to_have_been_stopped_by_it(make_node: Callable[..., Any]) -> None:
    node = await make_node(kill_grace=30.0)
    lease, token = await node.ask(ME, cpu_cores=1)
    work = subprocess.Popen(["sleep", "30"], process_group=0)
    try:
        await node.broker.register_group(lease["id"], ME, token, work.pid)
        await node.broker.release(lease["id"], ME, token)
        assert await asyncio.to_thread(work.wait, 10) == -signal.SIGTERM
        event = await node.event_once("lease.work_stopped")
        assert event["details"] == {"pgids": [work.pid], "signal": "SIGTERM", "killed": [], "grace": 30.0}
        assert (
            node.broker.get(lease["id"])["reason"]
            == f"released by its holder (pid {os.getpid()}); its work was stopped: process group {work.pid} ended on SIGTERM"
        )
    finally:
        if work.poll() is None:
            work.kill()
        work.wait()


async def test_a_grant_undone_as_its_holder_exits_leaves_nothing_behind_when_its_client_goes_away_then(
    make_node: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A waiting request's holder exits as the request is granted (its pidfd not read yet): the grant is undone. Should
    its client go away in the same instant, no release of a lease that never was is written, and its room is not given
    back twice."""
    node = await make_node()
    held, token = await node.ask(gpu_memory="20GiB")
    me = Caller("unix", uid=os.getuid(), pid=os.getpid(), start_time=holders.start_time(os.getpid()))
    waiting = asyncio.create_task(node.ask(me, gpu_memory="15GiB", cpu_cores=1, wait="1m", bind="caller"))
    await settle()
    (waiter,) = node.broker.waiters
    assert node.broker._watch is not None

    def exited_and_gone(*args: Any) -> bool:
        waiting.cancel()  # its client goes away as the grant is made...
        return False  # ...and its holder has exited

    monkeypatch.setattr(node.broker._watch, "watch", exited_and_gone)
    await node.broker.release(held["id"], TCP, token)
    await asyncio.gather(waiting, return_exceptions=True)
    await settle()
    assert waiter.id not in node.broker.ended
    assert waiter.id not in [event.get("lease") for event in await node.events() if event["type"] == "lease.released"]
    assert node.gpu()["figures"]["leased"] == 0
    assert node.broker.host_budget().leased_cores == 0


async def test_a_request_released_by_its_id_between_its_grant_and_the_answer_is_not_answered_as_granted(
    make_node: Callable[..., Any],
) -> None:
    """Its user deletes a waiting request just as it is granted: the grant is on its way to disk, so the delete releases
    it. Its requester was answered 201 with the lease released (or said granted), and `gpubroker lease -- CMD` started
    CMD on it, in room already given back."""
    node = await make_node()
    held, token = await node.ask(gpu_memory="20GiB")
    waiting = asyncio.create_task(node.ask(gpu_memory="15GiB", wait="1m"))
    await settle()
    (waiter,) = node.broker.waiters
    commit, handed, released = node.broker.store.commit, asyncio.Event(), asyncio.Event()

    async def held_grant(synced: asyncio.Future[None]) -> None:
        handed.set()
        await released.wait()  # the grant goes on only once the delete is made, however fast the disk
        await synced

    def commit_holding_the_grant(writes: list[Write], *args: Any, **kwargs: Any) -> Any:
        synced = commit(writes, *args, **kwargs)
        if not any(w.table == "events" and w.value["type"] == "lease.granted" for w in writes):
            return synced
        node.broker.store.commit = commit  # type: ignore[method-assign]
        return held_grant(synced)

    node.broker.store.commit = commit_holding_the_grant  # type: ignore[method-assign]
    await node.broker.release(held["id"], TCP, token)
    await asyncio.wait_for(handed.wait(), 10)
    gone = await node.broker.release(waiter.id, Caller("unix", uid=0, pid=None), None)  # root: granted now, so released
    assert gone.state == "released"
    released.set()
    with pytest.raises(BrokerError) as told:
        await waiting
    assert told.value.code is FailureCode.LEASE_TIMEOUT
    assert told.value.details == {"lease": waiter.id, "cancelled": True, "state": "released"}
    assert told.value.message == (
        f"request {waiter.id} was granted and then released before its grant could be answered: released by user root (uid 0)"
    )
    await node.restart()
    assert node.broker.get(waiter.id)["state"] == "released"


async def test_a_request_whose_release_between_grant_and_answer_fails_is_answered_as_granted(make_node: Callable[..., Any]) -> None:
    """The release that overtook the grant could not be written (a full store, a disk fault): the lease lives on, so its
    requester is answered 201 with its token, not told it was not granted while the lease goes on holding the room."""
    node = await make_node()
    held, token = await node.ask(gpu_memory="20GiB")
    waiting = asyncio.create_task(node.ask(gpu_memory="15GiB", wait="1m"))
    await settle()
    (waiter,) = node.broker.waiters
    commit = node.broker.store.commit
    handed, released, grant_synced, release_settled = asyncio.Event(), asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def held_grant(synced: Any) -> None:
        handed.set()
        await released.wait()
        await synced
        grant_synced.set()

    async def refused_after_the_grant(on_settled: Callable[[Exception | None], None]) -> None:
        await grant_synced.wait()  # the writer's order: the release was handed after the grant
        await asyncio.sleep(0.05)  # and is refused well after the grant is on disk
        full = StoreFull("the state store could not be written: a disk fault", {})
        on_settled(full)
        release_settled.set()
        raise full

    async def after_the_release(synced: Any) -> None:
        await release_settled.wait()  # anything handed after the release is settled after it
        await synced

    def commit_in_order(writes: list[Write], *args: Any, **kwargs: Any) -> Any:
        types = {w.value["type"] for w in writes if w.table == "events"}
        if "lease.granted" in types:
            return held_grant(commit(writes, *args, **kwargs))
        if "lease.released" in types and handed.is_set():  # the release by its id: the disk refuses it
            return refused_after_the_grant(kwargs["on_settled"])
        if handed.is_set() and not release_settled.is_set():
            return after_the_release(commit(writes, *args, **kwargs))
        return commit(writes, *args, **kwargs)

    node.broker.store.commit = commit_in_order  # type: ignore[method-assign]
    await node.broker.release(held["id"], TCP, token)
    await asyncio.wait_for(handed.wait(), 10)
    release = asyncio.create_task(node.broker.release(waiter.id, Caller("unix", uid=0, pid=None), None))
    await asyncio.sleep(0)  # the release is on its way to disk, and the grant's answer comes while it is
    released.set()
    lease, lease_token = await asyncio.wait_for(waiting, 5)
    assert (lease["id"], lease["state"]) == (waiter.id, "granted")
    assert lease_token
    with pytest.raises(StoreFull):
        await release
