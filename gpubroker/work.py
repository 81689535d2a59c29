"""The work under `gpubroker lease -- CMD`: every process CMD starts stays below `gpubroker lease`, and is found there.

`gpubroker lease` is made a child subreaper (Linux): a process whose parent exits is handed to its nearest ancestor
that is one, so CMD's descendants stay its own even when they leave CMD's process group, or its session (`setsid`), and
fork again to be orphaned, as daemons do. Its GPU memory then counts as the lease's (the holder's descendants'), its
process group is found and registered with the lease (`escaped_groups`), and what CMD leaves running when it ends is
stopped before the lease is released (`stop_leftovers`), as systemd stops what a service left in its control group.
The orphans it inherits, it reaps (`reap_orphans`), never CMD, whose exit status is waited for apart.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Make this process its descendants' reaper; False where the kernel does not have it (not Linux, before 3.4).
    Not inherited by its children; kept across exec."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return bool(ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


@dataclass(frozen=True, slots=True)
class Process:
    pid: int
    ppid: int
    pgid: int
    exited: bool  # a zombie, waiting to be reaped: it runs nothing and holds no memory


def processes() -> dict[int, Process]:
    """Every process of the machine, by pid, from one pass over /proc."""
    found: dict[int, Process] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as stat:
                line = stat.read()
            state, ppid, pgid = line[line.rindex(b")") + 2 :].split()[:3]
        except (OSError, ValueError):
            continue  # gone meanwhile
        found[int(name)] = Process(int(name), int(ppid), int(pgid), state in (b"Z", b"X"))
    return found


def descendants(table: dict[int, Process], root: int) -> set[int]:
    """The pids below `root`, exited ones included."""
    children: dict[int, list[int]] = {}
    for process in table.values():
        children.setdefault(process.ppid, []).append(process.pid)
    below: set[int] = set()
    todo = [root]
    while todo:
        for pid in children.get(todo.pop(), ()):
            if pid not in below:
                below.add(pid)
                todo.append(pid)
    return below


def own_groups(table: dict[int, Process], below: set[int]) -> dict[int, list[int]]:
    """The process groups with a process still running below this one and every process below it: their living pids,
    by group. This process's own group is never one (it holds the shell's job, or its caller)."""
    members: dict[int, list[Process]] = {}
    for process in table.values():
        members.setdefault(process.pgid, []).append(process)
    own = os.getpgrp()
    groups = {table[pid].pgid for pid in below if pid in table}
    return {
        pgid: [p.pid for p in members[pgid] if not p.exited]
        for pgid in sorted(groups)
        if pgid != own and all(p.pid in below for p in members[pgid]) and any(not p.exited for p in members[pgid])
    }


def real_uid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status", "rb") as status:
            for line in status:
                if line.startswith(b"Uid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def escaped_groups(known: set[int], others: Callable[[], tuple[set[int], set[int]]]) -> tuple[list[int], set[int], set[int]]:
    """The process groups below this process not in `known` that it may register with its lease; those of them that are
    another lease's, for good; and every group below it now (one of `known` not among them has ended: its id, reused,
    is another group). One not registrable for now (another uid's process in it) is looked at again next time.

    One it may register has every process below it, all of one uid, its own (or any one uid's, for root), as the broker
    asks; and is no other lease's: `others()` (asked only when there is a group to register) gives the holders' pids
    and the registered groups of the other leases, and a group registered with one of them, or with a process below
    the holder of one (a `gpubroker lease -- CMD` run from CMD), is that lease's work. Registered with this lease too,
    it would be as near to both, and the lease granted first, this one, would take its GPU memory."""
    table = processes()
    me = os.getpid()
    groups = own_groups(table, descendants(table, me))
    uid = os.getuid()
    candidates = []
    for pgid, pids in groups.items():
        if pgid in known:
            continue
        owners = {real_uid(pid) for pid in pids} - {None}  # (None: a process gone since: a short-lived child)
        if len(owners) == 1 and uid in (0, *owners):
            candidates.append(pgid)
    if not candidates:
        return [], set(), set(groups)
    holders, taken = others()
    found, theirs = [], set()
    for pgid in candidates:
        if pgid in taken:
            theirs.add(pgid)
            continue
        line: set[int] = set()  # the processes from each of the group's up to this one
        for pid in groups[pgid]:
            while pid in table and pid != me and pid not in line:
                line.add(pid)
                pid = table[pid].ppid
        if line & holders:
            theirs.add(pgid)
        else:
            found.append(pgid)
    return found, theirs, set(groups)


def reap_orphans(cmd: int) -> None:
    """Reap every exited process this one inherited, never CMD: CMD's exit status is for its own wait. Each is looked
    at before it is reaped (WNOWAIT): a wait for any child could take CMD's status."""
    while True:
        try:
            exited = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return  # no children at all
        if exited is None or exited.si_pid in (0, cmd):  # none has exited, or CMD first: its wait takes it, then these
            return
        with contextlib.suppress(ChildProcessError):
            os.waitpid(exited.si_pid, os.WNOHANG)


def _signal(pgid: int | None, pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if pgid is None:
            os.kill(pid, signum)
        elif pgid > 1:  # never init's group, never 0 (this process's own)
            os.killpg(pgid, signum)


def _signalable(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:  # gone, or another user's (a setuid program's): not this process's to stop, nor to wait for
        return False
    return True


def _living(table: dict[int, Process], below: set[int]) -> set[int]:
    return {pid for pid in below if pid in table and not table[pid].exited and _signalable(pid)}


SHOWN = 5  # of a group's pids, or of the groups stopped with one outcome, those named: the rest are counted


def _first(names: list[str]) -> str:
    """The first SHOWN names, the rest counted."""
    more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    return ", ".join(names[:SHOWN]) + more


def _listed(pids: list[int]) -> str:
    return ("pid " if len(pids) == 1 else "pids ") + _first([str(pid) for pid in pids])


def said_stopped(stopped: list[tuple[str, bool]], grace: float) -> str:
    """How work was stopped, in one short line however much of it there was: each group or process stopped (its name,
    and whether SIGKILL had to end it) by outcome, the first few named and the rest counted. Said by `gpubroker lease`
    of what CMD left running and by the broker of a lease's work: named one by one, a few hundred groups made a line
    of many kilobytes, in the terminal and in the lease's reason."""
    said = []
    for killed, outcome in ((False, "ended on SIGTERM"), (True, f"killed (SIGKILL) {grace:g}s after SIGTERM")):
        names = [name for name, was_killed in stopped if was_killed is killed]
        if names:
            said.append(f"{_first(names)} {outcome}")
    return "; ".join(said)


def stop_leftovers(grace: float) -> str | None:
    """Once CMD has ended (and been reaped): SIGTERM (and SIGCONT, should they be stopped) to what is still running below
    this process, then SIGKILL to what is left after `grace`; what was stopped, said as the broker says a lease's work
    was, or None when nothing was left. A group all of whose processes are below this one is signalled as a whole, as
    the broker signals a lease's groups (a process forked meanwhile is not missed); any other process alone."""
    me = os.getpid()
    reap_orphans(0)  # CMD has been reaped: every exited child is an orphan
    table = processes()
    below = descendants(table, me)
    left = _living(table, below)
    if not left:
        return None
    groups = own_groups(table, below)
    alone = sorted(left - {pid for pids in groups.values() for pid in pids})
    targets: list[tuple[int | None, list[int]]] = [*((pgid, pids) for pgid, pids in groups.items()), *((None, [pid]) for pid in alone)]
    for pgid, pids in targets:
        _signal(pgid, pids[0], signal.SIGTERM)
        _signal(pgid, pids[0], signal.SIGCONT)
    killed: set[int] = set()  # the targets (by index) SIGKILL had to end
    ends = time.monotonic() + grace
    pause = 0.005  # doubled up to 0.2 s: most work ends at once on SIGTERM, and /proc is read again each time
    while True:
        time.sleep(pause)
        pause = min(0.2, pause * 2)
        reap_orphans(0)
        table = processes()
        below = descendants(table, me)
        running = _living(table, below)
        if not running:
            break
        if time.monotonic() >= ends:
            groups = own_groups(table, below)
            for pgid in groups:
                _signal(pgid, pgid, signal.SIGKILL)
            for pid in running - {pid for pids in groups.values() for pid in pids}:
                _signal(None, pid, signal.SIGKILL)
            killed |= {
                index
                for index, (pgid, pids) in enumerate(targets)
                if (pids[0] in running if pgid is None else any(table[pid].pgid == pgid for pid in running))
            }
            if time.monotonic() >= ends + 2.0:  # in the kernel and deaf even to SIGKILL (a hung driver call): not waited on
                break
    return said_stopped(
        [
            (f"process group {pgid} ({_listed(pids)})" if pgid is not None else f"process {pids[0]}", index in killed)
            for index, (pgid, pids) in enumerate(targets)
        ],
        grace,
    )
