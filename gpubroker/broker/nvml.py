"""GPU readings through NVML (the `nvidia-ml-py` bindings, module `pynvml`).

Every fault of the driver or the bindings leaves `sample()` as a `ProbeError`
(no driver, NVML failing to start or to count the GPUs, bindings not installed):
the broker then refuses GPU requests with `DRIVER_ERROR` and keeps brokering CPU
cores and host memory. A fault of one GPU's calls (`GPU_IS_LOST`: a card fallen
off the bus) leaves that GPU alone unread: `GpusUnreadable` carries the
readings of the others, which the broker goes on brokering.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
import time
from collections.abc import Callable
from typing import Any

from gpubroker.broker.probes import GpuProcess, GpuReading, GpusUnreadable, ProbeError, UnreadableGpu, describe_process

# NVML_VALUE_NOT_AVAILABLE as an unsigned long long: the driver lists the process but not its
# memory (WDDM, some containers). Current bindings turn it into None, older ones pass it through.
NOT_AVAILABLE = 2**64 - 1
LIST_TRIES = 3  # a process list outgrown while it was read is asked for again, at most this many times in all
PID_LIMIT = 2**31  # no pid reaches it (pid_t is a signed 32-bit int): one read as such was misread
CLOSE_WAIT = 1.0  # seconds close() waits for a sample in flight
_PROCESS_LISTS = ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses")


class NvmlProbe:
    """The machine's NVIDIA GPUs; `sample()` blocks, so it runs in a thread."""

    def __init__(self, nvml: Any = None, clock: Callable[[], float] = time.time) -> None:
        self._nvml: Any = nvml  # the pynvml module, or a fake of it; imported at the first sample
        self._clock = clock
        self._initialised = False
        self._closed = False  # once closed, no sample starts NVML again
        self._lock = threading.Lock()  # sample() and close() may be called from different threads

    def sample(self) -> list[GpuReading]:
        """One reading per GPU, or `ProbeError` (`GpusUnreadable` when some GPUs alone cannot be read); NVML is
        initialised at the first success."""
        with self._lock:
            if self._closed:
                raise ProbeError("NVML is shut down: the broker is stopping")
            if self._nvml is None:
                try:
                    self._nvml = importlib.import_module("pynvml")
                except ImportError as error:
                    raise ProbeError(f"no NVML: the nvidia-ml-py package is not installed ({error})") from None
            if not self._initialised:
                self._call("nvmlInit", None)  # fails again and again until a driver appears
                self._initialised = True
            # Taken before the reads: a reading is never younger than its time says.
            now = self._clock()
            count = int(self._call("nvmlDeviceGetCount", None))
            readings: list[GpuReading] = []
            unreadable: list[UnreadableGpu] = []
            for gpu in range(count):
                # Accelerators are numbered in NVML's order, a GPU in MIG mode by its MIG devices; one that cannot
                # be read keeps its place, so the cards after it keep their numbers.
                try:
                    handle = self._call("nvmlDeviceGetHandleByIndex", gpu, gpu)
                except ProbeError as error:
                    unreadable.append(self._unreadable(len(readings) + len(unreadable), gpu, None, error))
                    continue
                try:
                    devices = self._devices(gpu, handle)
                except ProbeError as error:
                    unreadable.append(self._unreadable(len(readings) + len(unreadable), gpu, handle, error))
                    continue
                for device in devices:
                    index = len(readings) + len(unreadable)
                    try:
                        readings.append(self._read(index, gpu, device, now))
                    except ProbeError as error:
                        unreadable.append(self._unreadable(index, gpu, device, error))
            if unreadable:
                raise GpusUnreadable(readings, unreadable)
            return readings

    def close(self) -> None:
        """Shut NVML down if a sample initialised it; no sample starts it again. Closing twice does nothing."""
        self._closed = True  # a sample waiting for the lock finds it so
        if not self._lock.acquire(timeout=CLOSE_WAIT):
            return  # a sample stuck in the driver holds NVML: the process's exit lets it go
        try:
            if self._initialised:
                self._initialised = False
                with contextlib.suppress(ProbeError):  # the broker is stopping: a driver that fails even this changes nothing
                    self._call("nvmlShutdown", None)
        finally:
            self._lock.release()

    def _devices(self, gpu: int, handle: Any) -> list[Any]:
        """What work can be given of a GPU: the GPU, or in MIG mode each of its MIG devices (UUID `MIG-…`).

        Work on a GPU in MIG mode sees one MIG device, never the whole card: leasing the card's memory
        would promise what no process can reach (and only root may read the card as a whole)."""
        nvml = self._nvml
        if getattr(nvml, "nvmlDeviceGetMigMode", None) is None:
            return [handle]  # bindings older than MIG
        try:
            current = self._call("nvmlDeviceGetMigMode", gpu, handle)[0]
        except ProbeError as error:
            if isinstance(error.__cause__, (nvml.NVMLError_NotSupported, nvml.NVMLError_FunctionNotFound)):
                return [handle]  # a GPU without MIG, or a driver older than MIG
            raise
        if current != nvml.NVML_DEVICE_MIG_ENABLE:
            return [handle]
        devices = []
        for slot in range(int(self._call("nvmlDeviceGetMaxMigDeviceCount", gpu, handle))):
            try:
                devices.append(self._call("nvmlDeviceGetMigDeviceHandleByIndex", gpu, handle, slot))
            except ProbeError as error:
                if not isinstance(error.__cause__, nvml.NVMLError_NotFound):  # NotFound: no MIG device at that index
                    raise
        return devices

    def _read(self, index: int, gpu: int, handle: Any, now: float) -> GpuReading:
        memory = self._call("nvmlDeviceGetMemoryInfo", gpu, handle)
        return GpuReading(
            index=index,
            uuid=_text(self._call("nvmlDeviceGetUUID", gpu, handle)),
            name=_text(self._call("nvmlDeviceGetName", gpu, handle)),
            total=int(memory.total),
            used=int(memory.used),
            observed_at=now,
            processes=self._processes(gpu, handle, int(memory.total)),
        )

    def _unreadable(self, index: int, gpu: int, handle: Any, error: ProbeError) -> UnreadableGpu:
        """One GPU's fault, the others read on; a fault of the driver as a whole stops the sample."""
        nvml = self._nvml
        whole = (nvml.NVMLError_LibraryNotFound, nvml.NVMLError_DriverNotLoaded, nvml.NVMLError_Uninitialized)
        if isinstance(error.__cause__, whole):
            raise error
        uuid = None
        if handle is not None:
            with contextlib.suppress(ProbeError):  # a card fallen off the bus may not even say its UUID
                uuid = _text(self._call("nvmlDeviceGetUUID", gpu, handle))
        return UnreadableGpu(index, uuid, str(error))

    def _processes(self, index: int, handle: Any, total: int) -> tuple[GpuProcess, ...] | None:
        nvml = self._nvml
        # A driver older than the bindings' list function: _mismatch from 12.550 on, a bare FunctionNotFound before.
        unlistable = (nvml.NVMLError_NotSupported, nvml.NVMLError_NoPermission, nvml.NVMLError_FunctionNotFound, _mismatch(nvml))
        used: dict[int, int | None] = {}
        listed = False
        for function in _PROCESS_LISTS:
            try:
                entries = self._list(function, index, handle)
            except ProbeError as error:
                # One list unreadable (a compute-only card's graphics list, bindings newer than
                # the driver): the other still attributes what it can; the rest of `used`
                # stays unattributed either way.
                if isinstance(error.__cause__, unlistable):
                    continue
                raise
            read = [(int(entry.pid), _bytes(entry.usedGpuMemory)) for entry in entries]
            # Bindings whose structure is not the driver's (nvidia-ml-py 12.535.77 with any later driver, later ones with
            # the early R535 drivers, 535.43 and 535.54, whose structure 12.535.77 declares)
            # misread every entry after the first: pids such as 4294967295, or more bytes than the GPU has. Such a list
            # is not attributed, as one the driver does not give, rather than its garbage counted as some process's.
            if any(pid >= PID_LIMIT or (size is not None and size > total) for pid, size in read):
                continue
            listed = True
            for pid, size in read:
                # A process with compute and graphics contexts appears in both lists with
                # the same memory, or one list lacks the figure: the larger is the truth.
                if pid in used and (size is None or (used[pid] or 0) > size):
                    size = used[pid]
                used[pid] = size
        if not listed:
            return None  # the driver lists no processes here: the whole `used` is unattributed
        processes = []
        for pid, size in used.items():
            # A process gone since NVML listed it keeps its bytes, with no name and no group.
            name, pgid, ancestors, started, leader = describe_process(pid)
            processes.append(GpuProcess(pid, name, size, pgid, ancestors, started, leader))
        return tuple(processes)

    def _list(self, function: str, gpu: int, handle: Any) -> Any:
        """A process list; asked again when processes started between the bindings' call for the count and
        their call for the list (more than the room they left for), which is no fault of the driver."""
        for _ in range(LIST_TRIES - 1):
            try:
                return self._call(function, gpu, handle)
            except ProbeError as error:
                if not isinstance(error.__cause__, self._nvml.NVMLError_InsufficientSize):
                    raise
        return self._call(function, gpu, handle)

    def _call(self, function: str, gpu: int | None, *args: Any) -> Any:
        nvml = self._nvml
        try:
            return getattr(nvml, function)(*args)
        except nvml.NVMLError as error:
            raise self._fault(function, gpu, error) from error
        except _mismatch(nvml) as error:
            raise ProbeError(f"{function}{_on(gpu)}: {error}") from error

    def _fault(self, function: str, gpu: int | None, error: Exception) -> ProbeError:
        nvml = self._nvml
        if isinstance(error, (nvml.NVMLError_LibraryNotFound, nvml.NVMLError_DriverNotLoaded)):
            self._initialised = False
            return ProbeError(f"no NVIDIA driver: {error} ({function})")
        if isinstance(error, nvml.NVMLError_Uninitialized):
            self._initialised = False  # the next sample initialises NVML again
        return ProbeError(f"{function}{_on(gpu)}: {error} (NVML error {getattr(error, 'value', '?')})")


class _NeverRaised(Exception):
    """Stands in for an error class that older bindings lack."""


def _mismatch(nvml: Any) -> type[Exception]:
    """Raised by an unversioned function the driver lacks; not an NVMLError."""
    mismatch: type[Exception] = getattr(nvml, "NVMLLibraryMismatchError", _NeverRaised)
    return mismatch


def _on(gpu: int | None) -> str:
    return "" if gpu is None else f" on GPU {gpu}"


def _text(value: str | bytes) -> str:
    """Older bindings return bytes, current ones str."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _bytes(value: int | None) -> int | None:
    """Unmeasured is absent, never zero."""
    return None if value is None or value == NOT_AVAILABLE else int(value)
