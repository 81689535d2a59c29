"""Where a request fits now, or why not: `place()` returns a Placement or a Refusal. Pure, no I/O."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpubroker.broker.budget import Budget
from gpubroker.broker.probes import UnreadableGpu
from gpubroker.broker.request import LeaseRequest
from gpubroker.errors import FailureCode, Refusal
from gpubroker.units import gib, short_by


@dataclass(frozen=True, slots=True)
class HostBudget:
    cores: int
    leased_cores: int
    memory: int
    leased_memory: int

    def to_json(self) -> dict[str, Any]:
        return {
            "cpu": {"cores": self.cores, "leased": self.leased_cores, "schedulable": max(0, self.cores - self.leased_cores)},
            "memory": {"total": self.memory, "leased": self.leased_memory, "schedulable": max(0, self.memory - self.leased_memory)},
        }


@dataclass(frozen=True, slots=True)
class Placement:
    gpus: tuple[tuple[int, int], ...]  # (index, bytes) per granted accelerator


def candidates(request: LeaseRequest, budgets: Sequence[Budget]) -> list[Budget]:
    """The accelerators a request could use: the pinned one, or all of them."""
    if request.gpu is None:
        return list(budgets)
    return [b for b in budgets if request.gpu in (b.reading.index, b.reading.uuid)]


def could_use(request: LeaseRequest, budgets: Sequence[Budget]) -> list[Budget]:
    """The accelerators a request could use once room is made: its candidates that can lease what it asks for per
    GPU even when empty. A waiting request claims these alone: a card too small for it is never held back for it."""
    return [b for b in candidates(request, budgets) if _large_enough(request, b)]


def _large_enough(request: LeaseRequest, budget: Budget) -> bool:
    return request.gpu_memory <= budget.figures.total - budget.figures.reserve


def _room(request: LeaseRequest, budget: Budget) -> int | None:
    """Bytes this request would get on this accelerator, or None if it does not fit."""
    if budget.exclusive_holder is not None:
        return None
    if request.exclusive:
        if budget.held.held:
            return None
        room = budget.figures.total - budget.figures.external - budget.figures.resident - budget.figures.reserve
        return room if room > 0 and room >= request.gpu_memory else None
    return request.gpu_memory if budget.figures.schedulable >= request.gpu_memory else None


def _figures(budget: Budget) -> dict[str, Any]:
    return {
        "gpu": budget.reading.uuid,
        "index": budget.reading.index,
        "figures": budget.figures.to_json(),
        "external_processes": budget.external_by_name(),
        "leases": budget.leases_json(),
    }


CPU_CORES = "CPU cores"
HOST_MEMORY = "host memory"
# What a waiting request may hold back from the requests behind it: an accelerator by its index, the host's CPU
# cores or memory by these names.
Claim = int | str


def host_claims(request: LeaseRequest, host: HostBudget, claimed: Collection[Claim] = ()) -> set[str]:
    """The host's resources a waiting request holds back from the requests behind it: CPU cores or host memory where
    it asks for more than is schedulable, or where a request ahead of it holds them back already. Where it has enough
    of them (it waits for a GPU), those behind it may take them: no core sits idle for a request that waits for a GPU."""
    return {what for what, need, total, leased, _, _ in _host_needs(request, host) if need > total - leased or what in claimed}


def _host_needs(request: LeaseRequest, host: HostBudget) -> Iterator[tuple[str, int, int, int, Callable[[int], str], dict[str, Any]]]:
    """The host's resources a request asks for, each as its refusals name it: what, how much is asked, the total, how
    much is leased, how an amount is written, and the refusal's details."""
    for what, need, total, leased in (
        (CPU_CORES, request.cpu_cores, host.cores, host.leased_cores),
        (HOST_MEMORY, request.memory, host.memory, host.leased_memory),
    ):
        if need:
            show: Callable[[int], str] = (lambda v: f"{gib(v)} GiB") if what == HOST_MEMORY else str
            details = {"resource": what, "need": need, "total": total, "leased": leased, "schedulable": max(0, total - leased)}
            yield what, need, total, leased, show, details


def _host_capability(request: LeaseRequest, host: HostBudget) -> Refusal | None:
    """More cores or memory than the machine has: no release can make room for it."""
    for what, need, total, _, show, details in _host_needs(request, host):
        if need > total:
            short = short_by(need, total, "in all") if what == HOST_MEMORY else ""
            return Refusal(
                FailureCode.CAPABILITY_UNAVAILABLE, f"{what}: this node has {show(total)} in all; needs {show(need)}{short}", details
            )
    return None


def _host_room(request: LeaseRequest, host: HostBudget, blocked: Mapping[Claim, Sequence[str]]) -> Refusal | None:
    """Too few cores or too little memory free now, or what is free is claimed by a request waiting ahead."""
    for what, need, total, leased, show, details in _host_needs(request, host):
        figures = f"{what}: {show(total)} in all, {show(leased)} leased → {show(max(0, total - leased))} schedulable"
        if what in blocked:  # held back for a request of a higher class, or an earlier one of its own, as a GPU is
            ahead = blocked[what]
            return Refusal(
                FailureCode.LEASE_CONFLICT,
                f"{figures}; claimed by requests waiting ahead{_ahead(ahead)}; needs {show(need)}",
                {**details, "waiting_ahead": {what: list(ahead)}},
            )
        if need > total - leased:
            short = short_by(need, total - leased) if what == HOST_MEMORY else ""
            return Refusal(FailureCode.LEASE_CONFLICT, f"{figures}; needs {show(need)}{short}", details)
    return None


def place(
    request: LeaseRequest,
    budgets: Sequence[Budget],
    host: HostBudget,
    *,
    now: float,
    staleness: float,
    blocked: Mapping[Claim, Sequence[str]] | None = None,
    driver_error: str | None = None,
    unreadable: Sequence[UnreadableGpu] = (),
) -> Placement | Refusal:
    """Where the request fits now; `blocked` accelerators (and the host's CPU cores or memory) are claimed by requests
    waiting ahead of it (each with those requests, as a refusal names them, first ahead first); `unreadable`
    ones are listed by the driver but cannot be read, so nothing is placed on them."""
    blocked = blocked or {}
    # What no release can change is said first: a request the node can never serve is refused so, not queued.
    refusal = _host_capability(request, host)
    if refusal is not None:
        return refusal
    if not request.wants_gpus:
        return _host_room(request, host, blocked) or Placement(())
    if driver_error is not None:
        return Refusal(FailureCode.DRIVER_ERROR, f"GPUs cannot be read: {driver_error}", {"driver_error": driver_error})
    usable = candidates(request, budgets)
    # A pin matches an unreadable card by its index or UUID; by a UUID no card read has, also a card whose UUID is
    # unknown (not even its handle could be had): it may be the card asked for.
    unread = [
        u
        for u in unreadable
        if request.gpu is None or request.gpu in (u.index, u.uuid) or (u.uuid is None and isinstance(request.gpu, str) and not usable)
    ]
    if request.gpu is not None and unread and not usable:
        gpu = unread[0]
        return Refusal(
            FailureCode.DRIVER_ERROR,
            f"{gpu.label()} cannot be read: {gpu.error}; it is not offered until it can be read again",
            {"gpu": gpu.uuid, "index": gpu.index, "driver_error": gpu.error, "unreadable": [gpu.to_json()]},
        )
    if unread and request.gpus > len(usable):  # the cards that cannot be read might have served it
        return _unreadable_refusal(f"{request.gpus} GPU{'s' if request.gpus > 1 else ''} asked for; {len(usable)} can be read", unread)
    if request.gpu is not None and not usable:
        gpus = ", ".join(f"{b.reading.index} ({b.reading.uuid})" for b in budgets) or "none"
        return Refusal(FailureCode.CAPABILITY_UNAVAILABLE, f"no GPU {request.gpu!r} on this node; it has: {gpus}", {"gpu": request.gpu})
    if request.gpus > len(usable):
        return Refusal(
            FailureCode.CAPABILITY_UNAVAILABLE,
            f"{request.gpus} GPU{'s' if request.gpus > 1 else ''} asked for; this node has {len(usable)}",
            {"need_gpus": request.gpus, "gpus": len(usable)},
        )
    large_enough = [b for b in usable if _large_enough(request, b)]
    if len(large_enough) < request.gpus:  # it cannot fit even on an empty GPU: waiting would never end
        largest = max(usable, key=lambda b: (b.figures.total - b.figures.reserve, -b.reading.index))
        asked = f"{gib(request.gpu_memory)} GiB"
        if request.exclusive:  # refused for the bytes it names at least, which no GPU here has
            asked = f"the whole GPU with at least {asked}" if request.gpu_memory else "the whole GPU"
        # Pinned, the one GPU asked for is named as such, not as "the largest here" when a larger one may be here.
        here = "that can be read" if unread else "here"
        which = f"the GPU pinned, {largest.label()}" if request.gpu is not None else f"the largest {here}, {largest.label()}"
        if large_enough:  # several asked for, and some are large enough: what decides is the largest of the others
            largest = max(
                (b for b in usable if b not in large_enough), key=lambda b: (b.figures.total - b.figures.reserve, -b.reading.index)
            )
            which = f"only {len(large_enough)} GPU{'s' if len(large_enough) > 1 else ''} {here} can lease that much; the next largest, {largest.label()}"
        most = largest.figures.total - largest.figures.reserve
        if unread:  # what a card that cannot be read could lease is not known: it is no reason to give up waiting
            return _unreadable_refusal(
                f"{asked} asked for on {request.gpus} GPU{'s' if request.gpus > 1 else ''}; "
                f"{which}, can lease at most {gib(max(0, most))} GiB",
                unread,
            )
        return Refusal(
            FailureCode.CAPABILITY_UNAVAILABLE,
            f"{asked} asked for on {request.gpus} GPU{'s' if request.gpus > 1 else ''}; "
            f"{which}, can lease {f'at most {gib(most)} GiB' if most > 0 else 'nothing'} "
            f"(its total less the {gib(largest.figures.reserve)} GiB reserve)"
            f"{short_by(request.gpu_memory, most, 'it can lease')}",
            {"need": request.gpu_memory, "need_gpus": request.gpus, **_figures(largest)},
        )
    refusal = _host_room(request, host, blocked)
    if refusal is not None:
        return refusal
    fresh = [b for b in usable if now - b.reading.observed_at <= staleness]
    if len(fresh) < request.gpus:
        stale = [b for b in usable if b not in fresh]
        ages = ", ".join(f"GPU {b.reading.index} read {now - b.reading.observed_at:.1f}s ago" for b in stale)
        return Refusal(
            FailureCode.SCHEDULER_STATE_STALE,
            f"{ages}; decisions need a reading under {staleness:.1f}s old",
            {"staleness": staleness, "ages": {b.reading.uuid: round(now - b.reading.observed_at, 3) for b in stale}},
        )
    open_ = [b for b in fresh if b.reading.index not in blocked]
    fitting = [(b, room) for b in open_ if (room := _room(request, b)) is not None]
    if len(fitting) >= request.gpus:
        # Best fit: the fullest accelerator that still fits keeps large holes for large requests. The chosen ones are
        # given in index order, so that the work's CUDA device 0 is the lowest, as the driver numbers them.
        fitting.sort(key=lambda item: (item[0].figures.schedulable, item[0].reading.index))
        return Placement(tuple(sorted((b.reading.index, room) for b, room in fitting[: request.gpus])))
    refusal = _refuse(request, fresh, blocked)
    if unread:  # decided on the cards that can be read; the others are named, since they might have served it
        unreadable_json = [u.to_json() for u in unread]
        cannot = "; ".join(f"{u.label()} cannot be read" for u in unread)
        return Refusal(refusal.code, f"{refusal.message}; {cannot}", {**refusal.details, "unreadable": unreadable_json})
    return refusal


def _explain(budget: Budget) -> str:
    """A GPU's figures in a refusal; a pressed one says so, and by how much, whichever the refusal's code: its figures
    add up to more than its total."""
    if not budget.pressure:
        return budget.explain()
    return f"{budget.explain()} (external usage has grown {gib(budget.shortfall)} into leased or reserved memory)"


def _ahead(requests: Sequence[str]) -> str:
    """The requests that claim a GPU (or the host's cores or memory), as a refusal names them: the first few, first ahead first."""
    if not requests:
        return ""
    more = f" and {len(requests) - 3} more" if len(requests) > 3 else ""
    return f" ({', '.join(requests[:3])}{more})"


def _unreadable_refusal(what: str, unread: Sequence[UnreadableGpu]) -> Refusal:
    """A request that only cards the driver cannot read could serve: a fault of the driver, not a lack of room."""
    why = "; ".join(f"{u.label()} cannot be read: {u.error}" for u in unread)
    return Refusal(FailureCode.DRIVER_ERROR, f"{what}; {why}", {"driver_error": why, "unreadable": [u.to_json() for u in unread]})


def _refuse(request: LeaseRequest, fresh: list[Budget], blocked: Mapping[Claim, Sequence[str]]) -> Refusal:
    need = request.gpu_memory
    # The figures that decide are those of the GPUs that could hold it once room is made: a card too small for it even
    # when empty is no reason, however much room it has. They are named first, with the most room first.
    able = [b for b in fresh if _large_enough(request, b)] or fresh
    ranked = sorted(fresh, key=lambda b: (b not in able, -b.figures.schedulable, b.reading.index))
    best = ranked[0]
    # With several GPUs asked for, what decides is the room of the last one it would need, not of the best.
    nth = ranked[min(request.gpus, len(able)) - 1]
    if request.exclusive:
        needs = "needs the whole GPU" if request.gpus == 1 else f"needs {request.gpus} whole GPUs"
        if need:  # the whole GPU, as long as it has that much: the figure that decided it is named
            needs += f", with at least {gib(need)}{' each' if request.gpus > 1 else ''}{short_by(need, nth.figures.schedulable)}"
    elif request.gpus > 1:
        needs = f"needs {request.gpus} GPUs with {gib(need)} each{short_by(need, nth.figures.schedulable)}"
    else:
        needs = f"needs {gib(need)}{short_by(need, best.figures.schedulable)}"
    details: dict[str, Any] = {"need": need, "need_gpus": request.gpus, **_figures(best)}
    if len(fresh) > 1:
        details["considered"] = [_figures(b) for b in fresh]
    waiting = [b for b in fresh if b.reading.index in blocked and _room(request, b) is not None]
    if waiting:
        details["waiting_ahead_on"] = [b.reading.uuid for b in waiting]
        details["waiting_ahead"] = {b.reading.uuid: list(blocked[b.reading.index]) for b in waiting}
        claimed = [f"{b.explain()}; claimed by requests waiting ahead{_ahead(blocked[b.reading.index])}" for b in waiting]
        # The other GPUs are named too, with the room that keeps them out: "claimed" alone does not say why not those.
        others = [_explain(b) for b in ranked if b not in waiting]
        message = "; ".join([*claimed, *others[: max(0, 4 - len(claimed))]])
        return Refusal(FailureCode.INSUFFICIENT_SCHEDULABLE_VRAM, f"{message}; {needs}", details)
    # Held is what decides only on a GPU large enough for the request: on a smaller one it would not fit if free.
    held = [b for b in fresh if (b.exclusive_holder or (request.exclusive and b.leases)) and _large_enough(request, b)]
    free = [b for b in fresh if b not in held and _large_enough(request, b)]
    if held and len(free) < request.gpus:  # too few GPUs that could hold it are free of the leases that hold the others
        owners = [
            f"{b.label()} held whole by {b.exclusive_holder}"
            if b.exclusive_holder
            else f"{b.label()} held by {', '.join(x.id for x in b.leases)}"
            for b in held
        ]
        # The other GPUs with their figures: why those would not do either.
        others = [_explain(b) for b in ranked if b not in held]
        message = "; ".join([*owners, *others[: max(0, 4 - len(owners))]])
        return Refusal(FailureCode.LEASE_CONFLICT, f"{message}; {needs}", details)
    pressed = [b for b in able if b.pressure]
    code = FailureCode.EXTERNAL_GPU_PRESSURE if len(pressed) == len(able) else FailureCode.INSUFFICIENT_SCHEDULABLE_VRAM
    shown = ranked[:4]
    message = "; ".join(_explain(b) for b in shown)
    return Refusal(code, f"{message}; {needs}", details)
