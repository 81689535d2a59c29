"""An in-memory network of Membership nodes with a fake clock: deterministic from a seed.

A discrete-event loop (a heap of (time, seq, action)) carries datagrams with a random latency and loss,
drops them across partitions, holds them for a paused node (a stalled event loop: what arrives meanwhile
is handled, in order, when it resumes), and answers TCP push-pulls and TCP pings reliably between
reachable nodes. Each node is ticked exactly at its `next_deadline()`. Bytes are counted as the wire
would send them: `wire.encode` plus the AES-GCM seal when `gpubroker.gossip.wire` imports, else the
membership's own estimate plus 29 bytes of seal.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from gpubroker.gossip.membership import EventKind, Membership, MembershipConfig, estimate_size
from gpubroker.gossip.messages import Addr, DocumentNotice, MemberState, Message, PushPull

SEAL_OVERHEAD = 29  # keyring.OVERHEAD: version byte, 12-byte nonce, 16-byte tag
TCP_FRAME_PREFIX = 4

try:
    from gpubroker.gossip.wire import HEADER_SIZE, encode

    def body_size(message: Message) -> int:
        """What one message adds to a datagram's body (the piggyback budget counts this)."""
        return len(encode(message)) - HEADER_SIZE

    def datagram_size(message: Message) -> int:
        return len(encode(message)) + SEAL_OVERHEAD

    SIZES = "wire.encode"
except ImportError:  # the wire module is not there yet: a documented estimate

    def body_size(message: Message) -> int:
        return estimate_size(message)

    def datagram_size(message: Message) -> int:
        return 3 + estimate_size(message) + SEAL_OVERHEAD

    SIZES = "estimate"


@dataclass(frozen=True, slots=True)
class Observed:
    at: float
    observer: str
    kind: EventKind
    node: str


@dataclass
class SimNode:
    node_id: str
    addr: Addr
    membership: Membership
    seeds: list[Addr]
    epoch: int = 0  # grows at each kill or restart: what was in flight for the old life is dropped
    running: bool = True
    paused_until: float = -math.inf
    backlog: list[Callable[[], None]] = field(default_factory=list)
    next_tick: float = math.inf
    bytes_sent: int = 0
    datagrams_sent: int = 0
    persisted_incarnation: int = 0


class FakeNet:
    """Many nodes, one fake clock; `run_until` moves time; every random choice comes from `seed`."""

    def __init__(
        self,
        seed: int,
        config: MembershipConfig | None = None,
        latency: tuple[float, float] = (0.0005, 0.002),
        loss: float = 0.0,
        record: bool = False,
    ) -> None:
        self.config = config or MembershipConfig()
        self.rng = random.Random(seed)
        self.latency = latency
        self.loss = loss
        self.record = record
        self.now = 0.0
        self.nodes: dict[str, SimNode] = {}
        self.by_addr: dict[Addr, str] = {}
        self.log: list[Observed] = []
        self.notices: list[tuple[float, str, DocumentNotice]] = []
        self.sent: list[tuple[float, str, Addr, Message]] = []  # with record=True: every datagram, lost ones too
        self._groups: dict[str, int] | None = None
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0

    # --- building the cluster --------------------------------------------------------------------------------

    def add(self, node_id: str | None = None, seeds: Iterable[str] = (), incarnation: int = 0) -> SimNode:
        """A new node, started now, joining through the nodes named in `seeds`."""
        index = len(self.nodes)
        node_id = node_id or f"n-{index:03d}"
        addr = (f"10.0.{index // 250}.{index % 250 + 1}", 7946)
        node = SimNode(node_id, addr, self._membership(node_id, addr, incarnation), [self.nodes[s].addr for s in seeds])
        self.nodes[node_id] = node
        self.by_addr[addr] = node_id
        self._boot(node)
        return node

    def cluster(self, n: int) -> list[SimNode]:
        """n nodes started together, all joining through the first."""
        first = self.add()
        return [first, *(self.add(seeds=[first.node_id]) for _ in range(n - 1))]

    def kill(self, node_id: str) -> None:
        """The process dies: it stops answering; what it had in flight is lost."""
        node = self.nodes[node_id]
        node.persisted_incarnation = node.membership.incarnation
        node.running = False
        node.epoch += 1
        node.backlog.clear()
        node.next_tick = math.inf

    def restart(self, node_id: str, incarnation: int | None = None, seeds: Iterable[str] | None = None) -> SimNode:
        """A fresh process at the same address; by default with the incarnation its previous life persisted."""
        node = self.nodes[node_id]
        if node.running:
            self.kill(node_id)
        inc = node.persisted_incarnation if incarnation is None else incarnation
        node.membership = self._membership(node_id, node.addr, inc)
        if seeds is not None:
            node.seeds = [self.nodes[s].addr for s in seeds]
        node.running = True
        node.paused_until = -math.inf
        self._boot(node)
        return node

    def pause(self, node_id: str, duration: float) -> None:
        """The node's loop stalls: it neither ticks nor reads for `duration`, then handles its backlog in order."""
        node = self.nodes[node_id]
        node.paused_until = self.now + duration
        epoch = node.epoch

        def resume() -> None:
            if node.epoch != epoch or not node.running:
                return
            backlog, node.backlog = node.backlog, []
            for action in backlog:
                action()
            node.next_tick = math.inf
            self._schedule_tick(node)

        self._at(node.paused_until, resume)

    def do(self, node_id: str, action: Callable[[Membership], object]) -> None:
        """Call the node's membership now (as its runtime would, on its loop), then carry out what it asks."""
        node = self.nodes[node_id]
        self._when_running(node, lambda: action(node.membership))

    def leave(self, node_id: str) -> None:
        """The node announces its leave; it keeps running (answering, gossiping) until the test kills it."""
        self.do(node_id, lambda m: m.leave(self.now))

    def inject(self, node_id: str, message: Message, source: Addr = ("10.9.9.9", 1)) -> None:
        """`node_id` receives `message` now, as if a datagram had brought it."""
        node = self.nodes[node_id]
        self._when_running(node, lambda: node.membership.receive(self.now, source, message))

    def partition(self, *groups: Iterable[str]) -> None:
        """Only nodes in the same group can talk (a node in no group talks to no one)."""
        self._groups = {n: i for i, group in enumerate(groups) for n in group}

    def heal(self) -> None:
        self._groups = None

    # --- running ---------------------------------------------------------------------------------------------

    def run_until(self, t: float) -> None:
        while self._heap and self._heap[0][0] <= t:
            at, _, action = heapq.heappop(self._heap)
            self.now = at
            action()
        self.now = max(self.now, t)

    def run_for(self, duration: float) -> None:
        self.run_until(self.now + duration)

    def run_until_true(self, predicate: Callable[[], bool], timeout: float, step: float = 0.01) -> float | None:
        """The first fake time (to `step`) at which `predicate` holds, or None after `timeout` seconds."""
        end = self.now + timeout
        while self.now < end:
            if predicate():
                return self.now
            self.run_until(min(end, self.now + step))
        return self.now if predicate() else None

    # --- what the nodes see ----------------------------------------------------------------------------------

    def state(self, observer: str, node: str) -> MemberState | None:
        view = self.nodes[observer].membership.member(node)
        return None if view is None else view.state

    def running(self) -> list[SimNode]:
        return [n for n in self.nodes.values() if n.running]

    def all_see(self, state: MemberState, about: Iterable[str] | None = None, observers: Iterable[str] | None = None) -> bool:
        """Every running observer (or those named) sees every node in `about` (default: every running node) in `state`."""
        watchers = [self.nodes[o] for o in observers] if observers is not None else self.running()
        targets = list(about) if about is not None else [n.node_id for n in self.running()]
        return all(self.state(w.node_id, t) is state for w in watchers for t in targets if t != w.node_id)

    def first(self, kind: EventKind, node: str, after: float = 0.0, observer: str | None = None) -> Observed | None:
        return next(
            (o for o in self.log if o.kind is kind and o.node == node and o.at >= after and (observer is None or o.observer == observer)),
            None,
        )

    def count(self, kind: EventKind, after: float = 0.0) -> int:
        return sum(1 for o in self.log if o.kind is kind and o.at >= after)

    # --- the machinery ---------------------------------------------------------------------------------------

    def _membership(self, node_id: str, addr: Addr, incarnation: int) -> Membership:
        return Membership(node_id, addr, self.config, random.Random(self.rng.getrandbits(64)), incarnation, size_of=body_size)

    def _boot(self, node: SimNode) -> None:
        node.membership.join(node.seeds)
        node.membership.tick(self.now)
        self._flush(node)

    def _at(self, t: float, action: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, action))

    def _reachable(self, a: str, b: str) -> bool:
        if self._groups is None:
            return True
        ga, gb = self._groups.get(a), self._groups.get(b)
        return ga is not None and ga == gb

    def _latency(self) -> float:
        return self.rng.uniform(*self.latency)

    def _when_running(self, node: SimNode, action: Callable[[], object]) -> None:
        """Run `action` on `node` now, or when its loop resumes; never for a later life of the node."""
        epoch = node.epoch

        def guarded() -> None:
            if node.epoch != epoch or not node.running:
                return
            if self.now < node.paused_until:
                node.backlog.append(guarded)
                return
            action()
            self._flush(node)

        guarded()

    def _flush(self, node: SimNode) -> None:
        m = node.membership
        node.persisted_incarnation = m.incarnation
        outbox, m.outbox = m.outbox, []
        for addr, message in outbox:
            self._datagram(node, addr, message)
        requests, m.push_pull_requests = m.push_pull_requests, []
        for addr in requests:
            self._push_pull(node, addr)
        pings, m.tcp_ping_requests = m.tcp_ping_requests, []
        for ping in pings:
            self._tcp_ping(node, ping.addr, ping.node, ping.deadline)
        for event in m.events:
            self.log.append(Observed(self.now, node.node_id, event.kind, event.node))
        m.events.clear()
        for notice in m.notices:
            self.notices.append((self.now, node.node_id, notice))
        m.notices.clear()
        self._schedule_tick(node)

    def _schedule_tick(self, node: SimNode) -> None:
        if not node.running or self.now < node.paused_until:
            return
        due = max(node.membership.next_deadline(), self.now)
        if due >= node.next_tick:
            return
        node.next_tick = due
        epoch = node.epoch

        def tick() -> None:
            if node.epoch != epoch or not node.running or node.next_tick != due or self.now < node.paused_until:
                return
            node.next_tick = math.inf
            node.membership.tick(self.now)
            after = node.membership.next_deadline()
            assert after > self.now, f"{node.node_id}: tick at {self.now} left a deadline at {after}"
            self._flush(node)

        self._at(due, tick)

    def _datagram(self, node: SimNode, addr: Addr, message: Message) -> None:
        node.bytes_sent += datagram_size(message)
        node.datagrams_sent += 1
        if self.record:
            self.sent.append((self.now, node.node_id, addr, message))
        dst_id = self.by_addr.get(addr)
        if dst_id is None or not self._reachable(node.node_id, dst_id) or self.rng.random() < self.loss:
            return
        dst, source = self.nodes[dst_id], node.addr

        def deliver() -> None:
            if dst.running:
                self._when_running(dst, lambda: dst.membership.receive(self.now, source, message))

        self._at(self.now + self._latency(), deliver)

    def _push_pull(self, node: SimNode, addr: Addr) -> None:
        state = node.membership.push_pull_state()
        node.bytes_sent += datagram_size(state) + TCP_FRAME_PREFIX
        dst_id = self.by_addr.get(addr)
        if dst_id is None or not self.nodes[dst_id].running or not self._reachable(node.node_id, dst_id):
            return  # the connection fails; the membership is not told (it retries on its own schedule)
        dst, epoch = self.nodes[dst_id], node.epoch

        def serve() -> None:
            if not dst.running:
                return
            if self.now < dst.paused_until:
                self._at(dst.paused_until, serve)  # the kernel accepted the connection; the stalled loop reads it later
                return
            answer = dst.membership.push_pull_received(self.now, state)
            self._flush(dst)
            dst.bytes_sent += datagram_size(answer) + TCP_FRAME_PREFIX
            self._at(self.now + self._latency(), lambda: finish(answer))

        def finish(answer: PushPull) -> None:
            if node.epoch == epoch:
                self._when_running(node, lambda: node.membership.push_pull_reply(self.now, addr, answer))

        # A connect, then the request: two one-way trips before the server reads it.
        self._at(self.now + 2 * self._latency(), serve)

    def _tcp_ping(self, node: SimNode, addr: Addr, target: str, deadline: float) -> None:
        dst_id = self.by_addr.get(addr)
        if dst_id is None or not self.nodes[dst_id].running or not self._reachable(node.node_id, dst_id):
            return  # no answer: the probe's deadline passes on its own
        dst, epoch = self.nodes[dst_id], node.epoch

        def answer() -> None:
            if not dst.running:
                return
            if self.now < dst.paused_until:
                self._at(dst.paused_until, answer)  # the kernel accepted the connection; the loop reads it later
                return
            ok = dst.membership.node_id == target

            def result() -> None:
                if node.epoch == epoch and self.now <= deadline:
                    self._when_running(node, lambda: node.membership.tcp_ping_result(self.now, target, ok))

            self._at(self.now + self._latency(), result)

        self._at(self.now + 2 * self._latency(), answer)
