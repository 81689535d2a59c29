"""The store's writer thread: writes made durable in groups, answered on the loop."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import lmdb
import pytest
from fakes import FakeClock

from gpubroker.broker import store as store_module
from gpubroker.broker.store import PRUNE_EVERY, RECOVERED_AFTER, Store, StoreDamaged, Write, seq_key
from gpubroker.errors import StoreFull


def _put(i: int) -> list[Write]:
    return [Write("meta", f"k{i}".encode(), {"i": i})]


def _too_big() -> list[Write]:
    return [Write("meta", f"big{i}".encode(), {"pad": "x" * 200_000}) for i in range(8)]  # more than a 1 MiB store holds


async def test_writes_handed_over_together_are_made_durable_in_one_group(tmp_path: Path) -> None:
    store = Store(tmp_path, 16 * 2**20)
    store.load()
    store.start()
    try:
        await store.commit(_put(-1))  # the writer is awake and idle
        before = store.commits
        await asyncio.gather(*(store.commit(_put(i)) for i in range(50)))  # all handed over before the writer looks
        assert store.commits - before < 50
    finally:
        store.stop()
    reopened = Store(tmp_path, 16 * 2**20)
    reopened.start()
    try:
        assert {reopened.load().meta[f"k{i}"]["i"] for i in range(50)} == set(range(50))
    finally:
        reopened.stop()


async def test_a_value_that_cannot_be_packed_fails_its_own_writes_and_no_others(tmp_path: Path) -> None:
    store = Store(tmp_path, 16 * 2**20)
    store.load()
    before = store.commit(_put(1))
    bad = store.commit([Write("meta", b"bad", {"name": "x\udcff"})])  # a lone surrogate: not UTF-8
    after = store.commit(_put(2))
    store.start()  # the writer takes all three into one transaction
    try:
        results = await asyncio.gather(before, bad, after, return_exceptions=True)
        assert results[0] is None
        assert results[2] is None
        assert isinstance(results[1], StoreFull)
        assert "could not be written" in results[1].message
    finally:
        store.stop()
    reopened = Store(tmp_path, 16 * 2**20)
    meta = reopened.load().meta
    assert (meta["k1"], meta["k2"], "bad" in meta) == ({"i": 1}, {"i": 2}, False)


async def test_a_call_made_while_syncing_that_fails_keeps_no_answer_from_being_given(tmp_path: Path) -> None:
    store = Store(tmp_path, 16 * 2**20)
    store.load()
    store.start()
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _, context: reported.append(context))
    ran: list[int] = []

    def fails() -> None:
        raise RuntimeError("a broken answer")

    try:
        first = store.commit(_put(1), fails)
        second = store.commit(_put(2), lambda: ran.append(2))
        await asyncio.wait_for(asyncio.gather(first, second), 5)
    finally:
        store.stop()
        loop.set_exception_handler(None)
    assert ran == [2]
    assert [type(context["exception"]) for context in reported] == [RuntimeError]


@pytest.mark.parametrize("events_kept", [1, 100])
async def test_the_event_log_keeps_the_newest_events(tmp_path: Path, events_kept: int) -> None:
    store = Store(tmp_path, 16 * 2**20, events_kept=events_kept)
    store.load()
    store.start()
    try:
        for seq in range(1, 3 * PRUNE_EVERY + 1):
            await store.commit([Write("events", seq_key(seq), {"seq": seq})])
        kept = [event["seq"] for event in store.events_after(0, 10_000)]
    finally:
        store.stop()
    assert kept[-1] == 3 * PRUNE_EVERY
    assert kept == list(range(kept[0], kept[-1] + 1))
    assert events_kept <= len(kept) < events_kept + PRUNE_EVERY


async def test_a_full_store_says_what_to_do_and_the_log_says_so_once_and_when_it_is_over(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    clock = FakeClock()
    store = Store(tmp_path, 1 * 2**20, clock=clock.elapsed)
    store.start()
    try:
        for _ in range(3):
            with pytest.raises(StoreFull) as full:
                await store.commit(_too_big())
        assert "Restart the broker with a larger store_size" in full.value.message
        clock.advance(RECOVERED_AFTER)
        await store.commit(_put(1))  # a small write still fits
    finally:
        store.stop()
    logged = capsys.readouterr().err.splitlines()
    assert logged == [
        "gpubroker: the state store is full (1.0 MiB)",
        f"gpubroker: the state store can be written again: 3 writes failed, the last {RECOVERED_AFTER:.1f} s ago",
    ]


async def test_writes_failing_by_turns_are_said_once_with_their_count_and_over_only_once_none_fails_for_a_while(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A full disk under load: small commits fit in pages LMDB frees, larger ones fail. The log said "could not be
    written" and "can be written again" by turns, about 20 times for 500 grants, and /healthz flipped with it."""
    clock = FakeClock()
    looked: list[float] = []

    def elapsed() -> float:
        looked.append(clock.elapsed())
        return clock.elapsed()

    store = Store(tmp_path, 1 * 2**20, clock=elapsed)
    store.start()
    said: list[str | None] = []
    try:
        for i in range(5):
            await store.commit(_put(i))
        assert looked == []  # a healthy writer does not look at the clock
        for i in range(10):
            with pytest.raises(StoreFull):  # each request still hears the truth: this one failed...
                await store.commit(_too_big())
            said.append(store.failing)
            clock.advance(1.0)
            await store.commit(_put(i))  # ...and this one was written
            said.append(store.failing)
            clock.advance(1.0)
        assert said == ["the state store is full (1.0 MiB)"] * 20  # /healthz never says healthy between two failures
        clock.advance(RECOVERED_AFTER - 2.0 - 0.1)
        await store.commit(_put(10))
        assert store.failing is not None
        clock.advance(0.1)
        await store.commit(_put(11))
        assert store.failing is None
        assert store.failures == 10
    finally:
        store.stop()
    assert capsys.readouterr().err.splitlines() == [
        "gpubroker: the state store is full (1.0 MiB)",
        f"gpubroker: the state store can be written again: 10 writes failed, the last {RECOVERED_AFTER:.1f} s ago",
    ]


async def test_a_store_cut_short_to_nothing_is_refused_not_begun_again_empty(tmp_path: Path) -> None:
    """LMDB takes an empty data file for a new store: the leases would be forgotten and the epochs begin again."""
    store = Store(tmp_path, 16 * 2**20)
    store.start()
    try:
        await store.commit(_put(1))
    finally:
        store.stop()
    data = tmp_path / "store" / "data.mdb"
    os.truncate(data, 0)
    with pytest.raises(StoreDamaged) as damaged:
        Store(tmp_path, 16 * 2**20)
    assert "is empty" in str(damaged.value)
    assert data.stat().st_size == 0  # left as it was, for whoever restores it


async def test_an_old_event_that_cannot_be_read_stops_the_start_saying_the_store_is_damaged(tmp_path: Path) -> None:
    """Only the newest event was read at start: a store damaged among its old events was started on, and a reader of
    them (`gpubroker events`) got a bare 500."""
    store = Store(tmp_path, 16 * 2**20)
    store.start()
    try:
        await store.commit([Write("events", seq_key(seq), {"seq": seq, "type": "test"}) for seq in range(1, 201)])
    finally:
        store.stop()
    env = lmdb.open(str(tmp_path / "store"), max_dbs=8)
    events = env.open_db(b"events")
    with env.begin(write=True) as txn:
        txn.put(seq_key(1), b"\xc1", db=events)  # a byte msgpack never writes
    env.close()
    reopened = Store(tmp_path, 16 * 2**20)
    try:
        with pytest.raises(StoreDamaged, match="is damaged"):
            reopened.load()
    finally:
        reopened.stop()


async def test_a_store_larger_than_a_lowered_store_size_keeps_its_size_and_takes_every_release(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Started again with a store_size under what it held, LMDB took the file's size as the store's: no room was left
    for anything, and no lease could be released."""
    store = Store(tmp_path, 16 * 2**20)
    store.start()
    try:
        for i in range(60):
            await store.commit([Write("leases", f"l-{i:04d}".encode(), {"pad": "x" * 40_000})])
    finally:
        store.stop()
    small = Store(tmp_path, 2**20)
    small.start()
    try:
        with pytest.raises(StoreFull):  # what is not an end: the store holds more than store_size leaves for leases
            await small.commit([Write("leases", b"l-new", {"pad": "x"})])
        for i in range(60):  # a release: the lease leaves the live table, its record goes to the history, with its event
            ended = [Write("ended", seq_key(i + 1), {"pad": "x" * 40_000}), Write("events", seq_key(i + 1), {"seq": i + 1})]
            await small.commit([Write("leases", f"l-{i:04d}".encode()), *ended])
    finally:
        small.stop()
    said = capsys.readouterr().err
    assert "more than store_size (1.0 MiB) leaves for leases: new leases are refused until it holds less" in said, said


async def test_a_store_whose_write_failed_says_once_it_can_be_written_again_with_no_request_coming(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Space freed under an idle broker: /healthz said `store_error`, and the log that writes failed, until a request
    happened to come; an operator who had freed space saw no change."""
    monkeypatch.setattr(store_module, "RECHECK_EVERY", 0.05)
    store = Store(tmp_path, 16 * 2**20)
    real = store._env
    store._env = type("Env", (), {"begin": lambda self, write=False: _FailingCommit()})()  # the disk fails its writes
    store.start()
    try:
        with pytest.raises(StoreFull):
            await store.commit(_put(1))
        assert store.failing is not None
        store._env = real  # and works again, with no request coming
        for _ in range(400):  # at most 20 s: the writer tries again every RECHECK_EVERY
            if store.failing is None:
                break
            await asyncio.sleep(0.05)
        assert store.failing is None
    finally:
        store._env = real
        store.stop()
    assert capsys.readouterr().err.splitlines()[-1].startswith("gpubroker: the state store can be written again: 1 write failed")
    assert "k1" not in Store(tmp_path, 16 * 2**20).load().meta  # the failed write stays undone


async def test_a_full_store_is_not_said_to_be_writable_again_because_a_small_write_of_its_own_fits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A write of the writer's own fits in the pages the last one freed: every 5 s of a full store, /healthz said it
    was fine and the log that it could be written again, while every grant was refused."""
    monkeypatch.setattr(store_module, "RECHECK_EVERY", 0.01)
    store = Store(tmp_path, 1 * 2**20)
    store.start()
    try:
        for i in range(10_000):
            try:
                await store.commit([Write("leases", f"l-{i:08d}".encode(), {"pad": "x" * 2000})])
            except StoreFull:
                break
        assert store.failing is not None
        await asyncio.sleep(0.2)  # twenty rechecks' time
        assert store.failing is not None
    finally:
        store.stop()
    assert "can be written again" not in capsys.readouterr().err


class _FailingCommit:
    """A write transaction whose commit fails as LMDB's does when the disk fills under a page it writes: a short
    write, which LMDB reports as EIO, not ENOSPC."""

    def __enter__(self) -> _FailingCommit:
        return self

    def __exit__(self, *_: object) -> None:
        raise lmdb.Error("mdb_txn_commit: Input/output error")

    def put(self, *_: object, **__: object) -> None:
        pass


async def test_a_write_that_fails_on_a_full_disk_says_the_disk_is_full_whatever_the_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk said "Input/output error" for its first failures: an operator looked for a failing disk."""
    store = Store(tmp_path, 16 * 2**20)
    real = store._env
    monkeypatch.setattr(store, "_env", type("Env", (), {"begin": lambda self, write=False: _FailingCommit()})())
    disk = os.statvfs(tmp_path)
    monkeypatch.setattr(os, "statvfs", lambda path: os.statvfs_result((*disk[:4], 0, *disk[5:])))  # f_bavail 0
    store.start()
    try:
        with pytest.raises(StoreFull) as failed:
            await store.commit(_put(1))
    finally:
        store._env = real
        store.stop()
    assert f"the disk of {tmp_path} is full" in failed.value.message
    assert f"free space on the disk of {tmp_path}" in failed.value.message


async def test_a_store_on_a_disk_still_full_is_not_said_to_be_writable_again_because_a_small_write_of_its_own_fits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write of the writer's own may reuse freed pages where a grant needs new ones the full disk cannot give."""
    monkeypatch.setattr(store_module, "RECHECK_EVERY", 0.01)
    store = Store(tmp_path, 16 * 2**20)
    real = store._env
    store._env = type("Env", (), {"begin": lambda self, write=False: _FailingCommit()})()
    disk = os.statvfs(tmp_path)
    monkeypatch.setattr(os, "statvfs", lambda path: os.statvfs_result((*disk[:4], 0, *disk[5:])))  # f_bavail 0
    store.start()
    try:
        with pytest.raises(StoreFull):
            await store.commit(_put(1))
        store._env = real  # a small write would work: LMDB has pages to reuse
        await asyncio.sleep(0.2)  # twenty rechecks' time
        assert store.failing is not None
    finally:
        store._env = real
        store.stop()


async def test_an_idle_store_whose_last_write_succeeded_says_it_can_be_written_again_without_another_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A full store, then leases released at once (written), then no request: /healthz said store_error for ever."""
    monkeypatch.setattr(store_module, "RECOVERED_AFTER", 0.3)
    store = Store(tmp_path, 1 * 2**20)
    store.start()
    try:
        with pytest.raises(StoreFull):
            await store.commit(_too_big())
        await store.commit(_put(1))  # written before none has failed for a while: still said to fail
        assert store.failing is not None
        for _ in range(50):
            if store.failing is None:
                break
            await asyncio.sleep(0.05)
        assert store.failing is None
    finally:
        store.stop()
    assert capsys.readouterr().err.splitlines()[-1].startswith("gpubroker: the state store can be written again: 1 write failed")
