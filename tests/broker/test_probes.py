"""The simulated probe: GPUs from a spec or a TOML file re-read at every sample."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from gpubroker.broker.probes import SimulatedProbe

GIB = 2**30


def test_a_simulated_process_that_runs_here_is_described_as_nvml_describes_one(tmp_path: Path) -> None:
    work = subprocess.Popen(["sleep", "30"], process_group=0)
    try:
        sim = tmp_path / "gpus.toml"
        sim.write_text(
            '[[gpu]]\nmemory = "24GiB"\n'
            f'[[process]]\ngpu = 0\npid = {work.pid}\nname = "trainer"\nused = "4GiB"\n'
            '[[process]]\ngpu = 0\npid = 4000001\nname = "ollama"\nused = "6GiB"\n'
        )
        running, elsewhere = SimulatedProbe(str(sim)).sample()[0].processes or ()
        assert (running.name, running.bytes, running.pgid) == ("trainer", 4 * GIB, work.pid)
        assert os.getpid() in running.ancestors  # so a lease whose holder started it owns its memory
        assert (elsewhere.name, elsewhere.pgid, elsewhere.ancestors) == ("ollama", None, ())
    finally:
        work.kill()
        work.wait()
