"""The budget of one accelerator (SPEC §2): seven figures from one reading and the live leases. Pure."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from gpubroker.broker.lease import Lease
from gpubroker.broker.probes import GpuProcess, GpuReading
from gpubroker.units import gib, rfc3339

FIGURES = ("total", "observed", "external", "resident", "leased", "reserve", "schedulable")
OVER_DECLARED_RATIO = 1.1


@dataclass(frozen=True, slots=True)
class Figures:
    """Always reported together, integers of bytes."""

    total: int
    observed: int
    external: int
    resident: int
    leased: int
    reserve: int
    schedulable: int

    @property
    def shortfall(self) -> int:
        """How far external usage has grown into leased or reserved memory (> 0 is pressure)."""
        return self.external + self.resident + self.leased + self.reserve - self.total

    def to_json(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in FIGURES}


@dataclass(frozen=True, slots=True)
class AttributedProcess:
    process: GpuProcess
    lease: str | None  # None: external


@dataclass(frozen=True, slots=True)
class Budget:
    reading: GpuReading
    figures: Figures
    unattributed: int | None  # external that no process list explains; None when unmeasured
    processes: tuple[AttributedProcess, ...]
    usage: dict[str, int]  # observed bytes per live lease on this accelerator
    leases: tuple[Lease, ...]

    @property
    def pressure(self) -> bool:
        return self.figures.shortfall > 0

    @property
    def exclusive_holder(self) -> str | None:
        return next((lease.id for lease in self.leases if lease.exclusive), None)

    def label(self) -> str:
        name = self.reading.name.replace("NVIDIA ", "").replace("GeForce ", "")
        return f"GPU {self.reading.index} ({name}, {gib(self.figures.total)} GiB)"

    def external_by_name(self) -> dict[str, int]:
        names: dict[str, int] = {}
        for item in self.processes:
            if item.lease is None and item.process.bytes:
                name = item.process.name or f"pid {item.process.pid}"
                names[name] = names.get(name, 0) + item.process.bytes
        return names

    def explain(self) -> str:
        """The figures as one sentence: what holds the room and what is left."""
        f = self.figures
        named = ", ".join(f"{name} {gib(size)}" for name, size in sorted(self.external_by_name().items()))
        external = f"{gib(f.external)} external" + (f" ({named})" if named else "")
        resident = f", {gib(f.resident)} resident" if f.resident else ""
        return f"{self.label()}: {external}{resident}, {gib(f.leased)} leased, {gib(f.reserve)} reserve → {gib(f.schedulable)} schedulable"

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.reading.index,
            "uuid": self.reading.uuid,
            "name": self.reading.name,
            "observed_at": rfc3339(self.reading.observed_at),
            "figures": self.figures.to_json(),
            "unattributed": self.unattributed,
            "pressure": self.pressure,
            "processes": [
                {"pid": p.process.pid, "name": p.process.name, "bytes": p.process.bytes, "lease": p.lease} for p in self.processes
            ],
            "leases": [{"id": lease.id, "holder": lease.holder.name, "bytes": lease.bytes_on(self.reading.index)} for lease in self.leases],
        }


def belongs_to(process: GpuProcess, lease: Lease) -> bool:
    """A lease's processes: its holder, the holder's descendants, and its registered process groups."""
    pid = lease.holder.pid
    if pid is not None and (process.pid == pid or pid in process.ancestors):
        return True
    return process.pgid is not None and process.pgid in lease.pgids


def compute_budgets(readings: Iterable[GpuReading], leases: Iterable[Lease], reserve: int) -> list[Budget]:
    """Every accelerator's budget: the live leases are grouped by GPU in one pass."""
    by_index: dict[int, list[tuple[Lease, int]]] = {}
    for lease in leases:
        if lease.live:
            for gpu in lease.gpus:
                by_index.setdefault(gpu.index, []).append((lease, gpu.bytes))
    return [compute_budget(reading, by_index.get(reading.index, ()), reserve) for reading in readings]


def compute_budget(reading: GpuReading, mine: Sequence[tuple[Lease, int]], reserve: int) -> Budget:
    """The seven figures of one accelerator from one reading and the live leases on it, with what each declared there."""
    usage = {lease.id: 0 for lease, _ in mine}
    attributed: list[AttributedProcess] = []
    for process in reading.processes or ():
        owner = next((lease.id for lease, _ in mine if belongs_to(process, lease)), None)
        attributed.append(AttributedProcess(process, owner))
        if owner is not None and process.bytes:
            usage[owner] += process.bytes
    observed = reading.used
    external = max(0, observed - sum(usage.values()))
    leased = sum(max(declared, usage[lease.id]) for lease, declared in mine)
    schedulable = max(0, reading.total - external - leased - reserve)
    unattributed: int | None
    if reading.processes is None:
        unattributed = external  # the driver lists no processes: nothing explains any of it
    elif any(p.process.bytes is None for p in attributed if p.lease is None):
        unattributed = None  # a listed process of unknown size: the remainder is unmeasured
    else:
        listed = sum(p.process.bytes or 0 for p in attributed if p.lease is None)
        unattributed = max(0, external - listed)
    figures = Figures(reading.total, observed, external, 0, leased, reserve, schedulable)
    return Budget(reading, figures, unattributed, tuple(attributed), usage, tuple(lease for lease, _ in mine))


def over_declared(budget: Budget) -> list[tuple[Lease, int]]:
    """Leases whose processes use more than 110% of what they declared, with what they use."""
    return [
        (lease, budget.usage[lease.id])
        for lease in budget.leases
        if budget.usage[lease.id] > OVER_DECLARED_RATIO * lease.bytes_on(budget.reading.index)
    ]
