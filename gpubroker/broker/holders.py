"""Holders' lives: a pidfd per caller-bound lease, and signals for the work left behind."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from gpubroker.units import printable_text

# The kernel keeps when a process started as clock ticks since boot; psutil adds /proc/stat's btime, the wall clock
# less the time since boot, read anew on every call, so it moves with every step of the wall clock (NTP setting the
# clock of a board without a real-time clock): a holder read before a step of an hour and its processes read after it
# seemed to have started an hour apart, and were taken for other processes. Boot time read once keeps every start time
# this broker takes on one scale, and one read of /proc/PID/stat costs a grant less than psutil's two.
_BOOTED = psutil.boot_time()
_TICKS = os.sysconf("SC_CLK_TCK")


def boot_clock() -> tuple[str | None, float]:
    """This boot's id (None where the kernel does not say), and the boot time every start time of this broker is on.
    Kept in the store, so that a broker started again on the same boot after a step of the wall clock moves the start
    times it holds onto its own scale, and one started after a reboot knows that no process it held survived."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip(), _BOOTED
    except OSError:
        return None, _BOOTED


def start_time(pid: int) -> float | None:
    """When a process started (to tell it from a later process with the same pid), on the wall clock as it read when
    this broker started, whatever it reads now; None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
        return float(stat.rpartition(b")")[2].split()[19]) / _TICKS + _BOOTED  # starttime, the 22nd field
    except (OSError, IndexError, ValueError):  # gone, or not a process's stat
        return None


def process_of(pid: int) -> int | None:
    """The process a thread id belongs to (its thread group: the pid itself for a process); None if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_bytes().splitlines():
            if line.startswith(b"Tgid:"):
                return int(line.split()[1])
    except (OSError, IndexError, ValueError):
        pass
    return None


def group_started(pgid: int) -> float:
    """What a process group is known by as it is registered, against the reuse of its id: when its leader (the
    process whose pid is its id) started, or, where the leader is gone already, now, on the same scale."""
    started = start_time(pgid)
    return started if started is not None else _BOOTED + time.clock_gettime(time.CLOCK_BOOTTIME)


def is_same_group(pgid: int, started: float | None) -> bool:
    """Whether process group `pgid` may still be the one registered at `started` (`group_started`). A group's id is
    its leader's pid, which the kernel keeps from reuse while any process of the group lives: a process with that
    pid that started later is the leader of another group, the registered one having ended. One whose leader alone
    is gone is still the registered group. None (a group registered by an earlier version): the id alone says so."""
    if started is None:
        return True
    leader = start_time(pgid)
    return leader is None or leader < started + 0.01


def process_name(pid: int) -> str | None:
    try:
        return printable_text(psutil.Process(pid).name())  # a process may name itself with any bytes
    except psutil.Error:
        return None


def broker_lineage() -> frozenset[int]:
    """This broker and its ancestors, pid 1 among them: the descendants of any of them are most of the
    machine's processes, so no lease may be held in their name by a caller who merely names one."""
    lineage = {1, os.getpid()}
    with contextlib.suppress(psutil.Error):
        lineage.update(parent.pid for parent in psutil.Process().parents())
    return frozenset(lineage)


def is_same_process(pid: int, started: float | None) -> bool:
    """Whether `pid` is still the process that started at `started` (a reused pid is not)."""
    now = start_time(pid)
    return now is not None and (started is None or abs(now - started) < 0.01)


class HolderWatch:
    """Calls back once when a watched process exits, at once, through a pidfd on the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._fds: dict[str, int] = {}

    def watch(self, key: str, pid: int, started: float | None, on_exit: Callable[[str], None]) -> bool:
        """Watch `pid` for `key`; False (and no callback) if it is already gone or was reused."""
        try:
            fd = os.pidfd_open(pid)
        except (ProcessLookupError, OSError):
            return False
        # The pidfd pins this process; checking the start time after opening it
        # rules out a pid that was reused between the caller's request and now.
        if not is_same_process(pid, started):
            os.close(fd)
            return False
        self.unwatch(key)
        self._fds[key] = fd

        def fired() -> None:
            self.unwatch(key)
            on_exit(key)

        self._loop.add_reader(fd, fired)
        return True

    def unwatch(self, key: str) -> None:
        fd = self._fds.pop(key, None)
        if fd is not None:
            self._loop.remove_reader(fd)
            os.close(fd)

    def close(self) -> None:
        for key in list(self._fds):
            self.unwatch(key)


def group_owners(pgid: int) -> set[int]:
    """The real uids of the processes in a process group; empty if it has none (scans every process: run it off the loop)."""
    owners: set[int] = set()
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if os.getpgid(process.pid) == pgid:
                owners.add(process.uids().real)
    return owners


def signalable_groups(pgids: list[int], uids: list[int], started: list[float | None]) -> list[int]:
    """The groups still as they were registered: the same group (`is_same_group`), with processes, every one of
    them the uid's that owned the group then, and not the broker's (a group id reused, even by that uid, is left
    alone). `started` may be shorter than `pgids` (a lease stored by an earlier version): the rest go by id."""
    own = os.getpgrp()
    return [
        pgid
        for pgid, uid, at in zip(pgids, uids, [*started, *[None] * (len(pgids) - len(started))], strict=False)
        if pgid != own and is_same_group(pgid, at) and group_owners(pgid) == {uid}
    ]


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def signal_group(pgid: int, signum: int) -> bool:
    """Send a signal to a process group; False if the group is gone or not ours to signal."""
    if pgid <= 1:
        return False  # never init's group, never "every process"
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)
        return True
    return False


async def stop_groups(pgids: list[int], uids: list[int], started: list[float | None], grace: float) -> tuple[list[int], list[int]]:
    """SIGTERM each group, then SIGKILL what is left after `grace`: work never goes on without its lease.

    Only groups still as they were registered (`signalable_groups`), looked at again before each signal.
    Answers the groups sent SIGTERM, and those of them that had to be killed.
    """
    signalled = [pgid for pgid in await asyncio.to_thread(signalable_groups, pgids, uids, started) if signal_group(pgid, signal.SIGTERM)]
    for pgid in signalled:  # a stopped group (Ctrl-Z) acts on SIGTERM only once continued
        signal_group(pgid, signal.SIGCONT)
    owner = dict(zip(pgids, uids, strict=False))
    since = dict(zip(pgids, started, strict=False))
    alive = signalled
    waited = 0.0
    while alive and waited < grace:
        await asyncio.sleep(min(0.1, grace - waited))
        waited += 0.1
        alive = [pgid for pgid in alive if group_alive(pgid)]
    killed: list[int] = []
    if alive:
        for pgid in await asyncio.to_thread(signalable_groups, alive, [owner[pgid] for pgid in alive], [since.get(pgid) for pgid in alive]):
            if signal_group(pgid, signal.SIGKILL):
                killed.append(pgid)
    return signalled, killed
