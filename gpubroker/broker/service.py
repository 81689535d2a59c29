"""The broker of one node: requests, the queue, grants, renewals, releases, expiry and sampling.

Decisions are made on the event loop, one at a time, so two requests can never
be granted the same free bytes; the grant is reserved in memory at once and
answered only after the store has synced it.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import os
import pwd
import secrets
import struct
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypeVar

from gpubroker import __version__
from gpubroker.broker import holders
from gpubroker.broker.budget import Budget, GpuLeases, compute_budget, compute_budgets, leases_by_gpu, over_declared
from gpubroker.broker.decide import CPU_CORES, HOST_MEMORY, Claim, HostBudget, Placement, could_use, host_claims, place
from gpubroker.broker.lease import ENDED, LIVE, Holder, Lease, LeasedGpu, hash_token, new_lease_id, new_token, unknown_fields
from gpubroker.broker.probes import GpuProbe, GpuReading, GpusUnreadable, HostReading, ProbeError, UnreadableGpu, sample_host
from gpubroker.broker.request import LeaseRequest
from gpubroker.broker.store import PRUNE_EVERY, Store, StoreDamaged, Write, key_seq, seq_key
from gpubroker.config import CLASSES, Config
from gpubroker.errors import BrokerError, FailureCode, Forbidden, InvalidRequest, NotFound, Refusal, StoreFull
from gpubroker.units import gib, host_part, log_line, rfc3339
from gpubroker.work import said_stopped

RANK = {name: rank for rank, name in enumerate(CLASSES)}


class Clock(Protocol):
    def now(self) -> float: ...  # the wall clock: what times are shown and stored as

    def elapsed(self) -> float: ...  # a clock that only moves forward at one pace: what a lease's TTL is measured on


class SystemClock:
    def now(self) -> float:
        return time.time()

    def elapsed(self) -> float:
        return time.monotonic()


# The kinds of admin, who may act on any lease: one signed in to the web UI, one holding the node's API token,
# and, when a member forwards a release for them, root or the broker's own user on that member's socket.
WEB_UI, API_TOKEN = "the web UI", "the API token"
ROOT_ON_SOCKET, OWN_USER_ON_SOCKET = "root on the Unix socket", "the broker's own user on the Unix socket"
ADMINS = (WEB_UI, API_TOKEN, ROOT_ON_SOCKET, OWN_USER_ON_SOCKET)


@dataclass(frozen=True, slots=True)
class Caller:
    """Who is asking: on the Unix socket the kernel says (SO_PEERCRED); on TCP nobody does."""

    transport: str  # "unix", "tcp" or "peer" (a member forwarding a request)
    uid: int | None = None
    pid: int | None = None
    start_time: float | None = None  # on the Unix socket, when the caller's process started: read once per connection
    # On loopback TCP, the uid the kernel lists as owning the caller's end (/proc/net/tcp): whom [[stamp]] user
    # applies to, so that a stamped user cannot leave its class by asking over TCP. It authorises nothing.
    tcp_uid: int | None = None
    admin: str | None = None  # one of ADMINS: this caller may act on any lease
    admin_of: str | None = None  # the node whose admin it is, where that is worth saying

    @property
    def admin_name(self) -> str | None:
        """The admin as events and reasons name it: "the web UI of tower"."""
        if self.admin is None:
            return None
        return f"{self.admin} of {self.admin_of}" if self.admin_of else self.admin

    @property
    def user(self) -> str | None:
        """The Unix user stamps apply to: the socket's caller, or the owner of a loopback TCP caller's end."""
        uid = self.uid if self.uid is not None else self.tcp_uid
        return None if uid is None else _user_name(uid)


def socket_admin(uid: int | None) -> bool:
    """Whether a Unix-socket caller of this uid is the broker's admin there: root, or the user the broker runs as (who may
    stop it in any case)."""
    return uid is not None and uid in (0, os.geteuid())


def _user_called(uid: int) -> str:
    """A Unix user as reasons and events name it: `user alice (uid 1000)`, or `uid 1234` for one with no passwd entry."""
    name = _user_name(uid)
    return f"uid {uid}" if name == str(uid) else f"user {name} (uid {uid})"


def _user_name(uid: int) -> str:
    """The Unix user's name, or the uid itself for one with no passwd entry."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


@dataclass(eq=False, slots=True)
class Waiter:
    id: str
    request: LeaseRequest
    caller: Caller
    holder: Holder
    bind: str
    seq: int
    enqueued_at: float
    granted: asyncio.Future[tuple[Lease, str]]
    reason: str = ""
    # Whether it holds back the accelerators it could use from requests behind it: not while only cards the driver
    # cannot read keep it out (a card fallen off the bus may not be back before a reboot).
    claims: bool = True
    lease: Lease | None = None  # set once granted in memory, before it is durable

    @property
    def order(self) -> tuple[int, int]:
        return RANK[self.request.priority], self.seq


@dataclass(slots=True)
class _Reclaim:
    lease: str
    uuid: str
    pids: frozenset[int]
    started: dict[int, float]  # the start times of those known: a process that reuses one of the pids is not left over
    released_at: float  # on the elapsed clock: reclaim_grace is elapsed time, whatever NTP does to the wall clock
    reported: bool = False


RESTOP_WITHIN = 60.0  # seconds past kill_grace in which a restarted broker stops again the groups of leases that had ended
# A grant's latency includes its wait in the queue: from a synced commit's half a millisecond to waits of an hour.
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0, 30.0, 60.0, 300.0, 900.0, 3600.0)


@dataclass(slots=True)
class Stats:
    """Decisions by result code and how long grants took: plain counts, read by the metrics at scrape time."""

    # Every result a request can have, from 0: a series that first appears at 1 is no increase to Prometheus, so an
    # alert on a rare refusal (the one STORE_FULL of a run) would never see it.
    results: dict[str, int] = field(default_factory=lambda: dict.fromkeys(("GRANTED", *(c.value for c in FailureCode)), 0))
    grant_buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))  # the last is +Inf
    grant_seconds: float = 0.0

    def record(self, code: str, seconds: float) -> None:
        self.results[code] = self.results.get(code, 0) + 1
        if code == "GRANTED":
            self.grant_buckets[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
            self.grant_seconds += seconds


class RefusalBudget:
    """At most RATE refusal events a second, in bursts of BURST, the broker's and the API's together: a flood
    of bad requests must not become a flood of synced writes. Those not kept are counted, and the next one
    kept says how many (`details.not_kept_before`)."""

    RATE = 20.0
    BURST = 100.0

    def __init__(self, now: Callable[[], float]) -> None:
        self._now = now
        self.tokens = self.BURST
        self.at = now()
        self.not_kept = 0

    def keep(self, details: dict[str, Any]) -> dict[str, Any] | None:
        """The details to keep this refusal's event with (counting those not kept since), or None: not kept."""
        now = self._now()
        self.tokens = min(self.BURST, self.tokens + max(0.0, now - self.at) * self.RATE)
        self.at = now
        if self.tokens < 1:
            self.not_kept += 1
            return None
        self.tokens -= 1
        if self.not_kept:
            details = {**details, "not_kept_before": self.not_kept}
            self.not_kept = 0
        return details


T = TypeVar("T")
E = TypeVar("E", bound=BrokerError)


async def _in_daemon_thread(function: Callable[[], T]) -> T:
    """`function()` on a daemon thread of its own. A driver call can hang in the kernel for good (NVML and a GPU
    fallen off the bus): it must hang that thread alone. In the loop's executor it would hang the broker's stop too,
    which waits for every executor thread before the process exits."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if future.done():  # its awaiter was cancelled meanwhile
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        try:
            result, error = function(), None
        except BaseException as raised:
            result, error = None, raised
        with contextlib.suppress(RuntimeError):  # the loop closed while it ran: nobody waits for it any more
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name="gpubroker-sample", daemon=True).start()
    return await future


class Broker:
    def __init__(self, config: Config, store: Store, probe: GpuProbe, clock: Clock | None = None, node_id: str | None = None) -> None:
        self.config = config
        self._given_id = node_id  # the identity's id in a real broker; tests may leave it to the store
        self.store = store
        self.probe = probe
        self.clock: Clock = clock or SystemClock()
        self.node_id = ""
        # Made with the store and kept in it: a broker on a new or wiped store numbers its events from 1 again, and a
        # client following them (`gpubroker events --follow`) tells it is another by this, not by seq alone.
        self.store_id = ""
        self.leases: dict[str, Lease] = {}
        self.ended: OrderedDict[str, tuple[bytes, Lease]] = OrderedDict()
        self._dropped: list[bytes] = []  # keys of ended leases out of the history but still in the store
        self.waiters: list[Waiter] = []
        self.readings: list[GpuReading] = []
        self._applied_at = (0.0, 0.0)  # the wall and elapsed clocks when the readings were taken in
        self.host = HostReading(1, 0)
        self.driver_error: str | None = None
        # Accelerators the driver lists but cannot read (the others are read): none is offered, their leases stay.
        # Kept through a fault of the whole driver, so coming back from one says only what changed.
        self.unreadable: list[UnreadableGpu] = []
        self.stats = Stats()
        self.refusals = RefusalBudget(self.clock.now)
        self.start_warning: str | None = None  # what `gpubroker up` should say beside "ready"
        self._lease_epoch = 0
        self._gpu_epochs: dict[str, int] = {}
        self._event_seq = 0
        self._waiter_seq = 0
        self._stopping = False  # set by stop_waiting(): no request joins the queue any more
        self._rebooted = False  # the machine restarted since the store was last written: no holder it names lives
        self._lineage: frozenset[int] = frozenset({1})  # this broker and its ancestors (holders.broker_lineage), read at start
        self._pressure: set[str] = set()  # accelerators (by UUID) under external pressure
        self._sampled = False  # whether a first reading was taken
        # Accelerators (by UUID) that leases hold and the driver no longer lists, and since when (wall clock): shown,
        # as the driver last listed them (`_listed_as`), until listed again or no lease holds them.
        self._missing: dict[str, float] = {}
        self._listed_as: dict[str, tuple[int, str]] = {}  # each card's index and name as the driver last listed it
        self.over_declared_ids: set[tuple[str, str]] = set()  # (lease, GPU UUID): each GPU of a lease is reported once
        self._reclaims: list[_Reclaim] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self._watch: holders.HolderWatch | None = None
        self._budgets: list[Budget] | None = None
        self._stale: set[str] = set()  # accelerators (by UUID) whose budget must be computed again
        self._on_gpu: dict[str, GpuLeases] = {}  # the live leases by accelerator UUID, kept as they come and go
        self._leased_cores = 0  # what the live leases hold of the host, kept as they come and go
        self._leased_memory = 0

    # ----- start and stop -------------------------------------------------

    async def start(self) -> None:
        """Load the store, take a first reading, reconcile leases whose holders died meanwhile, and say cancelled the
        requests that waited when the broker last stopped unannounced."""
        loaded = self.store.load()
        try:
            self.node_id = self._given_id or loaded.meta.get("node_id") or f"n-{secrets.token_hex(6)}"
            self.store_id = str(loaded.meta.get("store_id") or f"s-{secrets.token_hex(8)}")
            self._event_seq = loaded.last_event
            epochs = loaded.meta.get("epochs", {})
            self._lease_epoch = int(epochs.get("lease", 0))
            self._gpu_epochs = {str(k): int(v) for k, v in epochs.get("gpu", {}).items()}
            ended = [(seq_key(int(record.pop("_end", 0))), Lease.from_record(record)) for record in loaded.ended]
            live = [Lease.from_record(record) for record in loaded.leases]
            cut_short = self._waits_cut_short(loaded.meta.get("clock"))
        except (TypeError, KeyError, ValueError, AttributeError, struct.error) as error:  # a value that unpacks, but is no record of ours
            raise StoreDamaged(self.store.damaged(f"a stored record cannot be read: {type(error).__name__}: {error}")) from None
        unknown = set().union(*(unknown_fields(record) for record in (*loaded.leases, *loaded.ended)))
        if unknown:  # a newer gpubroker wrote them (this one was rolled back): what it does not know, it will not keep
            log_line(
                f"the store holds lease fields this version does not know ({', '.join(sorted(unknown))}), written by a newer "
                "gpubroker; its leases are kept as this version reads them, and a lease rewritten here loses those fields"
            )
        for key, lease in ended:
            self.ended[lease.id] = (key, lease)
            self._saw_epochs(lease)
        history = self._trim_history()  # the store may hold more than leases_kept: they go with a group
        stored_deadlines = {lease.id: lease.deadline for lease in live}  # _hold reckons them from the wall clock
        for lease in sorted(live, key=lambda lease: lease.epoch):  # held in the order they were granted, as before the stop
            self._hold(lease)
            self._saw_epochs(lease)
        self._watch = holders.HolderWatch(asyncio.get_running_loop())
        self._lineage = await asyncio.to_thread(holders.broker_lineage)
        self.store.start()
        writes = [
            Write("meta", b"node_id", self.node_id),
            Write("meta", b"store_id", self.store_id),
            *history,
            *self._onto_this_boot_clock(loaded.meta.get("clock"), stored_deadlines),
        ]
        for lease in self.leases.values():
            if lease.node != self.node_id:  # held since before `gpubroker init` or a join gave this node its identity
                lease.node = self.node_id
                writes.append(Write("leases", lease.id.encode(), lease.to_record()))
        for lease in [x for x in self.leases.values() if x.pgids]:
            writes += await self._check_groups(lease)
        now = self.clock.now()
        # Leases that had ended shortly before this start: the broker may have stopped while it stopped their groups
        # (between SIGTERM and SIGKILL), and it finishes the job: work never goes on without its lease. Only recent
        # ends, since a group id is reused once its group is gone; those that end below are stopped by their end.
        window = self.config.kill_grace + RESTOP_WITHIN
        restop = [x for _, x in self.ended.values() if x.pgids and x.ended_at is not None and now - x.ended_at < window]
        if self._rebooted:  # their groups ended with the machine; the ids may be others' now
            restop = []
        ending: list[tuple[Lease, str, str]] = []
        for lease in self.leases.values():
            if lease.expires_at <= now:
                ending.append((lease, "expired", "not renewed before its expiry (while the broker was down)"))
            elif lease.bind == "caller" and lease.holder.pid is not None:
                if self._rebooted:
                    ending.append((lease, "released", f"holder pid {lease.holder.pid} is gone: the machine restarted since"))
                elif not self._watch.watch(lease.id, lease.holder.pid, lease.holder.start_time, self._holder_exited):
                    ending.append((lease, "released", f"holder pid {lease.holder.pid} exited while the broker was down"))
        # Ended with the start's own writes, and freed before they are on disk: nothing waits yet for their room.
        for lease, state, reason in ending:
            writes += self._end_writes(lease, state, reason)
            self._free(lease)
        for lease in restop:
            self._spawn(self._stop_work(lease))
        for request_id, queued_at in cut_short:
            writes.append(
                self._event(
                    "lease.cancelled",
                    f"request {request_id} cancelled: the broker stopped while it waited (since {queued_at}), cutting its "
                    "client's connection",
                    lease=request_id,
                    details={"broker_stopped": True, "queued_at": queued_at},
                )
            )
        said = f"broker {self.config.name} started with {len(self.leases)} live lease{'' if len(self.leases) == 1 else 's'}"
        if cut_short:
            one = len(cut_short) == 1
            said += f"; {len(cut_short)} request{'' if one else 's'} that waited when it stopped {'is' if one else 'are'} cancelled"
        writes.append(self._event("broker.started", said, details={"version": __version__, "waits_cancelled": len(cut_short)}))
        try:
            await self.store.commit(writes)
        except StoreFull as full:  # it still serves what it holds, and says why every change is refused
            self.start_warning = full.message
            if not loaded.meta.get("store_id"):  # a name not kept would be another at the next start: none said
                self.store_id = ""
        await self.sample()

    def _waits_cut_short(self, run: Any) -> list[tuple[str, str]]:
        """The ids and queueing times of the requests that still waited when the broker last stopped without answering
        them (kill -9, a power loss), oldest first: those since its last start with no event of their end after them
        (granted, refused, cancelled). Waiting requests live in memory alone; their requesters' connections were cut
        when it stopped. Read from the kept events, newest first, back to the last `broker.started`: no write per
        wait. A request whose `lease.queued` is no longer kept (events_kept) is not found, and nothing says it waited.
        None after a run of an earlier version (`run`, the clock its start kept, says so): its refusal at the end of a
        wait named no request, and past the refusal budget was not kept, so its ended waits would be said cut short."""
        if not (isinstance(run, dict) and run.get("waits_named") is True):
            return []
        ended: set[str] = set()
        cut: list[tuple[str, str]] = []
        for event in self.store.events_newest_first():
            type_ = event.get("type")
            if type_ == "broker.started":
                break
            if not isinstance(type_, str) or not type_.startswith("lease."):
                continue
            lease = event.get("lease")
            if not isinstance(lease, str):
                continue
            if type_ != "lease.queued":
                ended.add(lease)
            elif lease not in ended:
                at = event["time"]  # older stores hold the RFC 3339 form already
                cut.append((lease, at if isinstance(at, str) else rfc3339(at)))
        cut.reverse()
        return cut

    def _onto_this_boot_clock(self, stored: Any, deadlines: dict[str, float | None]) -> list[Write]:
        """The live leases' times moved onto this run's clocks, and this run's clock kept for the next.

        Start times are the kernel's ticks since boot plus the boot time as this broker read it at its start, which a
        step of the wall clock since the last run moves (NTP setting a board's clock): held as they were, every
        caller-bound holder would seem gone, its lease released and its work stopped, and every registered group seem
        another's. On the same boot they move by what the boot time moved, and each lease's expiry is where its
        `deadline` on the boot's monotonic clock puts it, whatever the wall clock did since it was granted or renewed:
        a step forward expired every lease not renewed since. After a reboot no holder and no process group survived (`_rebooted`)."""
        boot_id, booted = holders.boot_clock()
        # `waits_named`: every wait of this run ends in an event that names it (`_waits_cut_short`). An earlier version
        # writes this record again without it, at its start.
        writes = [Write("meta", b"clock", {"boot_id": boot_id, "booted": booted, "waits_named": True})]
        if not isinstance(stored, dict) or boot_id is None or not isinstance(stored.get("boot_id"), str):
            return writes
        if stored["boot_id"] != boot_id:
            self._rebooted = True
            return writes
        before = stored.get("booted")
        moved = booted - before if isinstance(before, int | float) else 0.0
        now, elapsed = self.clock.now(), self.clock.elapsed()
        for _, ended in self.ended.values() if moved else ():  # in memory: its groups are looked at only just after a start
            if ended.pgid_started:
                ended.pgid_started = [None if at is None else at + moved for at in ended.pgid_started]
        for lease in self.leases.values():
            changed = False
            if moved and lease.holder.start_time is not None:
                lease.holder.start_time += moved
                changed = True
            if moved and lease.pgid_started:
                lease.pgid_started = [None if at is None else at + moved for at in lease.pgid_started]
                changed = True
            deadline = deadlines.get(lease.id)
            if isinstance(deadline, int | float) and abs(now + (deadline - elapsed) - lease.expires_at) > 1.0:
                lease.expires_at = now + (deadline - elapsed)  # the wall clock was stepped since it was written
                lease.deadline = deadline
                changed = True
            if changed:
                writes.append(Write("leases", lease.id.encode(), lease.to_record()))
        return writes

    async def _check_groups(self, lease: Lease) -> list[Write]:
        """At start, a stored lease keeps only the process groups still as they were registered: a store from
        an earlier broker may hold groups taken on a token alone (no owner recorded), and a group that is
        gone may have its id reused by anyone."""
        known = len(lease.pgid_uids) == len(lease.pgids)
        if self._rebooted:  # none survived: a group with its id now is another's, and is never signalled for this lease
            kept: list[int] = []
        else:
            kept = await asyncio.to_thread(holders.signalable_groups, lease.pgids, lease.pgid_uids, lease.pgid_started) if known else []
        dropped = [pgid for pgid in lease.pgids if pgid not in kept]
        if not dropped:
            return []
        owner = dict(zip(lease.pgids, lease.pgid_uids, strict=False))
        since = dict(zip(lease.pgids, lease.groups_started(), strict=True))
        lease.pgids, lease.pgid_uids, lease.pgid_started = kept, [owner[pgid] for pgid in kept], [since[pgid] for pgid in kept]
        self._changed(lease)
        why = (
            "the machine restarted since"
            if self._rebooted
            else "registered with no owner recorded"
            if not known
            else "gone, another group's id now, or no longer all their owner's"
        )
        return [
            Write("leases", lease.id.encode(), lease.to_record()),
            self._event(
                "lease.groups_dropped",
                f"lease {lease.id}: process groups {', '.join(map(str, dropped))} are no longer its own ({why})",
                lease=lease.id,
                details={"pgids": dropped, "kept": kept},
            ),
        ]

    def _saw_epochs(self, lease: Lease) -> None:
        """Epochs only grow: every stored lease, live or ended, bounds the counters from below.

        A grant writes its lease record alone (its epochs inside it), so the counters need no
        write of their own; the `epochs` record is written when an ended lease is dropped from
        the history, the only moment an epoch could otherwise be forgotten.
        """
        self._lease_epoch = max(self._lease_epoch, lease.epoch)
        for gpu in lease.gpus:
            self._gpu_epochs[gpu.uuid] = max(self._gpu_epochs.get(gpu.uuid, 0), gpu.epoch)

    async def run(self) -> None:
        """Sample the GPUs and expire leases until cancelled."""
        async with asyncio.TaskGroup() as group:
            group.create_task(self._sample_loop())
            group.create_task(self._expiry_loop())

    def stop_waiting(self) -> None:
        """The broker is stopping: every waiting request is answered now, not when its wait runs out (which
        may be never), and says why; its client may ask again once the broker is back."""
        self._stopping = True  # and a request still on its way in is answered so too, not queued
        stopping = [w for w in self.waiters if w.lease is None and not w.granted.done()]
        self.waiters[:] = [w for w in self.waiters if w not in stopping]  # none is granted in the room of another
        for waiter in stopping:
            waiter.granted.set_exception(self._refused(waiter.request, self._stopping_refusal(waiter.id), waited=waiter.id))
            waiter.granted.exception()  # retrieved: the waiting handler answers with it

    def _stopping_refusal(self, request_id: str) -> Refusal:
        return Refusal(
            FailureCode.LEASE_TIMEOUT,
            f"request {request_id} was not granted: the broker on node {self.config.name} is stopping; ask again once it is back",
            {"lease": request_id, "stopping": True},
        )

    async def close(self) -> None:
        """Wait for pending durable work, then stop the writer; idempotent."""
        self.stop_waiting()
        for waiter in self.waiters:  # granted in memory, being made durable: their handlers see it through
            if not waiter.granted.done():
                waiter.granted.cancel()
        self.waiters.clear()
        if self.store.running:  # a barrier: every commit handed over earlier is settled, its follow-up run
            with contextlib.suppress(BrokerError):
                await self.store.commit([])
        while self._tasks:  # and what those spawned (a lease's groups being stopped), until none is left
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._watch is not None:
            self._watch.close()
        self.store.stop()
        await _in_daemon_thread(self.probe.close)  # NVML's shutdown, once no sample is taken any more

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ----- reading the hardware -------------------------------------------

    async def _sample_loop(self) -> None:
        said = None
        while True:
            await asyncio.sleep(self.config.sample_interval)
            try:
                await self.sample()
            except Exception as error:  # no file descriptor left, say: the readings go stale (and say so), the broker serves on
                problem = f"{type(error).__name__}: {error}"
                if problem != said:
                    log_line(f"a sample of the GPUs and the host failed, and is tried again: {problem}")
                said = problem
            else:
                said = None

    async def sample(self) -> None:
        """Read the GPUs and the host (in a thread of its own), then act on what changed."""

        def read() -> tuple[list[GpuReading] | None, str | None, HostReading, list[UnreadableGpu]]:
            try:
                return self.probe.sample(), None, sample_host(), []
            except GpusUnreadable as some:  # the GPUs that can be read are still brokered
                return some.readings, None, sample_host(), some.unreadable
            except ProbeError as error:
                return None, str(error), sample_host(), []

        readings, error, host, unreadable = await _in_daemon_thread(read)
        self.apply_sample(readings, error, host, unreadable)

    def apply_sample(
        self,
        readings: list[GpuReading] | None,
        error: str | None,
        host: HostReading | None = None,
        unreadable: list[UnreadableGpu] | None = None,
    ) -> None:
        """Take a reading (`unreadable`: the GPUs the driver lists but cannot read): pressure, over-use, reclaim and
        missing-GPU events, then grant waiters the room that appeared."""
        if host is not None:
            self.host = host
        said_before = self._sampled  # the log says what changed (the first reading's state is in the ready line)
        if error != self.driver_error:
            if error is not None:
                said = f"GPUs cannot be read: {error}"
                self._record(self._event("gpu.driver_error", said, code=FailureCode.DRIVER_ERROR))
            else:
                said = "GPUs can be read again"
                self._record(self._event("gpu.driver_ok", said))
            if self._sampled:  # the log says it too (the first reading's state is in the ready line)
                log_line(said)
        self._sampled = True
        self.driver_error = error
        self.readings = readings if readings is not None else []
        self._applied_at = (self.clock.now(), self.clock.elapsed())
        self._changed()
        writes: list[Write] = []
        now = self.clock.elapsed()
        for budget in self.budgets():
            index = budget.reading.index
            gpu = budget.reading.uuid
            if budget.pressure and gpu not in self._pressure:
                self._pressure.add(gpu)
                writes.append(
                    self._event(
                        "gpu.pressure.started",
                        f"{budget.explain()}: external usage has grown {gib(budget.shortfall)} GiB into leased or reserved memory",
                        code=FailureCode.EXTERNAL_GPU_PRESSURE,
                        gpu=gpu,
                        details={"figures": budget.figures.to_json(), "external_processes": budget.external_by_name()},
                    )
                )
            elif not budget.pressure and gpu in self._pressure:
                self._pressure.discard(gpu)
                writes.append(
                    self._event(
                        "gpu.pressure.ended",
                        f"{budget.explain()}: external usage fits again",
                        code=FailureCode.EXTERNAL_GPU_PRESSURE,
                        gpu=gpu,
                        details={"figures": budget.figures.to_json()},
                    )
                )
            for lease, used in over_declared(budget):
                if (lease.id, gpu) not in self.over_declared_ids:
                    self.over_declared_ids.add((lease.id, gpu))
                    declared = lease.bytes_on(gpu)
                    writes.append(
                        self._event(
                            "lease.over_declared",
                            f"lease {lease.id} ({lease.holder.called}) uses {gib(used)} GiB on GPU {index}, more than 110% of the {gib(declared)} GiB it declared; it counts what it uses",
                            lease=lease.id,
                            gpu=gpu,
                            details={"declared": declared, "observed": used},
                        )
                    )
            for reclaim in [r for r in self._reclaims if r.uuid == gpu]:
                # Memory a live lease's processes use is that lease's, not left over: a worker that keeps its memory
                # from one lease to the next must not pile up a reclaim per lease, each reported as not reclaimed.
                held = sum(
                    p.process.bytes or 0
                    for p in budget.processes
                    if p.process.pid in reclaim.pids and p.lease is None and p.process.same_as(0, reclaim.started.get(p.process.pid))
                )
                if not held:
                    self._reclaims.remove(reclaim)
                elif not reclaim.reported and now - reclaim.released_at >= self.config.reclaim_grace:
                    reclaim.reported = True
                    writes.append(
                        self._event(
                            "gpu.memory_not_reclaimed",
                            f"GPU {index}: {gib(held)} GiB of released lease {reclaim.lease} is still in use {now - reclaim.released_at:.0f}s after release; it counts as external until it is gone",
                            code=FailureCode.GPU_MEMORY_NOT_RECLAIMED,
                            lease=reclaim.lease,
                            gpu=gpu,
                            details={"bytes": held, "pids": sorted(reclaim.pids)},
                        )
                    )
        if readings is not None:  # a fault of the whole driver says nothing of any one card
            writes += self._missing_gpus({r.uuid: r.index for r in readings}, unreadable or [], log=said_before)
            kept = self._missing.keys() | {gpu.uuid for gpu in self.unreadable}  # not listed, or not read: as last listed
            self._listed_as = {uuid: was for uuid, was in self._listed_as.items() if uuid in kept}
            self._listed_as.update((r.uuid, (r.index, r.name)) for r in readings)
        self._record(*writes)
        self._scan()

    def _missing_gpus(self, seen: dict[str, int], unreadable: list[UnreadableGpu], log: bool = True) -> list[Write]:
        """Events for the cards not offered, once each time it changes: a card the driver lists but cannot read
        (`gpu.unreadable`, leased or not), a card that leases hold and the driver stopped listing (`gpu.missing`),
        and each once it is back (`gpu.readable`, `gpu.found`). Their leases stay, counted on no other card, since
        their room was on that card alone."""
        unread_uuids = {gpu.uuid for gpu in unreadable if gpu.uuid is not None}
        unknown = [gpu for gpu in unreadable if gpu.uuid is None]  # any lease's card may be one of these
        missing = {uuid for uuid, on in self._on_gpu.items() if on.held and uuid not in seen and uuid not in unread_uuids}
        writes = []
        said: list[str] = []
        for gpu in unreadable:
            if any(_same_card(gpu, before) for before in self.unreadable):
                continue  # said when it became unreadable; its error may have changed since, its state not
            message = f"{gpu.label()} cannot be read: {gpu.error}; it is not offered"
            details: dict[str, Any] = gpu.to_json()
            on = self._on_gpu.get(gpu.uuid) if gpu.uuid is not None else None
            if on is not None and on.held:
                message += (
                    f", and leases {', '.join(sorted(on.held))} hold {gib(on.declared)} GiB on it "
                    "and stay until released or expired, counted on no other GPU"
                )
                details.update(leases=sorted(on.held), bytes=on.declared)
            else:
                message += " until it can be read again"
            writes.append(self._event("gpu.unreadable", message, code=FailureCode.DRIVER_ERROR, gpu=gpu.uuid, details=details))
            said.append(message)
        for before in self.unreadable:
            if any(_same_card(gpu, before) for gpu in unreadable):
                continue
            now_read = before.uuid if before.uuid is not None else next((u for u, i in seen.items() if i == before.index), None)
            if now_read is None or now_read not in seen:
                continue  # no longer listed at all: nothing can be said of it being read
            message = f"{before.label()} can be read again"
            if (before.index, before.uuid) != (seen[now_read], now_read):  # numbered anew, or its UUID now known
                message += f", as GPU {seen[now_read]} ({now_read})"
            writes.append(self._event("gpu.readable", message, gpu=now_read, details={"index": seen[now_read], "uuid": now_read}))
            said.append(message)
        for uuid in sorted(missing - self._missing.keys()):
            on = self._on_gpu[uuid]
            why = "is no longer listed by the driver"
            if unknown:  # it may be the card that cannot say its UUID
                why = f"is not among the GPUs read ({'; '.join(f'{gpu.label()} cannot be read: {gpu.error}' for gpu in unknown)})"
            message = (
                f"{uuid} {why}; leases {', '.join(sorted(on.held))} hold {gib(on.declared)} GiB on it "
                "and stay until released or expired, counted on no other GPU"
            )
            # A fault of the driver or the card (one fallen off the bus), as a card listed but unreadable is: the same code.
            details = {"leases": sorted(on.held), "bytes": on.declared}
            writes.append(self._event("gpu.missing", message, code=FailureCode.DRIVER_ERROR, gpu=uuid, details=details))
            said.append(message)
        listed = {**{gpu.uuid: gpu.index for gpu in unreadable if gpu.uuid is not None}, **seen}
        for uuid in sorted((self._missing.keys() - missing) & listed.keys()):  # back, and read or not: it is listed again
            read = "" if uuid in seen else ", which cannot be read"
            message = f"{uuid} is listed by the driver again, as GPU {listed[uuid]}{read}"
            writes.append(self._event("gpu.found", message, gpu=uuid))
            said.append(message)
        now = self.clock.now()
        self._missing = {uuid: self._missing.get(uuid, now) for uuid in missing}
        self.unreadable = list(unreadable)
        if log:
            for line in said:
                log_line(line)
        return writes

    # ----- the figures ----------------------------------------------------

    def budgets(self) -> list[Budget]:
        """Every accelerator's budget, computed once per change of readings, and of leases on that accelerator."""
        if self._budgets is None:
            self._budgets = compute_budgets(self.readings, self._on_gpu, self.config.reserve)
            self._stale.clear()
        elif self._stale:
            stale, reserve = self._stale, self.config.reserve
            self._budgets = [
                compute_budget(b.reading, self._on_gpu.get(b.reading.uuid) or GpuLeases(), reserve) if b.reading.uuid in stale else b
                for b in self._budgets
            ]
            stale.clear()
        return self._budgets

    def _changed(self, lease: Lease | None = None) -> None:
        """Readings changed, or a lease's: every budget, or those of the lease's accelerators, must be computed again."""
        if lease is None:
            self._budgets = None
        else:
            self._stale.update(gpu.uuid for gpu in lease.gpus)

    def _hold(self, lease: Lease) -> None:
        self.leases[lease.id] = lease
        # Its TTL runs on the elapsed clock: a step of the wall clock (NTP on a box without a real-time clock)
        # must not end a lease early or keep it past its TTL. Its deadline is stored with it, so a restart on the same
        # boot finds it (`_onto_this_boot_clock`); its wall-clock expiry is for display, and for a start after a reboot.
        lease.deadline = self.clock.elapsed() + (lease.expires_at - self.clock.now())
        self._leased_cores += lease.cpu_cores
        self._leased_memory += lease.memory
        for gpu in lease.gpus:
            self._on_gpu.setdefault(gpu.uuid, GpuLeases()).add(lease, gpu.bytes)
        self._changed(lease)

    def _unhold(self, lease: Lease) -> None:
        if self.leases.pop(lease.id, None) is not None:
            self._leased_cores -= lease.cpu_cores
            self._leased_memory -= lease.memory
        for gpu in lease.gpus:
            held = self._on_gpu.get(gpu.uuid)
            if held is not None:
                held.remove(lease.id)
        self._changed(lease)

    def host_budget(self) -> HostBudget:
        return HostBudget(self.host.cores, self._leased_cores, self.host.memory, self._leased_memory)

    def readings_now(self) -> float:
        """Now, on the wall clock the readings are stamped with as it read when they were taken in, moved on since by
        the elapsed clock: a reading's age is this less its `observed_at`. A step of the wall clock since (NTP on a box
        without a real-time clock) neither ages a reading nor keeps a reading from a probe that hangs fresh."""
        wall, elapsed = self._applied_at
        return wall + (self.clock.elapsed() - elapsed)

    def _gpu_json(self, budget: Budget, now: float) -> dict[str, Any]:
        """A GPU's budget, with how old its reading is (`now` from readings_now): past `staleness`, no decision is made on it."""
        age = max(0.0, now - budget.reading.observed_at)
        return {**budget.to_json(), "age": round(age, 3), "stale": self.is_stale(budget, now)}

    def is_stale(self, budget: Budget, now: float) -> bool:
        """Whether this GPU's reading is too old to decide on (the probe has stopped answering, say); `now` from readings_now."""
        return now - budget.reading.observed_at > self.config.staleness

    @property
    def stale(self) -> bool:
        """Whether any GPU's reading is too old to decide on."""
        now = self.readings_now()
        return any(self.is_stale(budget, now) for budget in self.budgets())

    def unreadable_json(self) -> list[dict[str, Any]]:
        """The GPUs the driver lists but cannot read, with why and the leases that stay on them (none while the
        driver as a whole cannot be read: `driver_error` says it for every GPU)."""
        if self.driver_error is not None:
            return []
        return [
            {**gpu.to_json(), "leases": sorted(on.held) if gpu.uuid is not None and (on := self._on_gpu.get(gpu.uuid)) else []}
            for gpu in self.unreadable
        ]

    def missing_json(self) -> list[dict[str, Any]]:
        """The GPUs that leases hold and the driver no longer lists: as it last listed them (`name` null when not listed
        since this broker started), since when, and the leases and bytes held on them; as `unreadable_json`, none
        while the driver as a whole cannot be read."""
        if self.driver_error is not None:
            return []
        missing = []
        for uuid, since in self._missing.items():
            on = self._on_gpu.get(uuid)
            if on is None or not on.held:
                continue  # released since the last reading: no memory of it is held any more
            index, name = self._listed_as.get(uuid) or (_granted_index(on, uuid), None)
            missing.append(
                {"index": index, "uuid": uuid, "name": name, "since": rfc3339(since), "leases": sorted(on.held), "bytes": on.declared}
            )
        return sorted(missing, key=lambda gpu: (gpu["index"], gpu["uuid"]))

    def node_json(self) -> dict[str, Any]:
        now = self.readings_now()
        return {
            "node": {
                "id": self.node_id,
                "name": self.config.name,
                "production_eligible": self.config.production_eligible,
                "version": __version__,
            },
            "gpus": [self._gpu_json(budget, now) for budget in self.budgets()],
            "driver_error": self.driver_error,
            "unreadable_gpus": self.unreadable_json(),
            "missing_gpus": self.missing_json(),
            **self.host_budget().to_json(),
            "queue": {name: sum(1 for w in self.waiters if w.request.priority == name) for name in CLASSES},
        }

    # ----- requests -------------------------------------------------------

    async def request(
        self, request: LeaseRequest, caller: Caller, while_syncing: Callable[[Lease, str], None] | None = None
    ) -> tuple[Lease, str]:
        """Grant now, wait in the queue, or refuse: the lease and its token, or a BrokerError.

        `while_syncing(lease, token)` runs once a grant is decided and handed to the disk, while
        the writer thread syncs it (an answer can be prepared then); it may not run at all.
        """
        started = time.perf_counter()
        try:
            lease, token = await self._request(request, caller, while_syncing)
            if not lease.live:  # released by its id, or its holder gone, while its grant was on its way to disk
                await self.store.commit([])  # after the end's own commit, which may fail: the lease is then live again
                if not lease.live:
                    raise self._ended_unanswered(lease)
        except BrokerError as error:
            self.stats.record(error.code.value, time.perf_counter() - started)
            raise
        self.stats.record("GRANTED", time.perf_counter() - started)
        return lease, token

    @staticmethod
    def _ended_unanswered(lease: Lease) -> Refusal:
        """What the requester of a lease that ended before its grant was answered is told: not granted, as a request
        cancelled while it waited is told (the lease's end has its event already)."""
        ended = Refusal(
            FailureCode.LEASE_TIMEOUT,
            f"request {lease.id} was granted and then {lease.state} before its grant could be answered: {lease.reason}",
            {"lease": lease.id, "cancelled": True, "state": lease.state},
        )
        ended.recorded = True
        return ended

    async def _request(
        self, request: LeaseRequest, caller: Caller, while_syncing: Callable[[Lease, str], None] | None = None
    ) -> tuple[Lease, str]:
        now = self.clock.now()
        holder = Holder(name=request.holder_name)
        if caller.transport == "unix" and caller.pid is not None:
            holder.pid, holder.uid, holder.start_time = caller.pid, caller.uid, caller.start_time
        elif request.holder_pid is not None:
            if request.holder_pid in self._lineage:
                raise InvalidRequest(
                    f"holder.pid {request.holder_pid} is this broker or one of its ancestors, whose descendants are most of this "
                    "machine's processes: give the pid of the process that holds the lease",
                    {"field": "holder.pid"},
                )
            holder.pid = request.holder_pid
            # Bound to it or not, the holder's memory is the lease's: its start time keeps a later process with its pid
            # from being taken for it, so a pid nobody runs (whose memory would be the next process's) is refused.
            holder.start_time = holders.start_time(holder.pid)
            if holder.start_time is None:
                raise InvalidRequest(
                    f"holder.pid {holder.pid} is not a running process: give the pid of a living process that holds the "
                    "lease, or leave holder.pid out",
                    {"field": "holder.pid"},
                )
            if (process := holders.process_of(holder.pid)) not in (None, holder.pid):
                raise InvalidRequest(
                    f"holder.pid {holder.pid} is a thread of process {process}, not a process: give {process}",
                    {"field": "holder.pid"},
                )
        bind = request.bind or ("caller" if caller.transport == "unix" else "none")
        if holder.pid is not None and holder.start_time is None:  # a Unix caller's was read with its connection
            holder.start_time = holders.start_time(holder.pid)
        if bind == "caller" and (holder.pid is None or holder.start_time is None):
            raise InvalidRequest(
                "bind: caller needs a living holder process: call on the Unix socket, or give holder.pid", {"field": "bind"}
            )
        user = caller.user if self.config.stamps else None  # a passwd lookup only where stamps may need it
        priority = self.config.stamped_class(request.priority, user, holder.name)
        if priority != request.priority:
            request = replace(request, priority=priority)
        if priority == "production" and not self.config.production_eligible:
            raise self._refused(
                request,
                Refusal(
                    FailureCode.CAPABILITY_UNAVAILABLE,
                    f"node {self.config.name} is not production_eligible: production requests are not served here",
                    {"priority": priority},
                ),
            )
        if request.deadline is not None and request.deadline <= now:
            raise self._refused(
                request,
                Refusal(
                    FailureCode.DEADLINE_CANNOT_BE_MET,
                    f"the deadline {rfc3339(request.deadline)} has already passed",
                    {"deadline": rfc3339(request.deadline)},
                ),
            )
        waits = request.wait > 0 or request.deadline is not None
        self._waiter_seq += 1
        waiter = Waiter(
            id=new_lease_id(),
            request=request,
            caller=caller,
            holder=holder,
            bind=bind,
            seq=self._waiter_seq,
            enqueued_at=now,
            granted=asyncio.get_running_loop().create_future(),
        )
        blocked = self._claimed_ahead(waiter)
        decision = self._place(request, blocked)
        if isinstance(decision, Placement):
            return await self._grant_now(waiter, decision, while_syncing)
        if not waits or decision.code is FailureCode.CAPABILITY_UNAVAILABLE:  # no release can make this node able to
            raise self._refused(request, decision)
        if request.deadline is not None and self._hopeless(request):
            raise self._refused(request, self._deadline_hopeless(request, decision))
        # Only a request that must wait takes a place in its class's queue: one that fits now is granted, full queue or not.
        queued = [w for w in self.waiters if w.request.priority == priority]
        if len(queued) >= self.config.queue_limit:
            # Who fills it: one user's flood must be told apart from a busy machine, and named.
            by_whom = Counter(w.caller.user or w.caller.admin_name or f"anonymous ({w.caller.transport})" for w in queued)
            whom = ", ".join(f"{who} {count}" for who, count in sorted(by_whom.items(), key=lambda item: (-item[1], item[0])))
            raise self._refused(
                request,
                Refusal(
                    FailureCode.QUEUE_FULL,
                    f"{len(queued)} {priority} requests already wait on node {self.config.name} ({whom}); the queue holds "
                    f"{self.config.queue_limit} (queue_limit): ask again once some of them are granted or cancelled",
                    {"priority": priority, "queue_limit": self.config.queue_limit, "waiting_by_user": dict(by_whom)},
                ),
            )
        return await self._wait(waiter, decision)

    def _place(
        self, request: LeaseRequest, blocked: dict[Claim, list[str]], budgets: list[Budget] | None = None, host: HostBudget | None = None
    ) -> Placement | Refusal:
        return place(
            request,
            self.budgets() if budgets is None else budgets,
            self.host_budget() if host is None else host,
            now=self.readings_now(),
            staleness=self.config.staleness,
            blocked=blocked,
            driver_error=self.driver_error,
            unreadable=self.unreadable,
        )

    def _claimed_ahead(self, waiter: Waiter) -> dict[Claim, list[str]]:
        """Accelerators (and the host's cores or memory) claimed by requests waiting ahead of this one (higher class, or
        earlier in its own), each with those requests, first ahead first."""
        blocked: dict[Claim, list[str]] = {}
        if not self.waiters:
            return blocked
        for other, claimed in self._claims_ahead(waiter, self.budgets()):
            for what in claimed:
                blocked.setdefault(what, []).append(_named(other))
        return blocked

    def _claims_ahead(self, waiter: Waiter, budgets: list[Budget]) -> list[tuple[Waiter, set[Claim]]]:
        """The requests waiting ahead of this one that claim something, each with what it claims: not one refused for
        the driver (it claims none), nor one granted and being made durable."""
        host = self.host_budget()
        claims: list[tuple[Waiter, set[Claim]]] = []
        claimed: set[Claim] = set()  # by the requests ahead so far
        for other in self.waiters:
            if other.order < waiter.order and other.lease is None and other.claims:
                if theirs := self._claims(other.request, budgets, host, claimed):
                    claims.append((other, theirs))
                    claimed |= theirs
        return claims

    @staticmethod
    def _claims(request: LeaseRequest, budgets: list[Budget], host: HostBudget, claimed: Collection[Claim]) -> set[Claim]:
        """What a waiting request holds back from those behind it: every GPU it could use, and the host's cores or memory
        where it asks for more than is schedulable or a request ahead of it (`claimed`) holds them back already."""
        gpus: set[Claim] = {b.reading.index for b in could_use(request, budgets)} if request.wants_gpus else set()
        return gpus | host_claims(request, host, claimed)

    def _hopeless(self, request: LeaseRequest) -> bool:
        """Whether the request cannot fit by its deadline even if every lease that may end by then does."""
        assert request.deadline is not None
        staying = [lease for lease in self.leases.values() if lease.preemption == "never" and lease.expires_at > request.deadline]
        budgets = compute_budgets(self.readings, leases_by_gpu(staying), self.config.reserve)
        host = HostBudget(self.host.cores, sum(x.cpu_cores for x in staying), self.host.memory, sum(x.memory for x in staying))
        decision = self._place(request, {}, budgets, host)
        # A driver that cannot read a card, or has not read it lately, may read it before the deadline: only room
        # held past it makes a request hopeless.
        return (
            isinstance(decision, Refusal)
            and decision.code not in (FailureCode.DRIVER_ERROR, FailureCode.SCHEDULER_STATE_STALE)
            and "unreadable" not in decision.details
        )

    @staticmethod
    def _deadline_hopeless(request: LeaseRequest, decision: Refusal) -> Refusal:
        assert request.deadline is not None
        return Refusal(
            FailureCode.DEADLINE_CANNOT_BE_MET,
            f"the deadline {rfc3339(request.deadline)} cannot be met: what holds the room is held past it and may not be "
            f"preempted; as things stand, {decision.message}",
            {**decision.details, "deadline": rfc3339(request.deadline)},
        )

    def _refused(self, request: LeaseRequest, refusal: E, waited: str | None = None) -> E:
        """Keep a refusal as a `lease.refused` event, within the refusal budget. That of a request that waited (`waited`,
        its id) names it and is always kept, as its `lease.queued` was: it ends that request's story, one per wait."""
        details = refusal.details
        refusal.recorded = True
        kept = {**details, "priority": request.priority} if waited else self.refusals.keep({**details, "priority": request.priority})
        if kept is not None:
            gpu = details.get("gpu") if isinstance(details.get("gpu"), str) else None
            named = waited or details.get("lease")  # a request refused as the broker stops is named though it never waited
            lease = named if isinstance(named, str) else None
            self._record(self._event("lease.refused", refusal.message, code=refusal.code, lease=lease, gpu=gpu, details=kept))
        return refusal

    def _grant(self, waiter: Waiter, placement: Placement) -> tuple[Lease, str, list[Write]]:
        """Reserve the room in memory at once (the loop is the lock) and return what must be made durable."""
        now = self.clock.now()
        request = waiter.request
        self._lease_epoch += 1
        gpus: list[LeasedGpu] = []
        uuids: list[str] = []
        sizes: list[int] = []
        where: list[str] = []
        for index, size in placement.gpus:  # one pass builds the lease's GPUs and what its event says of them
            uuid = next(r.uuid for r in self.readings if r.index == index)
            epoch = self._gpu_epochs[uuid] = self._gpu_epochs.get(uuid, 0) + 1
            gpus.append(LeasedGpu(index, uuid, size, epoch))
            uuids.append(uuid)
            sizes.append(size)
            where.append(f"GPU {index} {gib(size)} GiB (GPU epoch {epoch})")
        ttl = request.ttl or self.config.default_ttl
        token = new_token()  # the id was drawn when the request arrived
        holder = waiter.holder
        if holder.name is None and holder.pid is not None:
            holder.name = holders.process_name(holder.pid)
        lease = Lease(
            id=waiter.id,
            node=self.node_id,
            state=LIVE,
            epoch=self._lease_epoch,
            priority=request.priority,
            preemption=request.preemption,
            bind=waiter.bind,
            holder=holder,
            gpus=gpus,
            exclusive=request.exclusive,
            cpu_cores=request.cpu_cores,
            memory=request.memory,
            labels=request.labels,
            token_hash=hash_token(token),
            requested_at=waiter.enqueued_at,
            granted_at=now,
            expires_at=now + ttl,
            ttl=ttl,
        )
        self._hold(lease)
        writes = [
            Write("leases", lease.id.encode(), lease.to_record()),
            self._event(
                "lease.granted",
                f"lease {lease.id} granted to {holder.called} ({lease.priority}): {', '.join(where + host_part(lease.cpu_cores, lease.memory)) or 'nothing'}",
                lease=lease.id,
                gpu=uuids[0] if uuids else None,
                details={"gpus": uuids, "bytes": sizes, "epoch": lease.epoch, "waited": round(now - waiter.enqueued_at, 3)},
            ),
        ]
        if lease.bind == "caller" and holder.pid is not None:
            assert self._watch is not None
            if not self._watch.watch(lease.id, holder.pid, holder.start_time, self._holder_exited):
                self._unhold(lease)
                raise InvalidRequest(f"holder pid {holder.pid} exited before its lease could be granted", {"field": "holder"})
        waiter.lease = lease  # granted in memory: a requester that goes away from now on has it released
        return lease, token, writes

    async def _grant_now(
        self, waiter: Waiter, placement: Placement, while_syncing: Callable[[Lease, str], None] | None = None
    ) -> tuple[Lease, str]:
        lease, token, writes = self._grant(waiter, placement)
        await self._make_durable(lease, writes, None if while_syncing is None else lambda: while_syncing(lease, token))
        return lease, token

    def _budgets_soon(self) -> None:
        """Compute again the budgets a change made stale on the loop's next turn, once the answer that awaited the
        change has left: the next request finds them ready, and the answer did not wait for them."""
        asyncio.get_running_loop().call_soon(self.budgets)

    async def _make_durable(self, lease: Lease, writes: list[Write], answer: Callable[[], None] | None = None) -> None:
        # While the writer syncs, the loop (idle but for this) prepares the answer.
        commit = self.store.commit(writes, answer)
        try:
            # Commit before replying: a crash in between must leave a lease without a
            # client, never a client without a lease.
            await commit
            self._budgets_soon()
        except asyncio.CancelledError:
            # The client went away mid-commit: the lease must not outlive the request. Its end is handed to
            # the writer behind the grant (first in, first out): on disk they land together, or the grant first.
            # (Awaiting the commit itself, not a shield around it, saves the answer a turn of the loop.)
            if lease.live:
                self._spawn(self._commit_quietly(self._end(lease, "released", "the requester disconnected before the grant was answered")))
            raise
        except BrokerError:
            self._rollback(lease)
            raise

    def _rollback(self, lease: Lease) -> None:
        """A grant that could not be made durable never happened (its epochs stay used: they only grow)."""
        self._unhold(lease)
        if self._watch is not None:
            self._watch.unwatch(lease.id)
        self._scan()

    async def _wait(self, waiter: Waiter, first: Refusal) -> tuple[Lease, str]:
        request = waiter.request
        if self._stopping:
            raise self._refused(request, self._stopping_refusal(waiter.id))
        waiter.reason, waiter.claims = first.message, first.code is not FailureCode.DRIVER_ERROR
        self.waiters.append(waiter)
        self.waiters.sort(key=lambda w: w.order)
        self._record(
            self._event(
                "lease.queued",
                f"request {waiter.id} ({request.priority}) waits: {first.message}",
                lease=waiter.id,
                details={"position": self.position(waiter), "wait": request.wait, "reason_code": first.code.value},
            )
        )
        if waiter.bind == "caller" and waiter.holder.pid is not None:
            # Bound to its holder, it waits only while the holder lives (granted, the lease's own watch takes over).
            assert self._watch is not None
            if not self._watch.watch(waiter.id, waiter.holder.pid, waiter.holder.start_time, self._waiting_holder_exited):
                self._drop_waiter(waiter)
                raise self._holder_gone(waiter)
        limits = [waiter.enqueued_at + request.wait] if request.wait > 0 else []
        if request.deadline is not None:
            limits.append(request.deadline)
        until = min(limits)
        try:
            return await asyncio.wait_for(asyncio.shield(waiter.granted), max(0.0, until - self.clock.now()))
        except TimeoutError:
            if waiter.lease is not None:  # granted in the same instant: being made durable
                return await waiter.granted
            still = self._place(request, self._claimed_ahead(waiter))  # why it waits now: ages and figures move on
            why = first.details
            if isinstance(still, Refusal):
                # The figures given are those the message gives: the ones at the end of the wait, not at its start.
                waiter.reason, why = still.message, still.details
            self._drop_waiter(waiter)
            if request.deadline is not None and until >= request.deadline:
                refusal = Refusal(
                    FailureCode.DEADLINE_CANNOT_BE_MET,
                    f"not granted by the deadline {rfc3339(request.deadline)}: {waiter.reason}",
                    {**why, "deadline": rfc3339(request.deadline)},
                )
            else:
                refusal = Refusal(
                    FailureCode.LEASE_TIMEOUT,
                    f"not granted within {request.wait:g}s: {waiter.reason}",
                    {**why, "wait": request.wait},
                )
            raise self._refused(request, refusal, waited=waiter.id) from None
        except asyncio.CancelledError:
            if waiter.lease is None:
                if self._drop_waiter(waiter):
                    self._record(self._event("lease.cancelled", f"request {waiter.id} cancelled: its client went away", lease=waiter.id))
                elif waiter.granted.done() and not waiter.granted.cancelled():
                    waiter.granted.exception()  # cancelled already as its holder exited: said, and nobody else to tell
            else:
                self._spawn(self._release_after_grant(waiter))
            raise

    async def _release_after_grant(self, waiter: Waiter) -> None:
        with contextlib.suppress(BrokerError, asyncio.CancelledError):
            await waiter.granted
        if waiter.lease is not None and waiter.lease.live:
            with contextlib.suppress(BrokerError):
                await self._end(waiter.lease, "released", "the requester disconnected before the grant was answered")

    def _drop_waiter(self, waiter: Waiter) -> bool:
        """Whether it was still waiting: it waits no more, and those behind it are looked at again."""
        if waiter.lease is None:
            self._unwatch_holder(waiter)
        if waiter not in self.waiters:
            return False
        self.waiters.remove(waiter)
        self._scan()  # a waiter that leaves may unblock those behind it
        return True

    def _unwatch_holder(self, waiter: Waiter) -> None:
        """A request that waits no more, ungranted, no longer watches its holder (granted, the lease's watch replaced it)."""
        if self._watch is not None:
            self._watch.unwatch(waiter.id)

    def _waiting_holder_exited(self, waiter_id: str) -> None:
        waiter = self.find_waiter(waiter_id)
        if waiter is not None and waiter.lease is None and not waiter.granted.done():
            waiter.granted.set_exception(self._holder_gone(waiter))
            self._drop_waiter(waiter)

    def _holder_gone(self, waiter: Waiter) -> Refusal:
        """The end of a request bound to its holder whose holder exited before it was granted: cancelled, as one whose
        client went away is (LEASE_TIMEOUT, SPEC §3.6's code for a wait that ended without a grant), with its event."""
        message = f"request {waiter.id} cancelled: its holder pid {waiter.holder.pid} exited while it waited"
        self._record(self._event("lease.cancelled", message, lease=waiter.id))
        refusal = Refusal(FailureCode.LEASE_TIMEOUT, message, {"lease": waiter.id, "cancelled": True, "holder_pid": waiter.holder.pid})
        refusal.recorded = True  # the lease.cancelled event says it
        return refusal

    def position(self, waiter: Waiter) -> int:
        return 1 + sum(1 for w in self.waiters if w.request.priority == waiter.request.priority and w.seq < waiter.seq)

    def _scan(self) -> None:
        """Grant waiters in claim order; one that cannot be granted claims every accelerator it could use."""
        blocked: dict[Claim, list[str]] = {}
        for waiter in list(self.waiters):
            if waiter.lease is not None:
                continue
            decision = self._place(waiter.request, blocked)
            if isinstance(decision, Refusal):
                if waiter.request.deadline is not None and self._hopeless(waiter.request):  # a lease renewed past it, say
                    self.waiters.remove(waiter)
                    self._unwatch_holder(waiter)
                    refusal = self._deadline_hopeless(waiter.request, decision)
                    waiter.granted.set_exception(self._refused(waiter.request, refusal, waited=waiter.id))
                    continue
                waiter.reason, waiter.claims = decision.message, decision.code is not FailureCode.DRIVER_ERROR
                if waiter.claims:
                    for what in self._claims(waiter.request, self.budgets(), self.host_budget(), blocked):
                        blocked.setdefault(what, []).append(_named(waiter))
                continue
            self.waiters.remove(waiter)
            try:
                lease, token, writes = self._grant(waiter, decision)
            except BrokerError:  # its holder exited, and its pidfd has not said so yet
                self._unwatch_holder(waiter)
                waiter.granted.set_exception(self._holder_gone(waiter))
                continue
            # Handed to the writer now, not a turn of the loop later: events reach the disk in the order of their
            # seqs, so a follower reading after=N never passes over one still on its way.
            self._spawn(self._settle_waiter(waiter, lease, token, self.store.commit(writes)))

    async def _settle_waiter(self, waiter: Waiter, lease: Lease, token: str, commit: asyncio.Future[None]) -> None:
        try:
            await commit
        except BrokerError as error:
            self._rollback(lease)
            waiter.lease = None  # never granted: a requester that goes away now has nothing to release
            if not waiter.granted.done():
                waiter.granted.set_exception(self._refused(waiter.request, error, waited=waiter.id))
            return
        self._budgets_soon()
        if not waiter.granted.done():
            waiter.granted.set_result((lease, token))

    # ----- acting on a lease ---------------------------------------------

    def find(self, lease_id: str) -> Lease:
        lease = self.leases.get(lease_id)
        if lease is None and lease_id in self.ended:
            lease = self.ended[lease_id][1]
        if lease is None:
            raise NotFound(
                f"no lease {lease_id!r} on node {self.config.name} (of ended leases, the newest {self.config.leases_kept} "
                "are kept: leases_kept)",
                {"lease": lease_id},
            )
        return lease

    def find_waiter(self, lease_id: str) -> Waiter | None:
        return next((w for w in self.waiters if w.id == lease_id), None)

    def authorize(self, lease: Lease | Waiter, caller: Caller, token: str | None, doing: str = "release") -> None:
        """The lease's own Unix user, root or the broker's own user, an admin, or its token: anyone else is FORBIDDEN,
        told how those may `doing` (release, renew or register) it."""
        if caller.admin is not None:
            return
        uid = lease.holder.uid
        # The broker's own user is its admin on the socket, as root is (its releases forwarded to other nodes are an
        # admin's there): a broker a user runs is not closed to that user.
        if socket_admin(caller.uid) or (caller.uid is not None and caller.uid == uid):
            return
        if isinstance(lease, Lease) and lease.token_matches(token):
            return
        # Named by its Unix user, not its holder name: that is the caller's word ("gpubroker", say), and the user is
        # who may act on it; a lease asked for over TCP has none, and only its token or root may.
        owner = "no Unix user (it was asked for over TCP)" if uid is None else f"user {_user_name(uid)} (uid {uid})"
        holder = lease.holder.name or "an unnamed holder"
        users = f"{'' if uid is None else 'that user, '}root or the broker's own user on the Unix socket"
        admin = "an admin (the API token, the web UI signed in)"
        if isinstance(lease, Waiter):  # no token until it is granted: X-Lease-Token cannot name it
            raise Forbidden(
                f"request {lease.id} ({holder}) waits to be granted and has no token yet (it belongs to {owner}): its "
                f"requester cancels it by ending its waiting POST /v1/leases (closing its connection); by its id (DELETE "
                f"/v1/leases/{lease.id}, `gpubroker release {lease.id}`) only {users}, or {admin}, may cancel it",
                {"lease": lease.id, "uid": uid, "state": "queued"},
            )
        given = "; the token given is not its" if token is not None else ""
        how = {
            "release": f"`gpubroker release {lease.id} --token T`",
            "renew": f"POST /v1/leases/{lease.id}/renew",
            "register": f"POST /v1/leases/{lease.id}/processes",
        }[doing]
        what = "register a process group with it" if doing == "register" else f"{doing} it"
        raise Forbidden(
            f"lease {lease.id} ({holder}) belongs to {owner}: only {users}, {admin}, or its token (X-Lease-Token; {how}), may {what}{given}",
            {"lease": lease.id, "uid": uid},
        )

    def _live(self, lease_id: str) -> Lease:
        waiter = self.find_waiter(lease_id)
        if waiter is not None:  # nothing to renew or register yet: it waits to be granted
            raise Refusal(
                FailureCode.LEASE_CONFLICT,
                f"request {lease_id} is queued, not granted (position {self.position(waiter)}): {waiter.reason}",
                {"lease": lease_id, "state": "queued"},
            )
        return self._still_live(self.find(lease_id))

    @staticmethod
    def _still_live(lease: Lease) -> Lease:
        """The lease, if it has not ended: also asked once a change to it is on disk, since it may have ended meanwhile."""
        if not lease.live:
            raise Refusal(
                FailureCode.LEASE_CONFLICT, f"lease {lease.id} is {lease.state} ({lease.reason})", {"lease": lease.id, "state": lease.state}
            )
        return lease

    async def renew(self, lease_id: str, caller: Caller, token: str | None, ttl: float | None) -> Lease:
        lease = self._live(lease_id)
        self.authorize(lease, caller, token, "renew")
        renewed = replace(lease, ttl=ttl if ttl is not None else lease.ttl)
        renewed.expires_at = self.clock.now() + renewed.ttl
        renewed.deadline = self.clock.elapsed() + renewed.ttl
        # The record as renewed goes to disk first; the lease changes only once it is there: a renewal refused
        # (STORE_FULL) leaves the lease as it was, in memory as on disk.
        await self.store.commit([Write("leases", lease.id.encode(), renewed.to_record())])
        # Ended while the renewal was on its way to disk (the end's own record follows it there): not renewed.
        self._still_live(lease)
        lease.ttl, lease.expires_at, lease.deadline = renewed.ttl, renewed.expires_at, renewed.deadline
        if self.waiters:
            self._scan()  # held longer, it may leave a waiting request's deadline out of reach
        return lease

    async def register_group(self, lease_id: str, caller: Caller, token: str | None, pgid: int) -> Lease:
        """Add a process group to the lease: its GPU memory is the lease's, and it is signalled when the lease ends."""
        lease = self._live(lease_id)
        self.authorize(lease, caller, token, "register")
        if pgid == os.getpgrp():
            raise Forbidden(f"process group {pgid} is the broker's own", {"pgid": pgid})
        # The broker signals a lease's groups when it ends: a token alone must not let anyone have
        # another user's processes killed. Only a uid the kernel named on the Unix socket is trusted.
        if caller.transport != "unix" or caller.uid is None:
            raise Forbidden(
                f"process group {pgid} can be registered only on the Unix socket, where the kernel names the caller", {"pgid": pgid}
            )
        # Its leader's start time first: the processes then found are of the group it leads (or led), not of a later one.
        started, owners = await asyncio.to_thread(lambda: (holders.group_started(pgid), holders.group_owners(pgid)))
        if not owners:
            raise InvalidRequest(f"process group {pgid} does not exist", {"field": "pgid"})
        uids = ", ".join(map(str, sorted(owners)))
        if len(owners) > 1:
            raise Forbidden(
                f"process group {pgid} has processes of uids {uids}; a group is registered only when one uid owns it all", {"pgid": pgid}
            )
        (owner,) = owners
        if caller.uid not in (0, owner):
            raise Forbidden(
                f"process group {pgid} is uid {uids}'s; uid {caller.uid} may register only its own", {"pgid": pgid, "uids": [owner]}
            )
        lease = self._live(lease_id)  # it may have ended while the processes were read
        before = list(lease.pgids), list(lease.pgid_uids), list(lease.pgid_started)
        lease.pgid_started = lease.groups_started()
        if pgid in lease.pgids:  # registered again: by its owner now (its id may have been reused since)
            lease.pgid_uids[lease.pgids.index(pgid)] = owner
            lease.pgid_started[lease.pgids.index(pgid)] = started
        else:
            lease.pgids.append(pgid)
            lease.pgid_uids.append(owner)  # at its end it is signalled only if still this uid's
            lease.pgid_started.append(started)  # and only if still this group, not another with its id
        self._changed(lease)  # its processes on its accelerators are now its own
        try:
            await self.store.commit([Write("leases", lease.id.encode(), lease.to_record())])
        except BrokerError:  # refused (STORE_FULL): "nothing was changed", in memory either
            if lease.live:
                lease.pgids, lease.pgid_uids, lease.pgid_started = before
                self._changed(lease)
            raise
        return self._still_live(lease)  # ended meanwhile: its groups were signalled with it, but it is no success

    async def release(self, lease_id: str, caller: Caller, token: str | None) -> Lease:
        """Release a granted lease, or cancel a waiting request."""
        waiter = self.find_waiter(lease_id)
        who = caller.admin_name or (_user_called(caller.uid) if caller.uid is not None else "its token")
        if waiter is not None:
            self.authorize(waiter, caller, token)
            self._drop_waiter(waiter)
            # LEASE_TIMEOUT is SPEC §3.6's code for a wait that ended without a grant; `cancelled` says how.
            self._record(self._event("lease.cancelled", f"request {lease_id} cancelled by {who}", lease=lease_id))
            told = Refusal(
                FailureCode.LEASE_TIMEOUT,
                f"request {lease_id} was cancelled by {who} before it could be granted",
                {"lease": lease_id, "cancelled": True},
            )
            gone = NotFound(f"request {lease_id} was waiting and is now cancelled", {"lease": lease_id, "cancelled": True})
            told.recorded = gone.recorded = True  # the lease.cancelled event says it for both
            waiter.granted.set_exception(told)
            waiter.granted.exception()  # retrieved: the waiting handler reports it
            raise gone
        lease = self._live(lease_id)
        self.authorize(lease, caller, token)
        if caller.transport == "unix" and caller.pid is not None and caller.pid == lease.holder.pid:
            # `gpubroker lease` once CMD has ended: told apart from its user (or root) releasing it from elsewhere.
            who = f"its holder (pid {caller.pid})"
        # Durable first: the lease keeps its room until its end is on disk, so a release the store
        # refuses (STORE_FULL) leaves the lease as it was, and nothing was granted in its room meanwhile.
        # What follows the disk's answer runs even when the caller goes away while it syncs.
        was = (lease.state, lease.ended_at, lease.reason)
        writes = self._end_writes(lease, "released", f"released by {who}")
        await self.store.commit(writes, on_settled=lambda error: self._released(lease, was, writes, error))
        self._budgets_soon()
        return lease

    def _released(self, lease: Lease, was: tuple[str, float | None, str | None], writes: list[Write], error: Exception | None) -> None:
        """A release's commit is settled: free its room, or, if the store refused it, make the lease live again."""
        if error is None:
            self._free(lease)
            return
        lease.state, lease.ended_at, lease.reason = was
        self.ended.pop(lease.id, None)
        owed = [write.key for write in writes if write.table == "ended" and write.value is None]
        self._dropped = owed + self._dropped  # history deletes that rode the refused commit are owed again
        if (
            lease.bind == "caller"
            and lease.holder.pid is not None
            and not holders.is_same_process(lease.holder.pid, lease.holder.start_time)
        ):
            self._holder_exited(lease.id)  # it died while the release was on its way: its pidfd found the lease ending

    def _holder_exited(self, lease_id: str) -> None:
        lease = self.leases.get(lease_id)
        if lease is not None and lease.live:  # not one whose release is on its way to disk
            self._spawn(self._commit_quietly(self._end(lease, "released", f"holder pid {lease.holder.pid} exited")))

    async def _commit_quietly(self, commit: asyncio.Future[None]) -> None:
        with contextlib.suppress(BrokerError):
            await commit

    def sweep(self) -> None:
        """Expire every lease whose TTL has run out (on the elapsed clock)."""
        elapsed = self.clock.elapsed()
        for lease in [x for x in self.leases.values() if (x.deadline or 0.0) <= elapsed and x.live]:
            self._spawn(self._commit_quietly(self._end(lease, "expired", f"not renewed before its expiry {rfc3339(lease.expires_at)}")))

    async def _expiry_loop(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            self.sweep()

    def _end(self, lease: Lease, state: str, reason: str) -> asyncio.Future[None]:
        """End a live lease, hand that to the writer, and only then free its room; the commit is returned, done once
        the end is on disk.

        A request waiting for the room is granted as it is freed: its grant reaches the writer after the end that made
        room for it, never before. Otherwise a follower of events could be shown the grant and pass over the end for
        good, and a crash between the two commits would bring the ended lease back beside the grant made in its room.
        (The room is freed before the end is on disk: should its commit fail, the grant behind it may still be written.)
        """
        commit = self.store.commit(self._end_writes(lease, state, reason))
        self._free(lease)
        return commit

    def _end_writes(self, lease: Lease, state: str, reason: str) -> list[Write]:
        """What makes a lease's end durable: its record, its event, and the history trimmed to leases_kept."""
        return self._record_end(lease, state, reason) + self._trim_history()

    def _record_end(self, lease: Lease, state: str, reason: str) -> list[Write]:
        """Mark a lease ended, with its event and its place in the history; its room stays held until `_free`."""
        assert state in ENDED
        lease.state, lease.ended_at, lease.reason = state, self.clock.now(), reason
        event = self._event(
            f"lease.{state}",
            f"lease {lease.id} ({lease.holder.called}) {state}: {reason}",
            lease=lease.id,
            gpu=lease.gpus[0].uuid if lease.gpus else None,
            details={"reason": reason},
        )
        key = seq_key(self._event_seq)
        record = lease.to_record()
        record["_end"] = self._event_seq
        self.ended[lease.id] = (key, lease)
        return [Write("leases", lease.id.encode()), Write("ended", key, record), event]

    def _free(self, lease: Lease) -> None:
        """Give an ended lease's room back, stop what it left running, and grant what waits for the room."""
        if lease.gpus and any(reading.processes for reading in self.readings):
            budgets = {b.reading.uuid: b for b in self.budgets()}
            for gpu in lease.gpus:
                budget = budgets.get(gpu.uuid)
                if budget is not None and budget.usage.get(lease.id):
                    mine = [p.process for p in budget.processes if p.lease == lease.id and p.process.bytes]
                    pids = frozenset(p.pid for p in mine)
                    # An earlier release's reclaim of these processes is this one's now: their memory was a later lease's.
                    for earlier in [r for r in self._reclaims if r.uuid == gpu.uuid and r.pids & pids]:
                        earlier.pids -= pids
                        if not earlier.pids:
                            self._reclaims.remove(earlier)
                    started = {p.pid: p.started[0] for p in mine if p.started}
                    self._reclaims.append(_Reclaim(lease.id, gpu.uuid, pids, started, self.clock.elapsed()))
        self._unhold(lease)
        self.over_declared_ids -= {(lease.id, gpu.uuid) for gpu in lease.gpus}
        if self._watch is not None:
            self._watch.unwatch(lease.id)
        if lease.pgids:
            self._spawn(self._stop_work(lease))
        self._scan()

    async def _stop_work(self, lease: Lease) -> None:
        """Stop what an ended lease left running, and say so in an event and in the lease's reason: its user
        is to see that the work was stopped, why, and whether it had to be killed."""
        grace = self.config.kill_grace
        signalled, killed = await holders.stop_groups(list(lease.pgids), list(lease.pgid_uids), list(lease.pgid_started), grace)
        if not signalled:
            return  # nothing was left running
        said = f"its work was stopped: {said_stopped([(f'process group {pgid}', pgid in killed) for pgid in signalled], grace)}"
        writes = [
            self._event(
                "lease.work_stopped",
                f"lease {lease.id} ({lease.holder.called}) {lease.state}: {lease.reason}; {said}",
                lease=lease.id,
                gpu=lease.gpus[0].uuid if lease.gpus else None,
                details={"pgids": signalled, "signal": "SIGKILL" if killed else "SIGTERM", "killed": killed, "grace": grace},
            )
        ]
        kept = self.ended.get(lease.id)
        if kept is not None and kept[1] is lease:  # still in the history: its reason says it too
            lease.reason = f"{lease.reason}; {said}"
            record = lease.to_record()
            record["_end"] = key_seq(kept[0])
            writes.insert(0, Write("ended", kept[0], record))
        self._record(*writes)

    def _trim_history(self) -> list[Write]:
        """Ended leases beyond leases_kept leave the history at once, and the store PRUNE_EVERY at a time.

        Their records go with the epoch counters, which they alone bounded from below until then;
        deleting in groups keeps most releases from rewriting the history's oldest page.
        """
        while len(self.ended) > self.config.leases_kept:
            _, (key, _) = self.ended.popitem(last=False)
            self._dropped.append(key)
        if len(self._dropped) < PRUNE_EVERY:
            return []
        writes = [self._epochs_write(), *(Write("ended", key) for key in self._dropped)]
        self._dropped = []
        return writes

    def _epochs_write(self) -> Write:
        return Write("meta", b"epochs", {"lease": self._lease_epoch, "gpu": dict(self._gpu_epochs)})

    # ----- listing --------------------------------------------------------

    def waiter_json(self, waiter: Waiter) -> dict[str, Any]:
        budgets = self.budgets()
        r = waiter.request
        mine: set[Claim] = {b.reading.index for b in could_use(r, budgets)} if r.wants_gpus else set()
        mine |= {what for what, need in ((CPU_CORES, r.cpu_cores), (HOST_MEMORY, r.memory)) if need}
        behind = [other.id for other, claimed in self._claims_ahead(waiter, budgets) if mine & claimed]
        return {
            "id": waiter.id,
            "state": "queued",
            "node": self.node_id,
            "priority": r.priority,
            "preemption": r.preemption,
            "bind": waiter.bind,
            "holder": waiter.holder.to_json(),
            "position": self.position(waiter),
            "waiting_behind": behind,
            "reason": waiter.reason,
            "queued_at": rfc3339(waiter.enqueued_at),
            "request": {
                "gpu_memory": r.gpu_memory,
                "gpus": r.gpus,
                "exclusive": r.exclusive,
                "gpu": r.gpu,
                "cpu_cores": r.cpu_cores,
                "memory": r.memory,
            },
            "labels": r.labels,
        }

    def list_leases(self, state: str | None, limit: int) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if state in (None, "queued"):
            out += [self.waiter_json(w) for w in self.waiters]
        if state in (None, LIVE):
            out += [lease.to_json() for lease in self.leases.values() if lease.live]  # a release on its way to disk is in the history
        if state is None or state in ENDED:
            out += [lease.to_json() for _, lease in reversed(self.ended.values()) if state in (None, lease.state)]
        return out[:limit]

    def get(self, lease_id: str) -> dict[str, Any]:
        waiter = self.find_waiter(lease_id)
        if waiter is not None:
            return self.waiter_json(waiter)
        return self.find(lease_id).to_json()

    # ----- events ---------------------------------------------------------

    def _event(
        self,
        type_: str,
        message: str,
        *,
        code: FailureCode | None = None,
        lease: str | None = None,
        gpu: str | None = None,
        details: dict[str, Any] | None = None,
    ) -> Write:
        self._event_seq += 1
        event: dict[str, Any] = {
            "seq": self._event_seq,
            "time": self.clock.now(),  # stored as a number; written as RFC 3339 when served
            "type": type_,
            "message": message,
            "details": details or {},
            "node": self.node_id,
        }
        if code is not None:
            event["code"] = code.value
        if lease is not None:
            event["lease"] = lease
        if gpu is not None:
            event["gpu"] = gpu
        return Write("events", seq_key(self._event_seq), event)

    def record_event(
        self,
        type_: str,
        message: str,
        *,
        details: dict[str, Any] | None = None,
        code: FailureCode | None = None,
        lease: str | None = None,
    ) -> None:
        """An event from outside the broker (the mesh, the API), kept and served with the broker's own."""
        self._record(self._event(type_, message, code=code, lease=lease, details=details))

    def _record(self, *writes: Write) -> None:
        """Events with nobody waiting on them: they ride the next commit."""
        if writes:
            self.store.submit(list(writes))

    @property
    def last_event_seq(self) -> int:
        """The seq of the newest event recorded; it may still be on its way to the store."""
        return self._event_seq

    def events(self, after: int, limit: int) -> tuple[list[dict[str, Any]], int]:
        events = self.store.events_after(after, limit)
        for event in events:
            if not isinstance(event["time"], str):  # older stores hold the RFC 3339 form already
                event["time"] = rfc3339(event["time"])
        # past the newest, `next` is the newest: a client resuming from it misses nothing that comes later
        return events, events[-1]["seq"] if events else min(after, self._event_seq)

    def dropped(self, after: int, found: list[dict[str, Any]]) -> int:
        """How many events after `after`, up to the first of `found`, are no longer kept (events_kept): those older than
        the oldest kept. A hole above it is no such thing: a write that failed (a full disk) took its events' seqs
        with it, and those events never were. The store is read only where there is a hole to account for."""
        if not found or found[0]["seq"] <= after + 1:
            return 0
        oldest = self.store.oldest_event()
        if oldest is None:
            return 0
        return max(0, min(int(found[0]["seq"]), oldest) - after - 1)


def _named(waiter: Waiter) -> str:
    """A waiting request as a refusal names it: its id and class, which `gpubroker leases` shows it by."""
    return f"{waiter.id} {waiter.request.priority}"


def _granted_index(on: GpuLeases, uuid: str) -> int:
    """The index a card had when a lease on it was granted: what names it where the driver has not listed it since."""
    lease, _ = next(iter(on.held.values()))
    return next(gpu.index for gpu in lease.gpus if gpu.uuid == uuid)


def _same_card(one: UnreadableGpu, other: UnreadableGpu) -> bool:
    """Whether two faults are of one card: the same UUID, or the same place where a UUID is not known."""
    if one.uuid is not None and other.uuid is not None:
        return one.uuid == other.uuid
    return one.index == other.index
