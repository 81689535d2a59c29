"""The mesh for real, at small N: brokers as processes in network namespaces on one bridge.

Measures, for N brokers joined with tokens: the time until every broker sees every other alive
with its document; how long a lease granted on one takes to show in every other view; how long a
killed broker takes to be dead on all the others; and how long after a link comes back every
broker sees every other alive again. Printed beside the goals (and HashiCorp Serf's detection
times on this kind of machine, from the issue), written as JSON. Never fails on a time.

    .venv/bin/python bench/bench_mesh_netns.py [--quick] [--sizes 3,5] [--repeats N] [--out FILE]
    (as root: it makes namespaces; --quick is N = 3 once)
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import common  # noqa: E402  (bench/common.py: run as a script, this folder is on the path)
from common import arguments, conduct, load_line  # noqa: E402
from netns import Lan, NsBroker, available, form, timed  # noqa: E402

DEFAULT_OUT = ROOT / "bench" / "results" / "mesh_netns.json"

GIB = 2**30
SERF_DETECTION = {3: 5.8, 10: 7.0}  # seconds, measured the same way in namespaces (issue 3)


def one_size(size: int, root: Path) -> dict[str, Any]:
    with Lan(size) as lan:
        brokers = [NsBroker(lan, i, root, "1x24GiB") for i in range(size)]
        try:
            formed = form(brokers)
            first, others = brokers[0], brokers[1:]
            first.client.call("POST", "/v1/leases", {"gpu_memory": "8GiB", "bind": "none"})

            def everywhere() -> bool:
                return all((b.document_of("node0") or {}).get("gpus", [{}])[0].get("figures", {}).get("leased") == 8 * GIB for b in others)

            spread = timed(everywhere, 20)
            victim = brokers[-1]
            victim.kill()
            survivors = brokers[:-1]
            detected = timed(lambda: all(b.sees()[f"node{size - 1}"] == "dead" for b in survivors), 60)
            victim.start()  # no seed, no token: found again by mDNS
            rejoined = timed(lambda: all(set(b.sees().values()) == {"alive"} for b in brokers), 60)
            lan.cut(size - 1)
            timed(lambda: all(b.sees()[f"node{size - 1}"] in ("suspect", "dead") for b in survivors), 60)
            lan.mend(size - 1)
            healed = timed(lambda: all(set(b.sees().values()) == {"alive"} for b in brokers), 60)
        finally:
            for broker in brokers:
                broker.stop()
    return {"n": size, "formed_s": formed, "lease_spread_s": spread, "detection_s": detected, "rejoin_mdns_s": rejoined, "heal_s": healed}


def run(sizes: list[int], repeats: int, root: Path, progress: bool) -> dict[str, Any]:
    started = time.perf_counter()
    results: dict[str, Any] = {"machine": common.machine(), "sizes": sizes, "repeats": repeats, "runs": []}
    for size in sizes:
        for repeat in range(repeats):
            if progress:
                print(f"  … N = {size}, run {repeat + 1}/{repeats}", file=sys.stderr, flush=True)
            where = root / f"n{size}-{repeat}"
            where.mkdir()
            results["runs"].append(one_size(size, where))
    results["loadavg_at_end"] = os.getloadavg()
    results["runtime_s"] = time.perf_counter() - started
    return results


def table(results: dict[str, Any]) -> str:
    lines = [
        f"{'N':>3} {'formed':>8} {'lease seen':>11} {'dead after':>11} {'rejoin':>8} {'healed':>8}   "
        "goals: formed < 5 s, lease < 2 s, dead < 8 s (Serf N=3: 5.8 s), heal < 30 s"
    ]
    for size in results["sizes"]:
        mine = [r for r in results["runs"] if r["n"] == size]

        def med(key: str, mine: list[dict[str, Any]] = mine) -> float:
            return statistics.median(r[key] for r in mine)

        serf = SERF_DETECTION.get(size)
        lines.append(
            f"{size:>3} {med('formed_s'):>7.2f}s {med('lease_spread_s'):>10.2f}s {med('detection_s'):>10.2f}s "
            f"{med('rejoin_mdns_s'):>7.2f}s {med('heal_s'):>7.2f}s" + (f"   (Serf: {serf} s)" if serf else "")
        )
    lines += ["", load_line(results)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__, "N = 3 only, once (about half a minute)", DEFAULT_OUT, ROOT)
    parser.add_argument("--sizes", default="3,5", help="the cluster sizes, comma-separated (default 3,5)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each size (default 1)")
    args = parser.parse_args(argv)
    if not available():
        print("bench_mesh_netns: network namespaces need root and iproute2", file=sys.stderr)
        return 2
    try:
        sizes = [3] if args.quick else sorted({int(s) for s in args.sizes.split(",")})
    except ValueError:
        parser.error(f"--sizes is a comma-separated list of cluster sizes, not {args.sizes!r}")
    if sizes[0] < 2 or args.repeats < 1:
        parser.error("a cluster has at least 2 brokers, and each size runs at least once")
    repeats = 1 if args.quick else args.repeats
    return conduct("bench_mesh_netns", args, lambda root: run(sizes, repeats, root, not args.quiet), table, "gpubroker-mesh-")


if __name__ == "__main__":
    sys.exit(main())
