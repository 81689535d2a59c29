"""Web UI benchmark: the Cluster and Leases pages of a 50-node simulated cluster, beside a cluster of one and GET /healthz.

Run: `.venv/bin/python bench/bench_ui.py [--quick] [--nodes N] [--out FILE] [--profile]`. It prints a table and writes
every figure as JSON (default bench/results/ui.json). It never fails on a time: the goal (the Cluster page of 50 nodes
in under 300 ms server-side) is printed beside the figures; only a cluster that cannot be built or a page answered
with an error ends it with status 1.

The cluster is made of the real objects; nothing stands in for the mesh's view:
- this node is a real `Broker` (its LMDB `Store` on a temporary directory) on simulated GPUs, holding a few leases;
- each of the 49 others is a real `Broker` too, on its own simulated GPUs (1–8 of one model, 0–3 processes outside
  any lease on each, 2–6 leases granted through `Broker.request`), whose body is `summarize(node_json, leases)` as
  `Mesh.publish` makes it, signed with the node's own identity and taken in through `Mesh._take_document` (signature,
  key and membership checked, as when it is fetched from the node); the broker is closed once its document is made;
- the `ClusterState` admits the 49 by `merge`, as replication does, and a real `Membership` learns them by a
  push-pull (`push_pull_received`), each with the meta `Mesh` encodes (name, API address, priority);
- `Mesh.run` is never called: no socket, no task, no timer. `cluster_json()` reads the same objects it reads at run
  time, so the page's path is the real one from the view to the HTML; only documents stay as first received.

Figures, all in one process and one event loop (the server on a Unix socket, as the broker serves it, and one
aiohttp client with one kept-alive connection per app):
- GET over HTTP: from sending the request to having read the whole body, for `/` and `/leases` on the 50-node app and
  on a 1-node app (the same broker with no mesh: the page of a cluster of one), and `GET /healthz`;
- server: the time inside the app (routing, the Host check, the page handler, the Response) for the same requests,
  from a middleware the benchmark puts first, as wall time and as the thread's CPU time (a page renders without
  awaiting, so its CPU time is its own: it leaves out waits for the core, not a core slowed by a busy sibling);
- render: the page functions alone, `shell(request, page, region(request))`, on a mocked request of each app, and
  `cluster_view` (the mesh's `cluster_json`) alone, to split the data from the HTML (wall and CPU time);
- with `--profile`, a cProfile of the 50-node Cluster page's render.

Everything is taken in lock step: each round calls each page function once, then makes one request of each kind, so
a busy neighbour weighs on every figure of a round alike and the ratios hold when the absolute figures move. The goal
is judged on the wall-clock p95 inside the app; on a shared machine the p50s hold and the tails move with the load
average (printed at start and end).
"""

from __future__ import annotations

import asyncio
import contextlib
import cProfile
import io
import json
import os
import pstats
import random
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import common  # bench/common.py: run as a script, this folder is on the path
from aiohttp import web
from aiohttp.test_utils import make_mocked_request
from common import BenchError, arguments, conduct, load_line, meets, percentile

from gpubroker.broker.probes import GpuProcess, GpuReading
from gpubroker.broker.request import parse_request
from gpubroker.broker.service import Broker, Caller
from gpubroker.broker.store import Store
from gpubroker.config import CLASSES, Config
from gpubroker.errors import BrokerError
from gpubroker.gossip.cluster import ClusterState
from gpubroker.gossip.documents import NodeDocument, sign_document, summarize
from gpubroker.gossip.identity import Identity
from gpubroker.gossip.membership import Membership, MembershipConfig
from gpubroker.gossip.mesh import Mesh, MeshSettings, _Meta
from gpubroker.gossip.messages import Member, MemberState, PushPull
from gpubroker.ui import pages
from gpubroker.ui.api import cluster_view, make_app

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "bench" / "results" / "ui.json"
GIB = 2**30
MIB = 2**20
MODELS = (  # (name, memory): one model per node, as machines are bought
    ("NVIDIA GeForce RTX 4090", 24 * GIB),
    ("NVIDIA RTX 6000 Ada Generation", 48 * GIB),
    ("NVIDIA A100-SXM4-80GB", 80 * GIB),
    ("NVIDIA H100 80GB HBM3", 80 * GIB),
    ("NVIDIA H200", 141 * GIB),
)
PROCESS_NAMES = ("ollama", "python3", "Xorg", "comfyui", "jupyter-lab", "tritonserver", "blender")
HOLDERS = ("train-llama", "vllm-serve", "jupyter:alice", "ci-bench", "sd-webui", "eval-harness", "whisper", "embedder")
GOALS = {"cluster_server_p95_ms": ("<", 300.0)}  # the Cluster page of a 50-node cluster, server-side


@dataclass(frozen=True, slots=True)
class Plan:
    """How much work each measurement does: fixed counts, so runs compare."""

    nodes: int  # in the cluster, this one included
    warmup: int  # rounds before anything is kept
    rounds: int  # lock-step rounds: one request of each kind and one call of each page function per round


FULL = Plan(nodes=50, warmup=50, rounds=1000)
QUICK = Plan(nodes=50, warmup=5, rounds=50)


# ----- figures ---------------------------------------------------------------


def ms(seconds: list[float]) -> dict[str, float]:
    return {
        "p50_ms": percentile(seconds, 0.50) * 1e3,
        "p95_ms": percentile(seconds, 0.95) * 1e3,
        "p99_ms": percentile(seconds, 0.99) * 1e3,
        "mean_ms": statistics.fmean(seconds) * 1e3,
        "n": len(seconds),
    }


# ----- the simulated cluster ---------------------------------------------------------


@dataclass(slots=True)
class SimulatedGpus:
    """A GpuProbe: one node's GPUs and the processes on them outside any lease, read now (the pages age on the wall clock)."""

    model: str
    total: int
    uuids: list[str]
    processes: dict[int, tuple[GpuProcess, ...]]

    def sample(self) -> list[GpuReading]:
        now = time.time()
        readings = []
        for index, gpu_uuid in enumerate(self.uuids):
            listed = self.processes.get(index, ())
            used = min(self.total, sum(p.bytes or 0 for p in listed))
            readings.append(GpuReading(index, gpu_uuid, self.model, self.total, used, now, listed))
        return readings

    def close(self) -> None:
        """Nothing to let go."""


@dataclass(slots=True)
class NodeMade:
    """Another simulated node: its identity, name and gossip address, its counts, and the document body it published."""

    identity: Identity
    name: str
    addr: tuple[str, int]
    gpus: int
    leases: int
    body: dict[str, Any] = field(default_factory=dict)


def simulated_gpus(rng: random.Random) -> SimulatedGpus:
    model, total = rng.choice(MODELS)
    count = rng.randint(1, 8)
    processes: dict[int, tuple[GpuProcess, ...]] = {}
    pid = rng.randint(10_000, 90_000)
    for index in range(count):
        listed = []
        for _ in range(rng.randint(0, 3)):
            pid += rng.randint(1, 500)
            listed.append(GpuProcess(pid, rng.choice(PROCESS_NAMES), rng.randint(1, 24) * 256 * MIB))
        processes[index] = tuple(listed)
    return SimulatedGpus(model, total, [f"GPU-{uuid.UUID(int=rng.getrandbits(128))}" for _ in range(count)], processes)


async def simulated_broker(root: Path, name: str, node_id: str, rng: random.Random) -> tuple[Broker, int]:
    """A started broker on simulated GPUs with 2–6 leases granted through its own request path; the leases granted."""
    probe = simulated_gpus(rng)
    config = Config(state_dir=root / name, name=name, store_size=64 * MIB, mdns=False)
    broker = Broker(config, Store(config.state_dir, config.store_size, config.events_kept), probe, node_id=node_id)
    await broker.start()
    granted = 0
    for _ in range(rng.randint(2, 6)):
        body: dict[str, Any] = {
            "gpu_memory": f"{rng.randint(1, 16)}GiB",
            "bind": "none",
            "ttl": f"{rng.randint(5, 240)}m",
            "priority": rng.choice(CLASSES),
            "holder": {"name": f"{rng.choice(HOLDERS)}-{rng.randint(1, 99)}"},
        }
        if len(probe.uuids) > 1 and rng.random() < 0.25:
            body["gpus"] = 2
        with contextlib.suppress(BrokerError):  # a node too full for this one: a refusal is a fact of life, not a failure
            await broker.request(parse_request(body), Caller("tcp"))
            granted += 1
    return broker, granted


def address(i: int) -> tuple[str, int]:
    return f"10.0.{i // 250}.{i % 250 + 1}", 7946


async def other_node(root: Path, i: int, rng: random.Random) -> NodeMade:
    """A node elsewhere in the cluster: made for real, then only its signed document is kept."""
    identity = Identity.generate()
    name = f"gpu-node-{i:02d}"
    broker, granted = await simulated_broker(root / "others", name, identity.node_id, rng)
    try:
        body = summarize(broker.node_json(), broker.list_leases("granted", 100_000))  # what Mesh.publish sends
    finally:
        await broker.close()
    return NodeMade(identity, name, address(i), len(body["gpus"]), granted, body)


def assemble_mesh(root: Path, broker: Broker, identity: Identity, others: list[NodeMade], seed: int) -> Mesh:
    """This node's Mesh, never run: its ClusterState admits the others, its Membership knows them, its view holds their documents."""
    now = time.time()
    cluster = ClusterState.init(root / "mesh", identity, broker.config.name, now)
    members = {
        o.identity.node_id: {
            "cert": o.identity.certificate_pem().decode(),
            "name": o.name,
            "admitted_by": identity.node_id,
            "admitted_at": now,
        }
        for o in others
    }
    cluster.merge({"members": members, "removed": {}}, now)
    mesh = Mesh(MeshSettings(gossip=("127.0.0.1", 0), advertise="127.0.0.1", mdns=False), broker, identity, cluster)
    membership = Membership(
        identity.node_id,
        ("127.0.0.1", 7946),
        MembershipConfig(),
        random.Random(seed),
        incarnation=cluster.incarnation,
        meta=_Meta(broker.config.name, broker.config.listen, 0).encode(),
    )
    remote = tuple(Member(o.identity.node_id, o.addr, 1, MemberState.ALIVE, _Meta(o.name, f"{o.addr[0]}:9740", 0).encode()) for o in others)
    membership.push_pull_received(now, PushPull(remote))
    # What the membership asks of the runtime is dropped: nothing here sends, and the view is what is measured.
    membership.outbox.clear()
    membership.push_pull_requests.clear()
    membership.tcp_ping_requests.clear()
    membership.events.clear()
    membership.notices.clear()
    mesh._membership = membership
    for o in others:
        document = NodeDocument(o.identity.node_id, 1, 1, time.time(), o.body, o.identity.public_key_bytes)
        mesh._take_document(sign_document(document, o.identity.sign))
    mesh._elect()
    if mesh.dropped_documents or len(mesh.view.held) != len(others):
        raise BenchError(f"the mesh took {len(mesh.view.held)} of {len(others)} documents ({mesh.dropped_documents} dropped)")
    known = len([m for m in membership.members() if m.state is MemberState.ALIVE])
    if known != len(others) + 1:
        raise BenchError(f"the membership knows {known} live members, not {len(others) + 1}")
    return mesh


@dataclass(slots=True)
class Cluster:
    """This node's broker and mesh, and the two apps measured: the 50-node one and the cluster of one (the same broker)."""

    broker: Broker
    mesh: Mesh
    others: list[NodeMade]
    this_gpus: int
    this_leases: int
    apps: dict[str, web.Application] = field(default_factory=dict)
    build_s: float = 0.0


async def build_cluster(root: Path, plan: Plan, seed: int) -> Cluster:
    started = time.perf_counter()
    rng = random.Random(seed)
    identity = Identity.generate()
    broker, granted = await simulated_broker(root, "bench-node-00", identity.node_id, rng)
    try:
        others = [await other_node(root, i, rng) for i in range(1, plan.nodes)]
        mesh = assemble_mesh(root, broker, identity, others, seed)
    except BaseException:
        await broker.close()
        raise
    cluster = Cluster(broker, mesh, others, len(broker.readings), granted)
    cluster.apps = {"cluster": make_app(broker, mesh), "alone": make_app(broker)}
    cluster.build_s = time.perf_counter() - started
    return cluster


# ----- measuring -------------------------------------------------------------------


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def timed(app: web.Application, into: dict[str, list[tuple[float, float]]]) -> None:
    """Put first a middleware that records, by path, the (wall, CPU) seconds each request spends inside the app.

    The pages render without awaiting, so nothing else runs on the loop meanwhile: the thread's CPU time is the
    request's own, and it does not grow when a neighbour takes the core, as the wall clock does.
    """

    @web.middleware
    async def clock(request: web.Request, handler: Handler) -> web.StreamResponse:
        started, cpu = time.perf_counter(), time.thread_time()
        try:
            return await handler(request)
        finally:
            into.setdefault(request.path, []).append((time.perf_counter() - started, time.thread_time() - cpu))

    app.middlewares.insert(0, clock)


async def get(session: aiohttp.ClientSession, path: str) -> tuple[float, int]:
    """GET over the socket: the seconds until the whole body is read, and its size; an error status ends the benchmark."""
    started = time.perf_counter()
    async with session.get(f"http://localhost{path}") as answer:
        body = await answer.read()
        if answer.status != 200:
            raise BenchError(f"GET {path} answered {answer.status}: {body[:400]!r}")
    return time.perf_counter() - started, len(body)


# (name, app, path): the requests of one lock-step round
REQUESTS = (
    ("healthz", "cluster", "/healthz"),
    ("cluster_1", "alone", "/"),
    ("cluster_n", "cluster", "/"),
    ("leases_1", "alone", "/leases"),
    ("leases_n", "cluster", "/leases"),
)


def renderers(cluster: Cluster) -> dict[str, Callable[[], object]]:
    """The page functions on a mocked request of each app, as the handlers call them; and the view alone."""
    out: dict[str, Callable[[], object]] = {}
    for size, app in (("1", cluster.apps["alone"]), ("n", cluster.apps["cluster"])):
        home = make_mocked_request("GET", "/", app=app)
        leases = make_mocked_request("GET", "/leases", app=app)
        out[f"view_{size}"] = lambda app=app: cluster_view(app)
        out[f"cluster_region_{size}"] = lambda home=home: pages.cluster_region(home)
        out[f"cluster_{size}"] = lambda home=home: pages.shell(home, "cluster", pages.cluster_region(home))
        out[f"leases_{size}"] = lambda leases=leases: pages.shell(leases, "leases", pages.leases_region(leases))
    return out


async def measure(cluster: Cluster, plan: Plan, root: Path) -> dict[str, Any]:
    """`plan.rounds` lock-step rounds after the warm-up, each one call of each page function and one request of REQUESTS."""
    inside: dict[str, dict[str, list[tuple[float, float]]]] = {name: {} for name in cluster.apps}
    runners: list[web.AppRunner] = []
    sessions: dict[str, aiohttp.ClientSession] = {}
    try:
        for name, app in cluster.apps.items():
            timed(app, inside[name])
            runner = web.AppRunner(app, handler_cancellation=True, access_log=None)  # as the daemon runs it
            await runner.setup()
            runners.append(runner)
            sock = root / f"{name}.sock"
            await web.UnixSite(runner, str(sock)).start()
            sessions[name] = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(sock), limit=1))
        functions = renderers(cluster)
        client: dict[str, list[float]] = {name: [] for name, _, _ in REQUESTS}
        server: dict[str, list[float]] = {name: [] for name, _, _ in REQUESTS}
        server_cpu: dict[str, list[float]] = {name: [] for name, _, _ in REQUESTS}
        sizes: dict[str, int] = {}
        wall: dict[str, list[float]] = {name: [] for name in functions}
        cpu: dict[str, list[float]] = {name: [] for name in functions}
        for round_ in range(plan.warmup + plan.rounds):
            kept = round_ >= plan.warmup
            for name, function in functions.items():  # synchronous: nothing else runs on the loop meanwhile
                started, thread = time.perf_counter(), time.thread_time()
                function()
                seconds, cpu_seconds = time.perf_counter() - started, time.thread_time() - thread
                if kept:
                    wall[name].append(seconds)
                    cpu[name].append(cpu_seconds)
            for app in sessions:  # untimed: a connection idle while the pages rendered answers its next request slower
                await get(sessions[app], "/healthz")
                inside[app]["/healthz"].pop()
            for name, app, path in REQUESTS:
                seconds, size = await get(sessions[app], path)
                spent, spent_cpu = inside[app][path].pop()
                if kept:
                    client[name].append(seconds)
                    server[name].append(spent)
                    server_cpu[name].append(spent_cpu)
                    sizes[name] = size
        http = {
            name: {"client": ms(client[name]), "server": ms(server[name]), "server_cpu": ms(server_cpu[name]), "bytes": sizes[name]}
            for name, _, _ in REQUESTS
        }
        return {"http": http, "render": {name: {**ms(wall[name]), "cpu": ms(cpu[name])} for name in functions}}
    finally:
        for session in sessions.values():
            await session.close()
        for runner in runners:
            await runner.cleanup()


def profile(cluster: Cluster, repeats: int, top: int) -> str:
    """cProfile of the 50-node Cluster page's render, the functions sorted by their own time, then by cumulative time."""
    render = renderers(cluster)["cluster_n"]
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(repeats):
        render()
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return out.getvalue()


# ----- the run ---------------------------------------------------------------------


async def run(plan: Plan, root: Path, seed: int, progress: bool, profile_top: int) -> dict[str, Any]:
    def say(message: str) -> None:
        if progress:
            print(f"  … {message}", file=sys.stderr, flush=True)

    started = time.perf_counter()
    results: dict[str, Any] = {"machine": common.machine(), "plan": asdict(plan), "seed": seed}
    say(f"building a {plan.nodes}-node cluster: {plan.nodes} real brokers on simulated GPUs, {plan.nodes - 1} signed documents")
    cluster = await build_cluster(root, plan, seed)
    try:
        view = cluster_view(cluster.apps["cluster"])
        results["cluster"] = {
            "nodes": len(view["nodes"]),
            "gpus": cluster.this_gpus + sum(o.gpus for o in cluster.others),
            "leases": cluster.this_leases + sum(o.leases for o in cluster.others),
            "external_processes": sum(len(g.get("external") or {}) for o in cluster.others for g in o.body["gpus"]),
            "this_node": {"gpus": cluster.this_gpus, "leases": cluster.this_leases},
            "view_json_bytes": len(json.dumps(view)),
            "build_s": cluster.build_s,
        }
        say(f"{plan.rounds} rounds of {len(REQUESTS)} requests over a Unix socket and {len(renderers(cluster))} page functions")
        results.update(await measure(cluster, plan, root))
        if profile_top:
            say(f"profiling the {plan.nodes}-node Cluster page's render")
            results["profile"] = profile(cluster, max(10, plan.rounds // 10), profile_top)
    finally:
        await cluster.broker.close()
    results["ratios"] = ratios(results)
    results["goals"] = {name: {"op": op, "value": value} for name, (op, value) in GOALS.items()}
    results["loadavg_at_end"] = os.getloadavg()
    results["runtime_s"] = time.perf_counter() - started
    return results


def ratios(results: dict[str, Any]) -> dict[str, Any]:
    http, render = results["http"], results["render"]
    return {
        "cluster_server_p95_ms": http["cluster_n"]["server"]["p95_ms"],
        "cluster_server_cpu_p95_ms": http["cluster_n"]["server_cpu"]["p95_ms"],
        "cluster_n_over_1_client_p50": http["cluster_n"]["client"]["p50_ms"] / http["cluster_1"]["client"]["p50_ms"],
        "cluster_n_over_healthz_client_p50": http["cluster_n"]["client"]["p50_ms"] / http["healthz"]["client"]["p50_ms"],
        "leases_n_over_1_client_p50": http["leases_n"]["client"]["p50_ms"] / http["leases_1"]["client"]["p50_ms"],
        "leases_n_over_healthz_client_p50": http["leases_n"]["client"]["p50_ms"] / http["healthz"]["client"]["p50_ms"],
        "cluster_render_n_over_1_p50": render["cluster_n"]["p50_ms"] / render["cluster_1"]["p50_ms"],
        "leases_render_n_over_1_p50": render["leases_n"]["p50_ms"] / render["leases_1"]["p50_ms"],
        # Of the 50-node page's time in the app, how much is the render itself, and how much of that is the view.
        "cluster_render_share_of_server_p50": render["cluster_n"]["p50_ms"] / http["cluster_n"]["server"]["p50_ms"],
        "cluster_view_share_of_render_p50": render["view_n"]["p50_ms"] / render["cluster_n"]["p50_ms"],
    }


# ----- the table ---------------------------------------------------------------------


def _meets(name: str, value: float) -> str:
    return meets(GOALS[name], value, " ms")


def _lat(figures: dict[str, float]) -> str:
    return f"p50 {figures['p50_ms']:8.3f}  p95 {figures['p95_ms']:8.3f}  p99 {figures['p99_ms']:8.3f}"


def table(results: dict[str, Any]) -> str:
    m, c, plan = results["machine"], results["cluster"], results["plan"]
    http, render, r = results["http"], results["render"], results["ratios"]
    n = c["nodes"]
    lines = [
        f"gpubroker web UI benchmark, {m['date']}: {m['cpus_usable']} CPUs ({m['cpu_model']}), Python {m['python']}, aiohttp {m['aiohttp']}",
        f"{'quick' if results.get('quick') else 'full'} run: {plan['rounds']} lock-step rounds (after {plan['warmup']} of warm-up), "
        f"seed {results['seed']}",
        f"cluster: {n} nodes, {c['gpus']} GPUs, {c['leases']} leases, {c['external_processes']} external process names "
        f"(this node: {c['this_node']['gpus']} GPUs, {c['this_node']['leases']} leases); GET /v1/cluster {c['view_json_bytes'] / 1e3:,.0f} kB; "
        f"built in {c['build_s']:.1f} s",
        "",
        "Over HTTP (Unix socket, one kept-alive connection; ms; client = request sent → body read, server = inside the app)",
        f"  {'':<27}{'client':<46}{'server':<46}{'server CPU p50, p95':<20}{'body':>9}",
    ]

    def nodes(size: str) -> str:
        count = 1 if size == "1" else n
        return f"{count:>4} node{'' if count == 1 else 's'}"

    labels = {"healthz": f"{'GET /healthz':<12}"}
    for page, path in (("cluster", "/"), ("leases", "/leases")):
        for size in ("1", "n"):
            labels[f"{page}_{size}"] = f"GET {path:<8}{nodes(size)}"
    for name, label in labels.items():
        f = http[name]
        cpu = f["server_cpu"]
        lines.append(
            f"  {label:<27}{_lat(f['client'])}   {_lat(f['server'])}   {cpu['p50_ms']:8.3f} {cpu['p95_ms']:8.3f}   {f['bytes'] / 1e3:9,.1f} kB"
        )
    lines += ["", "Render alone (the page functions on a mocked request; ms)"]
    functions = (
        ("view", "cluster_view   "),
        ("cluster_region", "cluster_region "),
        ("cluster", "shell + cluster"),
        ("leases", "shell + leases "),
    )
    for key, words in functions:
        for size in ("1", "n"):
            f = render[f"{key}_{size}"]
            lines.append(f"  {words + nodes(size):<27}{_lat(f)}   CPU p50 {f['cpu']['p50_ms']:8.3f}  p95 {f['cpu']['p95_ms']:8.3f}")
    lines += [
        "",
        "Ratios (p50s)",
        f"  Cluster page, {n} nodes / 1 node:   HTTP {r['cluster_n_over_1_client_p50']:6.2f}   render {r['cluster_render_n_over_1_p50']:6.2f}"
        f"   / GET /healthz: {r['cluster_n_over_healthz_client_p50']:6.1f}",
        f"  Leases page,  {n} nodes / 1 node:   HTTP {r['leases_n_over_1_client_p50']:6.2f}   render {r['leases_render_n_over_1_p50']:6.2f}"
        f"   / GET /healthz: {r['leases_n_over_healthz_client_p50']:6.1f}",
        f"  {n}-node Cluster page: the render is {r['cluster_render_share_of_server_p50']:.0%} of the time in the app, "
        f"the view (cluster_json) {r['cluster_view_share_of_render_p50']:.0%} of the render",
        "",
        f"Goal: the Cluster page of {n} nodes, server-side p95 {r['cluster_server_p95_ms']:.1f} ms   "
        f"{_meets('cluster_server_p95_ms', r['cluster_server_p95_ms'])}   (its CPU time p95 {r['cluster_server_cpu_p95_ms']:.1f} ms)",
    ]
    if "profile" in results:
        lines += ["", f"Profile of the {n}-node Cluster page's render", results["profile"].rstrip()]
    lines += [
        "",
        load_line(results),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__, "50 rounds instead of 1,000 (a few seconds)", DEFAULT_OUT, ROOT)
    parser.add_argument("--nodes", type=int, default=None, help="nodes in the cluster, this one included (default 50)")
    parser.add_argument("--seed", type=int, default=1, help="the simulated cluster's seed (GPUs, processes, leases)")
    parser.add_argument(
        "--profile", type=int, nargs="?", const=25, default=0, metavar="TOP", help="print a cProfile of the render (top 25)"
    )
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    if args.nodes is not None:
        if args.nodes < 2:
            parser.error("--nodes is at least 2: this node and one other")
        plan = Plan(args.nodes, plan.warmup, plan.rounds)
    return conduct(
        "bench_ui", args, lambda root: asyncio.run(run(plan, root, args.seed, not args.quiet, args.profile)), table, "gpubroker-bench-ui-"
    )


if __name__ == "__main__":
    sys.exit(main())
