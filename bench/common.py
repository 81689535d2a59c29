"""What every benchmark in bench/ shares: percentiles, the machine it ran on, a work directory that
is always removed, and the run itself (results as JSON, the table printed, status 1 only on a fault)."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp


class BenchError(Exception):
    """The benchmark cannot go on (a process did not start, a request failed): never a slow figure."""


def percentile(samples: list[float], fraction: float) -> float:
    """Nearest-rank percentile: the smallest sample with at least `fraction` of them at or below it."""
    ordered = sorted(samples)
    return ordered[min(len(ordered), max(1, math.ceil(fraction * len(ordered)))) - 1]


def meets(goal: tuple[str, float], value: float, unit: str = "") -> str:
    """A figure beside its goal (op, value): "goal <= 1.5: met" or "...: MISSED"."""
    op, target = goal
    ok = {"<=": value <= target, ">=": value >= target, "<": value < target}[op]
    return f"goal {op} {target:g}{unit}: {'met' if ok else 'MISSED'}"


def machine() -> dict[str, Any]:
    """What the figures were measured on (each benchmark adds what matters to it)."""
    return {
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "cpu_model": _cpu_model(),
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "aiohttp": aiohttp.__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "loadavg_at_start": os.getloadavg(),
    }


def _cpu_model() -> str | None:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return None


@contextlib.contextmanager
def workdir(parent: str | None, prefix: str) -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def arguments(doc: str | None, quick_help: str, default_out: Path, root: Path) -> argparse.ArgumentParser:
    """The options every benchmark run by `conduct` takes (--quick, --out, --dir, --quiet); each adds its own."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0] if doc else None)
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--out", type=Path, default=default_out, help=f"where the JSON goes (default {default_out.relative_to(root)})")
    parser.add_argument("--dir", default=None, help="where the temporary state directories go (default: the system's temp dir)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return parser


def load_line(results: dict[str, Any]) -> str:
    """The table's last line: how busy the machine was, and how long the run took."""
    return (
        f"load average {results['machine']['loadavg_at_start'][0]:.2f} at start, {results['loadavg_at_end'][0]:.2f} at end; "
        f"runtime {results['runtime_s']:.1f} s"
    )


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def conduct(name: str, args: Any, measure: Callable[[Path], dict[str, Any]], table: Callable[[dict[str, Any]], str], prefix: str) -> int:
    """Run `measure` in a fresh work directory (gone afterwards, SIGTERM and Ctrl-C included), then write the
    results to `args.out` as JSON and print the table. The exit status: 0, 1 on a BenchError, 130 if interrupted."""
    signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM unwinds like Ctrl-C, so children and directories go too
    try:
        with workdir(args.dir, prefix) as root:
            results = measure(root)
    except BenchError as error:
        print(f"{name}: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{name}: interrupted; its processes and temporary directories are gone", file=sys.stderr)
        return 130
    results["quick"] = args.quick
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(table(results))
    print(f"results in {args.out}")
    return 0
