"""The mesh for real, at small N: brokers as processes in network namespaces on one bridge.

Measures, for N brokers joined with tokens: the time until every broker sees every other alive
with its document; how long a lease granted on one takes to show in every other view; how long a
killed broker takes to be dead on all the others; and how long after a link comes back every
broker sees every other alive again. Printed beside the goals (and HashiCorp Serf's detection
times on this kind of machine, from the issue), written as JSON. Never fails on a time.

    .venv/bin/python bench/bench_mesh_netns.py [--sizes 3,5] [--out FILE]   (root: it makes namespaces)
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from netns import Lan, NsBroker, available, form, timed  # noqa: E402

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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="3,5")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "mesh_netns.json"))
    args = parser.parse_args()
    if not available():
        print("network namespaces need root and iproute2", file=sys.stderr)
        return 2
    runs: list[dict[str, Any]] = []
    for size in (int(s) for s in args.sizes.split(",")):
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory(prefix="gpubroker-mesh-") as tmp:
                runs.append(one_size(size, Path(tmp)))
    print(
        f"{'N':>3} {'formed':>8} {'lease seen':>11} {'dead after':>11} {'rejoin':>8} {'healed':>8}   goals: formed < 5 s, lease < 2 s, dead < 8 s (Serf N=3: 5.8 s), heal < 30 s"
    )
    for size in sorted({r["n"] for r in runs}):
        mine = [r for r in runs if r["n"] == size]

        def med(key: str, mine: list[dict[str, Any]] = mine) -> float:
            return statistics.median(r[key] for r in mine)

        serf = SERF_DETECTION.get(size)
        print(
            f"{size:>3} {med('formed_s'):>7.2f}s {med('lease_spread_s'):>10.2f}s {med('detection_s'):>10.2f}s "
            f"{med('rejoin_mdns_s'):>7.2f}s {med('heal_s'):>7.2f}s" + (f"   (Serf: {serf} s)" if serf else "")
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {"machine": {"python": platform.python_version(), "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, "runs": runs},
            indent=2,
        )
    )
    print(f"results in {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
