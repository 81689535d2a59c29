"""kill -9 of a real broker in a storm of grants and releases (SPEC §3.5), at random points, again and again.

What a client was answered is the truth the store must keep: a lease answered as
granted is there after the restart with the same id and epochs, a lease answered
as released never comes back, and epochs only grow. A call in flight at the kill
was answered nothing: it may or may not have happened, and the test learns which
from the restarted broker (and holds it to that from then on).
"""

from __future__ import annotations

import http.client
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from conftest import BrokerProcess, wait_for

from gpubroker.client import Client, ClientError

REQUEST = {"gpu_memory": "256MiB", "bind": "none", "ttl": "1h", "holder": {"name": "storm"}}
THREADS = 8
HELD = 24  # the storm keeps at most this many live: 6 GiB of two 24 GiB GPUs, so no grant is refused for room


class Unanswered(Exception):
    """The broker died with the call in flight (or was already dead): its outcome is unknown."""


def call(client: Client, method: str, path: str, body: Any = None, token: str | None = None) -> Any:
    try:
        return client.call(method, path, body, headers={"X-Lease-Token": token} if token else None)
    except ClientError as error:
        if error.status == 0:
            raise Unanswered from None
        raise
    except http.client.HTTPException:  # an answer cut short by the kill
        raise Unanswered from None


@dataclass(frozen=True)
class Held:
    """A lease the clients know to be durable and live: answered as granted, or seen live after a restart."""

    id: str
    epoch: int
    gpus: tuple[tuple[int, str, int, int], ...]  # (index, uuid, bytes, epoch)
    token: str | None  # None: granted in flight at a kill, so only its Unix user may release it

    @classmethod
    def of(cls, lease: dict[str, Any]) -> Held:
        return cls(lease["id"], lease["epoch"], gpus_of(lease), lease.get("token"))


def gpus_of(lease: dict[str, Any]) -> tuple[tuple[int, str, int, int], ...]:
    return tuple((g["index"], g["uuid"], g["bytes"], g["epoch"]) for g in lease["gpus"])


@dataclass
class Ledger:
    """Everything the storm's clients were told, accumulated over every round on one state directory."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    held: dict[str, Held] = field(default_factory=dict)
    released: set[str] = field(default_factory=set)  # answered as released
    released_this_round: set[str] = field(default_factory=set)
    grants_in_doubt: int = 0  # POSTs unanswered at the kill: each may have left a live lease nobody was told of
    releases_in_doubt: dict[str, Held] = field(default_factory=dict)  # DELETEs unanswered at the kill
    lease_epochs: set[int] = field(default_factory=set)
    gpu_epochs: set[tuple[str, int]] = field(default_factory=set)
    top_epoch: int = 0  # the highest lease epoch answered or seen so far
    top_gpu: dict[str, int] = field(default_factory=dict)  # the same per GPU
    floor_epoch: int = 0  # what every grant of the current broker must exceed: the top when it started
    floor_gpu: dict[str, int] = field(default_factory=dict)
    granted: int = 0
    released_count: int = 0
    wrong: list[str] = field(default_factory=list)  # answers that break a promise, found by the storm threads
    first_grant: threading.Event = field(default_factory=threading.Event)
    draining: threading.Event = field(default_factory=threading.Event)  # the storm only releases now

    def see(self, held: Held) -> None:
        """Raise the tops to a lease's epochs (caller holds the lock, or no storm runs)."""
        self.top_epoch = max(self.top_epoch, held.epoch)
        for _, uuid, _, epoch in held.gpus:
            self.top_gpu[uuid] = max(self.top_gpu.get(uuid, 0), epoch)

    def answered_granted(self, lease: dict[str, Any]) -> None:
        held = Held.of(lease)
        with self.lock:
            if held.epoch <= self.floor_epoch:
                self.wrong.append(
                    f"lease {held.id} was granted epoch {held.epoch}, not above {self.floor_epoch} answered before the restart"
                )
            if held.epoch in self.lease_epochs:
                self.wrong.append(f"lease {held.id} was granted epoch {held.epoch}, already answered for another lease")
            for _, uuid, _, epoch in held.gpus:
                if epoch <= self.floor_gpu.get(uuid, 0):
                    self.wrong.append(
                        f"lease {held.id} got {uuid} epoch {epoch}, not above {self.floor_gpu.get(uuid, 0)} answered before the restart"
                    )
                if (uuid, epoch) in self.gpu_epochs:
                    self.wrong.append(f"lease {held.id} got {uuid} epoch {epoch}, already answered for another lease")
                self.gpu_epochs.add((uuid, epoch))
            self.lease_epochs.add(held.epoch)
            self.see(held)
            self.held[held.id] = held
            self.granted += 1
        self.first_grant.set()

    def answered_released(self, held: Held, lease: dict[str, Any]) -> None:
        with self.lock:
            if lease["state"] != "released":
                self.wrong.append(f"DELETE of lease {held.id} answered state {lease['state']!r}")
            self.released.add(held.id)
            self.released_this_round.add(held.id)
            self.released_count += 1

    def take_one_to_release(self, rng: random.Random) -> Held | None:
        """Half the time (always once HELD are live) a live lease to release, taken so no other thread does too.

        Often the newest: then the highest epoch is often a released lease's, and
        only a durable epoch counter, not the live leases, keeps it from coming again.
        """
        with self.lock:
            if not self.held or (len(self.held) < HELD and not self.draining.is_set() and rng.random() < 0.5):
                return None
            if rng.random() < 0.5:
                return self.held.pop(max(self.held.values(), key=lambda held: held.epoch).id)
            return self.held.pop(rng.choice(sorted(self.held)))


def storm_thread(broker: BrokerProcess, ledger: Ledger, seed: float) -> None:
    """Grant and release until the broker stops answering; every answer goes into the ledger."""
    rng = random.Random(seed)
    client = broker.client()
    client.timeout = 10.0
    while True:
        held = ledger.take_one_to_release(rng)
        if held is None and ledger.draining.is_set():
            return  # drained: nothing live is left for this thread to release
        try:
            if held is None:
                try:
                    answer = call(client, "POST", "/v1/leases", REQUEST)
                except Unanswered:
                    with ledger.lock:
                        ledger.grants_in_doubt += 1
                    return
                ledger.answered_granted(answer["lease"])
            else:
                try:
                    answer = call(client, "DELETE", f"/v1/leases/{held.id}", token=held.token)
                except Unanswered:
                    with ledger.lock:
                        ledger.releases_in_doubt[held.id] = held
                    return
                ledger.answered_released(held, answer["lease"])
        except ClientError as error:  # a living broker refused what it must allow
            with ledger.lock:
                ledger.wrong.append(f"{'POST' if held is None else f'DELETE {held.id}'}: {error.status} {error}")
            return


def storm_and_kill(broker: BrokerProcess, ledger: Ledger, rng: random.Random, where: str) -> float:
    """Run the storm, kill -9 the broker at a random point in it, and return that point (seconds after the first grant).

    In a third of the rounds the storm turns to releasing only, a random while before
    the kill: the broker then often dies with its highest epochs on released
    leases, or with none live at all.
    """
    ledger.first_grant.clear()
    ledger.draining.clear()
    ledger.released_this_round.clear()
    threads = [threading.Thread(target=storm_thread, args=(broker, ledger, rng.random()), daemon=True) for _ in range(THREADS)]
    for thread in threads:
        thread.start()
    assert ledger.first_grant.wait(10), f"{where}: the storm was granted nothing: {ledger.wrong}"
    point = rng.uniform(0.05, 0.4)
    drain = point * rng.uniform(0.5, 1.0) if rng.random() < 1 / 3 else point
    time.sleep(drain)  # the random kill point (and the turn to draining before it): the only sleeps of this test
    ledger.draining.set()
    time.sleep(point - drain)
    broker.kill()
    for thread in threads:
        thread.join(15)
    assert not any(thread.is_alive() for thread in threads), f"{where}: a storm thread still waits on a dead broker"
    assert not ledger.wrong, f"{where}: {ledger.wrong}"
    return point


def state_of(client: Client, lease_id: str) -> str:
    """A lease's state, or "gone" once it has left the history of ended leases."""
    try:
        state: str = client.call("GET", f"/v1/leases/{lease_id}")["lease"]["state"]
    except ClientError as error:
        if error.code != "NOT_FOUND":
            raise
        return "gone"
    return state


def check_restarted(broker: BrokerProcess, ledger: Ledger, where: str) -> None:
    """Hold the restarted broker to every answer, learn what the unanswered calls did, and check its figures."""
    client = broker.client()
    listed = {lease["id"]: lease for lease in client.call("GET", "/v1/leases", query={"limit": 100_000})["leases"]}
    live = {lease_id: lease for lease_id, lease in listed.items() if lease["state"] == "granted"}

    for held in ledger.held.values():
        lease = live.get(held.id)
        state = listed[held.id]["state"] if held.id in listed else "gone"
        assert lease is not None, f"{where}: lease {held.id} (epoch {held.epoch}) was answered as granted and is {state} after kill -9"
        assert (lease["epoch"], gpus_of(lease)) == (held.epoch, held.gpus), f"{where}: lease {held.id} came back changed: {lease}"
        one = client.call("GET", f"/v1/leases/{held.id}")["lease"]
        assert (one["state"], one["epoch"], gpus_of(one)) == ("granted", held.epoch, held.gpus), f"{where}: GET {held.id}: {one}"

    revived = sorted(ledger.released & set(live))
    assert not revived, f"{where}: leases answered as released are granted again after kill -9: {revived}"
    for lease_id in ledger.released_this_round:
        state = state_of(client, lease_id)
        assert state != "granted", f"{where}: lease {lease_id} was answered as released and is granted after kill -9"

    # What nobody was told: only the calls cut by the kill may have left something behind.
    undecided = set(ledger.releases_in_doubt)
    unknown = {lease_id: lease for lease_id, lease in live.items() if lease_id not in ledger.held and lease_id not in undecided}
    assert len(unknown) <= ledger.grants_in_doubt, (
        f"{where}: {len(unknown)} live leases nobody was answered, but only {ledger.grants_in_doubt} grants were in flight: {sorted(unknown)}"
    )
    assert all(lease["holder"]["name"] == "storm" for lease in unknown.values()), f"{where}: {unknown}"
    for lease_id, held in ledger.releases_in_doubt.items():
        if lease_id in live:
            assert (live[lease_id]["epoch"], gpus_of(live[lease_id])) == (held.epoch, held.gpus), f"{where}: {live[lease_id]}"
            ledger.held[lease_id] = held
        else:
            ledger.released.add(lease_id)
    for lease in unknown.values():  # durable now: from here on it is held to the same promises
        ledger.held[lease["id"]] = Held.of(lease)
        ledger.lease_epochs.add(lease["epoch"])
        ledger.gpu_epochs.update((uuid, epoch) for _, uuid, _, epoch in gpus_of(lease))
    for held in ledger.held.values():
        ledger.see(held)
    ledger.grants_in_doubt = 0
    ledger.releases_in_doubt.clear()
    ledger.floor_epoch, ledger.floor_gpu = ledger.top_epoch, dict(ledger.top_gpu)
    assert set(live) == set(ledger.held), f"{where}: the live leases and the ledger disagree"

    node = client.call("GET", "/v1/node")
    for gpu in node["gpus"]:
        on_it = {lease["id"]: g["bytes"] for lease in live.values() for g in lease["gpus"] if g["index"] == gpu["index"]}
        assert gpu["figures"]["leased"] == sum(on_it.values()), f"{where}: GPU {gpu['index']} figures {gpu['figures']} vs leases {on_it}"
        assert {lease["id"] for lease in gpu["leases"]} == set(on_it), f"{where}: GPU {gpu['index']} lists other leases"


def survive_storms(broker_process: Callable[..., BrokerProcess], rounds: int, seed: int) -> Ledger:
    broker = broker_process("2x24GiB").start()
    ledger = Ledger()
    for round_ in range(rounds):
        rng = random.Random(seed * 1000 + round_)
        point = storm_and_kill(broker, ledger, rng, f"seed {seed} round {round_}")
        broker.start()
        check_restarted(broker, ledger, f"seed {seed} round {round_} (killed {point * 1000:.0f} ms into the storm)")

    # One grant after the last restart: its epochs are above every epoch ever answered.
    client = broker.client()
    lease = call(client, "POST", "/v1/leases", REQUEST)["lease"]
    ledger.answered_granted(lease)
    assert not ledger.wrong, f"seed {seed}, after the last restart: {ledger.wrong}"
    assert ledger.granted > rounds, f"the storm hardly ran: {ledger.granted} grants"
    assert ledger.released_count > 0, "the storm released nothing"
    return ledger


def test_kill_9_in_a_storm_keeps_every_answered_grant_and_revives_no_answered_release(broker_process: type[BrokerProcess]) -> None:
    survive_storms(broker_process, rounds=5, seed=1)


@pytest.mark.slow
def test_twenty_kill_9_storms_on_one_state_directory_keep_every_answer(broker_process: type[BrokerProcess]) -> None:
    survive_storms(broker_process, rounds=20, seed=2)


def test_a_request_waiting_at_kill_9_is_said_cancelled_by_the_restarted_broker(broker_process: type[BrokerProcess]) -> None:
    """A waiting request lives in the broker's memory alone: killed with -9, the broker took it and its requester's
    connection with it, and its events said `lease.queued` and then nothing, as if it still waited. Started again, the
    broker says it cancelled; a wait that had already ended (refused at the end of its wait) is not ended twice."""
    broker = broker_process("1x24GiB").start()
    client = broker.client()
    client.call("POST", "/v1/leases", {"gpu_memory": "20GiB", "bind": "none", "ttl": "1h"})
    with pytest.raises(ClientError, match="not granted within 0.05s"):
        client.call("POST", "/v1/leases", {"gpu_memory": "10GiB", "bind": "none", "wait": "50ms"})
    answered: list[Exception | None] = []

    def wait_long() -> None:
        try:
            call(client, "POST", "/v1/leases", {"gpu_memory": "10GiB", "bind": "none", "wait": "1h"})
            answered.append(None)
        except Exception as error:
            answered.append(error)

    waiting = threading.Thread(target=wait_long)
    waiting.start()
    wait_for(lambda: len(client.call("GET", "/v1/leases", query={"state": "queued"})["leases"]) == 1)
    (queued,) = client.call("GET", "/v1/leases", query={"state": "queued"})["leases"]

    def kept() -> list[str]:
        return [e["lease"] for e in client.call("GET", "/v1/events")["events"] if e["type"] == "lease.queued"]

    wait_for(lambda: queued["id"] in kept())  # on disk: a wait whose lease.queued never was has no story to end
    broker.kill()
    waiting.join(10)
    assert [type(error) for error in answered] == [Unanswered]
    broker.start()

    assert client.call("GET", "/v1/leases", query={"state": "queued"})["leases"] == []
    events = client.call("GET", "/v1/events")["events"]
    timed_out = next(e["lease"] for e in events if e["type"] == "lease.queued" and e["lease"] != queued["id"])
    ends = [(e["type"], e["lease"]) for e in events if e.get("lease") in (queued["id"], timed_out) and e["type"] != "lease.queued"]
    assert ends == [("lease.refused", timed_out), ("lease.cancelled", queued["id"])]
    cancelled, started = events[-2:]
    assert (cancelled["type"], cancelled["details"]["broker_stopped"]) == ("lease.cancelled", True)
    assert f"request {queued['id']} cancelled: the broker stopped while it waited" in cancelled["message"]
    assert (started["type"], started["details"]["waits_cancelled"]) == ("broker.started", 1)
    assert started["message"].endswith("started with 1 live lease; 1 request that waited when it stopped is cancelled")
