"""What `gpubroker lease` does with the processes below it, with real processes: a Python process stands for it."""

from __future__ import annotations

import subprocess
import sys

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
