"""NvmlProbe against a fake pynvml that raises and returns what the real bindings do."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pynvml
import pytest
from fake_pynvml import GIB, VANISHED_PID, FakeGpu, FakeNvml

from gpubroker.broker.nvml import CLOSE_WAIT as NVML_CLOSE_WAIT
from gpubroker.broker.nvml import NvmlProbe
from gpubroker.broker.probes import GpuProcess, GpuReading, GpusUnreadable, ProbeError, UnreadableGpu
from gpubroker.broker.request import parse_request
from gpubroker.broker.service import Broker, Caller
from gpubroker.broker.store import Store
from gpubroker.config import Config
from gpubroker.errors import FailureCode, Refusal

NOW = 1_700_000_000.5


def probe(nvml: FakeNvml) -> NvmlProbe:
    return NvmlProbe(nvml, clock=lambda: NOW)


def test_readings_carry_uuid_total_used_and_real_local_process_ancestry() -> None:
    me = os.getpid()
    gpus = [
        FakeGpu(uuid="GPU-aaaa", name="NVIDIA H200", total=141 * GIB, used=5 * GIB, compute=[(me, 3 * GIB)]),
        FakeGpu(uuid="GPU-bbbb", name="NVIDIA L4", total=24 * GIB, used=GIB // 2),
    ]

    readings = probe(FakeNvml(gpus)).sample()

    assert readings[1] == GpuReading(1, "GPU-bbbb", "NVIDIA L4", 24 * GIB, GIB // 2, NOW, ())
    first = readings[0]
    assert (first.index, first.uuid, first.name) == (0, "GPU-aaaa", "NVIDIA H200")
    assert (first.total, first.used, first.observed_at) == (141 * GIB, 5 * GIB, NOW)
    assert first.processes is not None
    [mine] = first.processes
    assert (mine.pid, mine.name, mine.bytes) == (me, psutil.Process().name(), 3 * GIB)
    assert mine.pgid == os.getpgid(0)
    assert mine.ancestors[0] == os.getppid()
    assert mine.ancestors == tuple(parent.pid for parent in psutil.Process().parents())


def test_a_machine_without_a_driver_raises_a_probe_error_not_a_crash() -> None:
    with pytest.raises(ProbeError, match=r"^no NVIDIA driver: NVML Shared Library Not Found"):
        probe(FakeNvml([FakeGpu()], driver_missing=True)).sample()


def test_a_driver_that_appears_later_is_initialised_on_the_next_sample() -> None:
    nvml = FakeNvml([FakeGpu()], driver_missing=True)
    gpus = probe(nvml)
    with pytest.raises(ProbeError):
        gpus.sample()

    nvml.driver_missing = False

    assert len(gpus.sample()) == 1
    assert len(gpus.sample()) == 1
    assert nvml.calls.count("nvmlInit") == 2  # the failed one and the first success, never again
    assert nvml.init_calls == 1


def test_bindings_that_are_not_installed_are_a_probe_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError

    with pytest.raises(ProbeError, match="nvidia-ml-py"):
        NvmlProbe().sample()


def test_the_real_bindings_either_read_gpus_or_say_there_is_no_driver() -> None:
    real = NvmlProbe()
    try:
        outcome: list[GpuReading] | str = real.sample()
    except ProbeError as error:
        outcome = str(error)
    finally:
        real.close()

    if isinstance(outcome, str):
        assert outcome.startswith("no NVIDIA driver")
    else:
        assert all(reading.total > 0 and 0 <= reading.used <= reading.total for reading in outcome)


def test_a_machine_with_a_driver_and_no_gpus_reports_no_readings() -> None:
    assert probe(FakeNvml([])).sample() == []


@pytest.mark.parametrize(
    "gpu",
    [
        FakeGpu(processes_not_supported=True),
        FakeGpu(
            errors={
                "nvmlDeviceGetComputeRunningProcesses": pynvml.NVML_ERROR_NO_PERMISSION,
                "nvmlDeviceGetGraphicsRunningProcesses": pynvml.NVML_ERROR_NOT_SUPPORTED,
            }
        ),
    ],
    ids=["not-supported", "no-permission"],
)
def test_a_gpu_whose_process_list_is_not_supported_reports_processes_as_none(gpu: FakeGpu) -> None:
    listed = FakeGpu(compute=[(VANISHED_PID, GIB)])

    readings = probe(FakeNvml([gpu, listed])).sample()

    assert readings[0].processes is None
    assert readings[1].processes == (GpuProcess(VANISHED_PID, "", GIB),)


def test_a_compute_only_gpu_without_a_graphics_list_still_reports_its_compute_processes() -> None:
    errors = {"nvmlDeviceGetGraphicsRunningProcesses": pynvml.NVML_ERROR_NOT_SUPPORTED}
    gpu = FakeGpu(compute=[(VANISHED_PID, 2 * GIB)], errors=errors)

    [reading] = probe(FakeNvml([gpu])).sample()

    assert reading.processes == (GpuProcess(VANISHED_PID, "", 2 * GIB),)


@pytest.mark.parametrize("both", [False, True], ids=["one-list", "both-lists"])
@pytest.mark.parametrize("unchecked", [False, True], ids=["checked", "unchecked-12.535"])
def test_bindings_newer_than_the_driver_leave_processes_unlisted_not_the_gpu_unread(both: bool, unchecked: bool) -> None:
    """Bindings before 12.550 say so with a bare FunctionNotFound, which left the whole GPU unread: not brokered at all."""
    missing = {"nvmlDeviceGetComputeRunningProcesses": pynvml.NVML_ERROR_FUNCTION_NOT_FOUND}
    if both:
        missing["nvmlDeviceGetGraphicsRunningProcesses"] = pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
    gpu = FakeGpu(used=3 * GIB, compute=[(VANISHED_PID, GIB)], graphics=[(VANISHED_PID + 1, GIB)], errors=missing)

    [reading] = probe(FakeNvml([gpu], unchecked_versions=unchecked)).sample()

    assert reading.used == 3 * GIB
    assert reading.processes == (None if both else (GpuProcess(VANISHED_PID + 1, "", GIB),))


@pytest.mark.parametrize("misread", [(2**32 - 1, GIB), (VANISHED_PID + 2, 2**63)], ids=["no-such-pid", "more-than-the-gpu"])
def test_a_process_list_misread_by_bindings_whose_structure_is_not_the_drivers_is_left_unattributed(misread: tuple[int, int]) -> None:
    """nvidia-ml-py 12.535.77, or any bindings with an early R535 driver, read every entry after the first at the wrong
    offset: pids such as 4294967295 and sizes beyond the GPU's, which were counted as some process's memory."""
    gpu = FakeGpu(used=3 * GIB, compute=[(VANISHED_PID, GIB), misread], graphics=[(VANISHED_PID + 1, GIB)])

    [reading] = probe(FakeNvml([gpu])).sample()

    assert reading.used == 3 * GIB
    assert reading.processes == (GpuProcess(VANISHED_PID + 1, "", GIB),)  # the list that reads true is still attributed


def test_a_process_that_vanishes_between_calls_keeps_its_bytes_without_a_name() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    assert psutil.pid_exists(child.pid)

    def vanish(index: int) -> None:
        child.kill()
        child.wait()

    try:
        nvml = FakeNvml([FakeGpu(compute=[(child.pid, 4 * GIB)])], after_process_list=vanish)
        [reading] = probe(nvml).sample()
    finally:
        child.kill()
        child.wait()

    assert reading.processes == (GpuProcess(child.pid, "", 4 * GIB, pgid=None, ancestors=()),)


@pytest.mark.parametrize("raw_structs", [False, True], ids=["current-bindings", "older-bindings"])
def test_unavailable_process_memory_is_absent_not_zero(raw_structs: bool) -> None:
    gpu = FakeGpu(compute=[(VANISHED_PID, None)], graphics=[(VANISHED_PID + 1, 0)])

    [reading] = probe(FakeNvml([gpu], raw_structs=raw_structs)).sample()

    assert reading.processes == (GpuProcess(VANISHED_PID, "", None), GpuProcess(VANISHED_PID + 1, "", 0))


def test_compute_and_graphics_lists_are_merged_by_pid() -> None:
    a, b, c, d = (VANISHED_PID + n for n in range(4))
    gpu = FakeGpu(
        compute=[(a, 100), (b, None), (c, 500), (d, None)],
        graphics=[(a, 300), (b, 200), (c, 400), (d, None), (a + 10, 7)],
    )

    [reading] = probe(FakeNvml([gpu])).sample()

    assert reading.processes is not None
    assert {p.pid: p.bytes for p in reading.processes} == {a: 300, b: 200, c: 500, d: None, a + 10: 7}
    assert len(reading.processes) == 5


def test_a_lost_gpu_is_left_unread_naming_it_and_the_others_are_read() -> None:
    """A card fallen off the bus (Xid 79) is NVML's GPU_IS_LOST on every call naming it, from its handle on: its
    UUID is unknown, and it keeps its place so the cards after it keep their numbers."""
    nvml = FakeNvml([FakeGpu(uuid="GPU-aaaa", used=GIB), FakeGpu(uuid="GPU-bbbb", lost=True), FakeGpu(uuid="GPU-cccc")])

    with pytest.raises(GpusUnreadable) as caught:
        probe(nvml).sample()

    assert [(r.index, r.uuid, r.used) for r in caught.value.readings] == [(0, "GPU-aaaa", GIB), (2, "GPU-cccc", 0)]
    [lost] = caught.value.unreadable
    assert lost == UnreadableGpu(1, None, "nvmlDeviceGetHandleByIndex on GPU 1: GPU is lost (NVML error 15)")
    assert str(caught.value) == "GPU 1 (UUID unknown) cannot be read: nvmlDeviceGetHandleByIndex on GPU 1: GPU is lost (NVML error 15)"
    assert isinstance(caught.value, ProbeError)  # to a caller that reads all or nothing, it is still a fault


@pytest.mark.parametrize(
    ("function", "code", "says"),
    [
        ("nvmlDeviceGetMemoryInfo", pynvml.NVML_ERROR_UNKNOWN, "Unknown Error"),
        ("nvmlDeviceGetName", pynvml.NVML_ERROR_GPU_IS_LOST, "GPU is lost"),
        ("nvmlDeviceGetComputeRunningProcesses", pynvml.NVML_ERROR_TIMEOUT, "Timeout"),
        ("nvmlDeviceGetGraphicsRunningProcesses", pynvml.NVML_ERROR_RESET_REQUIRED, "GPU requires restart"),
        ("nvmlDeviceGetMigMode", pynvml.NVML_ERROR_UNKNOWN, "Unknown Error"),
    ],
)
def test_any_other_nvml_error_of_one_gpu_leaves_that_gpu_unread_naming_the_function(function: str, code: int, says: str) -> None:
    nvml = FakeNvml([FakeGpu(uuid="GPU-aaaa"), FakeGpu(uuid="GPU-bbbb", errors={function: code})])

    with pytest.raises(GpusUnreadable) as caught:
        probe(nvml).sample()

    assert [r.uuid for r in caught.value.readings] == ["GPU-aaaa"]
    assert caught.value.unreadable == [UnreadableGpu(1, "GPU-bbbb", f"{function} on GPU 1: {says} (NVML error {code})")]


def test_a_gpu_whose_uuid_cannot_be_read_is_unread_by_its_index() -> None:
    nvml = FakeNvml([FakeGpu(uuid="GPU-aaaa", errors={"nvmlDeviceGetUUID": pynvml.NVML_ERROR_GPU_IS_LOST}), FakeGpu(uuid="GPU-bbbb")])

    with pytest.raises(GpusUnreadable) as caught:
        probe(nvml).sample()

    assert caught.value.unreadable == [UnreadableGpu(0, None, "nvmlDeviceGetUUID on GPU 0: GPU is lost (NVML error 15)")]
    assert [(r.index, r.uuid) for r in caught.value.readings] == [(1, "GPU-bbbb")]


def test_an_nvml_shut_down_in_the_middle_of_a_sample_is_a_fault_of_the_whole_driver() -> None:
    nvml = FakeNvml([FakeGpu(uuid="GPU-aaaa"), FakeGpu(uuid="GPU-bbbb")])
    gpus = probe(nvml)
    gpus.sample()
    nvml.gpus[1].errors = {"nvmlDeviceGetMemoryInfo": pynvml.NVML_ERROR_UNINITIALIZED}

    with pytest.raises(ProbeError, match="Uninitialized") as caught:
        gpus.sample()

    assert not isinstance(caught.value, GpusUnreadable)


def test_a_lost_gpu_can_be_read_again_once_the_driver_answers_for_it() -> None:
    nvml = FakeNvml([FakeGpu(uuid="GPU-aaaa"), FakeGpu(uuid="GPU-bbbb", lost=True)])
    gpus = probe(nvml)
    with pytest.raises(GpusUnreadable):
        gpus.sample()

    nvml.gpus[1].lost = False

    assert [r.uuid for r in gpus.sample()] == ["GPU-aaaa", "GPU-bbbb"]


def test_a_count_that_fails_is_a_probe_error_naming_the_function() -> None:
    nvml = FakeNvml([FakeGpu()], errors={"nvmlDeviceGetCount": pynvml.NVML_ERROR_UNKNOWN})

    with pytest.raises(ProbeError, match=r"^nvmlDeviceGetCount: Unknown Error"):
        probe(nvml).sample()


def test_an_nvml_shut_down_behind_the_probe_is_initialised_again() -> None:
    nvml = FakeNvml([FakeGpu()])
    gpus = probe(nvml)
    gpus.sample()
    nvml.nvmlShutdown()  # someone else's shutdown drops the library's count to zero

    with pytest.raises(ProbeError, match="Uninitialized"):
        gpus.sample()

    assert len(gpus.sample()) == 1
    assert nvml.init_calls == 2


def test_uuid_and_name_given_as_bytes_by_older_bindings_are_decoded() -> None:
    [reading] = probe(FakeNvml([FakeGpu(uuid="GPU-cccc", name="Tesla T4")], bytes_strings=True)).sample()

    assert (reading.uuid, reading.name) == ("GPU-cccc", "Tesla T4")


def test_close_shuts_nvml_down_once_and_only_after_it_was_initialised() -> None:
    nvml = FakeNvml([FakeGpu()])
    gpus = probe(nvml)
    gpus.close()
    assert nvml.shutdown_calls == 0

    gpus = probe(nvml)
    gpus.sample()
    gpus.close()
    gpus.close()

    assert nvml.shutdown_calls == 1


def test_a_shutdown_the_driver_fails_does_not_fail_the_brokers_stop() -> None:
    """It raised out of the broker's stop, after the store was closed: a traceback where the broker said it stopped."""
    nvml = FakeNvml([FakeGpu()])
    gpus = probe(nvml)
    gpus.sample()
    nvml.errors["nvmlShutdown"] = pynvml.NVML_ERROR_UNKNOWN
    gpus.close()
    assert nvml.calls[-1] == "nvmlShutdown"


def test_the_fake_returns_the_real_bindings_types() -> None:
    nvml = FakeNvml([FakeGpu(compute=[(VANISHED_PID, 1)])])
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nvml.nvmlDeviceGetCount()
    nvml.nvmlInit()
    handle = nvml.nvmlDeviceGetHandleByIndex(0)

    assert type(nvml.nvmlDeviceGetMemoryInfo(handle)) is pynvml.c_nvmlMemory_t
    [process] = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
    assert type(process) is pynvml.nvmlFriendlyObject
    assert (process.pid, process.usedGpuMemory) == (VANISHED_PID, 1)
    assert nvml.NVMLError_NotSupported is pynvml.NVMLError_NotSupported
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetHandleByIndex(1)


async def test_a_broker_that_stops_shuts_nvml_down_and_does_not_wait_for_a_stuck_sample(tmp_path: Path) -> None:
    import threading

    nvml = FakeNvml([FakeGpu(uuid="GPU-aaaa")])
    config = Config(state_dir=tmp_path / "state", name="tower")
    broker = Broker(config, Store(config.state_dir, config.store_size, config.events_kept), NvmlProbe(nvml))
    await broker.start()
    assert [reading.uuid for reading in broker.readings] == ["GPU-aaaa"]
    await broker.close()
    assert (nvml.init_calls, nvml.shutdown_calls) == (1, 1)

    stuck, release = threading.Event(), threading.Event()
    nvml.after_process_list = lambda index: (stuck.set(), release.wait(10))
    broker = Broker(config, Store(config.state_dir, config.store_size, config.events_kept), NvmlProbe(nvml))
    starting = asyncio.create_task(broker.start())
    try:
        await asyncio.to_thread(stuck.wait, 5)
        starting.cancel()  # SIGTERM while the first reading is stuck in the driver
        with contextlib.suppress(asyncio.CancelledError):
            await starting
        await asyncio.wait_for(broker.close(), NVML_CLOSE_WAIT + 2)
        assert nvml.shutdown_calls == 1  # the stuck sample holds NVML; the process's exit lets it go
    finally:
        release.set()


def test_a_sample_after_close_never_starts_nvml_again() -> None:
    nvml = FakeNvml([FakeGpu()])
    probe = NvmlProbe(nvml)
    probe.sample()
    probe.close()
    with pytest.raises(ProbeError, match="shut down"):
        probe.sample()  # a sampling thread that took the lock after the broker's stop
    assert (nvml.init_calls, nvml.shutdown_calls) == (1, 1)


async def test_a_broker_goes_on_brokering_the_gpus_nvml_reads_when_one_is_lost(tmp_path: Path) -> None:
    """Xid 79 on GPU 1 of two, each with a lease: GPU 0 keeps its figures and its grants, GPU 1 is shown as
    unreadable with NVML's error, its lease stays, and once NVML reads it again it is offered again."""
    nvml = FakeNvml([FakeGpu(uuid="GPU-aaaa", used=GIB), FakeGpu(uuid="GPU-bbbb")])
    config = Config(state_dir=tmp_path / "state", name="tower")
    broker = Broker(config, Store(config.state_dir, config.store_size, config.events_kept), NvmlProbe(nvml))
    await broker.start()
    try:
        on_0, _ = await broker.request(parse_request({"gpu_memory": "4GiB", "gpu": 0, "bind": "none"}), Caller("tcp"))
        on_1, _ = await broker.request(parse_request({"gpu_memory": "8GiB", "gpu": 1, "bind": "none"}), Caller("tcp"))
        nvml.gpus[1].lost = True
        await broker.sample()

        node = broker.node_json()
        assert node["driver_error"] is None
        [gpu] = node["gpus"]
        assert (gpu["uuid"], gpu["figures"]["observed"], gpu["figures"]["leased"]) == ("GPU-aaaa", GIB, 4 * GIB)
        lost = "nvmlDeviceGetHandleByIndex on GPU 1: GPU is lost (NVML error 15)"
        assert node["unreadable_gpus"] == [{"index": 1, "uuid": None, "error": lost, "leases": []}]
        more, _ = await broker.request(parse_request({"gpu_memory": "2GiB", "bind": "none"}), Caller("tcp"))
        assert [g.uuid for g in more.gpus] == ["GPU-aaaa"]
        with pytest.raises(Refusal) as refused:
            await broker.request(parse_request({"gpu_memory": "1GiB", "gpu": 1, "bind": "none"}), Caller("tcp"))
        assert refused.value.code is FailureCode.DRIVER_ERROR
        assert refused.value.message == f"GPU 1 (UUID unknown) cannot be read: {lost}; it is not offered until it can be read again"
        assert broker.get(on_1.id)["state"] == "granted"
        assert broker.get(on_0.id)["state"] == "granted"

        nvml.gpus[1].lost = False
        await broker.sample()
        assert [(g["uuid"], g["figures"]["leased"]) for g in broker.node_json()["gpus"]] == [("GPU-aaaa", 6 * GIB), ("GPU-bbbb", 8 * GIB)]
        await broker.store.commit([])
        events, _ = broker.events(0, 100)
        said = [(e["type"], e.get("gpu")) for e in events if e["type"].startswith("gpu.")]
        assert [e["message"] for e in events if e["type"] == "gpu.readable"] == [
            "GPU 1 (UUID unknown) can be read again, as GPU 1 (GPU-bbbb)"
        ]
        assert said == [("gpu.unreadable", None), ("gpu.missing", "GPU-bbbb"), ("gpu.readable", "GPU-bbbb"), ("gpu.found", "GPU-bbbb")]
    finally:
        await broker.close()


def mig_machine() -> list[FakeGpu]:
    """GPU 0 without MIG, GPU 1 in MIG mode with two MIG devices (and an empty index between them), GPU 2 with MIG off."""
    three_g = FakeGpu(
        uuid="MIG-aaaa", name="NVIDIA A100-SXM4-40GB MIG 3g.20gb", total=20 * GIB, used=5 * GIB, compute=[(VANISHED_PID, 4 * GIB)]
    )
    two_g = FakeGpu(uuid="MIG-bbbb", name="NVIDIA A100-SXM4-40GB MIG 2g.10gb", total=10 * GIB, used=GIB // 2)
    return [
        FakeGpu(uuid="GPU-plain", name="NVIDIA L4", total=24 * GIB, used=GIB),
        FakeGpu(
            uuid="GPU-mig", name="NVIDIA A100-SXM4-40GB", total=40 * GIB, used=6 * GIB, compute=[(VANISHED_PID, 4 * GIB)],
            mig_mode=pynvml.NVML_DEVICE_MIG_ENABLE, mig=[three_g, None, two_g],
        ),
        FakeGpu(uuid="GPU-off", name="NVIDIA A100-SXM4-40GB", total=40 * GIB, mig_mode=pynvml.NVML_DEVICE_MIG_DISABLE),
    ]  # fmt: skip


@pytest.mark.parametrize("root", [True, False], ids=["root", "not-root"])
def test_a_gpu_in_mig_mode_is_read_as_its_mig_devices_which_are_all_that_work_can_use(root: bool) -> None:
    """Work on a GPU in MIG mode sees one MIG device (CUDA_VISIBLE_DEVICES=MIG-…), never the whole card: leasing the
    card's 40 GiB would promise memory no process can reach. Each MIG device is an accelerator of its own."""
    readings = probe(FakeNvml(mig_machine(), root=root)).sample()

    assert [(r.index, r.uuid, r.total, r.used) for r in readings] == [
        (0, "GPU-plain", 24 * GIB, GIB),
        (1, "MIG-aaaa", 20 * GIB, 5 * GIB),
        (2, "MIG-bbbb", 10 * GIB, GIB // 2),
        (3, "GPU-off", 40 * GIB, 0),
    ]
    assert readings[1].name == "NVIDIA A100-SXM4-40GB MIG 3g.20gb"
    assert readings[1].processes == (GpuProcess(VANISHED_PID, "", 4 * GIB),)
    assert readings[2].processes == ()


@pytest.mark.parametrize("code", [pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND], ids=["no-mig", "old-driver"])
def test_a_gpu_or_driver_without_mig_is_read_as_one_gpu(code: int) -> None:
    gpu = FakeGpu(uuid="GPU-aaaa", used=GIB, errors={"nvmlDeviceGetMigMode": code})

    [reading] = probe(FakeNvml([gpu])).sample()

    assert (reading.uuid, reading.used) == ("GPU-aaaa", GIB)


def test_processes_that_start_while_nvml_lists_them_are_listed_again_not_a_driver_error() -> None:
    """The bindings ask for the count, then for the list with room for twice as many and five more: a burst of
    processes starting in between (a dataloader's workers) is NVMLError_InsufficientSize, and is asked again."""
    gpu = FakeGpu(used=2 * GIB, compute=[(VANISHED_PID, GIB)], lists_outgrown=2)

    [reading] = probe(FakeNvml([gpu])).sample()

    assert reading.processes == (GpuProcess(VANISHED_PID, "", GIB),)


def test_a_mig_device_that_cannot_be_read_is_unread_alone_and_keeps_its_place() -> None:
    gpus = mig_machine()
    mig = gpus[1].mig[2]
    assert mig is not None
    mig.errors = {"nvmlDeviceGetMemoryInfo": pynvml.NVML_ERROR_UNKNOWN}

    with pytest.raises(GpusUnreadable) as caught:
        probe(FakeNvml(gpus)).sample()

    assert [(r.index, r.uuid) for r in caught.value.readings] == [(0, "GPU-plain"), (1, "MIG-aaaa"), (3, "GPU-off")]
    assert caught.value.unreadable == [UnreadableGpu(2, "MIG-bbbb", "nvmlDeviceGetMemoryInfo on GPU 1: Unknown Error (NVML error 999)")]
