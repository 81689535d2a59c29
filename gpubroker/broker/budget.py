"""The budget of one accelerator (SPEC §2): seven figures from one reading and the live leases. Pure."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
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

    def to_json(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in FIGURES}


@dataclass(frozen=True, slots=True)
class AttributedProcess:
    process: GpuProcess
    lease: str | None  # None: external


@dataclass(slots=True)
class GpuLeases:
    """The live leases on one accelerator, kept up to date as leases come and go (no walk over all leases)."""

    held: dict[str, tuple[Lease, int]] = field(default_factory=dict)  # id -> (lease, bytes declared here)
    declared: int = 0
    exclusive: str | None = None

    def add(self, lease: Lease, size: int) -> None:
        self.held[lease.id] = (lease, size)
        self.declared += size
        if lease.exclusive:
            self.exclusive = lease.id

    def remove(self, lease_id: str) -> None:
        entry = self.held.pop(lease_id, None)
        if entry is not None:
            self.declared -= entry[1]
            if self.exclusive == lease_id:
                self.exclusive = None


@dataclass(frozen=True, slots=True)
class Budget:
    reading: GpuReading
    figures: Figures
    unattributed: int | None  # external that no process list explains; None when unmeasured
    processes: tuple[AttributedProcess, ...]
    usage: dict[str, int]  # observed bytes per lease whose processes use memory here
    held: GpuLeases

    @property
    def leases(self) -> list[Lease]:
        return [lease for lease, _ in self.held.held.values()]

    @property
    def shortfall(self) -> int:
        """How far external usage has grown into leased or reserved memory (> 0 is pressure): into what the leases
        declared, not what they use (a lease using more than it declared is over-declared, not pressed), and never
        more than the external usage itself (a GPU smaller than its reserve, with nothing else on it, is not pressed)."""
        f = self.figures
        return min(f.external, f.external + f.resident + self.held.declared + f.reserve - f.total)

    @property
    def pressure(self) -> bool:
        return self.shortfall > 0

    @property
    def exclusive_holder(self) -> str | None:
        return self.held.exclusive

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

    def leases_json(self) -> list[dict[str, Any]]:
        """Each lease here: what it declared (`bytes`) and what its processes use here (`used`)."""
        return [
            {"id": lease.id, "holder": lease.holder.name, "bytes": declared, "used": self.usage.get(lease.id, 0)}
            for lease, declared in self.held.held.values()
        ]

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
            "leases": self.leases_json(),
        }


class Owners:
    """Which live leases on one accelerator own which processes, indexed once per budget: by holder pid and by
    registered group, so a process is matched by looking up its own line, not by asking every lease.

    A lease's processes are its holder, the holder's descendants, and its registered process groups. A process may
    be owned by several leases: leases nest (a `gpubroker lease -- CMD` inside another's CMD, a program that takes a
    lease of its own from inside leased work), and then every enclosing lease's holder is an ancestor. Its memory is
    the nearest one's: by the place in the process's line (itself, its parent, ...) of the lease's holder or of the
    leader of a group registered with it. At one place a group comes before a holder: a shell that ran work in the
    background and then exec'd the inner `gpubroker lease` is both that work's group leader, for the outer lease,
    and the inner lease's holder. A group whose leader is gone, or not in the line, comes after every holder in it.
    Where two leases are as near, the one granted first (the lower lease epoch) owns it. A group whose leader started
    after it was registered is another group, with its id reused, and no lease's."""

    def __init__(self, held: GpuLeases) -> None:
        self._by_holder: dict[int, list[tuple[int, tuple[Lease, int]]]] = {}
        self._by_group: dict[int, list[tuple[int, float | None, tuple[Lease, int]]]] = {}
        for entry in held.held.values():
            # The order of grants is the lease epoch's, not the order held here: a restarted broker holds its leases in
            # the store's order, by their random ids.
            lease = entry[0]
            if lease.holder.pid is not None:
                self._by_holder.setdefault(lease.holder.pid, []).append((lease.epoch, entry))
            if lease.pgids:
                for pgid, started in zip(lease.pgids, lease.groups_started(), strict=True):
                    self._by_group.setdefault(pgid, []).append((lease.epoch, started, entry))

    def of(self, process: GpuProcess) -> tuple[Lease, int] | None:
        """The live lease here that owns a process, and what it declared here; None when none does."""
        best: tuple[tuple[int, int, int], tuple[Lease, int]] | None = None
        line = (process.pid, *process.ancestors)
        if self._by_holder:
            for place, pid in enumerate(line):
                for order, entry in self._by_holder.get(pid, ()):
                    if process.same_as(place, entry[0].holder.start_time) and (best is None or (place, 1, order) < best[0]):
                        best = ((place, 1, order), entry)
        if process.pgid is not None and process.pgid in self._by_group:
            place = line.index(process.pgid) if process.pgid in line else len(line)
            for order, started, entry in self._by_group[process.pgid]:
                if process.in_group_since(started) and (best is None or (place, 0, order) < best[0]):
                    best = ((place, 0, order), entry)
        return None if best is None else best[1]


def leases_by_gpu(leases: Iterable[Lease]) -> dict[str, GpuLeases]:
    """The live leases grouped by accelerator UUID, in one pass. By UUID, not index: a lease stays on its own
    card when the driver numbers the cards differently (one removed, their order changed at a reboot)."""
    by_uuid: dict[str, GpuLeases] = {}
    for lease in leases:
        if lease.live:
            for gpu in lease.gpus:
                by_uuid.setdefault(gpu.uuid, GpuLeases()).add(lease, gpu.bytes)
    return by_uuid


def compute_budgets(readings: Iterable[GpuReading], by_uuid: dict[str, GpuLeases], reserve: int) -> list[Budget]:
    return [compute_budget(reading, by_uuid.get(reading.uuid) or GpuLeases(), reserve) for reading in readings]


def compute_budget(reading: GpuReading, held: GpuLeases, reserve: int) -> Budget:
    """The seven figures of one accelerator from one reading and the live leases on it."""
    usage: dict[str, int] = {}
    excess = 0  # what leases' processes use beyond what they declared: a lease counts what it uses
    attributed: list[AttributedProcess] = []
    owners: Owners | None = None  # made at the first process: most readings of a simulated GPU list none
    for process in reading.processes or ():
        owners = owners or Owners(held)
        owner = owners.of(process)
        attributed.append(AttributedProcess(process, owner[0].id if owner else None))
        if owner is not None and process.bytes:
            usage[owner[0].id] = usage.get(owner[0].id, 0) + process.bytes
    observed = reading.used
    # A lease's process the driver lists without its size (some containers, WDDM): its memory is in `observed` but in
    # no listed size. Taken as the lease's up to what the lease declared, of what no listed size accounts for, it is
    # not also external: the lease counts its declared bytes anyway, so this frees no room that may be in use.
    presumed = 0
    unsized = dict.fromkeys(a.lease for a in attributed if a.lease is not None and a.process.bytes is None)
    if unsized:
        rest = observed - sum(a.process.bytes or 0 for a in attributed)
        for lease_id in unsized:
            take = max(0, min(rest - presumed, held.held[lease_id][1] - usage.get(lease_id, 0)))
            presumed += take
    for lease_id, used in usage.items():
        excess += max(0, used - held.held[lease_id][1])
    external = max(0, observed - sum(usage.values()) - presumed)
    leased = held.declared + excess
    schedulable = max(0, reading.total - external - leased - reserve)
    unattributed: int | None
    if reading.processes is None:
        unattributed = external  # the driver lists no processes: nothing explains any of it
    elif any(p.process.bytes is None for p in attributed):
        unattributed = None  # a listed process of unknown size, a lease's or not: the remainder is unmeasured
    else:
        listed = sum(p.process.bytes or 0 for p in attributed if p.lease is None)
        unattributed = max(0, external - listed)
    figures = Figures(reading.total, observed, external, 0, leased, reserve, schedulable)
    return Budget(reading, figures, unattributed, tuple(attributed), usage, held)


def over_declared(budget: Budget) -> list[tuple[Lease, int]]:
    """Leases whose processes use more than 110% of what they declared, with what they use."""
    return [
        (budget.held.held[lease_id][0], used)
        for lease_id, used in budget.usage.items()
        if used > OVER_DECLARED_RATIO * budget.held.held[lease_id][1]
    ]
