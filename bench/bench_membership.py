"""Membership benchmark on the in-memory network (tests/gossip/fakenet.py): fake time, deterministic from a seed.

Run: `.venv/bin/python bench/bench_membership.py [--quick] [--out FILE] [--seed N]`. It prints a table and writes
every figure as JSON (default bench/results/membership.json). It never fails on a time: the goals and memberlist's
figures computed from the same configuration are printed beside what was measured.

Figures, all in fake seconds of the simulated cluster (latency 0.5–2 ms per datagram, TCP reliable):
- notice: a DocumentNotice broadcast by one node until every other node has it (p50, p99) at N = 10, 50, 200;
- detection: one node killed until every other node has declared it dead (median, max over trials) at N = 10, 50;
- false dead: "dead" declarations about running nodes per node-hour, at 10 % and 30 % loss (N = 10, one hour;
  a quarter of an hour with --quick),
  with the TCP fallback ping (the default) and without it (UDP alone), and with one node's loop stalled 2 s
  every 30 s;
- bytes: datagrams and push-pull frames sent per second per node, as `wire.encode` plus the AES-GCM seal,
  idle and under churn (a node leaving or rejoining every 5 s) at N = 50.
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "gossip"))

import common  # noqa: E402  (bench/common.py: run as a script, this folder is on the path)
from common import BenchError, arguments, conduct, load_line, percentile  # noqa: E402
from fakenet import SIZES, FakeNet  # noqa: E402

from gpubroker.gossip.membership import EventKind, Membership, MembershipConfig  # noqa: E402
from gpubroker.gossip.messages import DocumentNotice, MemberState  # noqa: E402
from gpubroker.gossip.suspicion import expected_confirmations, suspicion_timeout  # noqa: E402

DEFAULT_OUT = ROOT / "bench" / "results" / "membership.json"
GOALS = {"idle_bytes_per_s_per_node_n50": ("<", 1000.0), "false_dead_per_node_hour": ("==", 0.0)}
SERF_MEASURED = {"3": 5.8, "10": 7.0}  # issue 3: HashiCorp Serf in network namespaces, seconds to dead everywhere


def converged(net: FakeNet) -> bool:
    n = len(net.running())
    return net.all_see(MemberState.ALIVE) and all(len(node.membership.members()) >= n for node in net.running())


def started(n: int, seed: int, config: MembershipConfig | None = None) -> FakeNet:
    net = FakeNet(seed, config=config)
    net.cluster(n)
    if net.run_until_true(lambda: converged(net), timeout=120.0, step=0.1) is None:
        raise BenchError(f"{n} nodes did not converge in 120 s of fake time")
    return net


def notice_spread(n: int, notices: int, seed: int) -> dict[str, Any]:
    net = started(n, seed)
    net.run_for(5.0)
    rng = random.Random(seed)
    delays: list[float] = []
    for version in range(1, notices + 1):
        origin = f"n-{rng.randrange(n):03d}"
        notice = DocumentNotice(origin, 1, version)
        net.do(origin, partial(Membership.broadcast, notice=notice))
        sent = net.now
        have = 0

        def everyone(x: DocumentNotice = notice) -> bool:
            nonlocal have
            have = sum(1 for _, _, y in net.notices if y == x)
            return have == n - 1

        reached = net.run_until_true(everyone, timeout=30.0, step=0.002)
        if reached is None:
            raise BenchError(f"a notice reached {have} of {n - 1} nodes in 30 s")
        delays.append(reached - sent)
        net.run_for(rng.uniform(0.5, 2.0))
    return {"n": n, "notices": notices, "p50_ms": statistics.median(delays) * 1000, "p99_ms": percentile(delays, 0.99) * 1000}


def detection(n: int, trials: int, seed: int) -> dict[str, Any]:
    times: list[float] = []
    for trial in range(trials):
        net = started(n, seed + trial)
        net.run_for(random.Random(seed + trial).uniform(5.0, 15.0))
        victim = f"n-{1 + trial % (n - 1):03d}"
        net.kill(victim)
        killed = net.now
        done = net.run_until_true(partial(net.all_see, MemberState.DEAD, [victim]), timeout=300.0)
        if done is None:
            raise BenchError(f"a killed node at N={n} was not dead everywhere after 300 s")
        times.append(max(o.at for o in net.log if o.kind is EventKind.DEAD and o.node == victim) - killed)
    c = MembershipConfig()
    shortest = suspicion_timeout(c.suspicion_mult, n, c.probe_interval)
    k = expected_confirmations(c.suspicion_mult, n)
    longest = c.suspicion_max_timeout_mult * shortest if k else shortest
    return {
        "n": n,
        "trials": trials,
        "median_s": statistics.median(times),
        "max_s": max(times),
        "times_s": times,
        # memberlist's formula: a probe fails after one interval, then the suspicion runs from its minimum
        # (k confirmations arrive in time) to its maximum (none do); the first probe comes within an interval or two.
        "memberlist_suspicion_min_s": shortest,
        "memberlist_suspicion_max_s": longest,
        "memberlist_expected_s": c.probe_interval / 2 + c.probe_interval + shortest,
        "serf_measured_s": SERF_MEASURED.get(str(n)),
    }


def false_deads(n: int, loss: float, hours: float, seed: int, tcp: bool = True, stall: bool = False) -> dict[str, Any]:
    net = started(n, seed, MembershipConfig(tcp_fallback_ping=tcp))
    start = net.now
    net.loss = loss
    end = start + hours * 3600.0
    while net.now < end:
        net.run_for(min(28.0, end - net.now))
        if stall and net.now < end:
            net.pause("n-003", 2.0)
            net.run_for(min(2.0, end - net.now))
    deads = net.count(EventKind.DEAD, after=start)
    return {
        "n": n,
        "loss": loss,
        "tcp_fallback": tcp,
        "stall_2s_every_30s": stall,
        "hours": hours,
        "false_dead": deads,
        "false_dead_per_node_hour": deads / (n * hours),
        "suspicions": net.count(EventKind.SUSPECT, after=start),
    }


def traffic(n: int, seconds: float, churn: bool, seed: int) -> dict[str, Any]:
    net = started(n, seed)
    net.run_for(35.0)  # past the join's broadcasts
    before = {node.node_id: node.bytes_sent for node in net.nodes.values()}
    rng = random.Random(seed)
    start, gone = net.now, list[str]()
    while net.now < start + seconds:
        if churn:
            if gone and (len(gone) > 3 or rng.random() < 0.5):
                back = gone.pop(0)
                net.restart(back, seeds=["n-000"])
            else:
                leaver = rng.choice([x.node_id for x in net.running() if x.node_id != "n-000"])
                net.leave(leaver)
                net.run_for(1.0)
                net.kill(leaver)
                gone.append(leaver)
            net.run_for(4.0 if churn else 5.0)
        else:
            net.run_for(5.0)
    elapsed = net.now - start
    rates = [(node.bytes_sent - before.get(node.node_id, 0)) / elapsed for node in net.nodes.values()]
    return {
        "n": n,
        "seconds": elapsed,
        "churn": churn,
        "bytes_per_s_per_node_mean": statistics.mean(rates),
        "bytes_per_s_per_node_max": max(rates),
        "sizes_from": SIZES,
    }


FALSE_DEAD_CASES = [(0.10, True, False), (0.30, True, False), (0.10, False, False), (0.30, False, False), (0.0, True, True)]
HOURS = 1.0  # of simulated loss per case; a quarter of it with --quick


def run(quick: bool, seed: int, progress: bool) -> dict[str, Any]:
    def say(message: str) -> None:
        if progress:
            print(f"  … {message}", file=sys.stderr, flush=True)

    started_at = time.perf_counter()
    results: dict[str, Any] = {
        "machine": common.machine(),
        "seed": seed,
        "config": {k: getattr(MembershipConfig(), k) for k in MembershipConfig.__dataclass_fields__},
        "goals": GOALS,
    }
    say("notice to every node")
    results["notice"] = [
        notice_spread(n, count, seed) for n, count in ((10, 20 if quick else 100), (50, 10 if quick else 50), (200, 5 if quick else 20))
    ]
    say("failure detection")
    results["detection"] = [detection(n, trials, seed) for n, trials in ((10, 5 if quick else 20), (50, 3 if quick else 10))]
    say("false dead declarations")
    results["false_dead"] = [
        false_deads(10, loss, HOURS / 4 if quick else HOURS, seed, tcp=tcp, stall=stall) for loss, tcp, stall in FALSE_DEAD_CASES
    ]
    say("bytes per second")
    results["traffic"] = [traffic(50, 60.0 if quick else 300.0, churn, seed) for churn in (False, True)]
    results["loadavg_at_end"] = os.getloadavg()
    results["runtime_s"] = time.perf_counter() - started_at
    return results


def table(results: dict[str, Any]) -> str:
    lines = ["notice to every node (fake time)"]
    for r in results["notice"]:
        lines.append(f"  N={r['n']:<4} p50 {r['p50_ms']:7.0f} ms   p99 {r['p99_ms']:7.0f} ms   ({r['notices']} notices)")
    lines.append("failure detection: kill one node → dead on all others")
    for r in results["detection"]:
        serf = f", Serf measured {r['serf_measured_s']} s" if r["serf_measured_s"] else ""
        lines.append(
            f"  N={r['n']:<4} median {r['median_s']:5.2f} s   max {r['max_s']:5.2f} s   "
            f"(memberlist: suspicion {r['memberlist_suspicion_min_s']:.1f}–{r['memberlist_suspicion_max_s']:.1f} s, "
            f"expected ≈ {r['memberlist_expected_s']:.1f} s{serf})"
        )
    lines.append("false dead declarations per node-hour (goal: 0)")
    for r in results["false_dead"]:
        what = (
            "one loop stalled 2 s every 30 s"
            if r["stall_2s_every_30s"]
            else f"{r['loss']:.0%} loss, {'with' if r['tcp_fallback'] else 'without'} TCP fallback ping"
        )
        lines.append(
            f"  N={r['n']} {what:<42} {r['false_dead_per_node_hour']:6.2f}   "
            f"({r['false_dead']} dead, {r['suspicions']} suspicions in {r['hours']} h)"
        )
    lines.append("bytes per second per node, N=50 (goal idle: < 1000)")
    for r in results["traffic"]:
        lines.append(
            f"  {'churn' if r['churn'] else 'idle':<6} mean {r['bytes_per_s_per_node_mean']:7.0f}   "
            f"max {r['bytes_per_s_per_node_max']:7.0f}   (sizes: {r['sizes_from']})"
        )
    lines += ["", load_line(results)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__, "fewer notices, trials and seconds of traffic (well under a minute)", DEFAULT_OUT, ROOT)
    parser.add_argument("--seed", type=int, default=1, help="the simulated cluster's seed (default 1)")
    args = parser.parse_args(argv)
    return conduct("bench_membership", args, lambda root: run(args.quick, args.seed, not args.quiet), table, "gpubroker-bench-membership-")


if __name__ == "__main__":
    sys.exit(main())
