"""Discovery by mDNS across real network namespaces: each broker finds the others, with its cluster's hash."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from netns import Lan, needs_netns

SCRIPT = """
import asyncio, json, sys
from gpubroker.gossip.discovery import Discovery

async def main(node, address):
    seen = {}
    def sighted(s):
        if s.node not in seen:
            seen[s.node] = [s.cluster, list(s.addr), list(s.protocol)]
            print(json.dumps({"node": s.node, "cluster": s.cluster, "addr": s.addr, "protocol": s.protocol}), flush=True)
    discovery = Discovery(node, "c0ffee", address, 9741, sighted)
    await discovery.start()
    await asyncio.sleep(float(sys.argv[3]))
    await discovery.close()

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""

pytestmark = [pytest.mark.slow, needs_netns]


def test_brokers_on_one_lan_find_each_other_by_mdns_with_their_cluster_hash() -> None:
    with Lan(3) as lan:
        runs = [
            lan.run(i, [sys.executable, "-c", SCRIPT, f"n-node{i}", lan.address(i), "6"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for i in range(3)
        ]
        outputs = [run.communicate(timeout=30) for run in runs]
    for i, (out, err) in enumerate(outputs):
        assert runs[i].returncode == 0, err
        seen = {json.loads(line)["node"]: json.loads(line) for line in out.splitlines()}
        assert set(seen) == {f"n-node{j}" for j in range(3) if j != i}, (out, err)
        for j in range(3):
            if j != i:
                assert seen[f"n-node{j}"]["addr"] == [lan.address(j), 9741]
                assert seen[f"n-node{j}"]["cluster"] == "c0ffee"
                assert seen[f"n-node{j}"]["protocol"] == [1, 1]
