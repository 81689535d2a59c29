"""Lease benchmark: the broker's grant and release beside a bare synced LMDB commit and a trivial aiohttp endpoint.

Run: `.venv/bin/python bench/bench_leases.py [--quick] [--out FILE]`. It prints a table and writes every
figure as JSON (default bench/results/leases.json). It never fails on a time: the goals are printed
beside the figures, and only a broker that cannot start or answers with an error ends it with status 1.

The load generator is this process's event loop, and it is the same code for the trivial endpoint and
for the broker (the same requests, bodies and headers), so the ratios compare the servers, not the
clients. The c=1 figures are taken in lock step (one bare LMDB commit, one commit of the broker's own
Store, one pair on the trivial endpoint, one pair on the broker, again and again), so a busy disk or a
busy neighbour weighs on both sides of the latency ratio alike. The two servers take turns going first
in a round: on a 2-core machine the server that goes second pays for the first one's tail (its
cleanup, its writer thread) and answers 0.1-0.2 ms slower, whichever it is, so a fixed order would tilt
the ratio; the medians by order are kept in the results, to show how much. The throughput runs of the trivial
endpoint and of the broker follow each other at each concurrency, and every repeat does all of it.
On a 2-core machine the server, its writer thread and the load generator share the cores: each
server's CPU time per pair is recorded too, as it moves far less than the wall clock when they do.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import common  # bench/common.py: run as a script, this folder is on the path
import lmdb
import psutil
from aiohttp import web
from common import BenchError, arguments, conduct, load_line, meets, percentile

from gpubroker.broker.lease import Holder, Lease, LeasedGpu
from gpubroker.broker.store import Store, Write, seq_key

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "bench" / "results" / "leases.json"
GPUS = "1x80GiB"
BODY = {"gpu_memory": "64MiB", "bind": "none", "ttl": "10m", "holder": {"name": "bench"}}
TRANSPORTS = ("unix", "tcp")
GOALS = {
    "grant_p50_ratio": ("<=", 1.5),
    "pairs_c64_ratio": (">=", 0.3),
    "rss_idle_mb": ("<", 60.0),
    "rss_1000_leases_mb": ("<", 80.0),
    "start_to_ready_s": ("<=", 1.5),
}


@dataclass(frozen=True, slots=True)
class Plan:
    """How much work each measurement does: fixed counts, so runs compare."""

    repeats: int
    lmdb_commits: int  # back to back, for commits per second
    latency_pairs: int  # lock-step c=1 rounds: the latencies and the c=1 throughput
    pairs: dict[int, int]  # concurrency → grant+release pairs
    warmup_pairs: int
    starts: int
    held_leases: int


FULL = Plan(repeats=3, lmdb_commits=500, latency_pairs=400, pairs={16: 1000, 64: 2000}, warmup_pairs=50, starts=5, held_leases=1000)
QUICK = Plan(repeats=1, lmdb_commits=200, latency_pairs=150, pairs={16: 300, 64: 500}, warmup_pairs=20, starts=3, held_leases=1000)


# ----- figures ---------------------------------------------------------------


def ms(seconds: list[float]) -> dict[str, float]:
    return {"p50_ms": percentile(seconds, 0.50) * 1e3, "p99_ms": percentile(seconds, 0.99) * 1e3, "n": len(seconds)}


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of each numeric figure across repeats (nested dicts too); the repeats stay in the JSON."""
    out: dict[str, Any] = {}
    for key, value in runs[0].items():
        if isinstance(value, dict):
            out[key] = median_of([run[key] for run in runs])
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out[key] = statistics.median(run[key] for run in runs)
        else:
            out[key] = value
    return out


# ----- processes ---------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Child:
    """A child process whose output a thread drains (it must never block on a full pipe); stop() is SIGTERM, then SIGKILL."""

    def __init__(self, argv: list[str], ready_prefix: str) -> None:
        self.argv = argv
        self.ready_prefix = ready_prefix
        self.lines: list[str] = []
        self.ready_at: float | None = None  # perf_counter when the ready line came
        self._ready = threading.Event()
        self.started_at = time.perf_counter()
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_child_env())
        self._drainer = threading.Thread(target=self._drain, name=f"drain-{self.proc.pid}", daemon=True)
        self._drainer.start()

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if self.ready_at is None and line.startswith(self.ready_prefix):
                self.ready_at = time.perf_counter()
                self._ready.set()
        self._ready.set()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, timeout: float = 30.0) -> None:
        if not self._ready.wait(timeout) or self.ready_at is None:
            self.stop()
            raise BenchError(f"{' '.join(self.argv[:4])} did not print {self.ready_prefix!r} within {timeout:g}s:\n{''.join(self.lines)}")

    def rss(self) -> int:
        return int(psutil.Process(self.proc.pid).memory_info().rss)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._drainer.join(5)  # it ends at the pipe's end, now that the process is gone


def _child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUBROKER_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


@dataclass(slots=True)
class Endpoints:
    """One server on a Unix socket and on TCP 127.0.0.1."""

    socket: Path
    port: int

    def session(self, transport: str, limit: int) -> aiohttp.ClientSession:
        connector: aiohttp.BaseConnector
        if transport == "unix":
            connector = aiohttp.UnixConnector(path=str(self.socket), limit=limit)
        else:
            connector = aiohttp.TCPConnector(limit=limit)
        return aiohttp.ClientSession(connector=connector)

    def base(self, transport: str) -> str:
        return "http://localhost" if transport == "unix" else f"http://127.0.0.1:{self.port}"


@dataclass(slots=True)
class Broker:
    """`python -m gpubroker up` on a fresh state directory."""

    root: Path
    endpoints: Endpoints = field(init=False)
    child: Child = field(init=False)

    def __post_init__(self) -> None:
        self.root.mkdir(parents=True)
        self.endpoints = Endpoints(self.root / "api.sock", free_port())

    @property
    def store(self) -> Path:
        return self.root / "state" / "store"

    def start(self, *, wait: bool = True) -> Broker:
        argv = [
            sys.executable, "-m", "gpubroker", "up", "--simulate-gpus", GPUS, "--state", str(self.root / "state"),
            "--socket", str(self.endpoints.socket), "--listen", f"127.0.0.1:{self.endpoints.port}",
        ]  # fmt: skip
        self.child = Child(argv, "gpubroker ready")
        if wait:
            self.child.wait_ready()
        return self

    def commits(self) -> int:
        """LMDB write transactions so far (its last txn id), read from outside without taking a lock."""
        env = lmdb.open(str(self.store), readonly=True, lock=False, max_dbs=8)
        try:
            return int(env.info()["last_txnid"])
        finally:
            env.close()


def start_trivial(root: Path) -> tuple[Child, Endpoints]:
    endpoints = Endpoints(root / "trivial.sock", free_port())
    child = Child(
        [sys.executable, str(Path(__file__).resolve()), "--serve-trivial", str(endpoints.socket), str(endpoints.port)], "trivial ready"
    )
    child.wait_ready()
    return child, endpoints


def serve_trivial(path: str, port: int) -> None:
    """The baseline server: a minimal aiohttp app that answers `{}` to every request, on the socket and on TCP."""

    async def answer(request: web.Request) -> web.Response:
        return web.json_response({})

    async def main() -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", answer)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.UnixSite(runner, path).start()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        print("trivial ready", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        await stop.wait()
        await runner.cleanup()

    asyncio.run(main())


@dataclass(slots=True)
class Server:
    """A server under load: where it answers, its process (for its CPU time), and for the broker its store (for commits)."""

    name: str
    endpoints: Endpoints
    child: Child
    broker: Broker | None = None

    def cpu(self) -> float:
        """User + system seconds of the whole process, every thread."""
        times = psutil.Process(self.child.pid).cpu_times()
        return float(times.user + times.system)

    def commits(self) -> int:
        return self.broker.commits() if self.broker is not None else 0


def healthy(path: Path) -> bool:
    """One GET /healthz over the Unix socket, answered 200."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(2.0)
            sock.connect(str(path))
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
            return sock.recv(64).startswith(b"HTTP/1.1 200")
    except OSError:
        return False


# ----- the load generator (the same for the trivial endpoint and the broker) ---------------------


async def grant_release(session: aiohttp.ClientSession, base: str) -> tuple[float, float]:
    """POST a lease, then DELETE it with its token: the seconds each took."""
    started = time.perf_counter()
    async with session.post(f"{base}/v1/leases", json=BODY) as answer:
        body = await answer.json(content_type=None)
        _check(answer.status, body, "POST /v1/leases")
    granted = time.perf_counter()
    lease = body.get("lease") or {"id": "l-trivial", "token": "-"}
    async with session.delete(f"{base}/v1/leases/{lease['id']}", headers={"X-Lease-Token": lease["token"]}) as answer:
        _check(answer.status, await answer.json(content_type=None), "DELETE /v1/leases/{id}")
    return granted - started, time.perf_counter() - granted


async def grant(session: aiohttp.ClientSession, base: str) -> None:
    async with session.post(f"{base}/v1/leases", json=BODY) as answer:
        _check(answer.status, await answer.json(content_type=None), "POST /v1/leases")


def _check(status: int, body: Any, what: str) -> None:
    if status >= 300:
        raise BenchError(f"{what} answered {status}: {json.dumps(body)[:400]}")


async def lockstep(servers: list[Server], transport: str, plan: Plan, scratch: Path) -> dict[str, Any]:
    """c=1 in lock step: each round times one bare synced LMDB commit, one Store commit of a grant's writes, and one pair per server."""
    env = lmdb.open(str(scratch / "bare"), map_size=64 * 2**20, sync=True, metasync=True)
    store = Store(scratch / "store", 64 * 2**20)
    store.start()
    sessions = [server.endpoints.session(transport, 1) for server in servers]
    try:
        for i in range(plan.warmup_pairs):
            await store.commit(_grant_writes(-1 - i))
            for server, session in zip(servers, sessions, strict=True):
                await grant_release(session, server.endpoints.base(transport))
        bare: list[float] = []
        stored: list[float] = []
        grants: dict[str, list[float]] = {server.name: [] for server in servers}
        releases: dict[str, list[float]] = {server.name: [] for server in servers}
        cpu = {server.name: server.cpu() for server in servers}
        commits = {server.name: server.commits() for server in servers}
        value = b"x" * 200
        for i in range(plan.latency_pairs):
            t = time.perf_counter()
            with env.begin(write=True) as txn:  # blocks the loop on purpose: nothing else runs in a lock-step round
                txn.put(i.to_bytes(8, "big"), value)
            bare.append(time.perf_counter() - t)
            t = time.perf_counter()
            await store.commit(_grant_writes(i))
            stored.append(time.perf_counter() - t)
            turn = list(zip(servers, sessions, strict=True))
            if i % 2:
                turn.reverse()  # every server goes first in half the rounds
            for server, session in turn:
                g, r = await grant_release(session, server.endpoints.base(transport))
                grants[server.name].append(g)
                releases[server.name].append(r)
        out: dict[str, Any] = {"lmdb": ms(bare), "store": ms(stored)}
        # The order effect: grant p50 of each server in the rounds where it went first, and where it went second.
        first, second = servers[0].name, servers[-1].name
        out["grant_p50_ms_by_turn"] = {
            name: {
                "first": percentile(grants[name][0 if name == first else 1 :: 2], 0.5) * 1e3,
                "second": percentile(grants[name][1 if name == first else 0 :: 2], 0.5) * 1e3,
            }
            for name in (first, second)
        }
        for server in servers:
            pairs = [g + r for g, r in zip(grants[server.name], releases[server.name], strict=True)]
            out[server.name] = {
                "grant": ms(grants[server.name]),
                "release": ms(releases[server.name]),
                "pair": ms(pairs),
                "pairs_per_s": len(pairs) / sum(pairs),
                "server_cpu_ms_per_pair": (server.cpu() - cpu[server.name]) / len(pairs) * 1e3,
                "commits_per_pair": (server.commits() - commits[server.name]) / len(pairs),
            }
        return out
    finally:
        for session in sessions:
            await session.close()
        store.stop()
        env.close()


async def concurrent(server: Server, transport: str, concurrency: int, pairs: int) -> dict[str, float]:
    """`concurrency` clients, each on its own connection, sharing a fixed number of grant+release pairs."""
    base = server.endpoints.base(transport)
    async with server.endpoints.session(transport, concurrency) as session:
        await asyncio.gather(*(grant_release(session, base) for _ in range(concurrency)))  # open every connection first
        left = pairs

        async def client() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                await grant_release(session, base)

        cpu, commits = server.cpu(), server.commits()
        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
        return {
            "pairs_per_s": pairs / elapsed,
            "server_cpu_ms_per_pair": (server.cpu() - cpu) / pairs * 1e3,
            "commits_per_pair": (server.commits() - commits) / pairs,
        }


async def hold(endpoints: Endpoints, count: int, concurrency: int = 16) -> None:
    """Grant `count` leases and keep them."""
    async with endpoints.session("unix", concurrency) as session:
        left = count

        async def client() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                await grant(session, endpoints.base("unix"))

        await asyncio.gather(*(client() for _ in range(concurrency)))


def measure(transport: str, trivial: Server, broker: Server, plan: Plan, scratch: Path) -> dict[str, Any]:
    """One repeat on one transport: the lock-step c=1 round, then each concurrency, trivial endpoint then broker."""

    async def run() -> dict[str, Any]:
        c1 = await lockstep([trivial, broker], transport, plan, scratch)
        out: dict[str, Any] = {"lmdb_c1": c1["lmdb"], "store_c1": c1["store"], "grant_p50_ms_by_turn": c1["grant_p50_ms_by_turn"]}
        for server in (trivial, broker):
            figures = c1[server.name]
            out[server.name] = {
                "grant": figures["grant"],
                "release": figures["release"],
                "pair": figures["pair"],
                "pairs_per_s_by_c": {"1": figures["pairs_per_s"]},
                "server_cpu_ms_per_pair_by_c": {"1": figures["server_cpu_ms_per_pair"]},
                "commits_per_pair_by_c": {"1": figures["commits_per_pair"]},
            }
        for concurrency, count in plan.pairs.items():
            for server in (trivial, broker):
                figures = await concurrent(server, transport, concurrency, count)
                out[server.name]["pairs_per_s_by_c"][str(concurrency)] = figures["pairs_per_s"]
                out[server.name]["server_cpu_ms_per_pair_by_c"][str(concurrency)] = figures["server_cpu_ms_per_pair"]
                out[server.name]["commits_per_pair_by_c"][str(concurrency)] = figures["commits_per_pair"]
        del out[trivial.name]["commits_per_pair_by_c"]  # it has no store
        return out

    scratch.mkdir(parents=True)
    try:
        return asyncio.run(run())
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


# ----- the baselines on their own ------------------------------------------------------------


def bare_lmdb(path: Path, commits: int) -> dict[str, Any]:
    """Back-to-back synced commits of a small put, on the disk of the broker's state directory."""
    env = lmdb.open(str(path), map_size=64 * 2**20, sync=True, metasync=True)
    try:
        value = b"x" * 200
        seconds: list[float] = []
        started = time.perf_counter()
        for i in range(commits):
            t = time.perf_counter()
            with env.begin(write=True) as txn:
                txn.put(i.to_bytes(8, "big"), value)
            seconds.append(time.perf_counter() - t)
        elapsed = time.perf_counter() - started
    finally:
        env.close()
        shutil.rmtree(path, ignore_errors=True)
    return {**ms(seconds), "commits_per_s": commits / elapsed}


def store_group_commit(path: Path, commits: int, concurrency: int) -> dict[str, Any]:
    """The broker's own Store (writer thread, group commit) without HTTP: `concurrency` tasks committing a grant's writes each time."""
    store = Store(path, 64 * 2**20)
    seconds: list[float] = []

    async def one(i: int) -> None:
        t = time.perf_counter()
        await store.commit(_grant_writes(i))
        seconds.append(time.perf_counter() - t)

    async def run() -> tuple[float, int]:
        store.start()
        await asyncio.gather(*(one(-1 - i) for i in range(concurrency)))  # warm: the tables exist, the pages are mapped
        seconds.clear()
        transactions = store.commits
        left = commits

        async def client() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                await one(left)

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return time.perf_counter() - started, store.commits - transactions

    try:
        elapsed, transactions = asyncio.run(run())
    finally:
        store.stop()
        shutil.rmtree(path, ignore_errors=True)
    return {**ms(seconds), "grants_per_s": commits / elapsed, "grants_per_transaction": commits / max(1, transactions)}


def _grant_writes(i: int) -> list[Write]:
    """What one grant writes (as Broker._grant does): the lease's record, made by the real `Lease`, and its event. The
    epochs ride inside the record."""
    lease_id = f"l-{i & 0xFFFFFFFFFFFF:012x}"
    now = time.time()
    lease = Lease(
        id=lease_id, node="n-bench", state="granted", epoch=i, priority="normal", preemption="never", bind="none",
        holder=Holder(name="bench", pid=4242, uid=0, start_time=now), gpus=[LeasedGpu(0, "GPU-sim-0", 64 * 2**20, i)],
        exclusive=False, cpu_cores=0, memory=0, labels={}, token_hash="0" * 64, requested_at=now, granted_at=now,
        expires_at=now + 600, ttl=600.0,
    )  # fmt: skip
    event = {
        "seq": i & 0xFFFFFFFF, "time": now, "type": "lease.granted",
        "message": f"lease {lease_id} granted to bench (normal): GPU 0 0.06 GiB epoch {i}",
        "details": {"gpus": ["GPU-sim-0"], "bytes": [64 * 2**20], "epoch": i, "waited": 0.0}, "node": "n-bench",
        "lease": lease_id, "gpu": "GPU-sim-0",
    }  # fmt: skip
    return [Write("leases", lease_id.encode(), lease.to_record()), Write("events", seq_key(i & 0xFFFFFFFF), event)]


# ----- the broker's own figures -----------------------------------------------------------


def start_to_ready(root: Path, starts: int) -> dict[str, Any]:
    """From Popen of `gpubroker up` to the first GET /healthz answered 200 on its socket, fresh state each time."""
    seconds: list[float] = []
    ready_lines: list[float] = []
    for i in range(starts):
        broker = Broker(root / f"start{i}")
        broker.start(wait=False)
        try:
            while not healthy(broker.endpoints.socket):
                if broker.child.proc.poll() is not None or time.perf_counter() - broker.child.started_at > 30:
                    raise BenchError(f"the broker did not answer /healthz:\n{''.join(broker.child.lines)}")
                time.sleep(0.002)
            seconds.append(time.perf_counter() - broker.child.started_at)
            broker.child.wait_ready()
            assert broker.child.ready_at is not None
            ready_lines.append(broker.child.ready_at - broker.child.started_at)
        finally:
            broker.child.stop()
            shutil.rmtree(broker.root, ignore_errors=True)
    return {"median_s": statistics.median(seconds), "samples_s": seconds, "ready_line_median_s": statistics.median(ready_lines)}


def memory(root: Path, held: int, pairs: int) -> dict[str, Any]:
    """The broker's RSS idle right after start and holding `held` leases (bind none); c=1 pairs before and while it holds them."""
    broker = Broker(root / "memory").start()
    server = Server("broker", broker.endpoints, broker.child, broker)
    try:
        while not healthy(broker.endpoints.socket):
            time.sleep(0.01)
        time.sleep(1.0)  # past the first sample of the GPUs and the host
        idle = broker.child.rss()
        empty = asyncio.run(sequential(server, "unix", pairs))
        started = time.perf_counter()
        asyncio.run(hold(broker.endpoints, held))
        granting = time.perf_counter() - started
        time.sleep(0.5)
        holding = broker.child.rss()
        full = asyncio.run(sequential(server, "unix", pairs))
    finally:
        broker.child.stop()
        shutil.rmtree(broker.root, ignore_errors=True)
    return {
        "idle_bytes": idle,
        "idle_mb": idle / 1e6,
        "held_leases": held,
        "holding_bytes": holding,
        "holding_mb": holding / 1e6,
        "grants_per_s_while_filling": held / granting,
        "c1_with_no_leases": empty,
        "c1_while_holding": full,
    }


async def sequential(server: Server, transport: str, pairs: int) -> dict[str, Any]:
    """c=1 grant+release pairs on their own: latencies and the server's CPU per pair."""
    base = server.endpoints.base(transport)
    async with server.endpoints.session(transport, 1) as session:
        for _ in range(10):
            await grant_release(session, base)
        grants: list[float] = []
        cpu = server.cpu()
        for _ in range(pairs):
            grants.append((await grant_release(session, base))[0])
        return {"grant": ms(grants), "server_cpu_ms_per_pair": (server.cpu() - cpu) / pairs * 1e3}


# ----- the run ---------------------------------------------------------------------


def machine(root: Path) -> dict[str, Any]:
    """The shared figures of the machine, with its memory, LMDB's version and the disk of the state directories."""
    resolved = str(root.resolve())
    mounts = [
        p for p in psutil.disk_partitions(all=True) if resolved == p.mountpoint or resolved.startswith(p.mountpoint.rstrip("/") + "/")
    ]
    disk = max(mounts, key=lambda p: len(p.mountpoint)) if mounts else None
    return {
        **common.machine(),
        "memory_bytes": psutil.virtual_memory().total,
        "lmdb": lmdb.__version__,
        "state_disk": {"device": disk.device if disk else None, "fstype": disk.fstype if disk else None, "dir": str(root)},
    }


def run(plan: Plan, root: Path, progress: bool) -> dict[str, Any]:
    def say(message: str) -> None:
        if progress:
            print(f"  … {message}", file=sys.stderr, flush=True)

    started = time.perf_counter()
    results: dict[str, Any] = {"machine": machine(root), "plan": dataclasses.asdict(plan)}
    lmdb_runs: list[dict[str, Any]] = []
    store_runs: list[dict[str, Any]] = []
    runs: dict[str, list[dict[str, Any]]] = {t: [] for t in TRANSPORTS}
    with contextlib.ExitStack() as stack:
        trivial_child, trivial_endpoints = start_trivial(root)
        stack.callback(trivial_child.stop)
        broker = Broker(root / "broker").start()
        stack.callback(broker.child.stop)
        results["broker_rss_fresh_bytes"] = broker.child.rss()
        trivial = Server("trivial", trivial_endpoints, trivial_child)
        server = Server("broker", broker.endpoints, broker.child, broker)
        for repeat in range(plan.repeats):
            step = f"repeat {repeat + 1}/{plan.repeats}"
            say(f"{step}: bare LMDB commits back to back, the Store alone at c=64")
            lmdb_runs.append(bare_lmdb(root / f"bare-lmdb-{repeat}", plan.lmdb_commits))
            store_runs.append(store_group_commit(root / f"store-{repeat}", plan.pairs[64], 64))
            for transport in TRANSPORTS:
                say(f"{step}: trivial endpoint and broker over {transport}")
                runs[transport].append(measure(transport, trivial, server, plan, root / f"lockstep-{transport}-{repeat}"))
        results["broker_rss_after_load_bytes"] = broker.child.rss()
        results["broker_commits_total"] = broker.commits()
    say(f"start to ready, {plan.starts} fresh brokers")
    results["start"] = start_to_ready(root, plan.starts)
    say(f"memory, idle and holding {plan.held_leases} leases")
    results["memory"] = memory(root, plan.held_leases, plan.latency_pairs)
    results["baselines"] = {
        "lmdb": {**median_of(lmdb_runs), "repeats": lmdb_runs},
        "store_c64": {**median_of(store_runs), "repeats": store_runs},
    }
    results["transports"] = {t: {**median_of(r), "repeats": r} for t, r in runs.items()}
    results["ratios"] = ratios(results)
    results["group_commit"] = group_commit(results)
    results["goals"] = {name: {"op": op, "value": value} for name, (op, value) in GOALS.items()}
    results["loadavg_at_end"] = os.getloadavg()
    results["runtime_s"] = time.perf_counter() - started
    return results


def ratios(results: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for t in TRANSPORTS:
        figures = results["transports"][t]
        trivial, broker = figures["trivial"], figures["broker"]
        floor = trivial["grant"]["p50_ms"] + figures["lmdb_c1"]["p50_ms"]
        out[t] = {
            "grant_p50_ms": broker["grant"]["p50_ms"],
            "trivial_p50_ms": trivial["grant"]["p50_ms"],
            "lmdb_p50_ms": figures["lmdb_c1"]["p50_ms"],
            "store_p50_ms": figures["store_c1"]["p50_ms"],
            "floor_p50_ms": floor,
            "grant_p50_ratio": broker["grant"]["p50_ms"] / floor,
            "grant_p50_ms_by_turn": figures["grant_p50_ms_by_turn"],
            "pairs_c64_ratio": broker["pairs_per_s_by_c"]["64"] / trivial["pairs_per_s_by_c"]["64"],
            "pairs_ratio_by_c": {c: broker["pairs_per_s_by_c"][c] / trivial["pairs_per_s_by_c"][c] for c in broker["pairs_per_s_by_c"]},
            # The trivial server's CPU per pair over the broker's: what the c=64 ratio would tend to were the servers the bottleneck.
            "server_cpu_ratio_c64": trivial["server_cpu_ms_per_pair_by_c"]["64"] / broker["server_cpu_ms_per_pair_by_c"]["64"],
        }
    return out


def group_commit(results: dict[str, Any]) -> dict[str, Any]:
    """Durable writes (a grant and a release per pair) per LMDB transaction, and their rate beside bare synced commits."""
    bare = results["baselines"]["lmdb"]["commits_per_s"]
    out: dict[str, Any] = {"bare_commits_per_s": bare, "store_alone_c64": results["baselines"]["store_c64"]}
    for t in TRANSPORTS:
        broker = results["transports"][t]["broker"]
        out[t] = {
            c: {
                "durable_writes_per_transaction": 2 / per_pair if per_pair else None,
                "durable_writes_per_s": 2 * broker["pairs_per_s_by_c"][c],
                "over_bare_commits_per_s": 2 * broker["pairs_per_s_by_c"][c] / bare,
            }
            for c, per_pair in broker["commits_per_pair_by_c"].items()
        }
    return out


# ----- the table ---------------------------------------------------------------------


def _meets(name: str, value: float) -> str:
    return meets(GOALS[name], value)


def _lat(figures: dict[str, float]) -> str:
    return f"p50 {figures['p50_ms']:6.3f} ms  p99 {figures['p99_ms']:6.3f} ms"


def table(results: dict[str, Any]) -> str:
    m = results["machine"]
    lm, st64 = results["baselines"]["lmdb"], results["baselines"]["store_c64"]
    tr = results["transports"]
    cs = list(tr["unix"]["broker"]["pairs_per_s_by_c"])
    lines = [
        f"gpubroker lease benchmark, {m['date']}: {m['cpus_usable']} CPUs ({m['cpu_model']}), Python {m['python']}, aiohttp {m['aiohttp']}, "
        f"py-lmdb {m['lmdb']}; state on {m['state_disk']['device']} ({m['state_disk']['fstype']})",
        f"{results['plan']['repeats']} repeat(s), medians; {'quick' if results.get('quick') else 'full'} run",
        "",
        "Baselines (the c=1 ones taken in lock step with the HTTP pairs below)",
        f"  {'bare LMDB synced commit, back to back':<40}{_lat(lm)}   {lm['commits_per_s']:7,.0f} commits/s",
    ]
    for t in TRANSPORTS:
        lines.append(f"  {f'bare LMDB synced commit, c=1 ({t})':<40}{_lat(tr[t]['lmdb_c1'])}")
    for t in TRANSPORTS:
        lines.append(f"  {f'the broker Store, c=1 ({t})':<40}{_lat(tr[t]['store_c1'])}   (its writer thread, no HTTP; a grant's writes)")
    lines.append(
        f"  {'the broker Store, c=64':<40}{_lat(st64)}   {st64['grants_per_s']:7,.0f} grants/s, "
        f"{st64['grants_per_transaction']:.1f} per transaction"
    )
    by_c = "".join(f"{'c=' + c:>8}" for c in cs)
    lines += [
        "",
        "HTTP (grant = POST /v1/leases → 201, release = DELETE /v1/leases/{id}; latencies in ms at c=1)",
        f"  {'':<14}{'grant p50':>10}{'p99':>8}{'release p50':>13}{'p99':>8}   pairs/s{by_c}   server CPU ms/pair{by_c}",
    ]
    for t in TRANSPORTS:
        for name in ("trivial", "broker"):
            f = tr[t][name]
            pairs = "".join(f"{f['pairs_per_s_by_c'][c]:8,.0f}" for c in cs)
            cpu = "".join(f"{f['server_cpu_ms_per_pair_by_c'][c]:8.3f}" for c in cs)
            lines.append(
                f"  {f'{name} {t}':<14}{f['grant']['p50_ms']:10.3f}{f['grant']['p99_ms']:8.3f}{f['release']['p50_ms']:13.3f}"
                f"{f['release']['p99_ms']:8.3f}   {'':7}{pairs}   {'':18}{cpu}"
            )
    gc = results["group_commit"]
    lines += ["", "Group commit (a grant and a release are one durable write each; LMDB transactions read from the broker's store)"]
    for t in TRANSPORTS:
        parts = []
        for c in cs:
            g = gc[t][c]
            per = "?" if g["durable_writes_per_transaction"] is None else f"{g['durable_writes_per_transaction']:.1f}"
            parts.append(f"c={c} {per} writes/txn, {g['durable_writes_per_s']:,.0f} writes/s")
        lines.append(f"  broker {t:<4}  " + ";  ".join(parts))
    lines.append(
        f"  beside: bare LMDB {gc['bare_commits_per_s']:,.0f} synced commits/s; the Store alone at c=64 "
        f"{st64['grants_per_s']:,.0f} grants/s ({st64['grants_per_transaction']:.1f} per transaction)"
    )
    lines += ["", "Ratios"]
    for t in TRANSPORTS:
        r = results["ratios"][t]
        rest = r["grant_p50_ms"] - r["trivial_p50_ms"] - r["store_p50_ms"]
        turn = r["grant_p50_ms_by_turn"]
        lines += [
            f"  {t:<4} grant p50 / (trivial POST p50 + bare commit p50) = {r['grant_p50_ms']:.3f} / ({r['trivial_p50_ms']:.3f} + "
            f"{r['lmdb_p50_ms']:.3f}) = {r['grant_p50_ratio']:.2f}   {_meets('grant_p50_ratio', r['grant_p50_ratio'])}",
            f"         (= trivial POST {r['trivial_p50_ms']:.3f} + Store commit {r['store_p50_ms']:.3f} + the rest {rest:.3f} ms)",
            f"         (going first / second in a round: trivial {turn['trivial']['first']:.3f} / {turn['trivial']['second']:.3f}, "
            f"broker {turn['broker']['first']:.3f} / {turn['broker']['second']:.3f} ms; each goes first in half the rounds)",
            f"  {t:<4} broker / trivial pairs/s at c=64 = {r['pairs_c64_ratio']:.2f}   {_meets('pairs_c64_ratio', r['pairs_c64_ratio'])}"
            f"   (c=1 {r['pairs_ratio_by_c']['1']:.2f}, c=16 {r['pairs_ratio_by_c']['16']:.2f}; "
            f"server CPU per pair at c=64, trivial / broker: {r['server_cpu_ratio_c64']:.2f})",
        ]
    mem, start = results["memory"], results["start"]
    lines += [
        "",
        "Memory (RSS of the broker process)",
        f"  idle after start        {mem['idle_mb']:6.1f} MB   {_meets('rss_idle_mb', mem['idle_mb'])}",
        f"  holding {mem['held_leases']:,} leases    {mem['holding_mb']:6.1f} MB   {_meets('rss_1000_leases_mb', mem['holding_mb'])}"
        f"   (granted at {mem['grants_per_s_while_filling']:,.0f}/s, c=16, unix)",
        f"  c=1 grant p50 with no leases {mem['c1_with_no_leases']['grant']['p50_ms']:.3f} ms, while holding them "
        f"{mem['c1_while_holding']['grant']['p50_ms']:.3f} ms; broker CPU per pair {mem['c1_with_no_leases']['server_cpu_ms_per_pair']:.3f} → "
        f"{mem['c1_while_holding']['server_cpu_ms_per_pair']:.3f} ms (unix)",
        f"  after the load runs     {results['broker_rss_after_load_bytes'] / 1e6:6.1f} MB   (that broker fresh: {results['broker_rss_fresh_bytes'] / 1e6:.1f} MB)",
        "",
        "Start to ready (Popen of `gpubroker up` → first GET /healthz 200 on its socket)",
        f"  median of {len(start['samples_s'])}             {start['median_s']:6.3f} s    {_meets('start_to_ready_s', start['median_s'])}"
        f"   (samples {', '.join(f'{s:.3f}' for s in start['samples_s'])}; the 'ready' line at {start['ready_line_median_s']:.3f} s)",
        "",
        load_line(results),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__, "fewer pairs, one repeat, three starts (under ~40 s)", DEFAULT_OUT, ROOT)
    parser.add_argument("--serve-trivial", nargs=2, metavar=("SOCKET", "PORT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_trivial:
        serve_trivial(args.serve_trivial[0], int(args.serve_trivial[1]))
        return 0
    plan = QUICK if args.quick else FULL
    return conduct("bench_leases", args, lambda root: run(plan, root, progress=not args.quiet), table, "gpubroker-bench-")


if __name__ == "__main__":
    sys.exit(main())
