"""`gpubroker lease -- CMD` as real processes, for the installed command and for the built binary.

The acceptance point: a lease held through `gpubroker lease -- CMD` is released within a second
of the `gpubroker lease` process dying by kill -9, with the reason recorded, and CMD's process
group is signalled. CMD's own exit code, environment and release are checked here too.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pwd
import re
import resource
import select
import shlex
import shutil
import signal
import subprocess
import sys
import termios
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
from conftest import BINARY, BrokerProcess, wait_for

from gpubroker.client import Client
from gpubroker.units import parse_time

GIB = 2**30
MakeBroker = Callable[..., BrokerProcess]  # the broker_process fixture: a factory of brokers

# CMD for the kill -9 test, run as `sh CMD_SCRIPT WORKDIR`. `gpubroker lease` starts it in a
# new process group, so its pid is the group's id. It starts a second member of that group
# which only a signal sent to the whole group can reach: PR_SET_PDEATHSIG reaches CMD itself
# (gpubroker's direct child) and is not inherited across fork. That member records SIGTERM.
# Files are written, then renamed, so the test never reads half of one.
CMD_SCRIPT = """\
work=$1
echo $$ > "$work/pgid.new" && mv "$work/pgid.new" "$work/pgid"
sh -c '
    trap "echo TERM > \\"$1/member-signal\\"; exit 0" TERM
    sleep 600 &
    echo $$ > "$1/member.new" && mv "$1/member.new" "$1/member"
    wait
' member "$work" &
wait
"""


def start_broker(gpubroker: list[str], broker_process: MakeBroker) -> BrokerProcess:
    """`gpubroker up` from the command under test, on one simulated 24 GiB GPU."""
    return broker_process("1x24GiB", command=gpubroker).start()


def living_members(pgid: int) -> list[int]:
    """The processes of a group that have not exited; zombies do not count.

    Not `os.killpg(pgid, 0)`: that succeeds while an exited member waits to be reaped, and an
    orphan is reaped by init, whenever init gets to it (or never, where pid 1 does not reap).
    """
    alive = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # gone meanwhile
        state, _ppid, group = stat[stat.rindex(")") + 2 :].split()[:3]
        if int(group) == pgid and state not in ("Z", "X"):
            alive.append(int(entry.name))
    return alive


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """Start `gpubroker lease ...` with its output in a file; everything it left running is killed afterwards."""
    started: list[subprocess.Popen[bytes]] = []

    def start(argv: list[str], env: dict[str, str], read: bool = True) -> subprocess.Popen[bytes]:
        """Unread: its output goes to a pipe nobody reads (a terminal gone), where every line it writes fails."""
        if read:
            with (tmp_path / f"lease{len(started)}.log").open("wb") as log:
                proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        else:
            proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            assert proc.stdout is not None
            proc.stdout.close()
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
    # CMD outlives a killed `gpubroker lease` if the broker failed to stop it: never leave it running.
    for pgid_file in tmp_path.glob("*/pgid"):
        pgid = int(pgid_file.read_text())
        if living_members(pgid):
            os.killpg(pgid, signal.SIGKILL)
            wait_for(lambda pgid=pgid: not living_members(pgid), timeout=5.0)


def lease_log(tmp_path: Path, index: int = 0) -> str:
    path = tmp_path / f"lease{index}.log"
    return path.read_text(errors="replace") if path.exists() else ""


def read_environ(path: Path) -> dict[str, str]:
    """A process's environment as /proc/PID/environ gave it: exactly what it was started with."""
    items = [item.partition("=") for item in path.read_bytes().decode().split("\0") if item]
    return {key: value for key, _, value in items}


def cmd_runs(holder: int, name: str) -> bool:
    """Whether a process of CMD's named `name` runs below the holder: CMD has started, past its registration (a group
    is listed with the lease as soon as it is registered in memory, before that is on disk and answered)."""
    with contextlib.suppress(psutil.Error):
        return any(child.name() == name for child in psutil.Process(holder).children(recursive=True))
    return False


def granted_to(client: Client, pid: int) -> dict[str, Any] | None:
    leases = client.call("GET", "/v1/leases", query={"state": "granted"})["leases"]
    return next((lease for lease in leases if lease["holder"]["pid"] == pid), None)


def test_a_lease_is_released_within_a_second_of_its_holder_dying_by_kill_9_and_its_process_group_is_stopped(
    gpubroker: list[str], broker_process: MakeBroker, spawn: Callable[..., subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    broker = start_broker(gpubroker, broker_process)
    client = broker.client()
    work = tmp_path / "cmd"
    work.mkdir()
    script = tmp_path / "cmd.sh"
    script.write_text(CMD_SCRIPT)
    holder = spawn([*gpubroker, "lease", "--gpu-memory", "4GiB", "--name", "worker", "--", "sh", str(script), str(work)], broker.env)

    def ready() -> bool:
        assert holder.poll() is None, f"gpubroker lease exited with {holder.returncode}:\n{lease_log(tmp_path)}"
        lease = granted_to(client, holder.pid)
        return lease is not None and bool(lease["process_groups"]) and (work / "member").exists()

    wait_for(ready, timeout=20.0)
    lease = granted_to(client, holder.pid)
    assert lease is not None
    pgid = int((work / "pgid").read_text())
    member = int((work / "member").read_text())
    assert os.getpgid(pgid) == pgid, "CMD leads its own process group"
    assert os.getpgid(member) == pgid, "the member is in CMD's group"
    assert lease["holder"] == {"name": "worker", "uid": os.getuid(), "pid": holder.pid}
    assert lease["process_groups"] == [pgid]
    assert lease["gpus"][0]["bytes"] == 4 * GIB

    killed_at = time.monotonic()
    holder.send_signal(signal.SIGKILL)  # not reaped yet: a zombie holder is a dead holder

    def state() -> dict[str, Any]:
        found: dict[str, Any] = client.call("GET", f"/v1/leases/{lease['id']}")["lease"]
        return found

    wait_for(lambda: state()["state"] == "released", timeout=1.0, interval=0.01)
    released_after = time.monotonic() - killed_at
    assert released_after < 1.0
    ended = state()
    assert ended["state"] == "released"
    assert ended["reason"].startswith(f"holder pid {holder.pid} exited")
    assert client.call("GET", "/v1/node")["gpus"][0]["figures"]["leased"] == 0

    def release_events() -> list[dict[str, Any]]:
        events = client.call("GET", "/v1/events", query={"limit": 1000})["events"]
        return [e for e in events if e["type"] == "lease.released" and e.get("lease") == lease["id"]]

    wait_for(release_events, timeout=5.0)
    [event] = release_events()
    assert event["details"]["reason"] == f"holder pid {holder.pid} exited"
    assert event["gpu"] == "GPU-sim-0"

    wait_for(lambda: not living_members(pgid), timeout=5.0)
    # Only a signal to the whole group reaches the member, and it was SIGTERM, not SIGKILL.
    assert (work / "member-signal").read_text() == "TERM\n"
    stopped = f"holder pid {holder.pid} exited; its work was stopped: process group {pgid} ended on SIGTERM"
    wait_for(lambda: state()["reason"] == stopped, timeout=5.0)  # said where its user looks, as is an event

    def stop_events() -> list[dict[str, Any]]:
        events = client.call("GET", "/v1/events", query={"limit": 1000})["events"]
        return [e for e in events if e["type"] == "lease.work_stopped" and e.get("lease") == lease["id"]]

    wait_for(stop_events, timeout=5.0)  # on disk just after the reason changes in memory
    [said] = stop_events()
    assert said["details"] == {"pgids": [pgid], "signal": "SIGTERM", "killed": [], "grace": 10.0}
    assert holder.wait(5) == -signal.SIGKILL


# CMD for the tests of work that leaves CMD's group, run as `python CMD_DAEMON WORK`: it starts a daemon as daemons
# start, in a session of its own and orphaned (fork, setsid, fork again, and the middle process exits), then ends once
# WORK/go exists. The daemon writes its pid to WORK/daemon, and its group to WORK/pgid (so that the spawn fixture kills
# it should a test fail); on SIGTERM it writes to WORK/stopped what state its lease was in then, and exits.
CMD_DAEMON = """\
import os, signal, sys, time
from gpubroker.client import Client

work = sys.argv[1]

def note(name, text):
    with open(os.path.join(work, name + ".new"), "w") as out:
        out.write(text)
    os.rename(os.path.join(work, name + ".new"), os.path.join(work, name))

def stopped(_signum, _frame):
    note("stopped", Client().call("GET", "/v1/leases/" + os.environ["GPUBROKER_LEASE"])["lease"]["state"])
    os._exit(0)

if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        signal.signal(signal.SIGTERM, stopped)
        note("pgid", str(os.getpgrp()))
        note("daemon", str(os.getpid()))
        while True:
            signal.pause()
    os._exit(0)
os.wait()
while not os.path.exists(os.path.join(work, "go")):
    time.sleep(0.02)
"""


def running(pid: int) -> bool:
    """Whether a process runs: not gone, and not exited (a zombie left for its parent to reap)."""
    with contextlib.suppress(psutil.Error):
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    return False


def start_daemon_under_a_lease(
    gpubroker: list[str], broker: BrokerProcess, spawn: Callable[..., subprocess.Popen[bytes]], tmp_path: Path
) -> tuple[subprocess.Popen[bytes], Path, int]:
    """`gpubroker lease --gpu-memory 1GiB -- python CMD_DAEMON WORK`, once the daemon runs: the holder, WORK, the daemon's pid."""
    work = tmp_path / "cmd"
    work.mkdir()
    script = tmp_path / "cmd.py"
    script.write_text(CMD_DAEMON)
    holder = spawn([*gpubroker, "lease", "--gpu-memory", "1GiB", "--", sys.executable, str(script), str(work)], broker.env)
    wait_for((work / "daemon").exists, timeout=20.0)
    daemon = int((work / "daemon").read_text())
    assert os.getsid(daemon) == os.getpgid(daemon) != os.getsid(holder.pid)  # it left CMD's group and session
    return holder, work, daemon


def test_work_that_leaves_cmds_session_is_the_leases_and_is_stopped_when_cmd_ends_before_the_lease_is_released(
    gpubroker: list[str], broker_process: MakeBroker, spawn: Callable[..., subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    """A daemon started by CMD (setsid, fork again) was handed to init: its GPU memory counted as external, and it ran on
    once CMD had ended and the lease was released, holding memory the broker then granted to others."""
    config = tmp_path / "gpubroker.toml"
    config.write_text('sample_interval = "200ms"\nstaleness = "1s"\n')
    sim = tmp_path / "gpus.toml"
    sim.write_text('[[gpu]]\nmemory = "24GiB"\n')
    broker = broker_process(str(sim), extra=["--config", str(config)], command=gpubroker).start()
    client = broker.client()
    holder, work, daemon = start_daemon_under_a_lease(gpubroker, broker, spawn, tmp_path)
    assert psutil.Process(daemon).ppid() == holder.pid  # orphaned, it went to `gpubroker lease`, not to init
    lease = granted_to(client, holder.pid)
    assert lease is not None

    # The simulation file, read at every sample, now has the daemon using 3 GiB of the GPU.
    (tmp_path / "gpus.new").write_text(f'[[gpu]]\nmemory = "24GiB"\n[[process]]\ngpu = 0\npid = {daemon}\nname = "daemon"\nused = "3GiB"\n')
    (tmp_path / "gpus.new").rename(sim)

    def gpu() -> dict[str, Any]:
        found: dict[str, Any] = client.call("GET", "/v1/node")["gpus"][0]
        return found

    wait_for(lambda: gpu()["processes"], timeout=5.0)
    assert [p["lease"] for p in gpu()["processes"]] == [lease["id"]]
    assert (gpu()["figures"]["external"], gpu()["figures"]["leased"]) == (0, 3 * GIB)

    (work / "go").touch()  # CMD ends, the daemon still running

    assert holder.wait(30) == 0, lease_log(tmp_path)
    assert not running(daemon)
    assert (work / "stopped").read_text() == "granted"  # stopped under its lease, which was released after
    pgid = int((work / "pgid").read_text())
    assert lease_log(tmp_path) == (
        f"gpubroker: CMD has ended; what it left running was stopped: process group {pgid} (pid {daemon}) ended on SIGTERM\n"
    )
    assert client.call("GET", f"/v1/leases/{lease['id']}")["lease"]["reason"] == f"released by its holder (pid {holder.pid})"


def test_work_that_leaves_cmds_session_is_stopped_by_the_broker_when_gpubroker_lease_dies_by_kill_9(
    gpubroker: list[str], broker_process: MakeBroker, spawn: Callable[..., subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    """The broker signals the process groups registered with the lease: a daemon's, in a session of its own, was never
    one of them, so it outlived the lease of a `gpubroker lease` killed with -9."""
    broker = start_broker(gpubroker, broker_process)
    client = broker.client()
    holder, work, daemon = start_daemon_under_a_lease(gpubroker, broker, spawn, tmp_path)
    pgid = os.getpgid(daemon)
    wait_for(lambda: pgid in (granted_to(client, holder.pid) or {}).get("process_groups", []), timeout=10.0)  # found, registered
    lease = granted_to(client, holder.pid)
    assert lease is not None
    assert lease["process_groups"][1:] == [pgid]  # after CMD's own

    holder.kill()

    wait_for(lambda: not running(daemon), timeout=5.0)
    assert (work / "stopped").read_text() == "released"  # by the broker, as it released the lease of a holder gone
    assert holder.wait(5) == -signal.SIGKILL


@pytest.mark.installed_only
def test_the_groups_of_a_lease_taken_inside_cmd_are_left_to_it_and_not_registered_with_the_outer_lease(
    gpubroker: list[str], broker_process: MakeBroker, spawn: Callable[..., subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    """Registered with both, the inner CMD's group would be as near to either lease, and the outer one, granted first,
    would take its GPU memory."""
    broker = start_broker(gpubroker, broker_process)
    client = broker.client()
    go = tmp_path / "go"
    inner = " ".join([*gpubroker, "lease", "--cpu-cores", "1", "--", "sleep", "600"])
    # The inner lease first; once the test says go, a process in a session of its own, which the outer lease takes.
    cmd = ["sh", "-c", f"{inner} & while [ ! -e {go} ]; do sleep 0.02; done; setsid sleep 600 & wait"]
    holder = spawn([*gpubroker, "lease", "--cpu-cores", "1", "--ttl", "3s", "--", *cmd], broker.env)

    def leases() -> dict[bool, dict[str, Any]]:
        """The outer lease (True) and the inner one, by whether `gpubroker lease` is their holder."""
        return {
            lease["holder"]["pid"] == holder.pid: lease for lease in client.call("GET", "/v1/leases", query={"state": "granted"})["leases"]
        }

    wait_for(lambda: len(leases()) == 2 and leases()[False]["process_groups"], timeout=20.0)
    go.touch()
    wait_for(lambda: len(leases()[True]["process_groups"]) == 2, timeout=10.0)  # the setsid one, looked for with the inner's

    outer, nested = leases()[True]["process_groups"], leases()[False]["process_groups"]
    assert not set(outer) & set(nested)
    holder.terminate()
    assert holder.wait(30) == 128 + signal.SIGTERM, lease_log(tmp_path)
    assert client.call("GET", "/v1/leases", query={"state": "granted"})["leases"] == []  # the inner lease went with its CMD


# CMD for the test of a CMD that starts many process groups, run as `python CMD_SESSIONS N SECONDS`: it starts N workers
# each in a session of its own (as a harness with start_new_session=True does), which end with it, and ends after SECONDS.
CMD_SESSIONS = """\
import ctypes, os, signal, sys, time
count, seconds = int(sys.argv[1]), float(sys.argv[2])
for _ in range(count):
    if os.fork() == 0:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: never left running should the test fail
        os.setsid()
        while True:
            signal.pause()
time.sleep(seconds)
"""


@pytest.mark.installed_only
def test_registering_many_process_groups_does_not_hold_up_the_renewals(
    gpubroker: list[str], broker_process: MakeBroker, spawn: Callable[..., subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    """The groups CMD made were registered by the thread that renews the lease, after a renewal and before the next:
    hundreds of them kept the broker busy for longer than the lease's TTL, which ran out, and CMD was stopped."""
    broker = start_broker(gpubroker, broker_process)
    script = tmp_path / "sessions.py"
    script.write_text(CMD_SESSIONS)
    holder = spawn([*gpubroker, "lease", "--cpu-cores", "1", "--ttl", "1s", "--", sys.executable, str(script), "300", "2.5"], broker.env)
    assert holder.wait(30) == 0, lease_log(tmp_path)  # not stopped (143) as its lease ran out
    assert "has run out" not in lease_log(tmp_path)


# CMD for the test of a group registered once another user's process has left it, run as root as
# `python CMD_MIXED WORK UID`: it starts a daemon (in a session of its own) with a child of uid UID, which is in its group
# until killed, then (that child's uid changed) a second daemon alone, and ends once WORK/go exists. The first
# daemon's group is in WORK/mixed/pgid, its child's pid in WORK/mixed/child, the second's group in WORK/alone/pgid.
CMD_MIXED = """\
import os, signal, sys, time
work, uid = sys.argv[1], int(sys.argv[2])

def note(name, text):
    with open(os.path.join(work, name + ".new"), "w") as out:
        out.write(text)
    os.rename(os.path.join(work, name + ".new"), os.path.join(work, name))

def uid_of(pid):
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("Uid:"))

if os.fork() == 0:
    os.setsid()
    child = os.fork()
    if child == 0:
        os.setuid(uid)
        while True:
            signal.pause()
    while uid_of(child) != uid:
        time.sleep(0.01)
    note("mixed/child", str(child))
    note("mixed/pgid", str(os.getpgrp()))
    os.waitpid(child, 0)
    while True:
        signal.pause()
while not os.path.exists(os.path.join(work, "mixed", "pgid")):
    time.sleep(0.01)
if os.fork() == 0:
    os.setsid()
    note("alone/pgid", str(os.getpgrp()))
    while True:
        signal.pause()
while not os.path.exists(os.path.join(work, "go")):
    time.sleep(0.02)
"""


@pytest.mark.installed_only
@pytest.mark.skipif(os.geteuid() != 0, reason="only root starts a process of another uid")
def test_a_group_another_users_process_has_left_is_registered_at_the_next_look(
    gpubroker: list[str], broker_process: MakeBroker, spawn: Callable[..., subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    """A group not registrable when first looked at (another uid's process in it, or one that exited meanwhile, as a
    daemon's short-lived children do) was never looked at again, and never registered: should `gpubroker lease` die,
    the broker left it running."""
    broker = start_broker(gpubroker, broker_process)
    client = broker.client()
    work = tmp_path  # (mixed/pgid and alone/pgid: the spawn fixture kills both groups should the test fail)
    for name in ("mixed", "alone"):
        (work / name).mkdir()
    script = tmp_path / "mixed.py"
    script.write_text(CMD_MIXED)
    nobody = pwd.getpwnam("nobody").pw_uid
    cmd = [sys.executable, str(script), str(work), str(nobody)]
    holder = spawn([*gpubroker, "lease", "--cpu-cores", "1", "--ttl", "3s", "--", *cmd], broker.env)

    def registered() -> list[int]:
        return list((granted_to(client, holder.pid) or {}).get("process_groups", []))

    wait_for((work / "alone" / "pgid").exists, timeout=20.0)
    mixed, alone = int((work / "mixed" / "pgid").read_text()), int((work / "alone" / "pgid").read_text())
    wait_for(lambda: alone in registered(), timeout=10.0)  # looked at, with the mixed group there already
    assert mixed not in registered()  # two uids: the broker would refuse it

    os.kill(int((work / "mixed" / "child").read_text()), signal.SIGKILL)  # its group is its leader's uid's alone now
    wait_for(lambda: mixed in registered(), timeout=3.0)  # at the next renewal's look (each second)
    (work / "go").touch()
    assert holder.wait(30) == 0, lease_log(tmp_path)


def test_an_orphan_handed_to_gpubroker_lease_is_reaped_when_it_exits(
    gpubroker: list[str], broker_process: MakeBroker, spawn: Callable[..., subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    """`gpubroker lease` inherits the processes orphaned below it: one that exits is reaped, not left a zombie."""
    broker = start_broker(gpubroker, broker_process)
    said, go, script = tmp_path / "orphan", tmp_path / "go", tmp_path / "orphan.sh"
    # Run as `sh orphan.sh PARENT` in the background of a shell (PARENT) that ends at once: orphaned, it says its pid and
    # who its parent is then (the fourth field of /proc/PID/stat; sh's name has no space), and exits.
    script.write_text(
        "parent() { cut -d' ' -f4 /proc/$$/stat; }\n"
        'while [ "$(parent)" -eq "$1" ]; do sleep 0.01; done\n'
        f'echo $$ "$(parent)" > {said}.new && mv {said}.new {said}\n'
    )
    cmd = ["sh", "-c", f"sh -c 'sh {script} $$ &'; while [ ! -e {go} ]; do sleep 0.02; done"]
    holder = spawn([*gpubroker, "lease", "--cpu-cores", "1", "--", *cmd], broker.env)
    wait_for(said.exists, timeout=20.0)
    pid, parent_then = map(int, said.read_text().split())
    assert parent_then == holder.pid

    wait_for(lambda: not psutil.pid_exists(pid), timeout=5.0)  # exited, and reaped: no zombie is left below the holder
    go.touch()
    assert holder.wait(30) == 0, lease_log(tmp_path)
    assert lease_log(tmp_path) == ""  # nothing was left running


def test_cmd_runs_with_the_lease_environment_and_its_exit_code_is_the_commands(
    gpubroker: list[str], broker_process: MakeBroker, spawn: Callable[..., subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    broker = start_broker(gpubroker, broker_process)
    client = broker.client()
    environ = tmp_path / "environ"
    cmd = ["sh", "-c", 'cat /proc/$$/environ > "$0"; exit 7', str(environ)]
    holder = spawn([*gpubroker, "lease", "--gpu-memory", "4GiB", "--name", "worker", "--", *cmd], broker.env)

    assert holder.wait(30) == 7, lease_log(tmp_path)

    env = read_environ(environ)
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-sim-0"
    assert env["GPUBROKER_GPU_MEMORY"] == str(4 * GIB) == "4294967296"
    lease = client.call("GET", f"/v1/leases/{env['GPUBROKER_LEASE']}")["lease"]
    assert lease["holder"] == {"name": "worker", "uid": os.getuid(), "pid": holder.pid}
    assert lease["state"] == "released"
    # Not "by uid 0", as when root releases it from another shell: it was released because CMD ended.
    assert lease["reason"] == f"released by its holder (pid {holder.pid})"
    assert client.call("GET", "/v1/leases", query={"state": "granted"})["leases"] == []
    assert lease_log(tmp_path) == ""


@pytest.mark.parametrize("callers", [None, "/opt/callers/lib"], ids=["unset", "set"])
def test_cmd_gets_the_callers_ld_library_path_never_the_bundles(
    gpubroker: list[str],
    broker_process: MakeBroker,
    spawn: Callable[..., subprocess.Popen[bytes]],
    tmp_path: Path,
    callers: str | None,
) -> None:
    broker = start_broker(gpubroker, broker_process)
    env = {k: v for k, v in broker.env.items() if k not in ("LD_LIBRARY_PATH", "LD_LIBRARY_PATH_ORIG")}
    if callers is not None:
        env["LD_LIBRARY_PATH"] = callers
    cmd = ["sh", "-c", 'cat /proc/$$/environ > "$0/cmd"; cat /proc/$PPID/environ > "$0/holder"', str(tmp_path)]
    holder = spawn([*gpubroker, "lease", "--gpu-memory", "1GiB", "--", *cmd], env)

    assert holder.wait(30) == 0, lease_log(tmp_path)

    if gpubroker == [str(BINARY)]:
        # Else this test would prove nothing: the bundle's loader points the dynamic linker at its own libraries.
        bundled = read_environ(tmp_path / "holder").get("LD_LIBRARY_PATH", "")
        assert str(BINARY.parent / "_internal") in bundled.split(":")
    assert read_environ(tmp_path / "cmd").get("LD_LIBRARY_PATH") == callers


def test_when_someone_else_releases_the_lease_cmd_is_stopped_and_gpubroker_lease_says_why(
    gpubroker: list[str], broker_process: MakeBroker, spawn: Callable[..., subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    broker = start_broker(gpubroker, broker_process)
    client = broker.client()
    cmd = ["sh", "-c", 'trap "exit 3" TERM; sleep 30 & wait']
    holder = spawn([*gpubroker, "lease", "--gpu-memory", "4GiB", "--", *cmd], broker.env)
    wait_for(lambda: cmd_runs(holder.pid, "sleep"), timeout=20.0)  # CMD has started, and set its trap
    lease = granted_to(client, holder.pid)
    assert lease is not None
    events_before = client.call("GET", "/v1/events", query={"after": 0, "limit": 1000})["next"]
    client.call("DELETE", f"/v1/leases/{lease['id']}")  # root on the socket, from another shell

    assert holder.wait(30) == 3  # CMD got SIGTERM from the broker, and its exit code is passed on
    said = lease_log(tmp_path)
    assert (
        f"gpubroker: lease {lease['id']} was released before CMD ended: released by user {pwd.getpwuid(os.getuid()).pw_name} (uid {os.getuid()})"
        in said
    ), said
    later = client.call("GET", "/v1/events", query={"after": events_before, "limit": 1000})["events"]
    assert [e["type"] for e in later if e["type"] == "request.refused"] == []  # no DELETE of an ended lease was sent


@pytest.mark.installed_only
@pytest.mark.slow  # 15 s of waiting for renewals a TTL apart
def test_renewals_that_resume_after_the_broker_restarts_say_so_and_keep_cmd_going(
    gpubroker: list[str], broker_process: MakeBroker, spawn: Callable[..., subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    """A failed renewal is said ("start one with `gpubroker up`"): without a word when renewals work again, the user
    of a long job could only guess whether its lease was lost. And they are tried again every second: tried only a third
    and two thirds of the TTL after the last one that worked, a broker back after the second was never asked, and CMD
    was stopped as the lease ran out, though the broker held it still."""
    broker = start_broker(gpubroker, broker_process)
    holder = spawn([*gpubroker, "lease", "--cpu-cores", "1", "--ttl", "15s", "--", "sleep", "600"], broker.env)
    wait_for(lambda: cmd_runs(holder.pid, "sleep"), timeout=20.0)
    lease = granted_to(broker.client(), holder.pid)
    assert lease is not None
    broker.stop()
    wait_for(lambda: "could not be renewed" in lease_log(tmp_path), timeout=30.0)
    time.sleep(max(0.0, parse_time(lease["granted_at"]) + 10.5 - time.time()))  # past the try two thirds of the TTL in
    broker.start()

    wait_for(lambda: "renewed again" in lease_log(tmp_path), timeout=30.0)
    said = lease_log(tmp_path)
    assert re.search(rf"^gpubroker: lease {lease['id']} renewed again: it expires \S+Z$", said, re.MULTILINE)
    assert said.count("could not be renewed") == 1, said  # said once, not once a second
    assert "has run out" not in said
    assert holder.poll() is None  # CMD goes on
    assert (granted_to(broker.client(), holder.pid) or {}).get("id") == lease["id"]


@pytest.mark.installed_only
def test_a_broker_that_no_longer_knows_the_lease_has_cmd_stopped_and_says_so(
    gpubroker: list[str], broker_process: MakeBroker, spawn: Callable[..., subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    """Its state directory wiped while it was down: the renewal's NOT_FOUND was printed, and CMD ended without a word
    that it was being stopped, nor why."""
    broker = start_broker(gpubroker, broker_process)
    holder = spawn([*gpubroker, "lease", "--cpu-cores", "1", "--ttl", "12s", "--", "sleep", "600"], broker.env)
    wait_for(lambda: cmd_runs(holder.pid, "sleep"), timeout=20.0)
    lease = granted_to(broker.client(), holder.pid)
    assert lease is not None
    broker.stop()
    shutil.rmtree(broker.state)
    broker.start()

    assert holder.wait(30) == 128 + signal.SIGTERM  # CMD's end, passed on
    said = lease_log(tmp_path)
    assert re.search(
        rf"^gpubroker: lease {lease['id']} could not be renewed: NOT_FOUND: .*; it has ended, so CMD is stopped \(SIGTERM, SIGKILL after \d+s\)$",
        said,
        re.MULTILINE,
    ), said


@pytest.mark.installed_only
def test_a_broker_that_stops_answering_does_not_hold_gpubroker_lease_past_cmds_end(
    gpubroker: list[str], broker_process: MakeBroker, spawn: Callable[..., subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    """A broker stopped (SIGSTOP, a debugger, a hung disk) took `gpubroker lease` with it for as long as it was stopped,
    once CMD had ended: its release waited for an answer without end."""
    broker = start_broker(gpubroker, broker_process)
    done, started = tmp_path / "done", tmp_path / "started"
    cmd = ["sh", "-c", 'touch "$1"; while [ ! -e "$0" ]; do sleep 0.05; done', str(done), str(started)]
    holder = spawn([*gpubroker, "lease", "--cpu-cores", "1", "--ttl", "6s", "--", *cmd], broker.env)
    wait_for(started.exists, timeout=20.0)  # CMD runs once the broker's answer to its group's registration has come
    lease = granted_to(broker.client(), holder.pid)
    assert lease is not None
    assert broker.proc is not None
    broker.proc.send_signal(signal.SIGSTOP)
    try:
        done.touch()  # CMD ends while the broker cannot answer

        assert holder.wait(60) == 0, lease_log(tmp_path)  # CMD's status, the broker answering or not
        said = lease_log(tmp_path)
        assert re.search(
            rf"^gpubroker: lease {lease['id']} is not released: the broker at unix:\S+ did not answer GET /v1/leases/{lease['id']} within 2s",
            said,
            re.MULTILINE,
        ), said
        assert "it is released once the broker sees that its holder is gone" in said
    finally:
        broker.proc.send_signal(signal.SIGCONT)
    wait_for(lambda: broker.client().call("GET", f"/v1/leases/{lease['id']}")["lease"]["state"] == "released", timeout=10.0)
    assert broker.client().call("GET", f"/v1/leases/{lease['id']}")["lease"]["reason"] == f"holder pid {holder.pid} exited"


@pytest.mark.installed_only
@pytest.mark.slow  # 5 s of looking for a broker that may be restarting
def test_a_lease_whose_broker_is_down_when_cmd_ends_is_said_to_be_released_once_the_broker_is_back(
    gpubroker: list[str], broker_process: MakeBroker, spawn: Callable[..., subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    """`releasing l-…: UNREACHABLE: …` said nothing of what becomes of the lease; a broker that does not answer in time
    was already said to release it once it sees its holder gone, as a restarted one does."""
    broker = start_broker(gpubroker, broker_process)
    done, started = tmp_path / "done", tmp_path / "started"
    cmd = ["sh", "-c", 'touch "$1"; while [ ! -e "$0" ]; do sleep 0.05; done', str(done), str(started)]
    holder = spawn([*gpubroker, "lease", "--cpu-cores", "1", "--ttl", "1m", "--", *cmd], broker.env)
    wait_for(started.exists, timeout=20.0)
    lease = granted_to(broker.client(), holder.pid)
    assert lease is not None
    broker.stop()
    done.touch()

    assert holder.wait(60) == 0  # CMD's status
    said = lease_log(tmp_path)
    assert re.search(
        rf"^gpubroker: lease {lease['id']} is not released: no broker answers at unix:\S+ \(.*\); start one with `gpubroker up`; "
        r"it is released once the broker sees that its holder is gone \(this process, which exits now\)$",
        said,
        re.MULTILINE,
    ), said
    broker.start()
    released = broker.client().call("GET", f"/v1/leases/{lease['id']}")["lease"]
    assert (released["state"], released["reason"]) == ("released", f"holder pid {holder.pid} exited while the broker was down")


@pytest.mark.installed_only
@pytest.mark.parametrize("read", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["said", "unread"])
def test_cmd_is_stopped_once_its_lease_has_certainly_run_out_with_the_broker_answering_no_renewal(
    gpubroker: list[str], broker_process: MakeBroker, spawn: Callable[..., subprocess.Popen[bytes]], tmp_path: Path, read: bool
) -> None:
    """Work never goes on without its lease: with the broker stopped for good, CMD ran on unleased, its memory
    free for the broker to grant once it ran again, while `gpubroker lease` said only that renewals failed. Unread (a
    terminal gone under a job sent to the background), the first failed renewal's line ended the renewals for good."""
    broker = start_broker(gpubroker, broker_process)
    started = tmp_path / "started"
    cmd = ["sh", "-c", f'trap "exit 3" TERM; touch {started}; sleep 600 & wait']
    holder = spawn([*gpubroker, "lease", "--cpu-cores", "1", "--ttl", "3s", "--", *cmd], broker.env, read=read)
    # CMD runs once `gpubroker lease` has the broker's answer to its group's registration: stopped before that answer
    # left, the broker would fail the registration rather than the renewals.
    wait_for(started.exists, timeout=20.0)
    lease = granted_to(broker.client(), holder.pid)
    assert lease is not None
    assert broker.proc is not None
    broker.proc.send_signal(signal.SIGSTOP)
    try:
        assert holder.wait(30) == 3, lease_log(tmp_path)  # CMD got SIGTERM, and its exit code is passed on
        if read:
            said = lease_log(tmp_path)
            assert f"gpubroker: lease {lease['id']} could not be renewed: TIMEOUT: " in said
            assert re.search(
                rf"^gpubroker: lease {lease['id']} has run out: no renewal has worked for its whole TTL \(3s\), so CMD is stopped "
                r"\(SIGTERM, SIGKILL after 10s\): work never goes on without its lease$",
                said,
                re.MULTILINE,
            ), said
    finally:
        broker.proc.send_signal(signal.SIGCONT)
        for pgid in lease["process_groups"]:  # CMD left running had the test failed
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
    wait_for(lambda: broker.client().call("GET", "/v1/leases", query={"state": "granted"})["leases"] == [], timeout=10.0)


# CMD for the ignored-signals test, run as `python CMD_NOTING GOT READY`: it says which signals it was started with
# ignored, then handles SIGHUP, SIGINT and SIGTERM whatever its caller meant (as many servers do), noting each it gets.
CMD_NOTING = """\
import os, signal, sys
got, ready = sys.argv[1:]
ignored = [s.name for s in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM) if signal.getsignal(s) == signal.SIG_IGN]
with open(got, "a") as out:
    out.write("ignored: " + " ".join(ignored) + "\\n")

def note(signum, _frame):
    with open(got, "a") as out:
        out.write(signal.Signals(signum).name + "\\n")
    if signum == signal.SIGTERM:
        os._exit(0)

for s in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM):
    signal.signal(s, note)
open(ready, "w").close()
while True:
    signal.pause()
"""


def catches(pid: int, signum: int) -> bool:
    """Whether a process has a handler of its own for a signal (SigCgt in /proc/PID/status)."""
    status = Path(f"/proc/{pid}/status").read_text()
    caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(caught & 1 << (signum - 1))


def test_signals_its_caller_ignored_stay_ignored_by_gpubroker_lease_and_cmd(
    gpubroker: list[str], broker_process: MakeBroker, tmp_path: Path
) -> None:
    """`nohup gpubroker lease -- CMD &` (SIGHUP ignored) or a script's background job (SIGINT and SIGQUIT ignored):
    a hang-up or a Ctrl-C meant for the terminal's foreground was passed on to CMD as if it had been meant for it."""
    broker = start_broker(gpubroker, broker_process)
    script, got, ready = tmp_path / "cmd.py", tmp_path / "got", tmp_path / "ready"
    script.write_text(CMD_NOTING)

    def as_nohup_in_the_background() -> None:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    with (tmp_path / "lease0.log").open("wb") as log:
        holder = subprocess.Popen(
            [*gpubroker, "lease", "--cpu-cores", "1", "--", sys.executable, str(script), str(got), str(ready)],
            env=broker.env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, preexec_fn=as_nohup_in_the_background,
        )  # fmt: skip
    try:
        wait_for(ready.exists, timeout=30.0)
        wait_for(lambda: catches(holder.pid, signal.SIGTERM), timeout=10.0)  # what it passes on, it is ready to
        holder.send_signal(signal.SIGHUP)  # the terminal hangs up
        holder.send_signal(signal.SIGINT)  # Ctrl-C for the script in the foreground
        holder.send_signal(signal.SIGTERM)  # not ignored: passed on, and CMD ends

        assert holder.wait(30) == 0, lease_log(tmp_path)
    finally:
        if holder.poll() is None:
            holder.kill()
        holder.wait()
    assert got.read_text() == "ignored: SIGHUP SIGINT\nSIGTERM\n"
    assert broker.client().call("GET", "/v1/leases", query={"state": "granted"})["leases"] == []


def test_cmd_starts_when_the_caller_passed_on_open_descriptors_past_9(gpubroker: list[str], broker_process: MakeBroker) -> None:
    """Some shells (dash, Debian's /bin/sh) know only descriptors 0-9: CMD's start must not depend on which the caller left open."""
    broker = start_broker(gpubroker, broker_process)
    # As a CI runner or an IDE's terminal may: descriptors 3 to 9 open, so a pipe made next is numbered past 9.
    caller = 'exec 3</dev/null 4</dev/null 5</dev/null 6</dev/null 7</dev/null 8</dev/null 9</dev/null; exec "$@"'
    cmd = ["sh", "-c", "echo hello; ls /proc/$$/fd"]
    done = subprocess.run(
        ["sh", "-c", caller, "caller", *gpubroker, "lease", "--cpu-cores", "1", "--", *cmd], env=broker.env, capture_output=True, timeout=60
    )
    assert done.returncode == 0, done
    said = done.stdout.decode().split()
    assert said[0] == "hello"
    assert not {str(fd) for fd in range(3, 13)} & set(said[1:])  # neither the caller's descriptors nor the gate reach CMD


def test_cmd_ended_by_ctrl_c_ends_gpubroker_lease_by_sigint_so_a_calling_loop_stops_too(
    gpubroker: list[str], broker_process: MakeBroker, spawn: Callable[..., subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    broker = start_broker(gpubroker, broker_process)
    holder = spawn([*gpubroker, "lease", "--cpu-cores", "1", "--", "sh", "-c", "kill -INT $$; sleep 30"], broker.env)

    assert holder.wait(30) == -signal.SIGINT, lease_log(tmp_path)  # as a shell sees a command Ctrl-C ended
    assert broker.client().call("GET", "/v1/leases", query={"state": "granted"})["leases"] == []  # released first


def test_cmd_ended_by_ctrl_backslash_ends_gpubroker_lease_by_sigquit_without_a_core_dump_of_its_own(
    gpubroker: list[str], broker_process: MakeBroker, tmp_path: Path
) -> None:
    """gpubroker did not fail: a core of its own (24 MB, in the directory it ran in) and "Quit (core dumped)" said it had."""
    broker = start_broker(gpubroker, broker_process)
    _, hard = resource.getrlimit(resource.RLIMIT_CORE)
    if hard == 0 and os.geteuid() != 0:  # root (CI) may raise it: elsewhere no core could be dumped either way
        pytest.skip("core dumps are off for this user and only root may turn them on")
    allowed = hard or resource.RLIM_INFINITY

    def cores_on() -> None:
        resource.setrlimit(resource.RLIMIT_CORE, (allowed, allowed))

    holder = subprocess.Popen(
        [*gpubroker, "lease", "--cpu-cores", "1", "--", "sh", "-c", "ulimit -c 0; kill -QUIT $$"],
        env=broker.env, cwd=tmp_path, stdin=subprocess.DEVNULL, preexec_fn=cores_on,
    )  # fmt: skip
    _, status = os.waitpid(holder.pid, 0)
    holder.returncode = os.waitstatus_to_exitcode(status)

    assert holder.returncode == -signal.SIGQUIT  # as a shell sees a command Ctrl-\ ended
    assert not os.WCOREDUMP(status)


def test_ctrl_c_while_waiting_in_the_queue_cancels_the_request_and_ends_gpubroker_lease_by_sigint(
    gpubroker: list[str], broker_process: MakeBroker, spawn: Callable[..., subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    """A shell loop over `gpubroker lease --wait` stops at Ctrl-C only if it ends by SIGINT: bash goes on to the next
    turn when its child exits with a status of its own, as it would for a child that handled Ctrl-C."""
    broker = start_broker(gpubroker, broker_process)
    client = broker.client()
    hog = client.call("POST", "/v1/leases", {"exclusive": True, "bind": "none"})["lease"]
    waiting = spawn([*gpubroker, "lease", "--exclusive", "--wait", "forever", "--", "true"], broker.env)
    wait_for(lambda: client.call("GET", "/v1/leases", query={"state": "queued"})["leases"], timeout=20.0)

    waiting.send_signal(signal.SIGINT)

    assert waiting.wait(30) == -signal.SIGINT, lease_log(tmp_path)
    assert client.call("GET", "/v1/leases", query={"state": "queued"})["leases"] == []  # the broker saw it go
    assert [lease["id"] for lease in client.call("GET", "/v1/leases", query={"state": "granted"})["leases"]] == [hog["id"]]
    assert "Traceback" not in lease_log(tmp_path)


def test_gpubroker_lease_with_cmd_over_tcp_says_it_needs_the_socket_before_asking_for_a_lease(
    gpubroker: list[str], broker_process: MakeBroker
) -> None:
    """Over TCP CMD's process group can never be registered: a lease asked for there (after a wait in the queue,
    perhaps) was granted only to be given back, and CMD never ran."""
    broker = start_broker(gpubroker, broker_process)
    done = subprocess.run(
        [*gpubroker, "lease", "--cpu-cores", "1", "--wait", "forever", "--", "true"],
        env={**broker.env, "GPUBROKER_URL": broker.url},
        capture_output=True,
        timeout=60,
    )
    assert done.returncode == 1, done
    assert done.stderr.decode() == (
        f"gpubroker: lease -- CMD needs the broker's Unix socket, not {broker.url}: only there can CMD's process group be "
        "registered with its lease, to be stopped when the lease ends (give GPUBROKER_URL=unix:PATH, the broker's --socket)\n"
    )
    assert broker.client().call("GET", "/v1/leases")["leases"] == []  # nothing was asked for


def test_gpubroker_lease_with_a_cmd_that_cannot_be_run_says_so_before_asking_for_a_lease(
    gpubroker: list[str], broker_process: MakeBroker, tmp_path: Path
) -> None:
    """A mistyped CMD, or a word taken for CMD (`--gpu-memory 8 GiB` runs `GiB`), was found out only once the lease had
    been waited for and granted, by the shell that starts CMD: `GiB: 1: exec: GiB: not found`."""
    broker = start_broker(gpubroker, broker_process)
    script = tmp_path / "train.sh"
    script.write_text("exit 0\n")  # not executable
    orphan = tmp_path / "orphan.sh"
    orphan.write_text("#!/no/such/interpreter -e\nexit 0\n")
    orphan.chmod(0o755)
    for argv, code, said in (
        (["--gpu-memory", "8", "GiB"], 127, "cannot run GiB: command not found"),
        (["--cpu-cores", "1", "--", "no-such-command-anywhere", "arg"], 127, "cannot run no-such-command-anywhere: command not found"),
        (["--cpu-cores", "1", "--", str(script)], 126, f"cannot run {script}: it is not executable"),
        (["--cpu-cores", "1", "--", str(tmp_path)], 126, f"cannot run {tmp_path}: it is a directory"),
        (
            ["--cpu-cores", "1", "--", str(orphan)],
            127,
            f"cannot run {orphan}: its interpreter /no/such/interpreter (its #! line) is not found",
        ),
    ):
        done = subprocess.run([*gpubroker, "lease", "--wait", "forever", *argv], env=broker.env, capture_output=True, timeout=60)
        assert (done.returncode, done.stderr.decode()) == (code, f"gpubroker: {said}; no lease was asked for\n"), argv
    assert broker.client().call("GET", "/v1/leases")["leases"] == []  # nothing was asked for


def test_gpubroker_lease_with_a_deadline_centuries_away_waits_for_it_without_a_traceback(
    gpubroker: list[str], broker_process: MakeBroker
) -> None:
    """The answer was waited for until the deadline: a socket timeout of thousands of years, an OverflowError."""
    broker = start_broker(gpubroker, broker_process)
    done = subprocess.run(
        [*gpubroker, "lease", "--cpu-cores", "1", "--deadline", "9999-12-31T23:59:59Z", "--json"],
        env=broker.env,
        capture_output=True,
        timeout=60,
    )
    assert (done.returncode, done.stderr) == (0, b"")
    assert json.loads(done.stdout)["state"] == "granted"


def test_gpubroker_lease_whose_output_cannot_be_written_releases_the_lease_it_got(
    gpubroker: list[str], broker_process: MakeBroker, tmp_path: Path
) -> None:
    broker = start_broker(gpubroker, broker_process)
    client = broker.client()
    for stdout, why in (("closed", "standard output is closed"), ("/dev/full", "No space left on device"), ("gone", "Broken pipe")):
        argv = [*gpubroker, "lease", "--cpu-cores", "1"]
        if stdout == "gone":  # `gpubroker lease --json | head -c 10` with head ended first: not a byte reached it
            piped = subprocess.Popen([*argv, "--json"], env=broker.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            assert piped.stdout is not None
            piped.stdout.close()
            said = piped.communicate(timeout=60)[1].decode()
            code = piped.returncode
        else:
            with open("/dev/full", "wb") as full:
                done = subprocess.run(
                    argv,
                    env=broker.env,
                    stdout=full if stdout == "/dev/full" else None,
                    stderr=subprocess.PIPE,
                    timeout=60,
                    preexec_fn=(lambda: os.close(1)) if stdout == "closed" else None,
                )
            code, said = done.returncode, done.stderr.decode()
        assert code == 1, said
        assert re.fullmatch(rf"gpubroker: lease l-\w+ is released again: it could not be written out \({why}\)\n", said), said
        assert client.call("GET", "/v1/leases", query={"state": "granted"})["leases"] == []  # nobody holds a lease nobody knows of


def process_state(pid: int) -> str:
    """R, S, T (stopped), Z... as /proc/PID/stat gives it."""
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]


# A shell's job control, as little of it as the Ctrl-Z tests need, run as the session leader of a pseudo-terminal:
# the job (argv[3:]) in a process group of its own in the foreground (in the background after a first word "&"); when it
# stops, the terminal is taken back and
# "stopped" said on descriptor argv[1]; a line on descriptor argv[2] is `fg` or `bg`; the job's exit status is said at its end,
# and whether the shell still has its terminal then.
MINI_SHELL = """\
import os, signal, subprocess, sys
signal.signal(signal.SIGTTOU, signal.SIG_IGN)
report, told = int(sys.argv[1]), int(sys.argv[2])
background = sys.argv[3] == "&"
job = subprocess.Popen(sys.argv[4:] if background else sys.argv[3:], process_group=0)
if not background:
    os.tcsetpgrp(0, job.pid)
while True:
    _, status = os.waitpid(job.pid, os.WUNTRACED)
    if not os.WIFSTOPPED(status):
        os.write(report, f"exit {os.waitstatus_to_exitcode(status)}\\n".encode())
        os.write(report, f"terminal {'shell' if os.tcgetpgrp(0) == os.getpgrp() else 'taken'}\\n".encode())
        break
    os.tcsetpgrp(0, os.getpgrp())
    os.write(report, f"stopped {job.pid}\\n".encode())
    if os.read(told, 100) == b"fg\\n":
        os.tcsetpgrp(0, job.pid)
    os.killpg(job.pid, signal.SIGCONT)
"""


@dataclass
class Terminal:
    """MINI_SHELL as the session leader of a pseudo-terminal, running one job: `master` is the terminal's other end (what
    a person types, what the job writes), `said` the shell's reports (`said_within`), `tell` takes its `fg` or `bg`."""

    shell: subprocess.Popen[bytes]
    master: int
    said: int
    tell: int

    def read_until(self, wanted: bytes) -> None:
        """What the job writes to the terminal, up to `wanted`."""
        output = b""
        while wanted not in output:
            assert select.select([self.master], [], [], 10)[0], output
            output += os.read(self.master, 1000)


@contextlib.contextmanager
def at_a_terminal(argv: list[str], env: dict[str, str], background: bool = False) -> Iterator[Terminal]:
    """`argv` run as a job by MINI_SHELL at a terminal of its own (in the background with `background`); all of it ends
    with the block."""
    master, slave = os.openpty()
    said, to_shell = os.pipe()
    shell_reads, tell = os.pipe()

    def session() -> None:
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    shell = subprocess.Popen(
        [sys.executable, "-c", MINI_SHELL, str(to_shell), str(shell_reads), *(["&"] if background else []), *argv], env=env,
        stdin=slave, stdout=slave, stderr=slave, pass_fds=(to_shell, shell_reads), preexec_fn=session,
    )  # fmt: skip
    os.close(slave)
    os.close(to_shell)
    os.close(shell_reads)
    try:
        yield Terminal(shell, master, said, tell)
    finally:
        # The job is in process groups of its own, which the shell's end does not reach: a test that failed halfway
        # leaves none of it behind (stopped, it would wait for ever).
        for process in psutil.process_iter():
            with contextlib.suppress(psutil.Error, OSError):
                if process.pid != shell.pid and os.getsid(process.pid) == shell.pid:
                    process.kill()
        if shell.poll() is None:
            shell.kill()
            shell.wait(10)
        os.close(said)
        os.close(tell)
        os.close(master)


def the_jobs_lease(client: Client) -> tuple[dict[str, Any], int, int]:
    """The one lease, once CMD's group is registered with it: the lease, its holder's pid and CMD's group."""
    wait_for(lambda: [lease for lease in client.call("GET", "/v1/leases")["leases"] if lease.get("process_groups")], timeout=20.0)
    [lease] = client.call("GET", "/v1/leases")["leases"]
    return lease, lease["holder"]["pid"], lease["process_groups"][0]


def said_within(fd: int, timeout: float = 30.0) -> str:
    """One line from a pipe, or what was there when `timeout` passed without its end (a limit for a loaded machine: a
    line comes as soon as it is written)."""
    line = b""
    deadline = time.monotonic() + timeout
    while not line.endswith(b"\n"):
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready or not (chunk := os.read(fd, 1)):
            return line.decode() + f" [nothing more within {timeout:g}s]"
        line += chunk
    return line.decode()


@pytest.mark.slow
def test_ctrl_z_stops_gpubroker_lease_with_cmd_so_the_shell_gets_its_terminal_and_fg_or_bg_continues_them(
    gpubroker: list[str], broker_process: MakeBroker, tmp_path: Path
) -> None:
    broker = start_broker(gpubroker, broker_process)
    client = broker.client()
    # CMD reads the terminal at once, forking nothing first: a Ctrl-Z that reaches a child dash has vforked and not yet
    # exec'd stops that child alone, and dash, waiting on it, never stops until it is continued (under any shell).
    reading = tmp_path / "reading"
    argv = [*gpubroker, "lease", "--cpu-cores", "1", "--ttl", "2s", "--", "sh", "-c", f": > {reading}; read x; echo got $x; sleep 60"]
    with at_a_terminal(argv, broker.env) as term:
        lease, holder, cmd = the_jobs_lease(client)
        wait_for(lambda: os.tcgetpgrp(term.master) == cmd, timeout=5.0)  # CMD has the terminal
        wait_for(reading.exists, timeout=10.0)

        os.write(term.master, b"\x1a")  # Ctrl-Z
        assert said_within(term.said) == f"stopped {holder}\n"  # the job stopped, as the shell sees it, and it has its terminal
        assert process_state(cmd) == "T"
        time.sleep(3)  # past the lease's 2 s TTL, with the job's renewer stopped too
        assert client.call("GET", f"/v1/leases/{lease['id']}")["lease"]["state"] == "granted"  # a stopped job's lease is held

        os.write(term.tell, b"bg\n")  # continued in the background, CMD reads the terminal: the job stops again
        assert said_within(term.said) == f"stopped {holder}\n"
        assert os.tcgetpgrp(term.master) == term.shell.pid  # and the terminal stayed the shell's

        os.write(term.tell, b"fg\n")
        wait_for(lambda: os.tcgetpgrp(term.master) == cmd, timeout=5.0)  # CMD has it again, and reads what is typed
        os.write(term.master, b"hi\n")
        term.read_until(b"got hi")
        time.sleep(3)  # renewed with its own TTL again, and the renewer goes on
        assert client.call("GET", f"/v1/leases/{lease['id']}")["lease"]["state"] == "granted"

        os.write(term.master, b"\x03")  # Ctrl-C reaches CMD, and ends the job by SIGINT
        assert said_within(term.said) == f"exit {-signal.SIGINT}\n"
        assert term.shell.wait(30) == 0


# A pager, as `less` is to the terminal: it sets the terminal's modes once the first line has come (CMD has the terminal
# by then), and writes there every line it reads.
PAGER = """\
import errno, os, signal, sys, termios
signal.signal(signal.SIGTTOU, signal.SIG_DFL)  # as a shell starts a job (MINI_SHELL ignores it)
tty = os.open("/dev/tty", os.O_RDWR)
def set_modes(*_):
    while True:
        try:
            return termios.tcsetattr(tty, termios.TCSANOW, termios.tcgetattr(tty))
        except termios.error as error:
            if error.args[0] != errno.EINTR:
                raise
signal.signal(signal.SIGCONT, set_modes)  # continued, it sets the terminal again, as less does
for number, line in enumerate(sys.stdin):
    if number == 0:
        set_modes()
    os.write(tty, b"pager: " + line.encode())
"""


@pytest.mark.slow
def test_a_pager_piped_from_gpubroker_lease_gets_the_terminal_and_ctrl_z_stops_the_job_with_its_lease_held(
    gpubroker: list[str], broker_process: MakeBroker, tmp_path: Path
) -> None:
    """`gpubroker lease -- CMD | less`: the pager setting the terminal while CMD had it had the kernel stop the whole job,
    `gpubroker lease` too, so the lease ran out unrenewed and the broker stopped CMD, which had gone on all the while."""
    broker = start_broker(gpubroker, broker_process)
    client = broker.client()
    go = tmp_path / "go"
    work = f"import os, time\nprint('started', flush=True)\nwhile not os.path.exists({str(go)!r}):\n    time.sleep(0.05)\nprint('done')"
    lease_cmd = [*gpubroker, "lease", "--cpu-cores", "1", "--ttl", "2s", "--", sys.executable, "-c", work]
    argv = ["sh", "-c", f"{shlex.join(lease_cmd)} | {shlex.join([sys.executable, '-c', PAGER])}"]
    with at_a_terminal(argv, broker.env) as term:
        lease, holder, cmd = the_jobs_lease(client)
        term.read_until(b"pager: started")  # the pager has the terminal it set, and nothing was stopped
        assert os.tcgetpgrp(term.master) == os.getpgid(holder)  # the job's, as a shell gives it to a pipeline
        time.sleep(3)  # past the lease's 2 s TTL: renewed all along
        assert client.call("GET", f"/v1/leases/{lease['id']}")["lease"]["state"] == "granted"

        os.write(term.master, b"\x1a")  # Ctrl-Z reaches the job's group, not CMD's: CMD stops with the job all the same
        assert said_within(term.said).startswith("stopped ")  # (said as soon as sh stops, which may be before CMD)
        wait_for(lambda: process_state(cmd) == "T", timeout=5.0)
        time.sleep(3)  # with the job's renewer stopped too
        assert client.call("GET", f"/v1/leases/{lease['id']}")["lease"]["state"] == "granted"  # a stopped job's lease is held

        os.write(term.tell, b"fg\n")
        wait_for(lambda: process_state(cmd) != "T", timeout=5.0)
        go.touch()
        term.read_until(b"pager: done")
        assert said_within(term.said) == "exit 0\n"
        assert client.call("GET", f"/v1/leases/{lease['id']}")["lease"]["state"] == "released"


def test_a_job_sent_to_the_background_with_bg_leaves_the_shell_its_terminal_when_it_ends(
    gpubroker: list[str], broker_process: MakeBroker, tmp_path: Path
) -> None:
    """An interactive shell that finds its terminal given to another group reads nothing more: bash exits."""
    broker = start_broker(gpubroker, broker_process)
    go = tmp_path / "go"
    # CMD forks nothing (as in the Ctrl-Z test above): a shell's loop of `sleep` could be stopped halfway through a vfork.
    wait_until_go = f"import os, sys, time\nwhile not os.path.exists({str(go)!r}):\n    time.sleep(0.05)"
    argv = [*gpubroker, "lease", "--cpu-cores", "1", "--", sys.executable, "-c", wait_until_go]
    with at_a_terminal(argv, broker.env) as term:
        _, holder, cmd = the_jobs_lease(broker.client())
        wait_for(lambda: os.tcgetpgrp(term.master) == cmd, timeout=5.0)

        os.write(term.master, b"\x1a")  # Ctrl-Z, then bg: the job goes on in the background, and the shell has the terminal
        assert said_within(term.said) == f"stopped {holder}\n"
        os.write(term.tell, b"bg\n")
        wait_for(lambda: process_state(cmd) != "T", timeout=5.0)
        go.touch()  # CMD ends in the background

        assert said_within(term.said) == "exit 0\n"
        assert said_within(term.said) == "terminal shell\n"
        assert term.shell.wait(30) == 0


def test_a_job_started_in_the_background_stops_when_cmd_reads_the_terminal_and_fg_gives_cmd_the_terminal(
    gpubroker: list[str], broker_process: MakeBroker
) -> None:
    """`gpubroker lease -- CMD &` at an interactive shell: CMD reading the terminal stopped CMD alone, where neither
    the shell (the job ran on, it said) nor `fg` (it continued `gpubroker lease` only) could reach it."""
    broker = start_broker(gpubroker, broker_process)
    client = broker.client()
    argv = [*gpubroker, "lease", "--cpu-cores", "1", "--", "sh", "-c", "read x; echo got $x"]
    groups: list[int] = []  # the job's and CMD's, killed at the end should the test fail: the shell's end reaches neither
    try:
        with at_a_terminal(argv, broker.env, background=True) as term:
            lease, holder, cmd = the_jobs_lease(client)
            groups += [holder, cmd]

            assert said_within(term.said) == f"stopped {holder}\n"  # CMD read the terminal: the job stopped, as the shell sees it
            assert os.tcgetpgrp(term.master) == term.shell.pid  # and the terminal was never taken from the shell

            os.write(term.tell, b"fg\n")
            wait_for(lambda: os.tcgetpgrp(term.master) == cmd, timeout=5.0)  # CMD has it, and reads what is typed
            os.write(term.master, b"hi\n")
            term.read_until(b"got hi")
            assert said_within(term.said) == "exit 0\n"
            assert client.call("GET", f"/v1/leases/{lease['id']}")["lease"]["state"] == "released"
    finally:
        for group in groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
