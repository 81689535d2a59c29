"""Durable state in LMDB (SPEC §3.5): leases, epochs and events, committed in groups by one writer thread.

The event loop never waits on a disk: `commit()` hands writes to the writer
thread, which wakes at once, takes everything that has gathered, commits it as
one synced transaction (one fsync for many grants under load, none when idle),
and resolves the waiting futures in one hop back to the loop.
"""

from __future__ import annotations

import asyncio
import functools
import os
import queue
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lmdb
import msgpack

from gpubroker.errors import StoreFull
from gpubroker.units import log_line

_KEY = struct.Struct(">Q")
PRUNE_EVERY = 64  # history (events, ended leases) is dropped in groups of this many: fewer pages per commit
DISK_FULL_UNDER = 2**20  # bytes free on the state directory's disk below which a failed write is put down to a full disk
RECHECK_EVERY = 5.0  # seconds: how often a store whose last write failed, with nothing else to write, tries a write
# Seconds without a failed write before a store whose writes failed says it can be written again. On a full disk,
# small commits fit in pages LMDB frees while larger ones fail: under load they take turns, and saying each turn
# (about 20 times for 500 grants) told an operator nothing but noise, and /healthz flipped with it.
RECOVERED_AFTER = 5.0
# Of store_size, the part no new lease may fill (a sixteenth, and at least 64 pages or a quarter: records of more than
# half a page need whole free runs of pages, which a small store's free pages may not hold): a store full for new leases
# still takes every release, expiry and renewal, with its event. Measured on a 1 MiB store of leases with labels of
# 3 KiB, 171 releases in a row, until none was left, took 11 pages beyond those in use at the first refusal.
KEPT_BACK = 1 / 16
KEPT_BACK_PAGES = 64


@dataclass(frozen=True, slots=True)
class Write:
    """One change: `put` or `delete` a key of a table."""

    table: str
    key: bytes
    value: Any = None  # None: delete


@dataclass(slots=True, eq=False)
class _Batch:
    writes: list[Write]
    future: asyncio.Future[None] | None
    loop: asyncio.AbstractEventLoop | None = None
    while_syncing: Callable[[], None] | None = None
    on_settled: Callable[[Exception | None], None] | None = None
    packed: list[bytes | None] = field(default_factory=list)  # the values as the writer packed them

    @property
    def lease_keys(self) -> list[bytes]:
        """The live leases it writes: a new one, which the store's KEPT_BACK refuses, or one it holds."""
        return [write.key for write in self.writes if write.table == "leases" and write.value is not None]


@dataclass(slots=True)
class Loaded:
    leases: list[dict[str, Any]] = field(default_factory=list)
    ended: list[dict[str, Any]] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    last_event: int = 0


def seq_key(seq: int) -> bytes:
    return _KEY.pack(seq)


def key_seq(key: bytes) -> int:
    return int(_KEY.unpack(key)[0])


class StoreDamaged(Exception):
    """The store on disk cannot be read (a file cut short or overwritten): the broker does not start on it."""


# What LMDB says of a file that is not what it wrote (py-lmdb's BadTxnError follows a corruption found mid-read).
_DAMAGE = (lmdb.CorruptedError, lmdb.InvalidError, lmdb.PageNotFoundError, lmdb.BadTxnError, lmdb.PanicError)


class Store:
    """leases (live, by id), ended (history, by end order), meta (epochs, node id), events (by seq)."""

    TABLES = ("leases", "ended", "meta", "events")

    def __init__(self, path: Path, map_size: int, events_kept: int = 10_000, clock: Callable[[], float] = time.monotonic) -> None:
        self._events_kept = events_kept
        self._clock = clock  # read only while writes fail: a healthy commit costs no look at it
        path.mkdir(parents=True, exist_ok=True)
        self._path = path
        data = path / "store" / "data.mdb"
        # LMDB takes an empty data file for a new store and writes one over it: the leases would be forgotten and the
        # epochs begin again. It writes its header as it makes the file, so an empty one was cut short, never new.
        if data.exists() and data.stat().st_size == 0:
            raise StoreDamaged(self.damaged(f"{data} is empty: it was cut short"))
        # sync and metasync: every acknowledged commit survives kill -9 and power loss.
        try:
            self._env = lmdb.open(str(path / "store"), map_size=map_size, max_dbs=8, sync=True, metasync=True)
        except _DAMAGE as error:
            raise StoreDamaged(self.damaged(str(error))) from None
        self._said: str | None = None  # why writes fail, from the first failure until none has for RECOVERED_AFTER
        self._reasons: set[str] = set()  # what the log has said of failing writes since they began to fail
        self._failed_at = 0.0  # when the last write failed (the clock's seconds)
        self._failed_since = 0  # transactions that failed since writes began to fail
        # A write succeeded after the last failure, while writes are still said to fail: the writer wakes once none
        # has failed for RECOVERED_AFTER to say so, or an idle broker said "store_error" until its next request.
        self._written_since = False
        # Whether the last failure was the disk's, which space freed outside may end: a full map is not, and a write of
        # the writer's own always fits in one (it rewrites pages freed by the last), while a grant's does not.
        self._disk_failed = False
        self.failures = 0  # transactions the disk refused (full, or a fault), for /metrics: only grows
        try:
            self._check_length()
            self._db = {name: self._env.open_db(name.encode()) for name in self.TABLES}
            # Pages in use past which no new lease is written: of store_size, however large the store already is.
            psize = self._env.stat()["psize"]
            pages = map_size // psize
            self._new_leases_until = pages - min(max(int(pages * KEPT_BACK), KEPT_BACK_PAGES), pages // 4)
            self._keep_room_beyond(map_size, psize)
        except (StoreDamaged, *_DAMAGE) as error:
            self._env.close()
            raise StoreDamaged(self.damaged(str(error))) from None
        self._queue: queue.SimpleQueue[_Batch | None] = queue.SimpleQueue()
        self._pack = msgpack.Packer().pack  # the writer thread's own: one packer for every value it writes
        self._thread: threading.Thread | None = None
        self.commits = 0  # transactions written, for the benchmark and tests

    def _keep_room_beyond(self, map_size: int, psize: int) -> None:
        """A store that already holds more than store_size leaves for leases (store_size was lowered) keeps room beyond
        its file for everything but new leases: LMDB takes the file's size for the map, which leaves none at all, and no
        lease could be released."""
        with self._env.begin() as txn:
            used = self._pages_in_use(txn)
        if used < self._new_leases_until:
            return
        end = (self._env.info()["last_pgno"] + 1) * psize
        room = max(int(used * KEPT_BACK), KEPT_BACK_PAGES) * psize
        self._env.set_mapsize(max(map_size, end + room))
        log_line(
            f"the state store holds {used * psize / 2**20:.1f} MiB, more than store_size ({map_size / 2**20:.1f} MiB) leaves "
            f"for leases: new leases are refused until it holds less (a larger store_size lets them in), and it keeps "
            f"{room / 2**20:.1f} MiB more for releases, renewals and expiries"
        )

    def damaged(self, problem: str) -> str:
        """What to say of a store that cannot be read, and what to do."""
        where = self._path / "store"
        return (
            f"the state store in {where} is damaged ({problem}); not starting on it, as the leases it holds would be "
            f"forgotten: restore {where} from a backup, or move it aside to start with no leases, epochs or events"
        )

    def _check_length(self) -> None:
        """A data file shorter than its own header says (cut short by a copy or a full disk) is refused before it is
        read: LMDB maps it, and touching a page past its end kills the process with SIGBUS, saying nothing."""
        data = self._path / "store" / "data.mdb"
        length = (self._env.info()["last_pgno"] + 1) * self._env.stat()["psize"]
        if (size := data.stat().st_size) < length:
            raise StoreDamaged(f"{data} is {size} bytes where its header says {length}: it was cut short")

    def load(self) -> Loaded:
        """Everything stored, unpacked; StoreDamaged when a page or a value cannot be read."""
        loaded = Loaded()
        try:
            with self._env.begin() as txn:
                for _, value in txn.cursor(self._db["leases"]):
                    loaded.leases.append(msgpack.unpackb(value))
                for _, value in txn.cursor(self._db["ended"]):
                    loaded.ended.append(msgpack.unpackb(value))
                for key, value in txn.cursor(self._db["meta"]):
                    loaded.meta[key.decode()] = msgpack.unpackb(value)
                # Every kept event is read too (about 30 ms for 10,000): one damaged stops the start here, saying so, where it
                # was found only by a reader of old events, whose request failed.
                for key, value in txn.cursor(self._db["events"]):
                    msgpack.unpackb(value)
                    loaded.last_event = _KEY.unpack(key)[0]
        except (*_DAMAGE, ValueError, msgpack.UnpackException, struct.error) as error:
            raise StoreDamaged(self.damaged(f"{type(error).__name__}: {error}")) from None
        return loaded

    def events_after(self, after: int, limit: int) -> list[dict[str, Any]]:
        """Committed events with seq > after, oldest first (a read transaction: never blocks the writer)."""
        out: list[dict[str, Any]] = []
        with self._env.begin() as txn:
            cursor = txn.cursor(self._db["events"])
            if not cursor.set_range(seq_key(after + 1)):
                return out
            for _, value in cursor:
                out.append(msgpack.unpackb(value))
                if len(out) >= limit:
                    break
        return out

    def events_newest_first(self) -> Iterator[dict[str, Any]]:
        """Every kept event, newest first, read in one transaction as they are asked for (a reader may stop early);
        StoreDamaged when one cannot be read."""
        try:
            with self._env.begin() as txn:
                cursor = txn.cursor(self._db["events"])
                if cursor.last():
                    for _, value in cursor.iterprev():
                        yield msgpack.unpackb(value)
        except (*_DAMAGE, ValueError, msgpack.UnpackException) as error:
            raise StoreDamaged(self.damaged(f"{type(error).__name__}: {error}")) from None

    def oldest_event(self) -> int | None:
        """The seq of the oldest event kept; None when none is."""
        with self._env.begin() as txn:
            cursor = txn.cursor(self._db["events"])
            return key_seq(bytes(cursor.key())) if cursor.first() else None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="gpubroker-store", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Finish what was handed over, then close; idempotent."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        self._env.close()

    def commit(
        self,
        writes: list[Write],
        while_syncing: Callable[[], None] | None = None,
        on_settled: Callable[[Exception | None], None] | None = None,
    ) -> asyncio.Future[None]:
        """Done once the writes are synced to disk; StoreFull if they do not fit (nothing is changed).

        The writes are handed over at once, in call order, and a plain future comes back:
        no task to schedule on the way to the disk or on the way back. `while_syncing` is
        called on the loop once the writer has the transaction ready and is syncing it (with
        the GIL released), so work such as preparing the answer costs the answer nothing.
        `on_settled(error)` is called on the loop just before the future is settled, and also when
        whoever awaited it has gone away meanwhile: what must follow the disk's answer always does.
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        self._queue.put(_Batch(writes, future, loop, while_syncing, on_settled))
        return future

    @property
    def running(self) -> bool:
        return self._thread is not None

    @property
    def failing(self) -> str | None:
        """Why the last failed transaction could not be written, until none has failed for RECOVERED_AFTER seconds
        (for /healthz); None otherwise. A write that succeeds between two failures does not clear it."""
        return self._said

    def submit(self, writes: list[Write]) -> None:
        """Writes that ride the next commit, with nobody waiting on them (events)."""
        self._queue.put(_Batch(writes, None))

    def _run(self) -> None:
        while True:
            try:
                # While writes fail, the writer also tries one of its own now and then: freed space on an idle broker
                # is seen (in /healthz, in the log) without waiting for a request to fail or succeed.
                first = self._queue.get(timeout=self._wake_in())
            except queue.Empty:
                if self._written_since:  # nothing was written meanwhile, so nothing failed
                    self._written(quiet=True)
                else:
                    self._recheck()
                continue
            if first is None:
                return
            batches = [first]
            stopping = False
            while not self._queue.empty():  # everything that gathered meanwhile rides this transaction
                more = self._queue.get_nowait()
                if more is None:
                    stopping = True
                    break
                batches.append(more)
            unpackable = self._pack_all(batches)
            if unpackable:
                for batch, problem in unpackable.items():
                    self._resolve([batch], problem)
                    if batch.future is None:  # an event nobody waits on: it is lost, and says so
                        log_line(f"an event could not be kept: {problem}")
                batches = [batch for batch in batches if batch not in unpackable]
            refused = self._new_leases_refused(batches)
            if refused:
                self._resolve(refused, self._failing(self._full_error(others_fit=True)))
                batches = [batch for batch in batches if batch not in refused]
            error = self._write(batches) if batches else None
            self._resolve(batches, error)
            if stopping:
                return

    def _pack_all(self, batches: list[_Batch]) -> dict[_Batch, Exception]:
        """Pack every value before the transaction: a batch holding a value that cannot be packed fails
        alone, and the batches beside it are written as if it had never come."""
        unpackable: dict[_Batch, Exception] = {}
        for batch in batches:
            try:
                batch.packed = [None if write.value is None else self._pack(write.value) for write in batch.writes]
            except Exception as error:
                unpackable[batch] = StoreFull(f"the state store could not be written: {type(error).__name__}: {error}", {})
        return unpackable

    def _write(self, batches: list[_Batch]) -> Exception | None:
        try:
            with self._env.begin(write=True) as txn:
                for batch in batches:
                    for write, value in zip(batch.writes, batch.packed, strict=True):
                        db = self._db[write.table]
                        if value is None:
                            txn.delete(write.key, db=db)
                        else:
                            txn.put(write.key, value, db=db)
                            if write.table == "events":
                                self._prune_events(txn, db, _KEY.unpack(write.key)[0])
                # The commit below syncs without the GIL: the loop can work meanwhile (one wake-up for them all).
                _call_on_loops([(batch.loop, batch.while_syncing) for batch in batches if batch.while_syncing is not None])
            self.commits += 1
            if self._said is not None:  # healthy, a commit costs this look alone: no clock, no timer
                self._written()
            return None
        except lmdb.MapFullError:
            return self._failing(self._full_error(others_fit=False))
        except Exception as error:  # a disk fault: the writes did not happen, the callers hear so,
            # and the writer lives on for the next batch.
            self._disk_failed = True
            problem = f"{type(error).__name__}: {error}"
            if "No space left" in str(error) or self._disk_full():  # a write cut short by a full disk is EIO to LMDB
                problem = f"the disk of {self._path} is full ({problem}); free space on the disk of {self._path}"
            else:
                problem += f" (in {self._path})"
            return self._failing(
                StoreFull(f"the state store could not be written: {problem}; nothing was changed", {"state_dir": str(self._path)})
            )

    def _full_error(self, others_fit: bool) -> StoreFull:
        """`others_fit`: a new lease refused as the pages in use reached KEPT_BACK, where all else is still written."""
        self._disk_failed = False
        size = self._env.info()["map_size"]
        return StoreFull(
            f"the state store is full ({size / 2**20:.1f} MiB); nothing was changed. Restart the broker with a larger "
            "store_size (its history, events_kept and leases_kept, fills it too)"
            + ("; releases, renewals and expiries are still kept meanwhile" if others_fit else ""),
            {"store_size": size},
        )

    def _new_leases_refused(self, batches: list[_Batch]) -> list[_Batch]:
        """The batches that write a lease the store does not hold yet, once the pages in use have reached
        KEPT_BACK: refused, where everything else (a renewal, a release, an event) is written. LMDB's file only
        grows (its last page is a high-water mark), so the pages in use are counted only once that is past. None when
        they cannot be counted: the write then says what fails."""
        putting = [batch for batch in batches if batch.lease_keys]
        if not putting:
            return []
        try:
            if self._env.info()["last_pgno"] < self._new_leases_until:
                return []
            with self._env.begin() as txn:
                if self._pages_in_use(txn) < self._new_leases_until:
                    return []
                leases = self._db["leases"]
                return [batch for batch in putting if any(txn.get(key, db=leases) is None for key in batch.lease_keys)]
        except Exception:
            return []

    def _pages_in_use(self, txn: lmdb.Transaction) -> int:
        stats = [self._env.stat(), *(txn.stat(db) for db in self._db.values())]
        return 2 + sum(stat["branch_pages"] + stat["leaf_pages"] + stat["overflow_pages"] for stat in stats)  # 2: the meta pages

    def _disk_full(self) -> bool:
        """Whether the state directory's disk has no room left to speak of (under a MiB this user may use)."""
        try:
            disk = os.statvfs(self._path)
        except OSError:
            return False
        return disk.f_bavail * disk.f_frsize < DISK_FULL_UNDER

    def _wake_in(self) -> float | None:
        """How long the writer waits for a batch before it looks at the store on its own; None: until one comes."""
        if self._said is None:
            return None
        if self._written_since:
            return max(0.0, self._failed_at + RECOVERED_AFTER - self._clock())
        return RECHECK_EVERY if self._disk_failed else None

    def _recheck(self) -> None:
        """A write of the time it was tried: once it succeeds, the store says it can be written again (it comes after
        RECHECK_EVERY seconds in which nothing was written, so none failed). Its failure is not counted nor said
        again, as nobody asked for it, but it puts off saying that writes work again. Not while the disk is still full:
        a write of its own may fit in pages freed by the last one, where a grant's needs new ones."""
        if self._disk_full():
            return
        try:
            with self._env.begin(write=True) as txn:
                txn.put(b"written_at", self._pack(time.time()), db=self._db["meta"])
        except Exception:
            self._failed_at = self._clock()
            self._written_since = False
            return
        self._written(quiet=True)

    def _failing(self, problem: StoreFull) -> StoreFull:
        """The log says when writes start failing and for what (each reason once), not per request or per turn."""
        said = problem.message.partition(";")[0]
        self.failures += 1
        self._failed_at = self._clock()
        self._written_since = False
        if self._said is None:
            self._reasons.clear()
            self._failed_since = 0
        self._failed_since += 1
        if said not in self._reasons:
            log_line(said)
            self._reasons.add(said)
        self._said = said
        return problem

    def _written(self, quiet: bool = False) -> None:
        """A write that succeeded while writes fail: the log says they work again, with how many failed, once none has
        failed for RECOVERED_AFTER seconds (`quiet`: none could have, as nothing was written meanwhile)."""
        ago = self._clock() - self._failed_at
        self._written_since = True
        if quiet or ago >= RECOVERED_AFTER:
            self._written_since = False
            count = self._failed_since
            log_line(
                f"the state store can be written again: {count} {'write' if count == 1 else 'writes'} failed, the last {ago:.1f} s ago"
            )
            self._said = None

    def _prune_events(self, txn: lmdb.Transaction, db: Any, seq: int) -> None:
        """The log is bounded: every PRUNE_EVERY events, the oldest beyond events_kept go, together.

        Dropping them in a group rather than one per event leaves most commits one page
        lighter (the log's oldest leaf is not rewritten each time); the store holds at most
        PRUNE_EVERY - 1 events beyond events_kept.
        """
        if seq % PRUNE_EVERY or seq <= self._events_kept:
            return
        newest_dropped = seq_key(seq - self._events_kept)
        cursor = txn.cursor(db)
        while cursor.first() and bytes(cursor.key()) <= newest_dropped:
            cursor.delete()

    @staticmethod
    def _resolve(batches: list[_Batch], error: Exception | None) -> None:
        """Settle each waiting future with `error` (None: done), in one hand-over per loop."""
        _call_on_loops(
            [
                (batch.loop, functools.partial(_settle, batch.future, error, batch.on_settled))
                for batch in batches
                if batch.future is not None
            ]
        )


def _call_on_loops(calls: list[tuple[asyncio.AbstractEventLoop | None, Callable[[], None]]]) -> None:
    """Run each call on its loop, with one hand-over (one wake-up) per loop."""
    by_loop: dict[asyncio.AbstractEventLoop, list[Callable[[], None]]] = {}
    for loop, call in calls:
        if loop is not None:
            by_loop.setdefault(loop, []).append(call)
    for loop, on_loop in by_loop.items():
        try:
            loop.call_soon_threadsafe(_run_all, on_loop)
        except RuntimeError:
            pass  # the loop is closed: nobody is waiting any more


def _run_all(calls: list[Callable[[], None]]) -> None:
    for call in calls:
        try:
            call()
        except Exception as error:  # one failing call must not keep those after it (a settle) from running
            asyncio.get_running_loop().call_exception_handler({"message": "a call from the store's writer failed", "exception": error})


def _settle(future: asyncio.Future[None], error: Exception | None, on_settled: Callable[[Exception | None], None] | None = None) -> None:
    if on_settled is not None:
        on_settled(error)
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
