"""The benchmarks stay runnable: each prints its figures and writes them as JSON (none judges a time)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from netns import available

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_leases.py"
UI_BENCH = BENCH.with_name("bench_ui.py")
MESH_BENCH = BENCH.with_name("bench_mesh_netns.py")


@pytest.mark.slow
def test_the_lease_benchmark_runs_and_writes_its_figures_as_json(tmp_path: Path) -> None:
    out = tmp_path / "leases.json"
    run = subprocess.run([sys.executable, str(BENCH), "--quick", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "Ratios" in run.stdout
    results = json.loads(out.read_text())
    assert results["memory"]["idle_mb"] > 0
    turns = results["ratios"]["unix"]["grant_p50_ms_by_turn"]  # each server went first in half the lock-step rounds
    assert set(turns) == {"trivial", "broker"}
    assert all(t["first"] > 0 and t["second"] > 0 for t in turns.values())


@pytest.mark.slow
def test_the_ui_benchmark_renders_a_50_node_cluster_and_writes_its_figures_as_json(tmp_path: Path) -> None:
    out = tmp_path / "ui.json"
    run = subprocess.run(
        [sys.executable, str(UI_BENCH), "--quick", "--quiet", "--out", str(out)], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "Ratios" in run.stdout
    results = json.loads(out.read_text())
    assert results["cluster"]["nodes"] == 50
    assert results["http"]["cluster_n"]["bytes"] > results["http"]["cluster_1"]["bytes"]
    assert results["ratios"]["cluster_server_p95_ms"] > 0


@pytest.mark.slow
@pytest.mark.skipif(not available(), reason="network namespaces need root and iproute2")
def test_the_mesh_benchmark_forms_three_brokers_in_namespaces_and_writes_its_figures_as_json(tmp_path: Path) -> None:
    out = tmp_path / "mesh.json"
    run = subprocess.run(
        [sys.executable, str(MESH_BENCH), "--quick", "--quiet", "--out", str(out)], capture_output=True, text=True, timeout=180
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "Serf" in run.stdout
    results = json.loads(out.read_text())
    assert results["machine"]["cpu_count"] > 0
    [only] = results["runs"]
    assert only["n"] == 3
    assert all(only[key] > 0 for key in ("formed_s", "lease_spread_s", "detection_s", "rejoin_mdns_s", "heal_s"))
