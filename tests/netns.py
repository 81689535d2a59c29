"""Test hosts in Linux network namespaces joined by a bridge: real UDP, TCP and multicast, nothing outside.

Every address lives inside namespaces this test made itself (10.231.N.0/24, N from the pid), and
everything is removed afterwards. Needs root (CI and development machines here run as root).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=10)


def available() -> bool:
    return os.geteuid() == 0 and subprocess.run(["ip", "netns", "list"], capture_output=True).returncode == 0


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
