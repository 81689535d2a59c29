"""argv → calls: `gpubroker up | status | lease | leases | release | events | self-check`."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import unicodedata
import urllib.parse
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from gpubroker import __version__, work
from gpubroker.broker.probes import ProbeError
from gpubroker.client import Client, ClientError
from gpubroker.config import CLASSES, ConfigError, load_config
from gpubroker.gossip.documents import listed_missing
from gpubroker.units import MAX_SECONDS, UnitError, duration_text, gib, host_part, parse_duration, parse_time, printable_text

if TYPE_CHECKING:
    from _typeshed import SupportsWrite

FOREVER = 10 * 365 * 86400


def _usage_error(message: str) -> NoReturn:
    """Flags that ask for nothing meaningful: said on one line, exit 2, as argparse does for the flags it reads."""
    print(f"gpubroker: {message}", file=sys.stderr)
    raise SystemExit(2)


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, sort_keys=True))


def _config_file(given: str | None) -> Path | None:
    """`--config FILE`; an empty FILE (`--config "$CONF"` with CONF unset) is refused, never run as no file at all."""
    if given is None:
        return None
    if not given:
        raise ConfigError("--config names no file (it was given an empty name): give the TOML file, or leave --config out")
    return Path(given)


def cmd_up(args: argparse.Namespace) -> int:
    from gpubroker import daemon  # the server's imports are not needed by the other commands

    try:
        config = load_config(
            _config_file(args.config),
            state_dir=args.state,
            listen=args.listen,
            socket=args.socket,
            simulate_gpus=args.simulate_gpus,
            name=args.name,
            gossip=args.gossip,
            advertise=args.advertise,
            peers=args.peer or None,
            mdns=False if args.no_mdns else None,
        )
        return daemon.run(config, join=args.join, ask=args.ask)
    except (ConfigError, ProbeError) as error:
        print(f"gpubroker: {error}", file=sys.stderr)
        return 2


def cmd_status(args: argparse.Namespace) -> int:
    client = Client()
    node = client.call("GET", "/v1/node")
    cluster = client.call("GET", "/v1/cluster")
    if args.json:
        _print_json({"node": node, "cluster": cluster})
        return 0
    info = node["node"]
    shown = printable_text  # a name from outside (a process's, a simulation file's) with a line feed would forge a line
    print(
        f"node {shown(info['name'])} ({info['id']}), gpubroker {info['version']}"
        + ("" if info["production_eligible"] else ", not production eligible")
    )
    if node.get("driver_error"):
        print(f"GPUs: cannot be read: {shown(node['driver_error'])}")
    lines: list[tuple[int, list[str]]] = []  # each GPU's lines, in the node's order of GPUs
    for gpu in node["gpus"]:
        f = gpu["figures"]
        pressure = "  EXTERNAL PRESSURE" if gpu.get("pressure") else ""
        stale = f"  STALE (read {gpu['age']:.1f}s ago: no decision is made on it)" if gpu.get("stale") else ""
        mine = [f"GPU {gpu['index']}  {shown(gpu['name'])}  {shown(gpu['uuid'])}{pressure}{stale}"]
        mine.append(
            "  "
            + "  ".join(
                f"{name} {gib(f[name])}" for name in ("total", "observed", "external", "resident", "leased", "reserve", "schedulable")
            )
            + " GiB"
        )
        for process in gpu["processes"]:
            owner = f"lease {process['lease']}" if process["lease"] else "external"
            mine.append(f"  pid {process['pid']} {shown(process['name'] or '?')}: {gib(process['bytes'])} GiB ({owner})")
        lines.append((gpu["index"], mine))
    for gpu in node.get("unreadable_gpus", []):
        mine = [f"GPU {gpu['index']}  {shown(gpu['uuid'] or 'UUID unknown')}  UNREADABLE: {shown(gpu['error'])}"]
        leases = f"; leases {', '.join(gpu['leases'])} stay on it" if gpu["leases"] else ""
        mine.append(f"  not offered until it can be read again{leases}")
        lines.append((gpu["index"], mine))
    for gpu in node.get("missing_gpus", []):
        name = f"  {shown(gpu['name'])}" if gpu["name"] else ""
        mine = [f"GPU {gpu['index']}{name}  {shown(gpu['uuid'])}  MISSING since {gpu['since']}: no longer listed by the driver"]
        mine.append(
            f"  leases {', '.join(gpu['leases'])} hold {gib(gpu['bytes'])} GiB on it "
            "and stay until released or expired; nothing is granted on it"
        )
        lines.append((gpu["index"], mine))
    for _, mine in sorted(lines, key=lambda item: item[0]):
        print("\n".join(mine))
    cpu, memory = node["cpu"], node["memory"]
    print(f"CPU {cpu['cores']} cores: {cpu['leased']} leased, {cpu['schedulable']} schedulable")
    print(f"memory {gib(memory['total'])} GiB: {gib(memory['leased'])} leased, {gib(memory['schedulable'])} schedulable")
    waiting = {k: v for k, v in node.get("queue", {}).items() if v}
    print("queue: " + (", ".join(f"{v} {k}" for k, v in waiting.items()) if waiting else "none waiting"))
    _print_cluster(cluster)
    return 0


def _print_cluster(cluster: dict[str, Any]) -> None:
    """The other nodes as this node's mesh sees them: state, freshness, each GPU's schedulable figure (for the
    nodes up; a dead or departed node's last figures are not its room now)."""
    removed = cluster.get("removed")
    if isinstance(removed, str):
        print(
            f"this node was removed from its cluster at {removed}: it gossips with no member any more; "
            "to join again it needs a new identity (a fresh --state, then `gpubroker up --join TOKEN`)"
        )
        return
    nodes = cluster.get("nodes", [])
    others = [n for n in nodes if not n.get("self")]
    if not others:
        return
    coordinator = (cluster.get("coordinator") or {}).get("id")
    names = Counter(n.get("name") for n in nodes)

    def label(node: dict[str, Any]) -> str:
        # Two nodes given one name (a machine rejoined with a fresh --state, a copied config) are told apart by id.
        name = node.get("name")
        return f"{name} ({node['id']})" if name and names[name] > 1 else name or node["id"]

    named = next((label(n) for n in nodes if n["id"] == coordinator), coordinator)
    up = sum(1 for n in others if n.get("state") in ("alive", "suspect")) + 1
    print(f"cluster: {len(others) + 1} nodes ({up} up), coordinator {named or 'not chosen yet'}")
    for other in others:
        document = other.get("document") or {}
        age = other.get("age")
        fresh = f"seen {age:.1f}s ago" if isinstance(age, int | float) else "no document yet"
        badge = " (coordinator)" if other["id"] == coordinator else ""
        line = f"  {label(other)}{badge}: {other['state']}, {fresh}"
        if other.get("state") in ("alive", "suspect") and document:
            gpus = ", ".join(
                f"GPU {g['index']} {gib(g['figures']['schedulable'])}/{gib(g['figures']['total'])} GiB schedulable"
                + (" STALE (no decision is made on it)" if g.get("stale") else "")
                for g in document.get("gpus", [])
            )
            gone = ", ".join(
                f"GPU {g['index']} ({g['uuid']}) MISSING since {g['since']}: leases {', '.join(g['leases'])}"
                + (f" and {g['leases_not_listed']} more" if g["leases_not_listed"] else "")
                + f" hold {gib(g['bytes'])} GiB on it"
                for g in listed_missing(document)
            )
            line += f"; {', '.join(part for part in (gpus, gone) if part) or 'no GPUs'}"
        print(line)


def _request_body(args: argparse.Namespace, bind: str) -> dict[str, Any]:
    body: dict[str, Any] = {"bind": bind}
    for name in ("gpu_memory", "gpus", "cpu_cores", "memory", "priority", "preemption", "ttl", "deadline"):
        value = getattr(args, name)
        if value is not None:
            body[name] = value
    if args.exclusive:
        body["exclusive"] = True
    if args.gpu is not None:
        body["gpu"] = int(args.gpu) if args.gpu.isdigit() else args.gpu
    if args.wait is not None:
        body["wait"] = FOREVER if args.wait == "forever" else args.wait
    holder: dict[str, Any] = {}
    if args.name:
        holder["name"] = args.name
    if bind == "caller":
        holder["pid"] = os.getpid()  # the Unix socket replaces it with the kernel's word
        holder.setdefault("name", printable_text(os.path.basename(args.command[0].rstrip("/")) or args.command[0] or "CMD")[:256])
    if holder:
        body["holder"] = holder
    if args.label:
        labels: dict[str, str] = {}
        for item in args.label:
            key, sep, value = item.partition("=")
            if not sep or not key:
                _usage_error(f"--label {item!r} is not K=V")
            if key in labels:  # the first or the last? Neither is kept without a word.
                _usage_error(f"--label {key} is given twice ({key}={labels[key]}, {item}); give each key once")
            labels[key] = value
        body["labels"] = labels
    return body


def _child_env(lease_env: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    if getattr(sys, "frozen", False):
        # The bundled binary's loader sets LD_LIBRARY_PATH for itself; the work must not inherit it.
        original = env.pop("LD_LIBRARY_PATH_ORIG", None)
        env.pop("LD_LIBRARY_PATH", None)
        if original is not None:
            env["LD_LIBRARY_PATH"] = original
    env.pop("GPUBROKER_GPU_MEMORY", None)  # an outer lease's, or one inherited: set again only for a lease of GPU memory
    env.update(lease_env)
    return env


def _die_with_parent(parent: int) -> Callable[[], None]:
    """In the child, before exec: SIGTERM when `gpubroker lease` dies, even by kill -9."""

    def prepare() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG; it survives exec
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(128 + signal.SIGTERM)

    return prepare


# CMD starts only once its process group is registered with the lease: a shell waits
# on a pipe the parent writes after registering. If the parent dies first, the pipe
# closes, the read fails, and the work never starts without its lease. The shell reads
# the pipe as descriptor 3 whatever its number here: some shells (dash) know only
# descriptors 0-9, and a caller that passed on open descriptors pushes a new pipe past 9.
GATE_FD = 3
_GATE = f'read -r _ <&{GATE_FD} && exec {GATE_FD}<&- && exec "$0" "$@"'
FIRST_LOOK = 1.0  # seconds after CMD's start that the process groups it made are first looked for (then at each renewal)
STOP_GRACE = 10.0  # seconds between SIGTERM and SIGKILL when CMD's lease has ended under it (as the broker's kill_grace)
REQUEST_TIMEOUT = 10.0  # the longest wait for an answer to a renewal, a look or a release once the lease is granted


def _patience(ttl: float) -> float:
    """How long `gpubroker lease` waits for the broker's answer about a granted lease: a third of its TTL, at least
    1 s, at most REQUEST_TIMEOUT. A live broker answers in milliseconds, even while each commit waits 10-25 ms for a
    busy disk; one silent for that long is stopped or wedged. The request for the lease itself: `_asking_patience`."""
    return min(REQUEST_TIMEOUT, max(1.0, ttl / 3))


def _asking_patience(args: argparse.Namespace) -> float | None:
    """How long `gpubroker lease` waits for the answer to its request: as long as the broker may keep it waiting in the
    queue (`--wait`, `--deadline`, whichever ends first), and REQUEST_TIMEOUT more; with `--wait forever` and no
    deadline, for ever. A value the broker will refuse is answered at once: REQUEST_TIMEOUT."""
    limits: list[float] = []
    with contextlib.suppress(UnitError):
        if args.wait is not None and args.wait != "forever":
            limits.append(parse_duration(args.wait))
    with contextlib.suppress(UnitError):
        if args.deadline is not None:
            limits.append(max(0.0, parse_time(args.deadline) - time.time()))  # the broker's clock may differ: the margin covers it
    if not limits and args.wait == "forever":
        return None
    patience = min(limits, default=0.0) + REQUEST_TIMEOUT
    return None if patience > MAX_SECONDS else patience  # a deadline centuries away: for ever (no socket waits that long)


def _gate_in_child(gate: int, die_with_parent: Callable[[], None]) -> Callable[[], None]:
    """In the child, before exec: the gate's pipe moved to GATE_FD (the lowest free descriptor when the pipe was made,
    or one that Popen's close_fds would close anyway), and SIGTERM when the parent dies."""

    def prepare() -> None:
        if gate != GATE_FD:
            os.dup2(gate, GATE_FD)
            os.close(gate)
        die_with_parent()

    return prepare


def _cannot_run(command: str) -> tuple[int, str] | None:
    """Why CMD cannot be run, with the shell's exit code for it (127 not found, 126 not executable), or None."""
    path = os.environ.get("PATH")
    if path is None and os.sep not in command:
        # /bin/sh then searches a default of its own (dash's has /usr/sbin and /usr/local/bin, Python's has neither):
        # whether CMD is there is for that shell to say, once the lease is granted, not for a guess to refuse.
        return None
    # An empty PATH is, to /bin/sh, the current directory; to shutil.which, nowhere.
    found = shutil.which(command, path=path or os.curdir)  # as /bin/sh finds it: on PATH, or a path with a slash
    if found is not None:
        return _cannot_interpret(found)
    if os.sep in command and os.path.exists(command):
        return 126, "it is a directory" if os.path.isdir(command) else "it is not executable"
    return 127, "no such file" if os.sep in command else "command not found"


def _cannot_interpret(script: str) -> tuple[int, str] | None:
    """A script whose `#!` names an interpreter that is not there, or cannot be run: the kernel's ENOENT reads, in the
    shell's words, as if the script itself were missing (`exec: ./train.sh: not found`)."""
    try:
        with open(script, "rb") as file:
            first = file.readline(256)
    except OSError:
        return None
    words = first[2:].split() if first.startswith(b"#!") else []
    if not words:
        return None
    interpreter = os.fsdecode(words[0])
    if not os.path.exists(interpreter):
        return 127, f"its interpreter {interpreter} (its #! line) is not found"
    if os.path.isdir(interpreter) or not os.access(interpreter, os.X_OK):
        return 126, f"its interpreter {interpreter} (its #! line) cannot be run"
    return None


def cmd_lease(args: argparse.Namespace) -> int:
    if args.gpu_memory is None and args.cpu_cores is None and args.memory is None and not args.exclusive:
        # The broker's word for it names the API's fields (gpu_memory, …); at the command line the flags are what to give.
        pins = " (--gpu and --gpus say which GPUs and how many, for --gpu-memory or --exclusive)" if args.gpu or args.gpus else ""
        print(f"gpubroker: give --gpu-memory, --exclusive, --cpu-cores or --memory{pins}; no lease was asked for", file=sys.stderr)
        return 2
    if args.command and (cannot := _cannot_run(args.command[0])) is not None:
        # Said before asking: a mistyped CMD (or a word taken for it, `--gpu-memory 8 GiB`) was found out only once the
        # lease had been waited for and granted, in the words of the shell that starts CMD.
        code, why = cannot
        print(f"gpubroker: cannot run {args.command[0]}: {why}; no lease was asked for", file=sys.stderr)
        return code
    client = Client(timeout=None)
    bind = "caller" if args.command else "none"
    if args.command and not client.endpoint.is_unix:
        # The broker registers a process group on its socket alone: over TCP, CMD could never start (SPEC §3.3).
        # Said before asking, not after a lease was waited for and granted only to be given back.
        print(
            f"gpubroker: lease -- CMD needs the broker's Unix socket, not {client.endpoint.url}: only there can CMD's process "
            "group be registered with its lease, to be stopped when the lease ends (give GPUBROKER_URL=unix:PATH, the broker's "
            "--socket)",
            file=sys.stderr,
        )
        return 1
    try:
        answer = client.call("POST", "/v1/leases", _request_body(args, bind), timeout=_asking_patience(args))
    except ClientError as error:
        said = f"gpubroker: {error.code}: {error.message}"
        if error.code == "TIMEOUT":  # it may still grant the request, once it runs again
            said += (
                "; CMD was not started, and a lease granted later is released once the broker sees this process gone"
                if args.command
                else "; a lease granted later has no holder to give it back, and lives until its TTL runs out"
            )
        print(said, file=sys.stderr)
        return 75 if error.status in (409, 429, 503) else 1
    granted = time.monotonic()  # the broker granted it by now: its TTL has begun
    lease = answer["lease"]
    if not args.command:
        try:
            if args.json:
                _print_json(lease)
            else:
                held = [f"GPU {g['index']} ({g['uuid']}) {gib(g['bytes'])} GiB" for g in lease["gpus"]]
                held += host_part(lease.get("cpu_cores") or 0, lease.get("memory") or 0)
                print(f"lease {lease['id']} granted: {', '.join(held)}; lease epoch {lease['epoch']}; expires {lease['expires_at']}")
                print(f"token {lease['token']}")
                for key, value in sorted(lease["env"].items()):
                    print(f"export {key}={value}")
            sys.stdout.flush()
        except OSError as error:  # nobody got the lease's token: it goes, rather than live out its TTL unknown
            _drop_output()  # what could not be written is said once, here, not again when the exit flushes it
            lost = f"{error.strerror or error}"
            try:
                _when_reachable(  # a broker restarting meanwhile is waited for: the lease outlives it otherwise
                    lambda: client.call(
                        "DELETE",
                        f"/v1/leases/{lease['id']}",
                        headers={"X-Lease-Token": lease["token"]},
                        timeout=_patience(float(lease["ttl"])),
                    )
                )
            except ClientError as failure:
                if failure.status not in (404, 409):  # ended meanwhile (expired, released by its user): released all the same
                    print(
                        f"gpubroker: lease {lease['id']} could not be written out ({lost}), nor released again ({failure.code}: "
                        f"{failure.message}): it holds what it was granted until it expires at {lease['expires_at']}, unless "
                        f"`gpubroker release {lease['id']}` ends it first",
                        file=sys.stderr,
                    )
                    return 1
            print(f"gpubroker: lease {lease['id']} is released again: it could not be written out ({lost})", file=sys.stderr)
            return 1
        return 0
    return _run_under_lease(client, lease, args.command, granted)


class _Terminal:
    """The controlling terminal, when this process is in its foreground or a job a shell can stop and continue in
    its background: CMD's group gets it while the job is in the foreground, so Ctrl-C and reads from the terminal
    reach the work, as if it had been started by the shell."""

    def __init__(self, fd: int | None) -> None:
        self._fd = fd
        self._ours = os.getpgrp()
        self._handed: int | None = None  # the group the terminal was handed to
        # Whether CMD's group is given the terminal when the job has it: not once another part of the job wants it.
        self.hands = True
        self._watching: dict[int, Any] = {}  # the signals `watch` handles, with what they were before

    @classmethod
    def open(cls) -> _Terminal:
        try:
            fd = os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY)
        except OSError:
            return cls(None)  # no controlling terminal: a service, a pipe, a test
        try:
            foreground = os.tcgetpgrp(fd) == os.getpgrp()
        except OSError:
            foreground = False
        if not foreground and not _stoppable():  # in the background with no shell to bring it to the foreground
            os.close(fd)
            return cls(None)
        return cls(fd)  # a background job keeps its hands off it until `fg` gives it the terminal

    def _set(self, pgid: int) -> None:
        if self._fd is None:
            return
        previous = signal.signal(signal.SIGTTOU, signal.SIG_IGN)  # tcsetpgrp from outside the foreground group
        try:
            os.tcsetpgrp(self._fd, pgid)
        except OSError:
            pass  # the group is gone or the terminal was hung up: nothing to hand over
        finally:
            signal.signal(signal.SIGTTOU, previous)

    def hand_to(self, pgid: int) -> None:
        if not self.hands:
            return
        self._set(pgid)
        self._handed = pgid

    def watch(self, child: subprocess.Popen[bytes]) -> None:
        """Job control for the other parts of the job and for Ctrl-Z reaching this process, where a shell can stop and
        continue the job (not in an orphaned one: the kernel stops none of it).

        `gpubroker lease -- CMD | less`: the pager, in this process's group, reading or setting the terminal while CMD's
        group has it has the kernel stop the whole group, this process too, whose renewals stopped with it: the lease
        ran out under CMD. The terminal is the job's from then on, as a shell has it for a pipeline, and the pager goes
        on; CMD reading the terminal then stops the job, as a job in the background is stopped. From the background,
        that stops the job with CMD, its lease held. Ctrl-Z reaching this process (the job has the terminal, not CMD)
        stops CMD, and the job with it (`_wait_as_a_job`), and a resized window reaching it is CMD's too."""
        shell = _shell_group()
        if self._fd is None or shell is None:
            return

        def stop_cmd(_signum: int = 0, _frame: object = None) -> None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGTSTP)

        def resize_cmd(_signum: int, _frame: object) -> None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGWINCH)

        def wanted(_signum: int, _frame: object) -> None:
            if self.foreground in (None, shell):  # the job is in the background: it stops, CMD first
                stop_cmd()
                return
            self.hands = False
            self.give_back()
            os.killpg(0, signal.SIGCONT)  # the pager goes on (and this process's own SIGCONT hands nothing to CMD)

        handlers = ((signal.SIGTSTP, stop_cmd), (signal.SIGWINCH, resize_cmd), (signal.SIGTTIN, wanted), (signal.SIGTTOU, wanted))
        for signum, handler in handlers:
            self._watching[signum] = signal.signal(signum, handler)

    def unwatch(self) -> None:
        """The signals `watch` handled, as they were."""
        for signum, was in self._watching.items():
            signal.signal(signum, was)
        self._watching.clear()

    @property
    def ours(self) -> bool:
        """Whether this process's group has the terminal (the job is in the foreground)."""
        return self.foreground == self._ours

    @property
    def foreground(self) -> int | None:
        """The process group the terminal's input goes to now (None: none known)."""
        if self._fd is None:
            return None
        try:
            return os.tcgetpgrp(self._fd)
        except OSError:
            return None

    @property
    def held(self) -> bool:
        """Whether this process runs as a job at a terminal (in its foreground, or in a shell's background)."""
        return self._fd is not None

    def give_back(self) -> None:
        """The terminal to this process's group, still held (CMD was stopped: the shell is to get it back)."""
        self._set(self._ours)

    def take_back(self) -> None:
        """The terminal back from CMD's group, if that has it, and let go of it. A job sent on with `bg` leaves it
        with the shell, and taking it from there would leave the shell reading from the background: bash exits."""
        if self._handed is not None and self.foreground == self._handed:
            self.give_back()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _tell(line: str) -> None:
    """A line on standard error from `gpubroker lease` once CMD runs. One that cannot be written (the terminal hung up
    under a job sent to the background, a reader gone) is lost, and nothing else: the renewals, the stop of CMD once
    its lease has run out and CMD's exit code must not end with it."""
    # Written with SIGTTOU blocked, so that it is written with `stty tostop` too: the kernel would stop the whole job for
    # it, or (as its handler sees it) have the terminal taken from CMD for a pager of the job's.
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTTOU})
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        # What stays buffered would fail again at exit, and make the exit status 120 in place of CMD's: it goes, with
        # what follows, to /dev/null.
        with contextlib.suppress(OSError, ValueError, AttributeError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stderr.fileno())
            sys.stderr.flush()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def _run_under_lease(client: Client, lease: dict[str, Any], command: list[str], granted: float) -> int:
    """Run CMD under the lease granted at `granted` (on the monotonic clock): renewed while CMD runs, released after."""
    token = {"X-Lease-Token": lease["token"]}
    patience = _patience(float(lease["ttl"]))
    gate = os.pipe()  # the lowest free descriptors: if the reading end is not GATE_FD, GATE_FD is open here
    shim = ["/bin/sh", "-c", _GATE, *command]
    # Every process CMD starts stays below this one, even one that leaves its group and session and is orphaned (a
    # daemon): its GPU memory is the lease's, and it is stopped with CMD. Where the kernel cannot, as before: such a
    # process is handed to init, and outlives the lease.
    work.become_subreaper()
    try:
        child = subprocess.Popen(
            shim,
            env=_child_env(lease["env"]),
            process_group=0,
            pass_fds=tuple({gate[0], GATE_FD}),
            preexec_fn=_gate_in_child(gate[0], _die_with_parent(os.getpid())),
        )
    except OSError as error:
        _tell(f"gpubroker: cannot run {command[0]}: {error.strerror}")
        with contextlib.suppress(ClientError):
            client.call("DELETE", f"/v1/leases/{lease['id']}", headers=token, timeout=patience)
        return 127
    finally:
        os.close(gate[0])
    terminal = _Terminal.open()
    terminal.watch(child)
    failed: str | None = None  # why CMD never started (its gate closed unopened)
    try:
        client.call("POST", f"/v1/leases/{lease['id']}/processes", {"pgid": child.pid}, headers=token, timeout=patience)
        if terminal.ours:
            terminal.hand_to(child.pid)
        os.write(gate[1], b"go\n")
    except ClientError as error:
        failed = f"CMD's process group could not be registered: {error.code}: {error.message}"
    except OSError as error:  # the shell waiting at the gate is gone (killed)
        failed = f"{command[0]} did not start: the shell that starts it ended before it could ({error.strerror})"
    finally:
        os.close(gate[1])
    if failed is not None:  # CMD never started, and the lease goes with it
        _tell(f"gpubroker: {failed}")
        terminal.unwatch()
        terminal.take_back()
        child.wait()
        with contextlib.suppress(ClientError):
            client.call("DELETE", f"/v1/leases/{lease['id']}", headers=token, timeout=patience)
        return 1

    # Orphans handed to this process are reaped as they exit; CMD's status is left to its own wait.
    signal.signal(signal.SIGCHLD, lambda _signum, _frame: work.reap_orphans(child.pid))

    def forward(signum: int, _frame: object) -> None:
        try:
            os.killpg(child.pid, signum)
            if signum not in (signal.SIGINT, signal.SIGQUIT):
                os.killpg(child.pid, signal.SIGCONT)  # a stopped CMD acts on SIGTERM or SIGHUP only once continued
        except ProcessLookupError:
            pass

    for signum in (signal.SIGINT, signal.SIGQUIT, signal.SIGTERM, signal.SIGHUP):
        # One ignored since this process started stays so (`nohup`, a script's background job), as it does for CMD,
        # which inherited it: a hang-up or a Ctrl-C its caller meant to ignore is not passed on.
        if signal.getsignal(signum) != signal.SIG_IGN:
            signal.signal(signum, forward)
    ended = threading.Event()  # CMD has ended
    done = threading.Event()  # and what it left running too: no more renewals
    ttl = float(lease["ttl"])
    # The latest the lease can last unless renewed again: a TTL after the last answer that extended it (the grant's
    # first). The broker extended it at the latest then, so once this has passed with no renewal answered, the lease has
    # run out.
    runs_out = granted + ttl

    registered = {child.pid}
    others_work: set[int] = set()  # groups below this process it does not register: another lease's
    looking = threading.Lock()
    look_due = threading.Event()  # a renewal was answered, or CMD has ended: the looker looks again, or stops

    def other_leases() -> tuple[set[int], set[int]]:
        """The holders' pids and the registered groups of the other leases here."""
        leases = client.call("GET", "/v1/leases", query={"state": "granted", "limit": 100_000}, timeout=patience)["leases"]
        others = [other for other in leases if other["id"] != lease["id"]]
        return {o["holder"]["pid"] for o in others if o["holder"].get("pid")}, {g for o in others for g in o.get("process_groups") or ()}

    def look() -> None:
        """Register with the lease the process groups CMD's processes made (a daemon's, a server's workers started in
        sessions of their own): if this process dies, even by kill -9, the broker stops them too. A group gone by the
        time it is registered, or refused, is no matter: what runs below this process is stopped with CMD anyway."""
        if ended.is_set():
            return
        with looking:
            if ended.is_set():
                return
            try:
                found, theirs, present = work.escaped_groups(registered | others_work, other_leases)
            except (OSError, ClientError):
                return
            registered.intersection_update(present | {child.pid})
            others_work.intersection_update(present)
            others_work.update(theirs)  # looked at once: another lease's
            for pgid in found:
                if ended.is_set():  # what CMD left running is stopped now, not registered
                    break
                with contextlib.suppress(ClientError):
                    path = f"/v1/leases/{lease['id']}/processes"
                    client.call("POST", path, {"pgid": pgid}, headers=token, timeout=patience)
                    registered.add(pgid)

    def renew() -> None:
        nonlocal runs_out
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})  # delivered to the main thread, whose handler reaps
        failed = False  # the last renewal failed, and was said to have: the next that works says so too
        wait = max(0.0, granted + ttl / 3 - time.monotonic())  # a third of its TTL after the grant, not after CMD's start
        while not done.wait(wait):
            if time.monotonic() >= runs_out:
                # The broker may expire it, grant its room to others, at any moment: CMD goes, as it would with the broker.
                _tell(
                    f"gpubroker: lease {lease['id']} has run out: no renewal has worked for its whole TTL ({ttl:g}s), so CMD is "
                    f"stopped (SIGTERM, SIGKILL after {STOP_GRACE:g}s): work never goes on without its lease"
                )
                _stop_group(child.pid, ended)
                return
            try:
                # A renewal still unanswered when the lease runs out is given up on then: CMD does not outlive it by a patience.
                timeout = max(0.1, min(patience, runs_out - time.monotonic()))
                renewed = client.call("POST", f"/v1/leases/{lease['id']}/renew", headers=token, timeout=timeout)["lease"]
            except ClientError as error:
                gone = error.status in (404, 409)  # the lease has ended: so does CMD, even if the broker could not see to it
                stopped = f"; it has ended, so CMD is stopped (SIGTERM, SIGKILL after {STOP_GRACE:g}s)" if gone else ""
                if gone or not failed:  # said once: a broker down for minutes is not a line a second
                    _tell(f"gpubroker: lease {lease['id']} could not be renewed: {error.code}: {error.message}{stopped}")
                if gone:
                    _stop_group(child.pid, ended)
                    return
                failed = True
                # Tried again every second (a broker back in time renews it), and looked at once it has run out.
                wait = min(RENEW_RETRY, ttl / 3, max(0.0, runs_out - time.monotonic()))
                continue
            runs_out, wait = time.monotonic() + ttl, ttl / 3
            if failed:
                _tell(f"gpubroker: lease {lease['id']} renewed again: it expires {renewed['expires_at']}")
                failed = False
            look_due.set()

    renewer = threading.Thread(target=renew, daemon=True)
    renewer.start()

    def looker() -> None:
        """Looks a second after CMD starts (a server's workers, a daemon, started as CMD starts), then after each renewal
        answered; apart from the renewals, which never wait for it: registering hundreds of groups keeps the broker busy
        for seconds, and a renewal that waited for that would find the lease run out."""
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})  # (as in the renewer) for the main thread, which reaps
        look_due.wait(FIRST_LOOK)
        while not ended.is_set():
            look_due.clear()
            look()
            look_due.wait()

    threading.Thread(target=looker, daemon=True).start()

    def hold(stopped: bool) -> None:
        nonlocal runs_out
        with contextlib.suppress(ClientError):
            held = STOPPED_TTL if stopped else duration_text(ttl)
            client.call("POST", f"/v1/leases/{lease['id']}/renew", {"ttl": held}, headers=token, timeout=patience)
            runs_out = time.monotonic() + parse_duration(held)

    code = _wait_as_a_job(child, terminal, hold)
    terminal.take_back()
    ended.set()
    look_due.set()  # the looker stops
    with looking:  # no group is registered while it is stopped (a look under way stops at its next group)
        # What CMD left running is stopped before the lease goes, as a service's leftovers are when it stops (systemd's
        # KillMode=control-group), and still under a renewed lease: work never goes on without its lease.
        stopped = work.stop_leftovers(STOP_GRACE)
    if stopped is not None:
        _tell(f"gpubroker: CMD has ended; what it left running was stopped: {stopped}")
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    done.set()
    _release_after(client, lease["id"], token, patience)
    if -code in (signal.SIGINT, signal.SIGQUIT):
        # Ctrl-C (or Ctrl-\) ended CMD: end the same way, so the shell or script that ran `gpubroker lease` stops too.
        signal.signal(-code, signal.SIG_DFL)
        if -code == signal.SIGQUIT:  # whose default action dumps core: this process did not fail, and leaves no core
            ctypes.CDLL(None, use_errno=True).prctl(4, 0)  # PR_SET_DUMPABLE: unlike RLIMIT_CORE, it holds for a piped core_pattern
        os.kill(os.getpid(), -code)
    return code if code >= 0 else 128 - code


RENEW_RETRY = 1.0  # seconds between tries to renew once one has failed, until the lease runs out
STOPPED_TTL = "24h"  # the lease's TTL while its job is stopped: the renewer stops with it, the work's memory stays held


def _wait_as_a_job(child: subprocess.Popen[bytes], terminal: _Terminal, hold: Callable[[bool], None]) -> int:
    """CMD's exit code (negative: the signal that ended it), with job control as a shell's job has it.

    At a terminal, CMD stopped by Ctrl-Z (it had the terminal) or by reading the terminal from the background
    stops this process's whole job too, so the shell gets its terminal and the job back and says "Stopped";
    when the shell continues the job, CMD is handed the terminal if the job has it (`fg`) and continued. A
    stopped job's memory stays held, so its lease is renewed with STOPPED_TTL first (`hold(True)`, since the
    renewer stops with this process) and with its own TTL again once continued (`hold(False)`)."""
    if not terminal.held:
        return _exit_code(child, os.waitpid(child.pid, 0)[1])

    continues = 0  # times this process was continued

    def continued(_signum: int, _frame: object) -> None:
        nonlocal continues
        continues += 1
        if terminal.ours:  # fg: the shell gave the job the terminal; CMD is to have it
            terminal.hand_to(child.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGCONT)

    signal.signal(signal.SIGCONT, continued)
    try:
        while True:
            _, status = os.waitpid(child.pid, os.WUNTRACED)
            if not os.WIFSTOPPED(status):
                return _exit_code(child, status)
            if terminal.foreground == child.pid:
                terminal.give_back()  # Ctrl-Z: the terminal goes back to the job, for the shell to take
            elif terminal.ours and terminal.hands and os.WSTOPSIG(status) != signal.SIGTSTP:
                # Stopped for reading or writing the terminal just as the job came to the foreground: go on.
                continued(signal.SIGCONT, None)
                continue
            elif not _stoppable():
                # In the background, and the shell is gone: the kernel would not stop this job, and CMD continued
                # would only stop again at once. It stays stopped, as it would had it been started alone.
                return _exit_code(child, os.waitpid(child.pid, 0)[1])
            hold(True)
            before = continues
            watching = signal.signal(signal.SIGTSTP, signal.SIG_DFL)  # this process stops with the rest of the job
            try:
                os.killpg(0, signal.SIGTSTP)  # the whole job, as the terminal stops it: stopped here until continued
            finally:
                signal.signal(signal.SIGTSTP, watching)
            hold(False)
            if continues == before:  # not stopped after all (the kernel would not): CMD goes on as the job does
                # Not again once continued: a pager stopping the job afresh (`bg`) may have stopped CMD meanwhile.
                continued(signal.SIGCONT, None)
    finally:
        signal.signal(signal.SIGCONT, signal.SIG_DFL)
        terminal.unwatch()


def _stoppable() -> bool:
    """Whether this process's job can be stopped and continued: it, or its nearest ancestor in its group, has its
    parent in another group of the same session (a shell with job control). An orphaned group is never stopped."""
    return _shell_group() is not None


def _shell_group() -> int | None:
    """The process group of the shell that can stop and continue this process's job (see `_stoppable`); None: none."""
    import psutil

    group, session = os.getpgrp(), os.getsid(0)
    try:
        for parent in psutil.Process().parents():
            if (theirs := os.getpgid(parent.pid)) != group:
                return theirs if os.getsid(parent.pid) == session else None
    except (psutil.Error, OSError):
        pass
    return None


def _exit_code(child: subprocess.Popen[bytes], status: int) -> int:
    child.returncode = os.waitstatus_to_exitcode(status)
    return child.returncode


def _stop_group(pgid: int, done: threading.Event) -> None:
    """SIGTERM to CMD's group (and SIGCONT, should it be stopped), then SIGKILL after STOP_GRACE unless CMD has ended."""
    try:
        os.killpg(pgid, signal.SIGTERM)
        os.killpg(pgid, signal.SIGCONT)
        if not done.wait(STOP_GRACE):
            os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _release_after(client: Client, lease_id: str, token: dict[str, str], patience: float) -> None:
    """CMD has exited: release its lease, or say why there was none left to release (released by someone
    else, expired while the broker could not be reached), since that is why CMD may have been stopped."""
    try:
        now = _when_reachable(lambda: client.call("GET", f"/v1/leases/{lease_id}", timeout=patience))["lease"]
        if now.get("state") not in (None, "granted"):
            _tell(f"gpubroker: lease {lease_id} was {now['state']} before CMD ended: {now.get('reason')}")
            return
    except ClientError as error:
        # Stopped, or not answering: a release would fare no better. The lease is bound to this process, so the broker
        # releases it once it sees it gone (at once when it answers again, or as it starts).
        if error.code in ("TIMEOUT", "UNREACHABLE"):
            _tell(
                f"gpubroker: lease {lease_id} is not released: {error.message}; it is released once the broker sees that "
                "its holder is gone (this process, which exits now)"
            )
            return
    try:
        client.call("DELETE", f"/v1/leases/{lease_id}", headers=token, timeout=patience)
    except ClientError as error:
        if error.status not in (404, 409):
            _tell(f"gpubroker: releasing {lease_id}: {error.code}: {error.message}")


def _when_reachable(call: Callable[[], Any], patience: float = 5.0) -> Any:
    """A call tried again for a few seconds while no broker answers: one restarting expires leases (stopping their
    work) before it listens, so CMD may end just before the broker can say why."""
    give_up = time.monotonic() + patience
    while True:
        try:
            return call()
        except ClientError as error:
            if error.code != "UNREACHABLE" or time.monotonic() > give_up:
                raise
        time.sleep(0.2)


def cmd_leases(args: argparse.Namespace) -> int:
    leases = Client().call("GET", "/v1/leases", query={"state": args.state, "node": args.node, "limit": args.limit})["leases"]
    if args.json:
        _print_json(leases)
        return 0
    if not leases:
        print("no leases")
        return 0
    if len(leases) == args.limit:  # the API gives at most --limit: there may be more
        shown = "lease is" if args.limit == 1 else "leases are"
        print(f"gpubroker: the first {args.limit} {shown} shown; there may be more: give a larger --limit", file=sys.stderr)
    _print_leases(leases)
    return 0


def _print_leases(leases: list[dict[str, Any]]) -> None:
    """A table of leases, each column as wide as its widest cell: a holder's name (up to 256 characters) or a lease on
    many GPUs is shown whole, and every column stays aligned."""
    rows = [("ID", "STATE", "CLASS", "HOLDER", "GPUS", "EXPIRES / REASON")]
    for lease in leases:
        gpus = ",".join(f"{g['index']}:{gib(g['bytes'])}" for g in lease.get("gpus", [])) or "-"
        if lease["state"] == "queued":
            gpus = _asked_gpus(lease.get("request") or {})
            tail = f"position {lease['position']}{_behind(lease.get('waiting_behind') or [])}: {lease['reason']}"
        elif lease["state"] == "granted":
            tail = lease["expires_at"]
        else:
            tail = lease.get("reason") or ""
        holder = printable_text(lease["holder"].get("name") or "-")  # measured as it is printed: escapes and all
        rows.append((lease["id"], lease["state"], lease["priority"], holder, gpus, tail))
    widths = [max(_width(row[column]) for row in rows) for column in range(5)]
    for row in rows:
        print("  ".join(_pad(cell, width) for cell, width in zip(row, widths, strict=False)) + f"  {row[5]}")


def _width(text: str) -> int:
    """The columns a text takes on a terminal: a wide character (CJK, most emoji) two, a combining mark none."""
    return sum(
        0 if unicodedata.category(char) in ("Mn", "Me") else 2 if unicodedata.east_asian_width(char) in ("W", "F") else 1 for char in text
    )


def _pad(text: str, width: int) -> str:
    """A table's cell filled with spaces to `width` columns on a terminal, as `f"{text:{width}}"` does by characters."""
    return text + " " * max(0, width - _width(text))


def _behind(ids: list[str], shown: int = 3) -> str:
    """Which requests a waiting one waits behind, as the API gives them (`waiting_behind`): the first few by id."""
    if not ids:
        return ""
    more = f" and {len(ids) - shown} more" if len(ids) > shown else ""
    return f", behind {', '.join(ids[:shown])}{more}"


def _asked_gpus(request: dict[str, Any]) -> str:
    """What a waiting request asks of GPUs, as the table shows a lease's: `2x18.0` (any two), `1:18.0` (pinned), `-`."""
    if not request.get("gpus"):
        return "-"
    each = "whole" if request.get("exclusive") else gib(request.get("gpu_memory") or 0)
    return f"{request['gpu']}:{each}" if request.get("gpu") is not None else f"{request['gpus']}x{each}"


def cmd_release(args: argparse.Namespace) -> int:
    if not args.id.strip():  # `gpubroker release "$ID"` with ID unset: not the broker's "no such path: /v1/leases/"
        print("gpubroker: give the id of a lease or waiting request (`gpubroker leases` lists them)", file=sys.stderr)
        return 2
    headers = {"X-Lease-Token": args.token} if args.token else {}
    try:
        lease = Client().call("DELETE", f"/v1/leases/{urllib.parse.quote(args.id, safe='')}", headers=headers)["lease"]
    except ClientError as error:
        if error.details.get("cancelled"):  # a request that waited: cancelling it is what releasing it means
            print(f"request {args.id} cancelled: it was waiting and had no lease yet")
            return 0
        raise
    if args.json:
        _print_json(lease)
    else:
        print(f"lease {lease['id']} {lease['state']}: {lease['reason']}")
    return 0


EVENTS_PAGE = 1000
FOLLOW_EVERY = 1.0  # seconds between asks while following: for new events, or of a broker that does not answer


def cmd_events(args: argparse.Namespace) -> int:
    client = Client()
    after = args.after
    listed: list[dict[str, Any]] = []  # --json without --follow: one document, as every listing
    waiting = False  # following, and the broker does not answer (restarting): said once, then tried every second
    store: str | None = None  # the store the events printed so far come from ("" unnamed), once the broker has answered
    while True:
        try:
            answer = client.call("GET", "/v1/events", query={"after": after, "limit": EVENTS_PAGE})
        except ClientError as error:
            if not (args.follow and error.code == "UNREACHABLE"):
                raise
            if not waiting:
                print(f"gpubroker: {error.message}; waiting for it to answer again", file=sys.stderr, flush=True)
            waiting = True
            time.sleep(FOLLOW_EVERY)
            continue
        if waiting:
            print("gpubroker: the broker answers again", file=sys.stderr, flush=True)
            waiting = False
        # A broker started again on a new or wiped store numbers its events from 1: resuming after the last seq seen
        # would skip its first ones (its broker.started among them), or all of them up to that seq.
        another = _another_store(store, answer, after)
        store = answer.get("store") or ""
        if another:
            print(f"gpubroker: {another}; printing its events from the first", file=sys.stderr, flush=True)
            after = 0
            continue
        if after > 0 and answer.get("dropped"):  # asked from a point (or fell behind) past what the broker keeps
            first = answer["events"][0]["seq"]
            print(
                f"gpubroker: {answer['dropped']} events after {after} are no longer kept (events_kept): from {first} on",
                file=sys.stderr,
                flush=True,
            )
        for event in answer["events"]:
            if args.json and not args.follow:
                listed.append(event)
            elif args.json:  # following: one JSON object per line, as each comes
                print(json.dumps(event, sort_keys=True), flush=True)
            else:
                print(_event_line(event), flush=True)
        after = answer["next"]
        if len(answer["events"]) == EVENTS_PAGE:
            continue  # more kept than one page: every one is printed, not the oldest thousand
        if not args.follow:
            if args.json:
                _print_json(listed)
            return 0
        time.sleep(FOLLOW_EVERY)


def _another_store(before: str | None, answer: dict[str, Any], after: int) -> str | None:
    """Why the broker's events, answered after `after`, come from another store than those printed so far, or None.
    Only once it has answered: a first `--after` past its newest resumes from its newest."""
    if before is None:
        return None
    if before and answer.get("store") and answer["store"] != before:
        return f"the broker keeps its events in another store ({answer['store']}, not {before}), which numbers them from 1 again"
    if answer["next"] < after:  # a broker that names no store: its newest event is older than the last one printed
        return f"the broker's newest event is {answer['next']}, below the {after} printed: it keeps its events in another store"
    return None


def _event_line(event: dict[str, Any]) -> str:
    """An event as `gpubroker events` prints it: one line, whatever its message holds (a driver's or a peer's text
    with a line break or an escape sequence would forge lines or act on the terminal)."""
    code = f" {event['code']}" if event.get("code") else ""
    return printable_text(f"{event['seq']:>6} {event['time']} {event['type']}{code}: {event['message']}")


def cmd_init(args: argparse.Namespace) -> int:
    """Create this node's identity and a new cluster, offline, in the state directory."""
    from gpubroker.daemon import BrokerRunning, StartError, load_identity, lock_state
    from gpubroker.gossip.cluster import ClusterError, ClusterState
    from gpubroker.gossip.keyring import cluster_hash

    try:
        config = load_config(_config_file(args.config), state_dir=args.state, name=args.name)
        os.close(lock_state(config.state_dir))  # a running broker would go on as the node it was, in no cluster
        identity = load_identity(config.state_dir)
        cluster = ClusterState.init(config.state_dir, identity, config.name)
    except BrokerRunning as error:
        print(f"gpubroker: {error}: stop it, run `gpubroker init`, then start it again", file=sys.stderr)
        return 2
    except (ConfigError, ClusterError, StartError) as error:
        print(f"gpubroker: {error}", file=sys.stderr)
        return 2
    except OSError as error:
        print(f"gpubroker: cannot write the node's identity and cluster in {config.state_dir}: {error.strerror}", file=sys.stderr)
        return 2
    print(f"cluster {cluster_hash(cluster.cluster_id)} created; this node is {identity.node_id} ({config.name})")
    print("start it with `gpubroker up`, then `gpubroker invite` prints a join token for the next node")
    return 0


def cmd_invite(args: argparse.Namespace) -> int:
    print(Client().call("POST", "/v1/cluster/invites", {"ttl": args.ttl})["token"])
    return 0


def cmd_nodes(args: argparse.Namespace) -> int:
    client = Client()
    if args.action in ("remove", "approve"):
        if not args.id:
            _usage_error(f"nodes {args.action} needs a node id")
        if args.action == "remove":
            answer = client.call("DELETE", f"/v1/cluster/nodes/{args.id}")
        else:
            answer = client.call("POST", f"/v1/cluster/nodes/{args.id}/approve")
    else:
        answer = client.call("GET", "/v1/cluster/nodes")
    if args.json:
        _print_json(answer)
        return 0
    for member in answer["members"]:
        name = _pad(printable_text(member["name"] or "-"), 20)
        renamed = member.get("admitted_as")
        also = f" as {printable_text(renamed)}" if renamed and renamed != member["name"] else ""
        print(f"{member['id']}  {name} {member['state']:8} admitted by {member['admitted_by'] or '-'}{also}")
    for pending in answer["pending"]:
        print(f"{pending['id']}  {_pad(printable_text(pending['name'] or '-'), 20)} pending  from {pending['addr']}")
    for removed in answer["removed"]:
        print(f"{removed}  removed")
    return 0


def cmd_keys(args: argparse.Namespace) -> int:
    client = Client()
    if args.action == "list":
        answer = client.call("GET", "/v1/cluster/keys")
    elif args.action == "install":
        answer = client.call("POST", "/v1/cluster/keys", {"install": args.key})
    elif not args.key:
        _usage_error(f"keys {args.action} needs a key id")
    else:
        answer = client.call("POST", "/v1/cluster/keys", {args.action: args.key})
    failed = {node: said for node, said in answer.get("members", {}).items() if said != "ok"}
    if args.json:
        _print_json(answer)
    else:
        for key in answer["keys"]:
            print(f"{key['id']}{'  (primary: seals datagrams)' if key['primary'] else ''}")
        for node, said in sorted(answer.get("members", {}).items()):
            print(f"member {node}: {said}", file=sys.stderr if said != "ok" else sys.stdout)
    if failed:  # the keyring now differs between members: say so in the exit code too
        print(f"gpubroker: the change was not made on {len(failed)} member(s): {', '.join(sorted(failed))}", file=sys.stderr)
        return 1
    return 0


def cmd_password(args: argparse.Namespace) -> int:
    """Print the ui_password_hash line for a password read from the terminal (twice) or from standard input."""
    import getpass

    from gpubroker.ui.auth import hash_password

    try:
        if sys.stdin is not None and sys.stdin.isatty():
            password = getpass.getpass("UI password: ")
            if getpass.getpass("again: ") != password:
                print("gpubroker: the two passwords differ", file=sys.stderr)
                return 2
        else:
            line = sys.stdin.readline() if sys.stdin is not None else ""  # None: standard input closed (`<&-`)
            if not line:
                raise EOFError
            password = line.rstrip("\n")
    except EOFError:  # an empty file, /dev/null, or Ctrl-D at the prompt: not a password too short
        print(
            "gpubroker: no password was read: standard input ended before one was given (type it when asked, in a terminal, "
            "or give it as the first line of standard input)",
            file=sys.stderr,
        )
        return 2
    if len(password.strip()) < 8:
        print("gpubroker: a UI password needs at least 8 characters besides spaces", file=sys.stderr)
        return 2
    print(f'ui_password_hash = "{hash_password(password)}"')
    return 0


def cmd_token(args: argparse.Namespace) -> int:
    """Print this node's API token (made once in the state directory): GPUBROKER_TOKEN for the CLI and Prometheus."""
    from gpubroker.ui.auth import load_or_create_api_token

    try:
        config = load_config(_config_file(args.config), state_dir=args.state)
    except ConfigError as error:
        print(f"gpubroker: {error}", file=sys.stderr)
        return 2
    try:
        if not config.state_dir.is_dir():  # a mistyped --state must not make a token no broker knows
            print(f"gpubroker: no state directory at {config.state_dir}: give the one the broker runs on (--state)", file=sys.stderr)
            return 2
        token = load_or_create_api_token(config.state_dir)
    except OSError as error:  # the broker's user's directory, read by another user: one line, not Python's errno
        print(
            f"gpubroker: cannot read the API token in {config.state_dir}: {error.strerror or error}; run this as the broker's "
            "user, with the --state it runs on",
            file=sys.stderr,
        )
        return 2
    # Written outside the handling of the token's file: a reader gone away or a full disk is said as by every command.
    print(token)
    if config.ui_password_hash is None:
        print(
            "gpubroker: the config read here sets no ui_password_hash, and a broker without one asks nobody for a token: "
            "the token counts once `gpubroker password` has made one and it is in the broker's config",
            file=sys.stderr,
        )
    return 0


def cmd_self_check(args: argparse.Namespace) -> int:
    from gpubroker.selfcheck import self_check

    return self_check()


class _Parser(argparse.ArgumentParser):
    """argparse, but help and --version written to standard output fail as a listing does when they cannot be written:
    argparse drops the error (and, with standard output closed, writes them to standard error) and exits 0."""

    def _print_message(self, message: str, file: SupportsWrite[str] | None = None) -> None:
        if message and file is not None and file is sys.stdout:
            file.write(message)
        else:
            super()._print_message(message, file)  # a usage error on standard error: lost where it cannot be written


def parser() -> argparse.ArgumentParser:
    top = _Parser(prog="gpubroker", description="Leases on GPU memory, whole GPUs, CPU cores and host memory.")
    top.add_argument("--version", action="version", version=f"gpubroker {__version__}")
    sub = top.add_subparsers(dest="command_name", required=True, metavar="COMMAND")

    def command(name: str, help: str, description: str | None = None) -> argparse.ArgumentParser:
        """A subcommand whose own --help says what it does, as the list of commands does."""
        return sub.add_parser(name, help=help, description=description or help)

    up = command("up", help="run the broker in the foreground")
    up.add_argument("--state", metavar="DIR", help="state directory (LMDB)")
    up.add_argument("--listen", metavar="HOST:PORT", help="TCP address of the API (default 127.0.0.1:9740)")
    up.add_argument("--socket", metavar="PATH", help="Unix socket of the API")
    up.add_argument("--config", metavar="FILE", help="TOML configuration file")
    up.add_argument("--simulate-gpus", metavar="SPEC|FILE", help="simulated GPUs: 2x24GiB,1x12GiB or a TOML file")
    up.add_argument("--name", help="this node's name (default: the name it was admitted to its cluster with, else the hostname)")
    up.add_argument("--gossip", metavar="HOST:PORT", help="where the mesh listens, UDP and TCP (default 0.0.0.0:9741)")
    up.add_argument("--advertise", metavar="HOST", help="the address peers should use to reach this node")
    up.add_argument("--peer", action="append", metavar="HOST:PORT", help="a seed member's gossip address (repeatable)")
    up.add_argument("--join", metavar="TOKEN", help="join a cluster with a token from `gpubroker invite`")
    up.add_argument("--no-mdns", action="store_true", help="do not look for peers by mDNS")
    up.add_argument("--ask", action="store_true", help="no token: ask the members found to admit this node, for an operator to approve")
    up.set_defaults(run=cmd_up)

    init = command("init", help="create this node's identity and a new cluster (once, on the first node)")
    init.add_argument("--state", metavar="DIR", help="state directory (as `gpubroker up --state`)")
    init.add_argument("--config", metavar="FILE", help="TOML configuration file (as `gpubroker up --config`)")
    init.add_argument("--name", help="this node's name (default: the hostname)")
    init.set_defaults(run=cmd_init)

    invite = command("invite", help="print a one-time join token for a new node (asks the running broker)")
    invite.add_argument("--ttl", default="1h", metavar="DURATION", help="how long the token is valid (default 1h)")
    invite.set_defaults(run=cmd_invite)

    nodes = command("nodes", help="the cluster's members: list, approve ID (a node that asked), remove ID")
    nodes.add_argument("action", choices=("list", "approve", "remove"), help="list the members, approve a node that asked, or remove one")
    nodes.add_argument("id", nargs="?", help="the node id to approve or remove")
    nodes.add_argument("--json", action="store_true", help="print the answer as JSON")
    nodes.set_defaults(run=cmd_nodes)

    keys = command("keys", help="the gossip keyring: list, install [KEY], use ID, remove ID")
    keys.add_argument(
        "action", choices=("list", "install", "use", "remove"), help="list the keys, install one, seal with one, or remove one"
    )
    keys.add_argument("key", nargs="?", help="a base64 key to install (default: a new one), or a key id")
    keys.add_argument("--json", action="store_true", help="print the answer as JSON")
    keys.set_defaults(run=cmd_keys)

    status = command("status", help="this node and its cluster at a glance")
    status.add_argument("--json", action="store_true", help="print GET /v1/node and GET /v1/cluster as JSON")
    status.set_defaults(run=cmd_status)

    lease = command(
        "lease",
        help="get a lease and print it, or run a command under it: lease [...] -- CMD ARGS",
        description="Get a lease. Without CMD, print it (its token and environment); it lives by its TTL and renewals. "
        "With -- CMD ARGS, run CMD with CUDA_VISIBLE_DEVICES (the granted GPUs' UUIDs), GPUBROKER_LEASE and "
        "GPUBROKER_GPU_MEMORY (bytes per GPU) set, renew the lease while CMD runs, release it when CMD exits, and exit "
        "with CMD's exit code. The exit code is 75 when the lease is refused; 127 or 126 when CMD cannot be run (not found, "
        "not executable), said before any lease is asked for.",
    )
    lease.add_argument("--gpu-memory", dest="gpu_memory", metavar="SIZE", help="bytes per GPU: 8GiB, 512MiB")
    lease.add_argument("--gpus", type=int, help="how many GPUs (default 1 with --gpu-memory or --exclusive)")
    lease.add_argument("--exclusive", action="store_true", help="whole GPUs: nothing else may be leased on them")
    lease.add_argument("--gpu", metavar="INDEX|UUID", help="pin to one GPU")
    lease.add_argument("--cpu-cores", dest="cpu_cores", type=int, metavar="N", help="CPU cores")
    lease.add_argument("--memory", metavar="SIZE", help="host memory")
    lease.add_argument("--priority", choices=CLASSES, help="the class, in claim order (default interactive)")
    lease.add_argument("--preemption", choices=("never", "drain", "interrupt"), help="how it may be taken (default never)")
    lease.add_argument("--ttl", metavar="DURATION", help="lifetime unless renewed (default 5m)")
    lease.add_argument("--wait", metavar="DURATION", help="how long to wait in the queue, or 'forever' (default: answer now)")
    lease.add_argument("--deadline", metavar="RFC3339", help="the time by which it must be granted, or not at all")
    lease.add_argument("--name", help="the holder's name (default: the command's name)")
    lease.add_argument("--label", action="append", metavar="K=V", help="a label shown with the lease (repeatable)")
    lease.add_argument("--json", action="store_true", help="without CMD: print the lease as JSON")
    lease.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS: run under the lease")
    lease.set_defaults(run=cmd_lease)

    leases = command("leases", help="list leases and waiting requests")
    leases.add_argument("--state", choices=("queued", "granted", "released", "expired", "revoked"), help="only leases in this state")
    leases.add_argument("--node", help="another node of the cluster (id or name): the granted leases its document lists")
    leases.add_argument("--limit", type=int, default=1000, help="at most this many (default 1000)")
    leases.add_argument("--json", action="store_true", help="print them as one JSON array")
    leases.set_defaults(run=cmd_leases)

    release = command("release", help="release a lease (or cancel a waiting request)")
    release.add_argument("id", help="the lease's id (or the waiting request's)")
    release.add_argument("--token", help="the lease's token, when not its Unix user or root")
    release.add_argument("--json", action="store_true", help="print the released lease as JSON")
    release.set_defaults(run=cmd_release)

    events = command("events", help="structured events, oldest first")
    events.add_argument("--after", type=int, default=0, metavar="SEQ", help="only the events after this sequence number")
    events.add_argument("--follow", "-f", action="store_true", help="keep printing new events")
    events.add_argument("--json", action="store_true", help="print them as one JSON array (with --follow, one object per line)")
    events.set_defaults(run=cmd_events)

    password = command("password", help="make the ui_password_hash setting from a password (asked twice, or one line on stdin)")
    password.set_defaults(run=cmd_password)

    token = command("token", help="print this node's API token, for GPUBROKER_TOKEN and Prometheus (read from the state directory)")
    token.add_argument("--state", metavar="DIR", help="the state directory the broker runs on")
    token.add_argument("--config", metavar="FILE", help="the broker's TOML configuration file")
    token.set_defaults(run=cmd_token)

    check = command("self-check", help="start a broker on a simulated GPU in a temporary directory, grant and release a lease")
    check.set_defaults(run=cmd_self_check)
    return top


# Flags whose value may be negative: "--ttl -5s" is the flag and its value (the broker says why it is
# refused), not two flags, as argparse would otherwise read any word that starts with "-".
_SIGNED = frozenset({"--gpu-memory", "--gpus", "--gpu", "--cpu-cores", "--memory", "--ttl", "--wait", "--deadline"})


def _join_signed(argv: list[str]) -> list[str]:
    out: list[str] = []
    rest = iter(argv)
    for word in rest:
        if word == "--":
            return [*out, word, *rest]  # CMD's own arguments are its own
        following = next(rest, None) if word in _SIGNED else None
        if following == "--":
            return [*out, word, following, *rest]
        if following is not None and following[:1] == "-" and following[1:2].isdigit():
            out.append(f"{word}={following}")
        else:
            out += [word] if following is None else [word, following]
    return out


class _Escaping:
    """A text stream whose control characters (but line ends and tabs) are written as their escapes: what
    the broker says may quote names it got from others (a process, an older node), and none may act on the
    terminal this prints to. JSON output is unchanged: json.dumps escapes them itself."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        return int(self._stream.write(printable_text(text, keep="\n\t")))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class _Closed:
    """Standard output closed before this process started (`gpubroker status >&-`): writing to it fails as writing to
    a full disk does, so a command whose output is its point says it could not be written and exits 1, instead of
    printing nothing and exiting 0 (or following events into nowhere for ever)."""

    def write(self, text: str) -> int:
        raise OSError(errno.EBADF, "standard output is closed")

    def flush(self) -> None:
        pass


class _Lost:
    """Standard error closed before this process started (`2>&-`): what is said there is lost, as the caller wanted.
    Left None, it would not be: print(file=None) writes to standard output, into the listing or JSON a script reads."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


@contextlib.contextmanager
def _escaped_output(output_needed: bool = True) -> Iterator[None]:
    saved = sys.stdout, sys.stderr
    # A stream closed before this process started is None: printing to it does nothing, as Python does, but for a
    # standard output a command cannot do without. Standard error closed is for the caller to have wanted.
    out, err = saved
    sys.stdout = _Escaping(out) if out is not None else _Closed() if output_needed else None
    sys.stderr = _Lost() if err is None else _Escaping(err)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved


def _output_needed(args: argparse.Namespace) -> bool:
    """Whether a command's standard output is its point (a listing, a token, a printed lease), so that it fails when
    that output is closed. A broker's output is its log and CMD's is CMD's own; an action (release, approve, a key's
    use) says only that it was done, which its exit status says too: run with `>&-`, it must not be done and then
    said to have failed."""
    if args.run is cmd_up or getattr(args, "command", None):
        return False
    if args.run in (cmd_release, cmd_init, cmd_self_check):
        return False
    return getattr(args, "action", "list") == "list"  # nodes and keys: only their listing


def _main(argv: list[str]) -> int:
    try:
        with _escaped_output():  # --help and --version are output whose reader may be gone too
            args = parser().parse_args(_join_signed(argv))
    except SystemExit as done:
        if done.code:  # a usage error, said on standard error
            raise
        _flush_output()  # --help or --version printed
        return 0
    if getattr(args, "command", None) and args.command[:1] == ["--"]:
        args.command = args.command[1:]
        if not args.command:  # `-- $CMD` with CMD empty: a lease bound to nothing would be printed, as if the work had run
            with _escaped_output(output_needed=False):  # with standard error closed, lost: not written into the output
                print("gpubroker lease: error: -- is to be followed by CMD [ARGS]", file=sys.stderr)
            return 2
    with _escaped_output(output_needed=_output_needed(args)):
        code: int = args.run(args)
    _flush_output()
    return code


def _flush_output() -> None:
    if sys.stdout is not None:
        sys.stdout.flush()  # a reader gone away is met here, not in the interpreter's exit


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(sys.argv[1:] if argv is None else argv)
    except ClientError as error:
        with _escaped_output():
            print(f"gpubroker: {error.code}: {error.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # Ctrl-C (a wait in the queue, `events --follow`): end by SIGINT, as when it ends CMD, so a shell loop over
        # the command stops too; bash goes on with the loop when its child exits with a status of its own.
        with contextlib.suppress(OSError, ValueError, AttributeError):
            sys.stdout.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        return 130
    except BrokenPipeError:  # `gpubroker events | head`: the reader has all it wanted
        _drop_output()
        return 128 + signal.SIGPIPE
    except OSError as error:  # the output cannot be written: a full disk, say
        with contextlib.suppress(OSError), _escaped_output(output_needed=False):
            print(f"gpubroker: the output could not be written: {error.strerror or error}", file=sys.stderr)
        _drop_output()
        return 1


def _drop_output() -> None:
    """Standard output goes to /dev/null: what is still buffered for it, kept after a write that failed, is flushed
    there, so the same failure is not met again (and said again) when the output is next flushed or at exit."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
