"""The mesh for real: brokers as separate processes in network namespaces on one bridge.

Joined with tokens, discovered again by mDNS, killed, partitioned by taking a link down, healed.
Times are measured and printed; the bounds asserted are the issue's, with room for a busy 2-core
machine where it says so.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest
from conftest import wait_for
from netns import Lan, NsBroker, form, needs_netns, timed

from gpubroker.client import ClientError

pytestmark = [pytest.mark.slow, needs_netns]
GIB = 2**30


@pytest.fixture
def three(tmp_path: Path) -> Iterator[list[NsBroker]]:
    with Lan(3) as lan:
        brokers = [NsBroker(lan, i, tmp_path, gpus) for i, gpus in enumerate(("1x24GiB", "1x12GiB", "1x48GiB"))]
        try:
            yield brokers
        finally:
            for broker in brokers:
                broker.stop()


def test_three_brokers_join_with_tokens_share_figures_and_leases_and_hint_elsewhere(three: list[NsBroker]) -> None:
    formed = form(three)
    print(f"three brokers formed one cluster in {formed:.2f} s (from the second broker's start)")
    assert formed < 15  # the goal is 5 s; the suite allows for a loaded 2-core machine
    a, b, c = three
    assert b.document_of("node2")["gpus"][0]["figures"]["total"] == 48 * GIB  # type: ignore[index]
    assert c.document_of("node0")["gpus"][0]["figures"]["total"] == 24 * GIB  # type: ignore[index]
    agreed = timed(lambda: len({json.dumps(x.cluster()["coordinator"]) for x in three}) == 1, 10)
    print(f"all three agreed on the coordinator {agreed:.2f} s after forming")

    held = a.client.call("POST", "/v1/leases", {"gpu_memory": "10GiB", "bind": "none", "holder": {"name": "train"}})["lease"]

    def seen_everywhere() -> bool:
        return all((x.document_of("node0") or {}).get("gpus", [{}])[0].get("figures", {}).get("leased") == 10 * GIB for x in (b, c))

    spread = timed(seen_everywhere, 10)
    print(f"a lease granted on node0 reached the other views in {spread:.2f} s")
    assert any(r["holder"] == "train" for r in b.document_of("node0")["leases"])  # type: ignore[index]

    with pytest.raises(ClientError) as refused:
        b.client.call("POST", "/v1/leases", {"gpu_memory": "30GiB", "bind": "none"})
    assert refused.value.code == "CAPABILITY_UNAVAILABLE"  # no GPU of node1 could ever hold it; node2's can
    elsewhere = refused.value.details["elsewhere"]
    assert [hint["name"] for hint in elsewhere] == ["node2"]
    assert elsewhere[0]["gpus"][0]["figures"]["schedulable"] >= 30 * GIB

    rotated = a.client.call("POST", "/v1/cluster/keys", {"install": None})  # a new key, installed everywhere
    assert rotated["members"] == {n["id"]: "ok" for n in a.cluster()["nodes"] if not n["self"]}
    new_key = next(k["id"] for k in rotated["keys"] if not k["primary"])
    a.client.call("POST", "/v1/cluster/keys", {"use": new_key})
    old_key = next(k["id"] for k in a.client.call("GET", "/v1/cluster/keys")["keys"] if not k["primary"])
    a.client.call("POST", "/v1/cluster/keys", {"remove": old_key})
    for x in three:
        assert [(k["id"], k["primary"]) for k in x.client.call("GET", "/v1/cluster/keys")["keys"]] == [(new_key, True)]
    time.sleep(3)  # gossip rounds under the new key only
    assert all(set(x.sees().values()) == {"alive"} for x in three)
    # Forwarded to node0, which releases it for root on node2 (an admin of the cluster) and names who asked.
    # Who else may (a lease's token, nobody without it) is tested in tests/gossip/test_forwarding.py.
    listed = c.client.call("GET", "/v1/leases", query={"node": "node0"})["leases"]  # as node0's document lists them
    assert [(r["id"], r["node"], r["state"]) for r in listed] == [(held["id"], a.cluster()["nodes"][0]["id"], "granted")]
    assert c.client.call("GET", f"/v1/leases/{held['id']}")["lease"] == listed[0]  # read from any node, as it is listed there
    shown = subprocess.run(
        [sys.executable, "-m", "gpubroker", "leases", "--node", "node0"],
        env={**os.environ, "GPUBROKER_URL": f"unix:{c.socket}"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert [line.split()[:4] for line in shown.stdout.splitlines()[1:]] == [[held["id"], "granted", held["priority"], "train"]], shown
    released = c.client.call("DELETE", f"/v1/leases/{held['id']}")["lease"]
    assert (released["state"], released["reason"]) == ("released", "released by root on the Unix socket of node2")
    assert a.client.call("GET", f"/v1/leases/{held['id']}")["lease"]["state"] == "released"

    # A removed node may gossip on with the key it holds, but it is no member, peer or coordinator any more.
    removed = next(n["id"] for n in a.cluster()["nodes"] if n["name"] == "node1")
    a.client.call("DELETE", f"/v1/cluster/nodes/{removed}")
    time.sleep(3)  # gossip rounds in which node1 still speaks
    assert set(a.sees()) == {"node0", "node2"}
    assert a.cluster()["coordinator"]["id"] != removed
    assert removed in a.client.call("GET", "/v1/cluster/nodes")["removed"]

    c.stop()  # SIGTERM, as systemd stops a service: it says it leaves, and is not taken for a failure
    left = timed(lambda: a.sees().get("node2") == "left", 5)
    print(f"a stopped broker was seen to have left {left:.2f} s after its stop")


def test_a_killed_broker_is_dead_everywhere_and_rejoins_by_mdns_and_a_partition_heals(three: list[NsBroker]) -> None:
    form(three)
    a, b, c = three
    c_id = next(n["id"] for n in c.cluster()["nodes"] if n["self"])
    c.kill()
    detected = timed(lambda: a.sees()["node2"] == "dead" and b.sees()["node2"] == "dead", 30)
    print(f"a killed broker was dead on both others after {detected:.2f} s")
    assert detected < 15  # the goal is 8 s at N <= 10 (Serf: 5.8 s at N = 3)
    wait_for(lambda: a.cluster()["coordinator"] == b.cluster()["coordinator"], 10)
    coordinator = a.cluster()["coordinator"]
    assert coordinator["id"] != c_id  # the coordinator moves when it was the one that died
    assert coordinator["id"] in {n["id"] for n in a.cluster()["nodes"] if n["state"] == "alive"}

    c.start()  # no seed, no token: mDNS alone finds the cluster again
    rejoined = timed(lambda: a.sees()["node2"] == "alive" and b.sees()["node2"] == "alive" and set(c.sees().values()) == {"alive"}, 30)
    print(f"the restarted broker rejoined by mDNS in {rejoined:.2f} s")

    c.lan.cut(2)
    timed(lambda: a.sees()["node2"] in ("suspect", "dead"), 30)
    c.lan.mend(2)
    healed = timed(lambda: all(set(x.sees().values()) == {"alive"} for x in three), 30)
    print(f"after the link came back, all three saw all alive in {healed:.2f} s")


def test_a_broker_of_another_cluster_pointed_at_a_member_is_never_counted(tmp_path: Path) -> None:
    with Lan(2) as lan:
        member, stranger = NsBroker(lan, 0, tmp_path, "1x24GiB"), NsBroker(lan, 1, tmp_path, "1x24GiB")
        try:
            member.init()
            stranger.init()  # a cluster of its own: another keyring, another set of members
            member.start()
            stranger.start("--peer", f"{lan.address(0)}:9741")
            time.sleep(5)  # several probe and gossip rounds, and mDNS sightings, for a stranger to sneak in
            assert [n["name"] for n in member.cluster()["nodes"]] == ["node0"]
            assert [n["name"] for n in stranger.cluster()["nodes"]] == ["node1"]
            events = member.client.call("GET", "/v1/events", query={"limit": 1000})["events"]
            assert not [e for e in events if e["type"].startswith("mesh.member") and "node1" in e["message"]]
        finally:
            member.stop()
            stranger.stop()


@pytest.mark.parametrize("skew", [0, -3 * 3600])  # and from a box whose clock is 3 hours slow (no real-time clock)
def test_a_node_without_a_token_asks_is_approved_and_joins(tmp_path: Path, skew: int) -> None:
    offset = tmp_path / "offset"
    offset.write_text(str(skew))
    skewed = {**os.environ, "PYTHONPATH": str(Path(__file__).parent / "skewed"), "GPUBROKER_TEST_CLOCK_OFFSET": str(offset)}
    with Lan(2) as lan:
        member, newcomer = NsBroker(lan, 0, tmp_path, "1x24GiB"), NsBroker(lan, 1, tmp_path, "1x12GiB")
        try:
            member.init()
            member.start()
            newcomer.start("--ask", env=skewed)  # found by mDNS; no token, no seed
            wait_for(lambda: [p["name"] for p in member.client.call("GET", "/v1/cluster/nodes")["pending"]] == ["node1"], 20)
            assert [n["name"] for n in member.cluster()["nodes"]] == ["node0"]  # asking is not being a member
            pending = member.client.call("GET", "/v1/cluster/nodes")["pending"][0]
            assert re.fullmatch(r"[0-9.]+:[0-9]+", pending["addr"]), pending["addr"]  # as people write an address
            assert newcomer.client.call("GET", "/healthz")["node"] == pending["id"]  # the id it asks with is the one it shows
            member.client.call("POST", f"/v1/cluster/nodes/{pending['id']}/approve")
            joined = timed(lambda: member.sees().get("node1") == "alive" and newcomer.sees().get("node0") == "alive", 30)
            print(f"an approved node joined {joined:.2f} s after the approval")
        finally:
            member.stop()
            newcomer.stop()


def test_a_member_whose_clock_is_an_hour_fast_and_then_stepped_right_stays_in_the_mesh_and_shows_true_times(
    tmp_path: Path,
) -> None:
    """A box without a real-time clock: node1's wall clock runs an hour fast, then NTP steps it back while it runs."""
    offset = tmp_path / "offset"
    offset.write_text(str(3600))
    with Lan(2) as lan:
        brokers = [NsBroker(lan, i, tmp_path, "1x24GiB") for i in range(2)]
        member, fast = brokers
        skewed = {**os.environ, "PYTHONPATH": str(Path(__file__).parent / "skewed"), "GPUBROKER_TEST_CLOCK_OFFSET": str(offset)}
        try:
            member.init()
            member.start()
            token = member.client.call("POST", "/v1/cluster/invites", {"ttl": "10m"})["token"]
            fast.start("--join", token, env=skewed)
            wait_for(lambda: member.sees() == {"node0": "alive", "node1": "alive"} and member.document_of("node1"), 30, 0.05)

            held = fast.client.call("POST", "/v1/leases", {"gpu_memory": "1GiB", "bind": "none", "ttl": "10m"})["lease"]
            wait_for(lambda: any(r["id"] == held["id"] for r in member.document_of("node1")["leases"]), 10, 0.05)  # type: ignore[index]
            shown = member.client.call("GET", f"/v1/leases/{held['id']}")["lease"]
            due = datetime.fromisoformat(shown["expires_at"]).timestamp() - time.time()
            print(f"a lease of node1 (an hour fast) due in 600 s reads on node0 as due in {due:.0f} s")
            assert 560 < due <= 601

            offset.write_text("0")  # NTP steps node1's clock back an hour
            time.sleep(3)  # a step is seen within 0.2 s; a few probe, gossip and publishing rounds after it
            later = fast.client.call("POST", "/v1/leases", {"gpu_memory": "2GiB", "bind": "none", "ttl": "10m"})["lease"]
            spread = timed(lambda: any(r["id"] == later["id"] for r in member.document_of("node1")["leases"]), 10)  # type: ignore[index]
            print(f"after node1's clock stepped back an hour, its new lease reached node0's view in {spread:.2f} s")
            assert member.sees() == {"node0": "alive", "node1": "alive"}
            assert fast.sees() == {"node0": "alive", "node1": "alive"}
            due = datetime.fromisoformat(member.client.call("GET", f"/v1/leases/{later['id']}")["lease"]["expires_at"]).timestamp()
            assert 560 < due - time.time() <= 601
        finally:
            for broker in brokers:
                broker.stop()


def test_a_member_started_from_a_snapshot_of_its_state_is_shown_as_it_is_now(tmp_path: Path) -> None:
    """A VM restored from a snapshot taken before its last starts: the others held a document of a later start of it."""
    with Lan(2) as lan:
        brokers = [NsBroker(lan, i, tmp_path, "1x24GiB") for i in range(2)]
        member, restored = brokers
        try:
            form(brokers)
            restored.stop()
            snapshot = tmp_path / "snapshot"
            shutil.copytree(restored.state, snapshot)
            for _ in range(2):  # starts after the snapshot: their documents' generations are above any it can make
                restored.stop()
                restored.start()
            held = restored.client.call("POST", "/v1/leases", {"gpu_memory": "1GiB", "bind": "none", "ttl": "10m"})["lease"]
            wait_for(lambda: any(r["id"] == held["id"] for r in member.document_of("node1")["leases"]), 10, 0.05)  # type: ignore[index]
            restored.stop()
            shutil.rmtree(restored.state)
            shutil.copytree(snapshot, restored.state)  # the snapshot comes back: that lease was never granted here
            restored.start()
            shown = timed(lambda: member.document_of("node1")["leases"] == [], 15)  # type: ignore[index]
            print(f"node1, restored from a snapshot, was shown without the lease it no longer holds after {shown:.2f} s")
        finally:
            for broker in brokers:
                broker.stop()
