"""Discovery by mDNS (`_gpubroker._tcp.local.`): it only finds peers; it never says a peer is alive.

Each broker advertises its node id, its cluster's hash (never a key), the protocol range and its
gossip port; it browses for the others and hands every address it sees to the membership,
which decides who is alive. A dead node's record can linger for an hour: that is harmless here.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass

from zeroconf import ServiceStateChange, Zeroconf
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

from gpubroker.gossip.messages import Addr
from gpubroker.gossip.wire import PROTOCOL_MAX, PROTOCOL_MIN

SERVICE = "_gpubroker._tcp.local."
log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Sighting:
    """A broker seen on the LAN: who it says it is, which cluster, and where its gossip listens."""

    node: str
    cluster: str  # the cluster's hash; empty for a node that belongs to no cluster yet
    addr: Addr
    protocol: tuple[int, int]


def _text(properties: dict[bytes, bytes | None], key: bytes) -> str:
    value = properties.get(key)
    return value.decode(errors="replace") if value else ""


def _protocol(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    try:
        return int(low), int(high or low)
    except ValueError:
        return 0, 0


class Discovery:
    """Advertise this broker and report the others, until closed."""

    def __init__(self, node: str, cluster: str, advertise: str, port: int, on_sighting: Callable[[Sighting], None]) -> None:
        self._node, self._cluster, self._advertise, self._port = node, cluster, advertise, port
        self._on_sighting = on_sighting
        self._zeroconf: AsyncZeroconf | None = None
        self._browser: AsyncServiceBrowser | None = None
        self._info: AsyncServiceInfo | None = None
        self._lookups: set[asyncio.Task[None]] = set()

    def _service_info(self) -> AsyncServiceInfo:
        return AsyncServiceInfo(
            SERVICE,
            f"{self._node}.{SERVICE}",
            addresses=[socket.inet_aton(self._advertise)] if _is_ipv4(self._advertise) else [],
            port=self._port,
            properties={"id": self._node, "cluster": self._cluster, "proto": f"{PROTOCOL_MIN}-{PROTOCOL_MAX}"},
            server=f"{self._node}.local.",
        )

    async def start(self) -> None:
        self._zeroconf = AsyncZeroconf()
        self._info = self._service_info()
        # The second await: without it the announcements are not sent before we go on.
        await (await self._zeroconf.async_register_service(self._info, allow_name_change=False))
        self._browser = AsyncServiceBrowser(self._zeroconf.zeroconf, SERVICE, handlers=[self._changed])

    def _changed(self, zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange) -> None:
        if state_change in (ServiceStateChange.Added, ServiceStateChange.Updated):
            task = asyncio.get_running_loop().create_task(self._look_up(zeroconf, service_type, name))
            self._lookups.add(task)
            task.add_done_callback(self._lookups.discard)

    async def _look_up(self, zeroconf: Zeroconf, service_type: str, name: str) -> None:
        info = AsyncServiceInfo(service_type, name)
        if not await info.async_request(zeroconf, 3000):
            return
        properties = info.properties or {}
        node = _text(properties, b"id")
        if not node or node == self._node or not info.port:
            return
        for address in info.parsed_addresses():
            self._on_sighting(Sighting(node, _text(properties, b"cluster"), (address, info.port), _protocol(_text(properties, b"proto"))))

    async def close(self) -> None:
        """Say goodbye (so peers drop the record at once) and stop; idempotent."""
        for task in list(self._lookups):
            task.cancel()
        if self._browser is not None:
            with contextlib.suppress(Exception):
                await self._browser.async_cancel()
            self._browser = None
        if self._zeroconf is not None:
            if self._info is not None:
                with contextlib.suppress(Exception):
                    await (await self._zeroconf.async_unregister_service(self._info))
            await self._zeroconf.async_close()
            self._zeroconf = None


def _is_ipv4(text: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(text), ipaddress.IPv4Address)
    except ValueError:
        return False
