"""Fakes over Protocols: a clock the test moves, a GPU probe the test fills."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from gpubroker.broker.probes import GpuProcess, GpuReading, GpusUnreadable, ProbeError, UnreadableGpu

GIB = 2**30


@dataclass
class FakeClock:
    """Time stands still until the test moves it: `advance` moves both clocks, `step` the wall clock alone (as NTP)."""

    t: float = 1_800_000_000.0
    wall: float = 0.0  # how far the wall clock was stepped from the elapsed one

    def now(self) -> float:
        return self.t + self.wall

    def elapsed(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds

    def step(self, seconds: float) -> None:
        self.wall += seconds


@dataclass
class FakeGpuProbe:
    """GPUs of given sizes; `external` sets what other processes use; `error` makes sampling fail, `unreadable` one GPU's."""

    clock: FakeClock
    sizes: list[int] = field(default_factory=lambda: [24 * GIB])
    processes: dict[int, list[GpuProcess]] = field(default_factory=dict)
    error: str | None = None
    processes_listed: bool = True
    uuids: list[str] | None = None  # each GPU's UUID, by index; GPU-fake-<index> unless given
    unreadable: dict[int, str] = field(default_factory=dict)  # GPUs by index that the driver cannot read, and why
    closed: bool = False  # whether the broker let the probe go
    unlisted: dict[int, int] = field(default_factory=dict)  # bytes in use by GPU index that no listed size accounts for

    def external(self, index: int, size: int, name: str = "ollama", pid: int = 900001) -> None:
        self.processes[index] = [p for p in self.processes.get(index, []) if p.pid != pid]
        if size:
            self.processes[index].append(GpuProcess(pid, name, size))

    def close(self) -> None:
        self.closed = True

    def sample(self) -> list[GpuReading]:
        if self.error is not None:
            raise ProbeError(self.error)
        readings, unreadable = [], []
        for index, total in enumerate(self.sizes):
            uuid = self.uuids[index] if self.uuids else f"GPU-fake-{index}"
            if index in self.unreadable:
                unreadable.append(UnreadableGpu(index, uuid, self.unreadable[index]))
                continue
            listed = tuple(self.processes.get(index, []))
            used = min(total, sum(p.bytes or 0 for p in listed) + self.unlisted.get(index, 0))
            reading = GpuReading(index, uuid, "NVIDIA GeForce RTX 4090", total, used, self.clock.now(), listed)
            readings.append(reading if self.processes_listed else replace(reading, processes=None))
        if unreadable:
            raise GpusUnreadable(readings, unreadable)
        return readings
