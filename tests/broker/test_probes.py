"""The simulated probe: GPUs from a spec or a TOML file re-read at every sample."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import psutil
import pytest

from gpubroker.broker import holders
from gpubroker.broker.probes import GpuProcess, GpusUnreadable, ProbeError, SimulatedProbe, UnreadableGpu, describe_process

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
        # with when it and each ancestor started, so a process that reuses the holder's pid is not taken for it
        assert running.started[0] == psutil.Process(work.pid).create_time()
        assert running.started[1 + running.ancestors.index(os.getpid())] == psutil.Process().create_time()
        assert (elsewhere.name, elsewhere.pgid, elsewhere.ancestors, elsewhere.started) == ("ollama", None, (), ())
    finally:
        work.kill()
        work.wait()


@pytest.mark.parametrize(
    ("gpus", "says"),
    [
        ('[[gpu]]\nmemory = "0"\n', "GPU 0 has memory 0: a GPU has more than 0 bytes"),
        (
            '[[gpu]]\nmemory = "24GiB"\nuuid = "GPU-x"\n[[gpu]]\nmemory = "24GiB"\nuuid = "GPU-x"\n',
            "GPU 1 has the UUID 'GPU-x' of an earlier GPU",
        ),
        ('[[gpu]]\nmemory = "24GiB"\n[[gpu]]\nmemory = "24GiB"\nuuid = "GPU-sim-0"\n', "GPU 1 has the UUID 'GPU-sim-0'"),
        ('[[gpu]]\nmemory = "24GiB"\n[[process]]\ngpu = 1\npid = 9\nused = "1GiB"\n', "is on GPU 1, which is not defined"),
    ],
    ids=["no-memory", "same-uuid", "same-as-a-default-uuid", "process-on-no-gpu"],
)
def test_a_simulation_file_that_describes_no_real_machine_is_a_probe_error_that_says_why(tmp_path: Path, gpus: str, says: str) -> None:
    """As --simulate-gpus refuses 0 bytes; and leases are on a card by UUID, so two cards may not share one."""
    sim = tmp_path / "gpus.toml"
    sim.write_text(gpus)
    with pytest.raises(ProbeError, match=says):
        SimulatedProbe(str(sim)).sample()


@pytest.mark.parametrize(
    ("gpus", "says"),
    [
        ('[[gpus]]\nmemory = "24GiB"\n', "gpus.toml: unknown key 'gpus'; a simulation file holds [[gpu]] and [[process]] tables"),
        ('[[gpu]]\nmemroy = "24GiB"\nmemory = "24GiB"\n', "gpus.toml: GPU 0: unknown key 'memroy'; a [[gpu]] table takes name, memory"),
        ('[[gpu]]\nname = "RTX"\n', "gpus.toml: GPU 0: no memory given; a [[gpu]] table needs memory"),
        ('[[gpu]]\nmemory = "-5GiB"\n', "gpus.toml: GPU 0: memory: size '-5GiB' is not bytes or a number with a unit"),
        ('[[gpu]]\nmemory = "24GiB"\nuuid = ""\n', "gpus.toml: GPU 0: uuid '' is not a UUID"),
        ('[[gpu]]\nmemory = "24GiB"\nuuid = 7\n', "gpus.toml: GPU 0: uuid 7 is not a string (quote it)"),
        ('[[gpu]]\nmemory = "24GiB"\nuuid = "GPU-\\u001b[31m"\n', "gpus.toml: GPU 0: uuid 'GPU-\\x1b[31m' is not a UUID"),
        ('[[gpu]]\nmemory = "24GiB"\n[[process]]\ngpu = 0\npid = -1\nused = "1GiB"\n', "[[process]] table 1: pid -1 is not a process id"),
        ('[[gpu]]\nmemory = "24GiB"\n[[process]]\ngpu = "0"\npid = 9\nused = "1GiB"\n', "is on GPU '0', which is not defined (GPU 0)"),
        ('[[gpu]]\nmemory = "24GiB"\n[[process]]\ngpu = 0\npid = 9\nused = "1e30GiB"\n', "[[process]] table 1: used: size '1e30GiB'"),
        (
            '[[gpu]]\nmemory = "24GiB"\n[[process]]\ngpu = 0\npid = 9\nused = "50GiB"\n',
            "the processes on GPU 0 use 53687091200 bytes (50.0 GiB), more than its memory, 25769803776 bytes (24.0 GiB)",
        ),
        ("gpu = 5\n", "gpus.toml: gpu must be [[gpu]] tables, not 5"),
        ('[[process]]\ngpu = 0\npid = 9\nused = "1GiB"\n', "is on GPU 0, which is not defined (no [[gpu]] table)"),
    ],
    ids=[
        "misspelt-table",
        "misspelt-key",
        "no-memory-key",
        "negative-size",
        "empty-uuid",
        "uuid-not-text",
        "uuid-with-escape",
        "negative-pid",
        "gpu-as-text",
        "absurd-size",
        "more-used-than-the-card",
        "gpu-not-a-table",
        "process-without-gpus",
    ],
)
def test_a_mistake_in_a_simulation_file_is_named_with_its_table_key_and_value_never_left_out(tmp_path: Path, gpus: str, says: str) -> None:
    """A misspelt table used to make no GPU at all, a misspelt key or a text index went unseen, a pid of -1 stopped the
    start with a traceback, and the rest were said as a Python exception naming no table."""
    sim = tmp_path / "gpus.toml"
    sim.write_text(gpus)
    with pytest.raises(ProbeError) as refused:
        SimulatedProbe(str(sim)).sample()
    assert says in str(refused.value)


def test_a_simulation_file_that_is_not_there_is_said_missing_whatever_its_name_ends_with(tmp_path: Path) -> None:
    for name in ("gpus.toml", "gpus", "gpus.conf"):
        with pytest.raises(ProbeError) as refused:
            SimulatedProbe(str(tmp_path / name))
        assert str(refused.value) == f"{tmp_path / name}: No such file or directory"  # not "size '/tmp/...' is not bytes"
    for name in ("gpus", "gpus.conf"):  # a name in the working directory: a file's, or GPUs mistyped
        with pytest.raises(ProbeError) as refused:
            SimulatedProbe(name)
        assert str(refused.value) == f"simulated GPUs {name!r}: no such file, and not GPUs as [Nx]SIZE (2x24GiB,1x12GiB)"


def test_a_simulated_gpu_can_be_unreadable_as_a_card_fallen_off_the_bus(tmp_path: Path) -> None:
    sim = tmp_path / "gpus.toml"
    sim.write_text('[[gpu]]\nmemory = "24GiB"\n[[gpu]]\nmemory = "12GiB"\nunreadable = "GPU is lost (Xid 79)"\n')
    probe = SimulatedProbe(str(sim))  # no fault of the file

    with pytest.raises(GpusUnreadable) as caught:
        probe.sample()

    assert [(r.index, r.uuid) for r in caught.value.readings] == [(0, "GPU-sim-0")]
    assert caught.value.unreadable == [UnreadableGpu(1, "GPU-sim-1", "simulated: GPU is lost (Xid 79)")]


def test_a_simulation_file_not_in_utf8_is_a_probe_error_naming_the_line_at_start_and_while_running(tmp_path: Path) -> None:
    sim = tmp_path / "gpus.toml"
    sim.write_text('[[gpu]]\nname = "RTX"\nmemory = "24GiB"\n')
    probe = SimulatedProbe(str(sim))
    sim.write_bytes(b'[[gpu]]\nname = "RTX \xe9"\nmemory = "24GiB"\n')  # saved in Latin-1 by an editor
    with pytest.raises(ProbeError, match="not UTF-8, as a TOML file must be: byte 0xe9 at line 2"):
        probe.sample()  # the broker then says DRIVER_ERROR, as for any broken file, and serves on
    with pytest.raises(ProbeError, match="not UTF-8"):
        SimulatedProbe(str(sim))


def test_a_step_of_the_wall_clock_leaves_a_process_the_one_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    before = holders.start_time(os.getpid())
    # /proc/stat's btime is the wall clock less the time since boot: NTP stepping the clock an hour on moves it an hour on.
    booted = psutil.boot_time()
    monkeypatch.setattr(psutil._pslinux, "boot_time", lambda: booted + 3600)
    assert holders.is_same_process(os.getpid(), before)  # a caller-bound lease's holder is not said to have exited
    name, pgid, ancestors, started, leader = describe_process(os.getpid())
    assert GpuProcess(os.getpid(), name, GIB, pgid, ancestors, started, leader).same_as(0, before)  # its memory stays its lease's
