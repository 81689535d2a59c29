"""SWIM with Lifeguard, pure: exact timers on one node driven by hand, then many nodes on the in-memory network."""

from __future__ import annotations

import json
import math
import random
import statistics
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
from fakenet import FakeNet, datagram_size

from gpubroker.gossip.membership import BroadcastQueue, EventKind, Membership, MembershipConfig, TcpPing
from gpubroker.gossip.messages import (
    Ack,
    Addr,
    Alive,
    Compound,
    Dead,
    DocumentNotice,
    IndirectPing,
    Member,
    MemberState,
    Message,
    Nack,
    Ping,
    PushPull,
    Suspect,
)
from gpubroker.gossip.suspicion import Awareness, Suspicion, expected_confirmations, suspicion_duration, suspicion_timeout

CONFIG = MembershipConfig()
A: Addr = ("10.0.0.1", 7946)
B: Addr = ("10.0.0.2", 7946)
C: Addr = ("10.0.0.3", 7946)
EPS = 1e-9


def parts(message: Message) -> tuple[Message, ...]:
    return message.parts if isinstance(message, Compound) else (message,)


class Script:
    """One real Membership and scripted peers: those in `answering` ack pings at once and Nack indirect pings on time."""

    def __init__(self, answering: set[Addr], peers: dict[str, Addr] | None = None, seed: int = 1) -> None:
        self.m = Membership("n-a", A, CONFIG, random.Random(seed))
        self.answering = answering
        self.sent: list[tuple[float, Addr, Message]] = []
        self.events: list[tuple[float, EventKind, str]] = []
        self.tcp: list[tuple[float, TcpPing]] = []
        self.pending: list[tuple[float, Message]] = []
        peers = peers if peers is not None else {"n-b": B, "n-c": C}
        self.m.push_pull_received(0.0, PushPull(tuple(Member(n, addr, 1, MemberState.ALIVE) for n, addr in peers.items())))
        self.collect(0.0)

    def collect(self, t: float) -> None:
        for addr, message in self.m.outbox:
            for part in parts(message):
                self.sent.append((t, addr, part))
                if addr in self.answering and isinstance(part, Ping):
                    self.pending.append((t + 0.001, Ack(part.seq)))
                if addr in self.answering and isinstance(part, IndirectPing):
                    # The relay cannot reach the target either: its own ping times out, then it says so.
                    self.pending.append((t + 0.001 + CONFIG.probe_timeout + 0.001, Nack(part.seq)))
        self.m.outbox.clear()
        self.events.extend((t, e.kind, e.node) for e in self.m.events)
        self.m.events.clear()
        self.tcp.extend((t, p) for p in self.m.tcp_ping_requests)
        self.m.tcp_ping_requests.clear()

    def run_until(self, end: float) -> None:
        while True:
            self.pending.sort(key=lambda p: p[0])
            due = self.m.next_deadline()
            if self.pending and self.pending[0][0] <= due:
                t, message = self.pending.pop(0)
                if t > end:
                    self.pending.insert(0, (t, message))
                    return
                self.m.receive(t, B, message)
            else:
                if due > end:
                    return
                t = due
                self.m.tick(t)
                assert self.m.next_deadline() > t
            self.collect(t)

    def first_ping(self, to: Addr | None = None) -> tuple[float, Addr, Ping]:
        for t, addr, part in self.sent:
            if isinstance(part, Ping) and (to is None or addr == to):
                return t, addr, part
        raise AssertionError("no ping sent")

    def event_time(self, kind: EventKind, node: str) -> float:
        return next(t for t, k, n in self.events if k is kind and n == node)


# --- timers, exactly ---------------------------------------------------------------------------------------------


def test_the_suspicion_timeout_is_scaled_by_log10_of_the_cluster_size_with_a_floor_of_one() -> None:
    assert suspicion_timeout(4, 3, 1.0) == 4.0
    assert suspicion_timeout(4, 10, 1.0) == 4.0
    assert suspicion_timeout(4, 100, 1.0) == 8.0
    assert suspicion_timeout(4, 1000, 0.5) == pytest.approx(6.0)
    assert expected_confirmations(4, 3) == 0  # n − 2 < k: nobody is left to confirm
    assert expected_confirmations(4, 4) == 2


def test_each_independent_confirmation_shrinks_the_suspicion_as_memberlists_formula_says() -> None:
    s = Suspicion(start=100.0, k=2, minimum=4.0, maximum=24.0, source="n-a")
    assert s.deadline == 124.0
    assert not s.confirm("n-a")  # the accuser does not confirm itself
    assert s.confirm("n-b")
    assert s.deadline == pytest.approx(100.0 + math.floor(1000 * (24 - 20 * math.log(2) / math.log(3))) / 1000)
    assert not s.confirm("n-b")  # one confirmation per member
    assert s.confirm("n-c")
    assert s.deadline == 104.0
    assert not s.confirm("n-d")  # k reached: nothing more to shrink
    assert suspicion_duration(0, 0, 4.0, 24.0) == 4.0  # k = 0 starts at the minimum


def test_local_health_is_bounded_by_the_multiplier_and_scales_timeouts() -> None:
    awareness = Awareness(maximum=8)
    awareness.apply(-3)
    assert awareness.score == 0
    awareness.apply(20)
    assert awareness.score == 7
    assert awareness.scale(1.0) == 8.0


def test_an_unanswered_probe_goes_indirect_at_the_timeout_and_suspects_at_the_interval_then_dies_after_the_suspicion() -> None:
    script = Script(answering={C})  # n-c answers and relays; n-b is gone
    script.run_until(3.0)
    t0, _, ping = script.first_ping(to=B)
    indirect = [(t, addr, p) for t, addr, p in script.sent if isinstance(p, IndirectPing) and p.target == "n-b"]
    assert indirect[0][0] == pytest.approx(t0 + CONFIG.probe_timeout, abs=EPS)
    assert indirect[0][1] == C
    assert indirect[0][2].seq == ping.seq
    assert indirect[0][2].nack
    assert [(t, p.node, p.deadline) for t, p in script.tcp][0] == pytest.approx((t0 + 0.5, "n-b", t0 + 1.0))
    suspected = script.event_time(EventKind.SUSPECT, "n-b")
    assert suspected == pytest.approx(t0 + CONFIG.probe_interval, abs=EPS)
    assert script.m.health_score() == 0  # the relay's Nack came: the target is to blame, not us
    script.run_until(suspected + 10.0)
    n = 3  # this node and its two members: no one left to confirm, so the minimum applies from the start
    assert script.event_time(EventKind.DEAD, "n-b") == pytest.approx(suspected + suspicion_timeout(4, n, 1.0), abs=EPS)


def test_a_probe_answered_through_a_relay_keeps_the_target_alive_and_improves_health() -> None:
    script = Script(answering={C})
    script.m._awareness.score = 2  # as after two bad probes
    script.run_until(0.0)
    while not any(isinstance(p, Ping) and addr == B for _, addr, p in script.sent):
        script.run_until(script.m.next_deadline())
    t0, _, ping = script.first_ping(to=B)
    script.run_until(t0 + CONFIG.probe_timeout)
    script.m.receive(t0 + 0.7, C, Ack(ping.seq))  # the relay reached n-b and forwards its Ack under our seq
    script.collect(t0 + 0.7)
    assert script.m.health_score() == 1  # a success lowers the score by one
    script.run_until(t0 + 3 * CONFIG.probe_interval)  # the end this probe would have had at health 2
    next_ping = next((t for t, addr, p in script.sent if isinstance(p, Ping) and addr == B and t > t0), math.inf)
    assert not any(n == "n-b" and k is not EventKind.JOINED and t <= next_ping for t, k, n in script.events)


def test_missing_nacks_worsen_local_health_and_stretch_the_next_probe() -> None:
    script = Script(answering=set())  # nobody answers anything: from here it looks like our own network is down
    script.run_until(0.0)
    while not any(k is EventKind.SUSPECT for _, k, _ in script.events):
        script.run_until(script.m.next_deadline())
    t_first, _, first = script.first_ping()
    first_target = "n-b" if first.target == "n-b" else "n-c"
    assert script.event_time(EventKind.SUSPECT, first_target) == pytest.approx(t_first + 1.0, abs=EPS)
    assert script.m.health_score() == 1  # one relay was asked, no Nack came
    other = "n-c" if first_target == "n-b" else "n-b"
    while not any(n == other and k is EventKind.SUSPECT for _, k, n in script.events):
        script.run_until(script.m.next_deadline())
    t_second = next(t for t, _, p in script.sent if isinstance(p, Ping) and p.target == other)
    # Health 1 doubles the probe interval; the direct ping's own timeout is not scaled (memberlist's choice).
    assert script.event_time(EventKind.SUSPECT, other) == pytest.approx(t_second + 2 * CONFIG.probe_interval, abs=EPS)
    # The first target is suspect now, so no live relay is left: only the TCP ping goes out, and the failure counts once.
    assert [t for t, p in script.tcp if p.node == other] == [pytest.approx(t_second + CONFIG.probe_timeout, abs=EPS)]
    assert script.m.health_score() == 2


def test_a_suspect_member_hears_of_its_suspicion_from_the_next_node_that_probes_it() -> None:
    script = Script(answering={B, C})
    script.m.receive(0.0, C, Suspect(1, "n-b", "n-c"))
    script.collect(0.0)
    script.run_until(3.0)
    ping_time, _, ping = script.first_ping(to=B)
    together = [p for t, addr, p in script.sent if addr == B and t == ping_time]
    assert Suspect(1, "n-b", "n-a") in together  # the buddy system: the suspicion rides with the ping


def test_a_node_told_it_is_suspect_refutes_with_a_higher_incarnation_and_counts_it_against_its_health() -> None:
    m = Membership("n-a", A, CONFIG, random.Random(1), incarnation=41)
    assert m.incarnation == 42  # one above the persisted incarnation
    m.receive(1.0, B, Suspect(45, "n-a", "n-b"))
    assert m.incarnation == 46
    assert m.health_score() == 1
    m.receive(1.1, B, Ping(7, "n-a", "n-b", B))
    (addr, reply), *_ = m.outbox
    assert addr == B
    assert parts(reply)[0] == Ack(7)
    assert Alive(46, "n-a", A) in parts(reply)  # the refutation rides the very next datagram


def test_incarnations_decide_between_alive_suspect_and_dead() -> None:
    m = Membership("n-a", A, CONFIG, random.Random(1))
    m.receive(0.0, B, Alive(1, "n-b", B))

    def state() -> MemberState | None:
        view = m.member("n-b")
        return None if view is None else view.state

    m.receive(1.0, C, Suspect(1, "n-b", "n-c"))
    assert state() is MemberState.SUSPECT  # equal incarnation: suspect overrides alive
    m.receive(1.1, B, Alive(1, "n-b", B))
    assert state() is MemberState.SUSPECT  # an alive needs a higher incarnation
    m.receive(1.2, B, Alive(2, "n-b", B))
    assert state() is MemberState.ALIVE
    m.receive(1.3, C, Suspect(1, "n-b", "n-c"))
    assert state() is MemberState.ALIVE  # an older accusation is ignored
    m.receive(1.4, C, Dead(2, "n-b", "n-c"))
    assert state() is MemberState.DEAD  # dead overrides at an equal incarnation
    m.receive(1.5, B, Alive(2, "n-b", B))
    assert state() is MemberState.DEAD
    m.receive(1.6, B, Alive(3, "n-b", B))
    assert state() is MemberState.ALIVE  # the dead node talks again with a higher incarnation: it is back
    m.receive(1.7, B, Dead(3, "n-b", "n-b"))
    assert state() is MemberState.LEFT
    assert [(e.kind, e.node) for e in m.events] == [
        ("joined", "n-b"),
        ("suspect", "n-b"),
        ("alive", "n-b"),
        ("dead", "n-b"),
        ("alive", "n-b"),
        ("left", "n-b"),
    ]


def test_the_broadcast_queue_sends_fewest_transmits_first_within_the_budget_and_the_newest_replaces_the_older() -> None:
    queue = BroadcastQueue(size_of=lambda m: 10, retransmit_mult=4)
    assert [queue.limit(n) for n in (1, 9, 10, 99, 100)] == [4, 4, 8, 8, 12]
    queue.queue(("member", "n-b"), Alive(1, "n-b", B))
    queue.queue(("member", "n-c"), Alive(1, "n-c", C))
    assert queue.take(budget=10, n=1) == [Alive(1, "n-c", C)]  # one fits; the newest goes first
    assert queue.take(budget=10, n=1) == [Alive(1, "n-b", B)]  # now the other has fewer transmits
    queue.queue(("member", "n-b"), Suspect(1, "n-b", "n-c"))  # replaces the Alive about n-b
    sent = [queue.take(budget=100, n=1) for _ in range(5)]
    assert sent[0] == [Suspect(1, "n-b", "n-c"), Alive(1, "n-c", C)]
    assert sum(m == Suspect(1, "n-b", "n-c") for batch in sent for m in batch) == 4
    assert len(queue) == 0


# --- many nodes on the in-memory network -------------------------------------------------------------------------


def converged(net: FakeNet) -> bool:
    n = len(net.running())
    return net.all_see(MemberState.ALIVE) and all(len(node.membership.members()) >= n for node in net.running())


def started(n: int, seed: int = 1, config: MembershipConfig | None = None, loss: float = 0.0, record: bool = False) -> FakeNet:
    net = FakeNet(seed, config=config, record=record)
    net.cluster(n)
    assert net.run_until_true(lambda: converged(net), timeout=30.0) is not None
    net.loss = loss
    return net


@pytest.mark.parametrize("n", [3, 10, 50])
def test_nodes_joining_through_one_seed_all_see_each_other_alive(n: int) -> None:
    net = FakeNet(seed=n)
    net.cluster(n)
    took = net.run_until_true(lambda: converged(net), timeout=30.0)
    assert took is not None
    assert all(node.membership.alive_count() == n for node in net.running())
    assert net.count(EventKind.SUSPECT) == 0


@pytest.mark.parametrize("n", [3, 10])
def test_a_killed_node_is_suspected_then_declared_dead_everywhere_within_memberlists_bound(n: int) -> None:
    net = started(n, seed=100 + n)
    net.run_for(5.0)
    victim = "n-001"
    net.kill(victim)
    killed = net.now
    assert net.run_until_true(lambda: net.all_see(MemberState.DEAD, [victim]), timeout=120.0) is not None
    c = CONFIG
    shortest = suspicion_timeout(c.suspicion_mult, n, c.probe_interval)
    longest = c.suspicion_max_timeout_mult * shortest if expected_confirmations(c.suspicion_mult, n) else shortest
    suspected = min(o.at for o in net.log if o.kind is EventKind.SUSPECT and o.node == victim and o.at >= killed)
    deaths = [o.at for o in net.log if o.kind is EventKind.DEAD and o.node == victim]
    # Round robin reaches any member within two shuffled rounds; the probe then takes one interval.
    assert suspected - killed <= (2 * (n - 1) - 1) * c.probe_interval + c.probe_interval
    # Death comes between the shortest and the longest suspicion, then spreads within a few gossip rounds.
    assert shortest - EPS <= min(deaths) - suspected <= longest
    assert max(deaths) - min(deaths) <= c.probe_interval
    assert len(deaths) == n - 1
    print(f"N={n}: suspected after {suspected - killed:.2f} s, dead everywhere after {max(deaths) - killed:.2f} s")


def test_a_suspected_node_that_is_alive_refutes_and_is_never_declared_dead() -> None:
    net = started(10, seed=3)
    target = net.nodes["n-004"].membership
    before = target.incarnation
    net.inject("n-000", Suspect(before, "n-004", "n-007"))  # a false accusation, as after lost packets
    assert net.run_until_true(lambda: target.incarnation > before and net.all_see(MemberState.ALIVE), timeout=10.0)
    net.run_for(60.0)
    assert net.count(EventKind.DEAD) == 0
    assert net.all_see(MemberState.ALIVE)


@pytest.mark.slow  # an hour of gossip, simulated
def test_ten_percent_packet_loss_for_an_hour_declares_no_one_dead() -> None:
    net = started(10, seed=10)
    net.loss = 0.10
    net.run_for(3600.0)
    assert net.count(EventKind.DEAD) == 0
    assert net.all_see(MemberState.ALIVE)


@pytest.mark.slow  # an hour of gossip, simulated
def test_ten_percent_loss_without_the_tcp_fallback_suspects_often_yet_refutations_keep_everyone_alive() -> None:
    net = started(10, seed=11, config=MembershipConfig(tcp_fallback_ping=False))
    net.loss = 0.10
    net.run_for(3600.0)
    assert net.count(EventKind.SUSPECT) > 0  # the UDP path alone does fail now and then
    assert net.count(EventKind.DEAD) == 0


@pytest.mark.slow
def test_thirty_percent_packet_loss_for_an_hour_declares_no_one_dead() -> None:
    net = started(10, seed=30)
    net.loss = 0.30
    net.run_for(3600.0)
    assert net.count(EventKind.DEAD) == 0


def test_a_node_whose_loop_stalls_for_two_seconds_is_not_declared_dead() -> None:
    net = started(10, seed=4)
    paused_at = net.now
    for _ in range(20):  # twenty stalls, 20 s apart: some of them catch a probe of the node in flight
        net.run_for(18.0)
        net.pause("n-006", 2.0)
    net.run_for(60.0)
    suspicions = sum(1 for o in net.log if o.kind is EventKind.SUSPECT and o.node == "n-006" and o.at >= paused_at)
    assert suspicions > 0  # the stalls were noticed ...
    assert net.count(EventKind.DEAD) == 0  # ... and refuted every time, in time
    assert net.all_see(MemberState.ALIVE)
    print(f"suspicions of the paused node (20 stalls, all observers): {suspicions}")


def test_each_half_of_a_partition_declares_the_other_dead_and_after_the_heal_all_are_alive_within_30_s() -> None:
    net = started(10, seed=5)
    left = [f"n-{i:03d}" for i in range(5)]
    right = [f"n-{i:03d}" for i in range(5, 10)]
    net.partition(left, right)
    split = net.run_until_true(
        lambda: net.all_see(MemberState.DEAD, right, observers=left) and net.all_see(MemberState.DEAD, left, observers=right),
        timeout=180.0,
    )
    assert split is not None
    net.run_for(60.0)  # long enough for the dead to leave the probe rings and the gossip
    net.heal()
    healed = net.now
    back = net.run_until_true(lambda: net.all_see(MemberState.ALIVE), timeout=30.0)
    assert back is not None
    print(f"partition seen after {split:.1f} s; all alive {back - healed:.1f} s after the heal")


@pytest.mark.parametrize("persisted", [True, False])
def test_a_restarted_node_rejoins_and_is_alive_everywhere(persisted: bool) -> None:
    net = started(5, seed=6)
    net.kill("n-002")
    assert net.run_until_true(lambda: net.all_see(MemberState.DEAD, ["n-002"]), timeout=60.0)
    declared = net.nodes["n-000"].membership.member("n-002")
    assert declared is not None
    node = net.restart("n-002", incarnation=None if persisted else 0, seeds=["n-000"])
    restarted = net.now
    back = net.run_until_true(lambda: converged(net), timeout=CONFIG.dead_retry_interval)
    assert back is not None
    assert node.membership.incarnation > declared.incarnation
    if persisted:
        # It starts above what it persisted, so its first Alive already beats the Dead: no refutation needed.
        assert back - restarted < CONFIG.probe_interval


def reached_all(net: FakeNet, notice: DocumentNotice, others: int) -> bool:
    return sum(1 for _, _, x in net.notices if x == notice) == others


def test_a_document_notice_reaches_every_node() -> None:
    net = started(10, seed=7)
    rng = random.Random(7)
    delays: list[float] = []
    for version in range(1, 21):
        origin = net.nodes[f"n-{rng.randrange(10):03d}"]
        notice = DocumentNotice(origin.node_id, 1, version)
        net.do(origin.node_id, partial(Membership.broadcast, notice=notice))
        sent = net.now
        reached = net.run_until_true(partial(reached_all, net, notice, 9), timeout=10.0, step=0.001)
        assert reached is not None
        delays.append(reached - sent)
        net.run_for(rng.uniform(0.5, 2.0))
    p99 = statistics.quantiles(delays, n=100)[98]
    assert p99 < 2.0
    print(f"notice to all of 10: p50 {statistics.median(delays) * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms")


def test_a_node_started_from_older_state_hears_of_the_newer_document_the_others_hold_of_it() -> None:
    """A VM restored from a snapshot announces documents behind the one the others hold of it, which they would
    ignore until its versions passed it: they tell it of theirs again, so that it goes on above it."""
    net = started(3, seed=11)
    newer = DocumentNotice("n-002", 5, 40)
    net.do("n-002", partial(Membership.broadcast, notice=newer))
    assert net.run_until_true(partial(reached_all, net, newer, 2), timeout=10.0) is not None
    net.run_for(30.0)  # every retransmit of it is long done
    net.restart("n-002")
    net.do("n-002", partial(Membership.broadcast, notice=DocumentNotice("n-002", 5, 1)))  # one start later than the state
    told = net.run_until_true(lambda: any(node == "n-002" and notice == newer for _, node, notice in net.notices), timeout=5.0)
    assert told is not None


def test_a_broadcast_is_sent_at_most_retransmit_mult_times_log10_n_plus_one_by_each_node() -> None:
    net = started(10, seed=8, record=True)
    net.run_for(5.0)
    notice = DocumentNotice("n-003", 2, 1)
    net.do("n-003", lambda m: m.broadcast(notice))
    net.run_for(30.0)
    limit = CONFIG.retransmit_mult * math.ceil(math.log10(10 + 1))
    sends: dict[str, int] = {}
    for _, sender, _, message in net.sent:
        if notice in parts(message):
            sends[sender] = sends.get(sender, 0) + 1
    assert sends["n-003"] == limit
    assert max(sends.values()) <= limit
    assert len(sends) == 10


def test_a_node_that_leaves_is_seen_as_left_everywhere_and_never_as_dead() -> None:
    net = started(5, seed=9)
    net.leave("n-003")
    leaving = net.nodes["n-003"].membership
    assert net.run_until_true(lambda: leaving.leave_done, timeout=10.0) is not None
    net.kill("n-003")
    net.run_for(30.0)
    assert net.all_see(MemberState.LEFT, ["n-003"])
    assert net.count(EventKind.DEAD) == 0
    assert {o.observer for o in net.log if o.kind is EventKind.LEFT and o.node == "n-003"} == {f"n-{i:03d}" for i in (0, 1, 2, 4)}


def test_new_meta_is_seen_everywhere_as_an_update() -> None:
    net = started(5, seed=12)
    net.do("n-001", lambda m: m.set_meta(net.now, b"name=gpu-box-1"))
    net.run_for(5.0)
    assert {o.observer for o in net.log if o.kind is EventKind.UPDATED and o.node == "n-001"} == {"n-000", "n-002", "n-003", "n-004"}
    view = net.nodes["n-004"].membership.member("n-001")
    assert view is not None
    assert view.meta == b"name=gpu-box-1"


def test_no_datagram_exceeds_1400_bytes_under_churn() -> None:
    net = started(20, seed=13, record=True)
    rng = random.Random(13)
    for _ in range(10):
        victim = f"n-{rng.randrange(1, 20):03d}"
        net.kill(victim)
        net.run_for(rng.uniform(1.0, 8.0))
        net.restart(victim, seeds=["n-000"])
        net.do(victim, lambda m: m.set_meta(net.now, bytes(300)))
        net.run_for(rng.uniform(1.0, 8.0))
    assert max(datagram_size(m) for _, _, _, m in net.sent if not isinstance(m, PushPull)) <= 1400
    assert net.run_until_true(lambda: converged(net), timeout=30.0) is not None


def test_the_same_seed_gives_the_same_history() -> None:
    def history() -> list[tuple[float, str, str, str]]:
        net = started(10, seed=42, loss=0.2)
        net.kill("n-005")
        net.run_for(30.0)
        return [(o.at, o.observer, o.kind.value, o.node) for o in net.log]

    assert history() == history()


@pytest.mark.slow
def test_the_membership_benchmark_runs_and_writes_its_figures_as_json(tmp_path: Path) -> None:
    bench = Path(__file__).resolve().parents[2] / "bench" / "bench_membership.py"
    out = tmp_path / "membership.json"
    run = subprocess.run([sys.executable, str(bench), "--quick", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    results = json.loads(out.read_text())
    assert [r["n"] for r in results["notice"]] == [10, 50, 200]
    assert [r["n"] for r in results["detection"]] == [10, 50]
    assert results["traffic"][0]["bytes_per_s_per_node_mean"] > 0
    assert results["machine"]["python"]
    assert results["runtime_s"] > 0
