"""The benchmarks stay runnable: each prints its figures and writes them as JSON (none judges a time)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from netns import needs_netns

BENCH = Path(__file__).resolve().parents[1] / "bench"


def run_quick(name: str, tmp_path: Path, timeout: float) -> tuple[str, dict[str, Any]]:
    """`bench/NAME.py --quick --quiet`: what it printed, and the JSON it wrote (it must exit 0)."""
    out = tmp_path / f"{name}.json"
    run = subprocess.run(
        [sys.executable, str(BENCH / f"{name}.py"), "--quick", "--quiet", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    return run.stdout, json.loads(out.read_text())


@pytest.mark.slow
def test_the_lease_benchmark_runs_and_writes_its_figures_as_json(tmp_path: Path) -> None:
    printed, results = run_quick("bench_leases", tmp_path, timeout=300)
    assert "Ratios" in printed
    assert results["memory"]["idle_mb"] > 0
    turns = results["ratios"]["unix"]["grant_p50_ms_by_turn"]  # each server went first in half the lock-step rounds
    assert set(turns) == {"trivial", "broker"}
    assert all(t["first"] > 0 and t["second"] > 0 for t in turns.values())


@pytest.mark.slow
def test_the_ui_benchmark_renders_a_50_node_cluster_and_writes_its_figures_as_json(tmp_path: Path) -> None:
    printed, results = run_quick("bench_ui", tmp_path, timeout=120)
    assert "Ratios" in printed
    assert results["cluster"]["nodes"] == 50
    assert results["http"]["cluster_n"]["bytes"] > results["http"]["cluster_1"]["bytes"]
    assert results["ratios"]["cluster_server_p95_ms"] > 0


@pytest.mark.slow
@needs_netns
def test_the_mesh_benchmark_forms_three_brokers_in_namespaces_and_writes_its_figures_as_json(tmp_path: Path) -> None:
    printed, results = run_quick("bench_mesh_netns", tmp_path, timeout=180)
    assert "Serf" in printed
    assert results["machine"]["cpu_count"] > 0
    [only] = results["runs"]
    assert only["n"] == 3
    assert all(only[key] > 0 for key in ("formed_s", "lease_spread_s", "detection_s", "rejoin_mdns_s", "heal_s"))
