"""What `gpubroker lease` does with the processes below it, with real processes: a Python process stands for it."""

from __future__ import annotations

import subprocess
import sys

from gpubroker import work

# Stands for `gpubroker lease`: a subreaper whose CMD leaves a process in a session of its own, deaf to SIGTERM (ignored
# before exec, as `nohup` does SIGHUP), then ends; what is left is stopped with a grace of 0.3 s and said, with its pid.
STANDS_FOR_LEASE = """\
import os, subprocess, time
from gpubroker import work

assert work.become_subreaper()
cmd = subprocess.Popen(["sh", "-c", "(trap '' TERM; exec setsid sleep 30 >/dev/null) & echo $!"], stdout=subprocess.PIPE, text=True)
left = int(cmd.stdout.readline())
cmd.wait()
deadline = time.monotonic() + 10
while os.getsid(left) != left and time.monotonic() < deadline:  # `echo $!` can come before the setsid
    time.sleep(0.01)
print(left, work.stop_leftovers(0.3))
"""


def test_what_cmd_leaves_running_deaf_to_sigterm_is_killed_after_the_grace_and_said_so() -> None:
    done = subprocess.run([sys.executable, "-c", STANDS_FOR_LEASE], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    left, said = done.stdout.split(" ", 1)
    assert said == f"process group {left} (pid {left}) killed (SIGKILL) 0.3s after SIGTERM\n"


def test_hundreds_of_groups_stopped_are_said_in_one_short_line_by_outcome() -> None:
    """A CMD that left 300 groups running (a server's workers, each in a session of its own) had each named with its
    outcome, in a line of many kilobytes: the first few of each outcome are named, the rest counted."""
    stopped = [(f"process group {pgid}", pgid % 100 == 0) for pgid in range(1000, 1300)]
    assert work.said_stopped(stopped, 10) == (
        "process group 1001, process group 1002, process group 1003, process group 1004, process group 1005 and 292 more"
        " ended on SIGTERM; process group 1000, process group 1100, process group 1200 killed (SIGKILL) 10s after SIGTERM"
    )
    assert work.said_stopped([("process 7", False)], 0.3) == "process 7 ended on SIGTERM"
