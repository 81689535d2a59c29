"""Test hosts in Linux network namespaces joined by a bridge: real UDP, TCP and multicast, nothing outside.

Every address lives inside namespaces this test made itself (10.231.N.0/24, N from the pid), and
everything is removed afterwards. Needs root (CI and development machines here run as root).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from conftest import wait_for

from gpubroker.client import Client, ClientError, Endpoint


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=10)


def available() -> bool:
    return os.geteuid() == 0 and subprocess.run(["ip", "netns", "list"], capture_output=True).returncode == 0


# On a machine where namespaces cannot be made (no root, no iproute2) these tests cannot run at all;
# CI and the development machines run as root, so there they always run.
needs_netns = pytest.mark.skipif(not available(), reason="network namespaces need root and iproute2")


@dataclass
class Lan:
    """A bridge and `size` namespaces on it; `host(i)` names namespace i, `address(i)` its IPv4 address."""

    size: int
    tag: str = field(default_factory=lambda: f"gb{os.getpid() % 100000}")
    made: list[str] = field(default_factory=list)

    @property
    def bridge(self) -> str:
        return f"{self.tag}br"

    @property
    def subnet(self) -> int:
        return 1 + os.getpid() % 250

    def host(self, index: int) -> str:
        return f"{self.tag}n{index}"

    def address(self, index: int) -> str:
        return f"10.231.{self.subnet}.{11 + index}"

    def veth(self, index: int) -> str:
        return f"{self.tag}v{index}"

    def __enter__(self) -> Lan:
        _ip("link", "add", self.bridge, "type", "bridge")
        self.made.append("bridge")
        _ip("link", "set", self.bridge, "up")
        for index in range(self.size):
            name = self.host(index)
            _ip("netns", "add", name)
            self.made.append(name)
            _ip("link", "add", self.veth(index), "type", "veth", "peer", "name", "eth0", "netns", name)
            _ip("link", "set", self.veth(index), "master", self.bridge)
            _ip("link", "set", self.veth(index), "up")
            _ip("-n", name, "link", "set", "lo", "up")
            _ip("-n", name, "addr", "add", f"{self.address(index)}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "up")
        return self

    def cut(self, index: int) -> None:
        """Take a host's link down: a real partition, no packet ever crosses."""
        _ip("link", "set", self.veth(index), "down")

    def mend(self, index: int) -> None:
        _ip("link", "set", self.veth(index), "up")

    def run(self, index: int, argv: Sequence[str], **popen: object) -> subprocess.Popen[str]:
        return subprocess.Popen(["ip", "netns", "exec", self.host(index), *argv], text=True, **popen)  # type: ignore[call-overload, no-any-return]

    def __exit__(self, *_: object) -> None:
        for index in range(self.size):
            subprocess.run(["ip", "link", "del", self.veth(index)], capture_output=True)
        for name in self.made:
            if name != "bridge":
                subprocess.run(["ip", "netns", "del", name], capture_output=True)
        if "bridge" in self.made:
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


@dataclass
class NsBroker:
    lan: Lan
    index: int
    root: Path
    gpus: str
    proc: subprocess.Popen[str] | None = None

    @property
    def state(self) -> Path:
        return self.root / f"state{self.index}"

    @property
    def socket(self) -> Path:
        return self.root / f"api{self.index}.sock"

    @property
    def client(self) -> Client:
        return Client(Endpoint(f"unix:{self.socket}"), timeout=10)

    def init(self) -> None:
        subprocess.run(
            [sys.executable, "-m", "gpubroker", "init", "--state", str(self.state), "--name", f"node{self.index}"],
            check=True,
            capture_output=True,
        )

    def start(self, *extra: str, env: dict[str, str] | None = None) -> None:
        argv = [
            sys.executable, "-m", "gpubroker", "up", "--state", str(self.state), "--socket", str(self.socket),
            "--listen", "127.0.0.1:9740", "--simulate-gpus", self.gpus, "--gossip", "0.0.0.0:9741",
            "--advertise", self.lan.address(self.index), "--name", f"node{self.index}", *extra,
        ]  # fmt: skip
        log = open(self.root / f"log{self.index}", "a")  # noqa: SIM115 - kept open for the process's life
        self.proc = self.lan.run(self.index, argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        wait_for(lambda: self._ready(), timeout=20)

    def _ready(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError((self.root / f"log{self.index}").read_text())
        try:
            self.client.call("GET", "/healthz")
        except ClientError:
            return False
        return True

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def cluster(self) -> dict[str, Any]:
        answer: dict[str, Any] = self.client.call("GET", "/v1/cluster")
        return answer

    def sees(self) -> dict[str, str]:
        """Node name → membership state, as this broker sees the cluster."""
        return {n["name"]: n["state"] for n in self.cluster()["nodes"]}

    def document_of(self, name: str) -> dict[str, Any] | None:
        for node in self.cluster()["nodes"]:
            if node["name"] == name:
                document: dict[str, Any] | None = node.get("document")
                return document
        return None


def timed(condition: Callable[[], bool], timeout: float) -> float:
    started = time.monotonic()
    wait_for(condition, timeout=timeout, interval=0.05)
    return time.monotonic() - started


def form(brokers: list[NsBroker]) -> float:
    """Node 0 creates the cluster; the others join with its tokens. The seconds until all see all alive."""
    first = brokers[0]
    first.init()
    first.start()
    started = time.monotonic()
    for broker in brokers[1:]:
        token = first.client.call("POST", "/v1/cluster/invites", {"ttl": "10m"})["token"]
        broker.start("--join", token)
    everyone = {f"node{i}": "alive" for i in range(len(brokers))}
    wait_for(
        lambda: all(b.sees() == everyone and all(b.document_of(n) or n == f"node{b.index}" for n in everyone) for b in brokers), 30, 0.05
    )
    return time.monotonic() - started
