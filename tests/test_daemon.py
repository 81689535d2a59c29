"""Starting the broker process: what `gpubroker up` refuses before it serves, and how it says so."""

from __future__ import annotations

import errno
import fcntl
import ipaddress
import json
import os
import pwd
import re
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import BrokerProcess, free_port, wait_for

from gpubroker import daemon
from gpubroker.client import Client, Endpoint
from gpubroker.config import Config


def test_a_stale_socket_that_cannot_be_removed_is_a_start_error_saying_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not an OSError that `gpubroker up` would report as "the output could not be written"."""
    path = tmp_path / "api.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as left:  # a broker killed with -9 leaves its socket
        left.bind(str(path))

    def refused(self: Path, missing_ok: bool = False) -> None:
        raise PermissionError(errno.EPERM, "Operation not permitted", str(self))

    monkeypatch.setattr(Path, "unlink", refused)  # another user's socket in a sticky directory
    with pytest.raises(daemon.StartError, match=f"cannot remove {path}, a socket no broker answers on: Operation not permitted"):
        daemon._free_socket(path)


@pytest.fixture
def umask_000() -> Iterator[None]:
    """The broker started from a shell whose umask is 000: every mode it asks for is what it gets."""
    before = os.umask(0)
    try:
        yield
    finally:
        os.umask(before)


def _others_may_write(path: Path) -> bool:
    return bool(path.stat().st_mode & 0o022)


@pytest.mark.usefixtures("umask_000")
def test_under_umask_000_the_state_and_socket_directories_made_are_writable_by_the_broker_alone(tmp_path: Path) -> None:
    """A directory every user may write lets anyone put a socket of their own where clients send their tokens, or a
    cluster.json of their own where the broker reads its cluster at its next start."""
    state, sock = tmp_path / "var" / "state", tmp_path / "run" / "gpubroker" / "api.sock"
    os.close(daemon.lock_state(state))
    daemon._free_socket(sock)
    for made in (state, state.parent, sock.parent, sock.parent.parent):
        assert not _others_may_write(made), f"{made} is {stat.S_IMODE(made.stat().st_mode):o}"
        assert made.stat().st_mode & 0o005 == 0o005  # others still reach the socket, as before


def test_a_second_broker_is_refused_whatever_is_removed_from_the_state_directory(tmp_path: Path) -> None:
    """The lock was a file in it: removed as stale, a second broker started on the same store, granting the same epochs."""
    state = tmp_path / "state"
    first = daemon.lock_state(state)
    try:
        for made in state.iterdir():
            made.unlink()
        with pytest.raises(daemon.BrokerRunning, match=f"another broker is running on {state}"):
            daemon.lock_state(state)
    finally:
        os.close(first)
    os.close(daemon.lock_state(state))  # and once the first has stopped, a broker starts


def test_a_state_directory_that_cannot_itself_be_locked_is_locked_by_a_file_in_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a directory cannot be locked (NFS locks only what is open for writing), the start ended in a traceback."""
    real = fcntl.flock

    def flock(fd: int, operation: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.ENOLCK, "No locks available")
        real(fd, operation)

    monkeypatch.setattr(fcntl, "flock", flock)
    state = tmp_path / "state"
    first = daemon.lock_state(state)
    try:
        assert (state / "lock").exists()
        with pytest.raises(daemon.BrokerRunning, match=f"another broker is running on {state}"):
            daemon.lock_state(state)
    finally:
        os.close(first)


def test_a_state_directory_every_user_may_write_is_refused_with_what_to_do(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    state.chmod(0o1777)  # even sticky: anyone could still add a cluster.json or an identity/ of their own
    with pytest.raises(daemon.StartError, match=rf"the state directory {state} is writable by every user \(mode 1777\).*chmod o-w"):
        daemon.lock_state(state)
    assert list(state.iterdir()) == []  # refused before anything is made in it


def test_a_socket_directory_every_user_may_write_is_refused_unless_sticky(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    run.chmod(0o777)
    with pytest.raises(daemon.StartError, match=rf"the socket's directory {run} is writable by every user and not sticky"):
        daemon._free_socket(run / "api.sock")
    run.chmod(0o1777)  # as /tmp: nobody else may remove or rename the broker's socket there
    daemon._free_socket(run / "api.sock")


# The directories of another user are made, and tried, as root alone; CI and the development machines run as root, so
# there these always run.
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to make and try directories as another user")


@as_root
@pytest.mark.usefixtures("umask_000")
def test_under_umask_000_another_user_can_neither_add_to_the_state_nor_replace_the_socket() -> None:
    # Not under tmp_path, whose parents only root may enter: here others reach what the broker makes, as /var/lib and /run.
    with tempfile.TemporaryDirectory() as top:
        os.chmod(top, 0o755)
        assert _attempts_of_nobody(Path(top)) == ["refused", "refused"]


def _attempts_of_nobody(top: Path) -> list[str]:
    state, sock = top / "state", top / "run" / "api.sock"
    os.close(daemon.lock_state(state))
    daemon._free_socket(sock)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listening:
        listening.bind(str(sock))
        # A shell, not this interpreter: it may live where the other user cannot read (root's home).
        attempt = 'for act in "touch $1/cluster.json" "rm -f $2"; do $act 2>/dev/null && echo done || echo refused; done'
        someone = pwd.getpwnam("nobody")
        done = subprocess.run(
            ["sh", "-c", attempt, "sh", str(state), str(sock)],
            user=someone.pw_uid,
            group=someone.pw_gid,
            extra_groups=[],
            capture_output=True,
            text=True,
            check=True,
        )
    return done.stdout.split()


@as_root
def test_a_directory_inside_one_another_user_owns_is_refused_naming_them() -> None:
    """A root broker given a socket or state under another user's directory: that user may rename the directory the
    broker made there and put one of their own in its place."""
    with tempfile.TemporaryDirectory() as top:
        home = Path(top) / "alice"
        home.mkdir(mode=0o755)
        os.chown(home, pwd.getpwnam("nobody").pw_uid, -1)
        with pytest.raises(
            daemon.StartError, match=rf"the socket's directory {home}/run is inside {home}, which belongs to user nobody, who"
        ):
            daemon._free_socket(home / "run" / "api.sock")
        with pytest.raises(
            daemon.StartError, match=rf"the state directory {home}/state is inside {home}, which belongs to user nobody, who"
        ):
            daemon.lock_state(home / "state")


@as_root
def test_a_socket_directory_another_user_made_first_is_refused_naming_them() -> None:
    """Made before the broker (or between its look and its mkdir) by another user, it is theirs: its mode lets only
    them write, and they could replace the socket where clients send their tokens."""
    with tempfile.TemporaryDirectory() as top:
        os.chmod(top, 0o1777)  # as /tmp
        run = Path(top) / "gpubroker"
        run.mkdir(mode=0o755)
        os.chown(run, pwd.getpwnam("nobody").pw_uid, -1)
        with pytest.raises(daemon.StartError, match=rf"the socket's directory {run} belongs to user nobody"):
            daemon._free_socket(run / "api.sock")
        state = Path(top) / "state"
        state.mkdir(mode=0o755)
        os.chown(state, pwd.getpwnam("nobody").pw_uid, -1)
        with pytest.raises(daemon.StartError, match=rf"the state directory {state} belongs to user nobody"):
            daemon.lock_state(state)


@as_root
@pytest.mark.parametrize("inside", ["identity", "store/data.mdb", "cluster.json"])
def test_what_another_user_owns_inside_the_state_directory_is_refused_naming_it(tmp_path: Path, inside: str) -> None:
    """`mkdir -p S/identity && chown -R alice S/identity`, then `gpubroker init --state S` as root: the node's private
    key went where alice could replace it (or read it, in a file of hers)."""
    state = tmp_path / "state"
    theirs = state / inside
    theirs.parent.mkdir(parents=True, exist_ok=True)
    if "." in inside:
        theirs.touch()
    else:
        theirs.mkdir()
    os.chown(theirs, pwd.getpwnam("nobody").pw_uid, -1)
    with pytest.raises(daemon.StartError, match=rf"{theirs}, in the state directory {state}, belongs to user nobody, who could .*chown -R"):
        daemon.lock_state(state)
    assert [path.name for path in state.iterdir()] == [inside.split("/")[0]]  # refused before anything is made in it


@as_root
def test_a_state_subdirectory_linked_to_one_another_user_owns_is_refused_naming_them(tmp_path: Path) -> None:
    home = tmp_path / "alice"
    (home / "keys").mkdir(parents=True)
    os.chown(home, pwd.getpwnam("nobody").pw_uid, -1)
    state = tmp_path / "state"
    state.mkdir()
    (state / "identity").symlink_to(home / "keys")
    with pytest.raises(daemon.StartError, match=rf"{state}/identity, in the state directory {state}, is inside {home}, which belongs"):
        daemon.lock_state(state)


def test_a_state_subdirectory_every_user_may_write_is_refused_with_what_to_do(tmp_path: Path) -> None:
    state = tmp_path / "state"
    (state / "ui").mkdir(parents=True)
    (state / "ui").chmod(0o777)
    with pytest.raises(daemon.StartError, match=rf"{state}/ui, in the state directory {state}, is writable by every user.*chmod o-w"):
        daemon.lock_state(state)


def test_sighup_stops_the_broker_as_sigterm_does_saying_so(broker_process: type[BrokerProcess]) -> None:
    """The terminal of a `gpubroker up` run in the foreground goes away (an ssh session ends), or an operator sends
    SIGHUP hoping for a reload: the broker stopped at once, with no word in its log, its socket left behind and its
    cluster not told it leaves."""
    broker = broker_process("1x24GiB").start()
    assert broker.proc is not None
    broker.proc.send_signal(signal.SIGHUP)
    assert broker.proc.wait(10) == 0
    wait_for(lambda: broker.output[-1:] == ["gpubroker: stopped\n"], timeout=5)  # read to its end
    assert broker.output[-2:] == ["gpubroker: SIGHUP: stopping\n", "gpubroker: stopped\n"], broker.output
    assert not broker.socket.exists()


def test_a_broker_started_with_sighup_ignored_goes_on_after_one(broker_process: type[BrokerProcess]) -> None:
    """`nohup gpubroker up &`: its operator asked for it to outlive the terminal."""
    broker = broker_process("1x24GiB")
    broker.command = ["nohup", *broker.command]
    broker.start()
    assert broker.proc is not None
    broker.proc.send_signal(signal.SIGHUP)  # an ignored signal is dropped as it is sent
    assert broker.client().call("GET", "/healthz")["ok"] is True
    assert broker.proc.poll() is None


def test_the_ready_line_gives_a_relative_state_and_socket_in_full(
    broker_process: type[BrokerProcess], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`gpubroker up --state s2 --socket s2/api.sock` said "API on unix:s2/api.sock … state in s2": from any other
    directory, GPUBROKER_URL set to what it said reached no broker."""
    monkeypatch.chdir(tmp_path)
    broker = broker_process("1x24GiB", ["--state", "s2", "--socket", "s2/api.sock"]).start()  # the later flags win
    said = re.search(r"API on unix:(\S+) and .*; state in (\S+)$", broker.ready_line)
    assert said is not None, broker.ready_line
    assert said.groups() == (str(tmp_path.resolve() / "s2" / "api.sock"), str(tmp_path.resolve() / "s2"))
    monkeypatch.chdir("/")
    assert Client(Endpoint(f"unix:{said[1]}")).call("GET", "/healthz")["ok"] is True


def test_leases_held_when_gpubroker_init_gives_the_node_its_identity_are_then_that_nodes(
    broker_process: type[BrokerProcess],
) -> None:
    """A lone broker's node id is made up by its store; `gpubroker init` (or a join) gives it the identity's. The leases
    it held went on naming the old id, a node no member knows: `leases --node` of this node left them out."""
    broker = broker_process("1x24GiB", ["--no-mdns", "--gossip", f"127.0.0.1:{free_port()}"]).start()
    lease = broker.client().call("POST", "/v1/leases", {"gpu_memory": "1GiB", "bind": "none", "ttl": "1h"})["lease"]
    broker.stop()
    made = subprocess.run(
        [sys.executable, "-m", "gpubroker", "init", "--state", str(broker.state)], capture_output=True, text=True, timeout=60
    )
    assert made.returncode == 0, made.stderr
    broker.start()
    node = broker.client().call("GET", "/v1/node")["node"]["id"]
    assert node != lease["node"]
    again = broker.client().call("GET", f"/v1/leases/{lease['id']}")["lease"]
    assert (again["state"], again["node"], again["epoch"]) == ("granted", node, lease["epoch"])
    listed = broker.client().call("GET", "/v1/leases", query={"node": node})["leases"]
    assert [x["id"] for x in listed] == [lease["id"]]


def test_a_join_token_that_cannot_be_read_is_refused_before_the_state_directory_is_made(tmp_path: Path) -> None:
    """A mistyped token left an identity, a lock and a store behind (in /var/lib/gpubroker, by default) before it was
    refused."""
    state = tmp_path / "state"
    argv = [sys.executable, "-m", "gpubroker", "up", "--state", str(state), "--socket", str(tmp_path / "api.sock")]
    refused = subprocess.run(
        [*argv, "--listen", "127.0.0.1:0", "--simulate-gpus", "1x24GiB", "--join", "gbj1.mistyped!"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2
    assert refused.stderr.startswith("gpubroker: cannot join: not a join token: it has '!' at character"), refused.stderr
    assert not state.exists()


@pytest.mark.parametrize(("gossip", "advertised"), [("127.0.0.2:20100", "127.0.0.2"), ("[::1]:20100", "::1")])
def test_a_mesh_bound_to_one_address_is_advertised_there(gossip: str, advertised: str) -> None:
    """`up --gossip 127.0.0.1:PORT` without --advertise: `gpubroker invite` (and an --ask request, and mDNS) named the
    machine's first non-loopback address, where nothing listened, so a join with that token failed."""
    assert daemon._mesh_settings(Config(gossip=gossip), ()).advertise == advertised
    assert daemon._mesh_settings(Config(gossip=gossip, advertise="10.1.2.3"), ()).advertise == "10.1.2.3"
    wildcard = daemon._mesh_settings(Config(gossip="0.0.0.0:20100"), ()).advertise  # every address: one peers may reach
    assert wildcard == daemon._mesh_settings(Config(gossip="[::]:20100"), ()).advertise
    assert not ipaddress.ip_address(wildcard).is_unspecified


@pytest.mark.slow
def test_a_member_started_again_with_the_join_it_was_first_started_with_runs_as_the_member_it_is(
    broker_process: type[BrokerProcess], tmp_path: Path
) -> None:
    """`gpubroker up --join TOKEN` again from the shell's history, or a service's command line: the node is a member
    already. A token of another cluster, or for a node removed from its own, is refused saying what to do."""
    from gpubroker.gossip.cluster import ClusterState
    from gpubroker.gossip.identity import Identity
    from gpubroker.gossip.keyring import cluster_hash

    broker = broker_process("1x24GiB", ["--no-mdns", "--gossip", f"127.0.0.1:{free_port()}"])
    made = subprocess.run(
        [sys.executable, "-m", "gpubroker", "init", "--state", str(broker.state)], capture_output=True, text=True, timeout=60
    )
    assert made.returncode == 0, made.stderr
    broker.start()
    node = broker.client().call("GET", "/healthz")["node"]
    token = broker.client().call("POST", "/v1/cluster/invites", {"ttl": "10m"})["token"]
    broker.stop()
    mine = cluster_hash(json.loads((broker.state / "cluster.json").read_text())["cluster_id"])

    broker.extra += ["--join", token]
    broker.start()
    assert (
        f"gpubroker: this node already belongs to cluster {mine}: --join was not used (it is needed only the first time)\n" in broker.output
    )
    shown = broker.client().call("GET", "/v1/cluster")
    assert ([n["id"] for n in shown["nodes"]], shown["removed"]) == ([node], None)
    broker.stop()

    stranger = Identity.load_or_create(tmp_path / "other")
    other = ClusterState.init(tmp_path / "other", stranger, "other", now=time.time())
    up = [sys.executable, "-m", "gpubroker", "up", "--state", str(broker.state), "--socket", str(broker.socket), "--no-mdns"]
    refused = subprocess.run(
        [*up, "--join", other.invite(("127.0.0.1", 9), stranger, 600, time.time())], capture_output=True, text=True, timeout=60
    )
    assert (refused.returncode, refused.stderr) == (
        2,
        f"gpubroker: {broker.state} already belongs to cluster {mine}, and this token is for cluster "
        f"{cluster_hash(other.cluster_id)}: to move this node, remove it there (`gpubroker nodes remove {node}` on a member), "
        "then start it with a fresh --state and --join TOKEN\n",
    )

    own = ClusterState.load(broker.state)
    assert own is not None
    own.merge({"removed": {node: time.time()}}, time.time())  # as a member's push-pull tells a node removed while it was down
    refused = subprocess.run([*up, "--join", token], capture_output=True, text=True, timeout=60)
    assert (refused.returncode, refused.stderr) == (
        2,
        f"gpubroker: this node was removed from cluster {mine}: to join again it needs a new identity, "
        "a fresh --state with `gpubroker up --join TOKEN`\n",
    )
