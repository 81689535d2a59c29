"""A fake `pynvml` module: the real bindings' errors, constants and ctypes structures, fake GPUs.

Everything a caller can catch or read is the real thing: errors are the real
`pynvml.NVMLError_*` classes (built by `NVMLError(code)`, as the bindings do),
memory is a real `c_nvmlMemory_t`, process lists are built from real
`c_nvmlProcessInfo_t` structures the way the bindings build them. Only the
library behind them is fake, and like the real one it answers
`NVMLError_Uninitialized` before `nvmlInit()` or after the last `nvmlShutdown()`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pynvml

GIB = 2**30
# Above Linux's largest pid_max (2**22): NVML may list it, no process can ever have it.
VANISHED_PID = 2**22 + 123
NOT_AVAILABLE: int = pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value  # 2**64 - 1

# A listed process: (pid, bytes); None bytes is the driver's NVML_VALUE_NOT_AVAILABLE.
Listed = tuple[int, int | None]


# What NVML gives of a GPU in MIG mode as a whole only to root ("aggregate information"); per MIG device to anyone.
_WHOLE_CARD = ("nvmlDeviceGetMemoryInfo", "nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses")


@dataclass
class FakeGpu:
    """One fake accelerator as NVML would report it."""

    uuid: str = "GPU-00000000-fake-0000-0000-000000000000"
    name: str = "NVIDIA Fake 24GB"
    total: int = 24 * GIB
    used: int = 0
    compute: list[Listed] = field(default_factory=list)
    graphics: list[Listed] = field(default_factory=list)
    processes_not_supported: bool = False  # both process lists raise NVMLError_NotSupported
    lost: bool = False  # every call naming this GPU raises NVMLError_GpuIsLost
    # The next so many process lists raise NVMLError_InsufficientSize, as the bindings do when more processes
    # start between their call for the count and their call for the list than the room they left.
    lists_outgrown: int = 0
    errors: dict[str, int] = field(default_factory=dict)  # function name → NVML_ERROR_* it returns
    # NVML_DEVICE_MIG_ENABLE or _DISABLE; None: a GPU without MIG, whose nvmlDeviceGetMigMode is NVMLError_NotSupported.
    mig_mode: int | None = None
    # In MIG mode, its MIG devices by MIG index (None: no device at that index, NVMLError_NotFound). On the GPU
    # itself, memory and process lists are then the whole card's for root, NVMLError_NoPermission for anyone else.
    mig: list[FakeGpu | None] = field(default_factory=list)


@dataclass(frozen=True)
class FakeHandle:
    """Stands in for `c_nvmlDevice_t`: opaque to callers."""

    index: int
    mig: int | None = None  # a MIG device of GPU `index`, by its MIG index


class FakeNvml:
    """Pass an instance where the `pynvml` module is expected."""

    def __init__(
        self,
        gpus: list[FakeGpu] | None = None,
        *,
        driver_missing: bool = False,
        errors: dict[str, int] | None = None,
        bytes_strings: bool = False,
        raw_structs: bool = False,
        after_process_list: Callable[[int], None] | None = None,
        root: bool = True,
        unchecked_versions: bool = False,
    ) -> None:
        self.gpus = list(gpus or [])
        self.driver_missing = driver_missing  # nvmlInit raises NVMLError_LibraryNotFound
        self.errors = dict(errors or {})  # function name → NVML_ERROR_*, for functions without a GPU
        self.bytes_strings = bytes_strings  # UUID and name as bytes, as bindings before 11.5 gave them
        # Process lists as the raw structures, NOT_AVAILABLE unconverted, as older bindings gave them.
        self.raw_structs = raw_structs
        self.after_process_list = after_process_list  # called with the GPU index after each list
        self.root = root  # whether the caller may read a GPU in MIG mode as a whole
        # Bindings before 12.550 (no @throwOnVersionMismatch): a function the driver lacks is a bare FunctionNotFound.
        self.unchecked_versions = unchecked_versions
        self.calls: list[str] = []
        self.init_calls = 0
        self.shutdown_calls = 0
        self._refcount = 0
        # The real error classes and constants, so `except nvml.NVMLError_NotSupported` is the real test.
        for name in dir(pynvml):
            if name.startswith(("NVML_", "NVMLError", "c_nvml")) or name == "NVMLLibraryMismatchError":
                setattr(self, name, getattr(pynvml, name))

    def __getattr__(self, name: str) -> Any:
        # Only for names that are not set: a function the fake lacks is named, never the real one.
        raise AttributeError(f"the fake pynvml has no {name}: add it to FakeNvml")

    # The library ------------------------------------------------------------------------------

    def nvmlInit(self) -> None:
        self._enter("nvmlInit", initialised=False)
        if self.driver_missing:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
        self.init_calls += 1
        self._refcount += 1

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")
        self.shutdown_calls += 1
        self._refcount -= 1

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeHandle:
        self._enter("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.gpus):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        self._device("nvmlDeviceGetHandleByIndex", FakeHandle(index))
        return FakeHandle(index)

    def nvmlDeviceGetUUID(self, handle: FakeHandle) -> str | bytes:
        gpu = self._device("nvmlDeviceGetUUID", handle)
        return gpu.uuid.encode() if self.bytes_strings else gpu.uuid

    def nvmlDeviceGetName(self, handle: FakeHandle) -> str | bytes:
        gpu = self._device("nvmlDeviceGetName", handle)
        return gpu.name.encode() if self.bytes_strings else gpu.name

    def nvmlDeviceGetMemoryInfo(self, handle: FakeHandle) -> Any:
        gpu = self._device("nvmlDeviceGetMemoryInfo", handle)
        return pynvml.c_nvmlMemory_t(total=gpu.total, free=gpu.total - gpu.used, used=gpu.used)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: FakeHandle) -> list[Any]:
        gpu = self._unversioned("nvmlDeviceGetComputeRunningProcesses", handle)
        return self._process_list(handle, gpu, gpu.compute)

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: FakeHandle) -> list[Any]:
        gpu = self._unversioned("nvmlDeviceGetGraphicsRunningProcesses", handle)
        return self._process_list(handle, gpu, gpu.graphics)

    def nvmlDeviceGetMigMode(self, handle: FakeHandle) -> list[int]:
        gpu = self._device("nvmlDeviceGetMigMode", handle)
        if gpu.mig_mode is None or handle.mig is not None:
            raise pynvml.NVMLError_NotSupported()
        return [gpu.mig_mode, gpu.mig_mode]  # current and pending

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: FakeHandle) -> int:
        gpu = self._device("nvmlDeviceGetMaxMigDeviceCount", handle)
        return len(gpu.mig) if gpu.mig_mode == pynvml.NVML_DEVICE_MIG_ENABLE else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: FakeHandle, index: int) -> FakeHandle:
        gpu = self._device("nvmlDeviceGetMigDeviceHandleByIndex", handle)
        if gpu.mig_mode != pynvml.NVML_DEVICE_MIG_ENABLE or not 0 <= index < len(gpu.mig):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if gpu.mig[index] is None:
            raise pynvml.NVMLError_NotFound()
        return FakeHandle(handle.index, index)

    # How the real library behaves ----------------------------------------------------------------

    def _enter(self, function: str, *, initialised: bool = True) -> None:
        self.calls.append(function)
        if initialised and self._refcount <= 0:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        if function in self.errors:
            raise pynvml.NVMLError(self.errors[function])

    def _device(self, function: str, handle: FakeHandle) -> FakeGpu:
        if function != "nvmlDeviceGetHandleByIndex":
            self._enter(function)
        gpu = self.gpus[handle.index]
        if gpu.lost:
            raise pynvml.NVMLError_GpuIsLost()
        if handle.mig is not None:
            mig = gpu.mig[handle.mig]
            assert mig is not None
            gpu = mig
        elif gpu.mig_mode == pynvml.NVML_DEVICE_MIG_ENABLE and not self.root and function in _WHOLE_CARD:
            raise pynvml.NVMLError_NoPermission()
        if function in gpu.errors:
            raise pynvml.NVMLError(gpu.errors[function])
        return gpu

    def _unversioned(self, function: str, handle: FakeHandle) -> FakeGpu:
        # The bindings' @throwOnVersionMismatch: a driver older than the function they call.
        try:
            return self._device(function, handle)
        except pynvml.NVMLError_FunctionNotFound:
            if self.unchecked_versions:
                raise
            raise pynvml.NVMLLibraryMismatchError(f"Unversioned function called: {function}") from None

    def _process_list(self, handle: FakeHandle, gpu: FakeGpu, listed: list[Listed]) -> list[Any]:
        if gpu.processes_not_supported:
            raise pynvml.NVMLError_NotSupported()
        if gpu.lists_outgrown > 0:
            gpu.lists_outgrown -= 1
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
        processes: list[Any] = []
        for pid, size in listed:
            struct = pynvml.c_nvmlProcessInfo_t(pid=pid, usedGpuMemory=NOT_AVAILABLE if size is None else size)
            if self.raw_structs:
                processes.append(struct)
                continue
            # What the bindings do with each structure the library fills in.
            friendly = pynvml.nvmlStructToFriendlyObject(struct)
            if friendly.usedGpuMemory == NOT_AVAILABLE:
                friendly.usedGpuMemory = None
            processes.append(friendly)
        if self.after_process_list is not None:
            self.after_process_list(handle.index)
        return processes
