"""`gpubroker self-check`: a broker on one simulated GPU in a temporary directory, one lease granted and released.

Run from the built binary, it proves that every dependency bundled: LMDB, aiohttp,
psutil, prometheus-client, msgpack and NVML's bindings are all imported and used.
"""

from __future__ import annotations

import asyncio
import tempfile
import threading
from pathlib import Path

from gpubroker.broker.nvml import NvmlProbe
from gpubroker.broker.probes import ProbeError
from gpubroker.client import Client, Endpoint
from gpubroker.config import Config
from gpubroker.daemon import serve


def self_check() -> int:
    with tempfile.TemporaryDirectory(prefix="gpubroker-check-") as tmp:
        socket_path = Path(tmp) / "api.sock"
        config = Config(
            state_dir=Path(tmp) / "state", socket=socket_path, listen="127.0.0.1:0", simulate_gpus="1x24GiB", sample_interval=0.2
        )
        loop = asyncio.new_event_loop()
        ready = threading.Event()
        failure: list[BaseException] = []
        task = loop.create_task(serve(config, on_ready=lambda _broker: ready.set()))

        def run() -> None:
            try:
                loop.run_until_complete(task)
            except asyncio.CancelledError:
                pass
            except BaseException as error:  # reported below, not lost in a thread
                failure.append(error)
            finally:
                ready.set()
                loop.close()

        runner = threading.Thread(target=run, daemon=True)
        runner.start()
        try:
            if not ready.wait(30) or failure:
                print(f"self-check: the broker did not start: {failure[0] if failure else 'not ready in 30 s'}")
                return 1
            client = Client(Endpoint(f"unix:{socket_path}"))
            lease = client.call("POST", "/v1/leases", {"gpu_memory": "8GiB", "bind": "none", "holder": {"name": "self-check"}})["lease"]
            figures = client.call("GET", "/v1/node")["gpus"][0]["figures"]
            assert figures["leased"] == 8 * 2**30, figures
            client.call("DELETE", f"/v1/leases/{lease['id']}", headers={"X-Lease-Token": lease["token"]})
            assert client.call("GET", "/v1/node")["gpus"][0]["figures"]["leased"] == 0
            assert "gpubroker_gpu_schedulable_bytes" in client.text("/metrics")
        finally:
            loop.call_soon_threadsafe(task.cancel)
            runner.join(10)
        mesh = _mesh_check()
        nvml_probe = NvmlProbe()
        try:
            nvml_probe.sample()
            nvml = "NVML: GPUs readable"
        except ProbeError as error:
            nvml = f"NVML: {error}"
        finally:
            nvml_probe.close()
    print(f"self-check ok: lease {lease['id']} granted and released on a simulated 24 GiB GPU; {mesh}; {nvml}")
    return 0


def _mesh_check() -> str:
    """The mesh's own dependencies, bundled and working: Ed25519, AES-GCM, msgpack framing, zeroconf."""
    import zeroconf

    from gpubroker.gossip import wire
    from gpubroker.gossip.identity import Identity
    from gpubroker.gossip.keyring import Keyring
    from gpubroker.gossip.messages import Ping

    identity = Identity.generate()
    assert Identity.verify(identity.public_key_bytes, b"check", identity.sign(b"check"))
    keyring = Keyring.generate()
    ping = Ping(1, identity.node_id, identity.node_id, ("127.0.0.1", 9741))
    assert wire.decode(keyring.open(keyring.seal(wire.encode(ping)))) == ping
    return f"mesh: identity {identity.node_id}, sealed gossip, zeroconf {zeroconf.__version__}"
