"""Shared fixtures: a real broker process on a temporary state directory, and leak checks."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from gpubroker.client import Client, Endpoint

REPO = Path(__file__).resolve().parents[1]
BINARY = REPO / "build" / "dist" / "gpubroker" / "gpubroker"  # what packaging/build makes


@pytest.fixture(params=["installed", pytest.param("binary", marks=pytest.mark.slow)])
def gpubroker(request: pytest.FixtureRequest) -> list[str]:
    """The command under test: the console script pip installed, or the PyInstaller build (a failure if missing)."""
    command = Path(sys.executable).with_name("gpubroker") if request.param == "installed" else BINARY
    if not command.exists():
        # A failure, not a skip: the slow tier exists to prove the binary, and a missing one proves nothing.
        how = "run packaging/build first" if command == BINARY else "run pip install -e '.[test]' first"
        pytest.fail(f"{command} is missing: {how}")
    return [str(command)]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The binary variant of a test marked installed_only is left out (the slow tier's time goes where the binary differs)."""
    left_out = [
        item
        for item in items
        if item.get_closest_marker("installed_only") is not None
        and getattr(item, "callspec", None) is not None
        and item.callspec.params.get("gpubroker") == "binary"  # type: ignore[attr-defined]
    ]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = [item for item in items if item not in left_out]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class BrokerProcess:
    """`gpubroker up` as a real process; `kill()` is kill -9, `start()` starts it again on the same state."""

    root: Path
    simulate: str
    extra: list[str] = field(default_factory=list)
    command: list[str] = field(default_factory=lambda: [sys.executable, "-m", "gpubroker"])
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[str] | None = None
    ready_line: str = ""
    output: list[str] = field(default_factory=list)  # every line it printed, as it prints them

    @property
    def state(self) -> Path:
        return self.root / "state"

    @property
    def socket(self) -> Path:
        return self.root / "api.sock"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "GPUBROKER_URL": f"unix:{self.socket}"}

    def client(self, tcp: bool = False) -> Client:
        return Client(Endpoint(self.url if tcp else f"unix:{self.socket}"))

    def start(self, timeout: float = 20.0) -> BrokerProcess:
        argv = [
            *self.command, "up", "--state", str(self.state), "--socket", str(self.socket),
            "--listen", f"127.0.0.1:{self.port}", "--simulate-gpus", self.simulate, *self.extra,
        ]  # fmt: skip
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert self.proc.stdout is not None
        lines: list[str] = []
        found = threading.Event()

        def read() -> None:
            assert self.proc is not None
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                lines.append(line)
                self.output.append(line)
                if line.startswith("gpubroker ready"):
                    self.ready_line = line
                    found.set()
            found.set()

        threading.Thread(target=read, daemon=True).start()
        if not found.wait(timeout) or not self.ready_line:
            self.stop()
            raise AssertionError("broker did not become ready:\n" + "".join(lines))
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture
def broker_process(tmp_path: Path) -> Iterator[type[BrokerProcess]]:
    """A factory: `broker_process("2x24GiB").start()`; every broker it made is stopped afterwards."""
    made: list[BrokerProcess] = []
    roots = iter(range(1000))

    def make(simulate: str = "1x24GiB", extra: list[str] | None = None, command: list[str] | None = None) -> BrokerProcess:
        root = tmp_path / f"broker{next(roots)}"
        root.mkdir()
        broker = BrokerProcess(root, simulate, extra or [], command or [sys.executable, "-m", "gpubroker"])
        made.append(broker)
        return broker

    yield make  # type: ignore[misc]
    for broker in made:
        broker.stop()


@pytest.fixture
def live_pid() -> Iterator[Callable[[], int]]:
    """A factory of pids of processes that run until the test ends (`sleep`): a lease's holder.pid must be running."""
    started: list[subprocess.Popen[bytes]] = []

    def make() -> int:
        started.append(subprocess.Popen(["sleep", "600"]))
        return started[-1].pid

    yield make
    for process in started:
        process.kill()
        process.wait()


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    """A test leaves no child process running and no store writer thread behind."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    yield
    deadline = time.monotonic() + 5
    while True:
        left = [
            p for p in psutil.Process().children(recursive=True)
            if p.pid not in before and p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        ]  # fmt: skip
        writers = [t for t in threading.enumerate() if t.name == "gpubroker-store"]
        if not left and not writers:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"the test left behind processes {[(p.pid, p.cmdline()) for p in left]} and threads {writers}")
        time.sleep(0.05)


def wait_for(predicate: object, timeout: float = 10.0, interval: float = 0.02) -> None:
    """Poll a condition on a real process (never used on our own fake clock)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s")
