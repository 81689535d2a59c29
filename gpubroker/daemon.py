"""The broker process: the store, the probes, the API on the Unix socket and on TCP, one TaskGroup."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import signal
import socket
import sys
from collections.abc import Callable
from pathlib import Path

from aiohttp import web

from gpubroker.broker.nvml import NvmlProbe
from gpubroker.broker.probes import GpuProbe, SimulatedProbe
from gpubroker.broker.service import Broker
from gpubroker.broker.store import Store
from gpubroker.config import Config
from gpubroker.ui.api import make_app


class StartError(Exception):
    """The broker cannot start: the message says why and what to do."""


def make_probe(config: Config) -> GpuProbe:
    if config.simulate_gpus:
        return SimulatedProbe(config.simulate_gpus)
    return NvmlProbe()


def _lock_state(state_dir: Path) -> int:
    """One broker per state directory: a second would fight over the same leases."""
    state_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(state_dir / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StartError(f"another broker is running on {state_dir}") from None
    return fd


def _free_socket(path: Path) -> None:
    """Remove a stale socket left by a broker that died; refuse if a live one answers there."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink()
            return
    raise StartError(f"another broker answers on {path}; stop it or give --socket")


async def serve(config: Config, probe: GpuProbe | None = None, on_ready: Callable[[Broker], None] | None = None) -> None:
    """Run the broker until cancelled; closing is idempotent and leaves the store consistent."""
    lock = _lock_state(config.state_dir)
    try:
        broker = Broker(config, Store(config.state_dir, config.store_size, config.events_kept), probe or make_probe(config))
        await broker.start()
        runner = web.AppRunner(make_app(broker), handler_cancellation=True, access_log=None)
        try:
            await runner.setup()
            sock_path = config.socket_path
            _free_socket(sock_path)
            await web.UnixSite(runner, str(sock_path)).start()
            os.chmod(sock_path, 0o666)  # any local user may ask; the kernel tells us who they are
            host, _, port = config.listen.rpartition(":")
            try:
                await web.TCPSite(runner, host.strip("[]"), int(port)).start()
            except OSError as error:
                raise StartError(f"cannot listen on {config.listen}: {error.strerror}; give --listen HOST:PORT") from None
            if on_ready is not None:
                on_ready(broker)
            await broker.run()
        finally:
            await runner.cleanup()
            await broker.close()
            with contextlib.suppress(OSError):
                config.socket_path.unlink()
    finally:
        os.close(lock)


def run(config: Config) -> int:
    """`gpubroker up`: run in the foreground until SIGINT or SIGTERM."""

    def ready(broker: Broker) -> None:
        gpus = len(broker.readings)
        source = f"simulated ({config.simulate_gpus})" if config.simulate_gpus else "NVML"
        state = f"GPUs: {broker.driver_error}" if broker.driver_error else f"{gpus} GPU{'s' * (gpus != 1)} via {source}"
        print(
            f"gpubroker ready: node {config.name} ({broker.node_id}), {state}; "
            f"API on unix:{config.socket_path} and http://{config.listen}; state in {config.state_dir}",
            flush=True,
        )

    async def main() -> None:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, task.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            await serve(config, on_ready=ready)

    try:
        asyncio.run(main())
    except StartError as error:
        print(f"gpubroker: {error}", file=sys.stderr)
        return 2
    return 0
