"""SWIM with Lifeguard as a pure state machine, after HashiCorp memberlist (state.go, suspicion.go, awareness.go, queue.go).

No sockets, no asyncio, no clock: the runtime feeds it inputs with the time and carries out what it asks.

    inputs    join(seeds) · receive(now, source, message) · tick(now) · leave(now) · set_meta(meta)
              push_pull_received(now, remote) -> ours · push_pull_reply(now, addr, remote) · tcp_ping_result(now, node, ok)
    outputs   outbox               (addr, message) datagrams; piggybacked broadcasts already packed in as a Compound
              push_pull_requests   addresses to exchange `push_pull_state()` with over TCP (join, every push-pull
                                   interval, dead members every dead_retry_interval, seeds while we know nobody)
              tcp_ping_requests    TcpPing: the fallback ping over TCP; answer with tcp_ping_result
              events               Event(kind, node): joined, alive, suspect, dead, left, updated
              notices              DocumentNotice values newer than any seen before for their node (this node's own
                                   too: members hold a newer document of it than it makes, so it must start above)
    queries   members() · alive_count() · health_score() · incarnation · next_deadline() · leave_done

The runtime empties the output lists after each call (they only grow here), calls `tick` no later than
`next_deadline()`, and persists `incarnation` whenever it changes: a restarted node passes it back, starts one
above it, and so beats any Dead that its previous life left behind.

Incarnations only grow. An Alive needs a higher incarnation than the one known (a node about itself refutes
anything else); a Suspect needs an equal or higher one and only turns an alive member suspect; a Dead needs
an equal or higher one and overrides both. A Dead whose source is the node itself means it left.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple

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
from gpubroker.gossip.suspicion import Awareness, Suspicion, expected_confirmations, suspicion_timeout

PUSH_PULL_SCALE_THRESHOLD = 32  # memberlist: push-pull slows down logarithmically above this many members


@dataclass(frozen=True, slots=True)
class MembershipConfig:
    """memberlist's DefaultLANConfig, in seconds, plus the two additions of SPEC §7 (dead retries, kept incarnations)."""

    probe_interval: float = 1.0
    probe_timeout: float = 0.5  # the direct ping's wait; not scaled by health (memberlist: waiting longer does not help UDP)
    indirect_checks: int = 3
    suspicion_mult: int = 4
    suspicion_max_timeout_mult: int = 6
    retransmit_mult: int = 4
    gossip_interval: float = 0.2
    gossip_nodes: int = 3
    push_pull_interval: float = 30.0
    awareness_max_multiplier: int = 8
    gossip_to_the_dead_time: float = 30.0
    dead_retry_interval: float = 10.0  # ours: push-pull with each dead member this often, so a healed partition rejoins
    reconnect_timeout: float = 24 * 3600.0  # ours (Serf's default): a dead or left member is forgotten after this
    tcp_fallback_ping: bool = True
    # Bytes for the bodies of one datagram's messages, as `size_of` counts them: 1,400 on the wire less AES-GCM (29),
    # the wire header (3) and the Compound's own prefix and array header (8).
    datagram_budget: int = 1360


class EventKind(StrEnum):
    JOINED = "joined"  # first seen, alive
    ALIVE = "alive"  # back to alive from suspect, dead or left (a refutation, a rejoin)
    SUSPECT = "suspect"
    DEAD = "dead"
    LEFT = "left"
    UPDATED = "updated"  # still alive, with new meta or a new address


class Event(NamedTuple):
    kind: EventKind
    node: str


@dataclass(frozen=True, slots=True)
class MemberView:
    node: str
    addr: Addr
    state: MemberState
    incarnation: int
    meta: bytes
    since: float  # when this node last saw the state change, on its own clock


@dataclass(frozen=True, slots=True)
class TcpPing:
    """Send `ping` to `addr` over TCP; report whether an Ack came back before `deadline` with tcp_ping_result."""

    node: str
    addr: Addr
    ping: Ping
    deadline: float


def estimate_size(message: Message) -> int:
    """Roughly the bytes msgpack gives the message's body (a short key and a value per field); used when no encoder is given."""
    if isinstance(message, Compound):
        return 8 + sum(estimate_size(part) for part in message.parts)
    if isinstance(message, PushPull):
        return 8 + sum(24 + len(m.node) + len(m.addr[0]) + len(m.meta) for m in message.members)
    total = 4
    for f in dataclasses.fields(message):
        value = getattr(message, f.name)
        if isinstance(value, bool):
            total += 3
        elif isinstance(value, int):
            total += 2 + (1 if 0 <= value < 128 else 5 if -(2**31) <= value < 2**32 else 9)
        elif isinstance(value, str | bytes):
            total += 4 + len(value)
        elif isinstance(value, tuple):
            total += 8 + len(value[0])
    return total


@dataclass
class _Broadcast:
    message: Message
    size: int
    order: int
    transmits: int = 0


class BroadcastQueue:
    """memberlist's TransmitLimitedQueue: fewest transmits first, a newer broadcast with the same key replaces the older."""

    def __init__(self, size_of: Callable[[Message], int], retransmit_mult: int) -> None:
        self._size_of = size_of
        self._mult = retransmit_mult
        self._items: dict[tuple[str, str], _Broadcast] = {}
        self._order = 0

    def __len__(self) -> int:
        return len(self._items)

    def limit(self, n: int) -> int:
        """How many times one broadcast is sent in a cluster of n: retransmit_mult × ceil(log10(n + 1))."""
        return self._mult * math.ceil(math.log10(n + 1))

    def queue(self, key: tuple[str, str], message: Message) -> None:
        self._order += 1
        self._items[key] = _Broadcast(message, self._size_of(message), self._order)

    def has(self, key: tuple[str, str]) -> bool:
        return key in self._items

    def take(self, budget: int, n: int) -> list[Message]:
        """Broadcasts that fit `budget` bytes, each counted as sent once; those at the limit leave the queue."""
        if not self._items:
            return []
        limit = self.limit(n)
        # memberlist's order: fewest transmits, then the largest, then the newest.
        ranked = sorted(self._items.items(), key=lambda kv: (kv[1].transmits, -kv[1].size, -kv[1].order))
        taken: list[Message] = []
        for key, item in ranked:
            if item.size > budget:
                continue
            budget -= item.size
            taken.append(item.message)
            item.transmits += 1
            if item.transmits >= limit:
                del self._items[key]
        return taken


@dataclass
class _Member:
    node: str
    addr: Addr
    incarnation: int
    state: MemberState
    meta: bytes
    since: float
    in_ring: bool = False


@dataclass
class _Probe:
    node: str
    seq: int
    start: float
    timeout_at: float  # the direct ping's wait ends; indirect pings and the TCP ping go out
    deadline: float  # the probe ends: suspect unless something answered
    indirect: bool = False
    expected_nacks: int = 0
    nacks: int = 0
    tcp_ok: bool = False


@dataclass(frozen=True, slots=True)
class _Relay:
    """An indirect ping we forward for `requester`: its Ack goes back under the requester's seq."""

    seq: int
    requester: Addr
    nack: bool
    deadline: float


def _next_tick(previous: float, interval: float, now: float) -> float:
    """A ticker's next firing after `now`, keeping its phase (missed ticks are skipped, as Go's ticker does)."""
    if previous > now:
        return previous
    return previous + (math.floor((now - previous) / interval) + 1) * interval


class Membership:
    """One node's view of the cluster; see the module docstring for the inputs, outputs and queries."""

    def __init__(
        self,
        node_id: str,
        addr: Addr,
        config: MembershipConfig,
        rng: random.Random,
        incarnation: int = 0,
        meta: bytes = b"",
        size_of: Callable[[Message], int] = estimate_size,
    ) -> None:
        """`incarnation` is the last one this node used (persisted by the runtime); it starts one above it."""
        self.node_id = node_id
        self.addr = addr
        self.config = config
        self.rng = rng
        self.size_of = size_of
        self.outbox: list[tuple[Addr, Message]] = []
        self.push_pull_requests: list[Addr] = []
        self.tcp_ping_requests: list[TcpPing] = []
        self.events: list[Event] = []
        self.notices: list[DocumentNotice] = []
        self._members: dict[str, _Member] = {}
        self._ring: list[str] = []  # probe order: every other member not yet reaped, shuffled each round
        self._probe_index = 0
        self._seq = 0
        self._awareness = Awareness(config.awareness_max_multiplier)
        self._suspicions: dict[str, Suspicion] = {}
        self._queue = BroadcastQueue(size_of, config.retransmit_mult)
        self._probe: _Probe | None = None
        self._relays: dict[int, _Relay] = {}
        self._now: float | None = None
        self._next_probe = self._next_gossip = self._next_push_pull = self._next_retry = math.inf
        self._seeds: list[Addr] = []
        self._joined = False
        self._left = False
        self._documents: dict[str, tuple[int, int]] = {}
        # memberlist's setAlive: the first incarnation is one above the last one used, so it beats a Dead left behind.
        self._members[node_id] = _Member(node_id, addr, incarnation + 1, MemberState.ALIVE, meta, 0.0)
        self._queue.queue(("member", node_id), self._my_alive())

    # --- queries ---------------------------------------------------------------------------------------------

    @property
    def incarnation(self) -> int:
        return self._members[self.node_id].incarnation

    @property
    def leave_done(self) -> bool:
        """After leave(): True once our Dead has been sent as often as the queue sends a broadcast (or was replaced)."""
        return self._left and not self._queue.has(("member", self.node_id))

    def members(self) -> list[MemberView]:
        return [MemberView(m.node, m.addr, m.state, m.incarnation, m.meta, m.since) for m in self._members.values()]

    def member(self, node: str) -> MemberView | None:
        m = self._members.get(node)
        return None if m is None else MemberView(m.node, m.addr, m.state, m.incarnation, m.meta, m.since)

    def alive_count(self) -> int:
        """Members alive in this view, this node included."""
        return sum(1 for m in self._members.values() if m.state is MemberState.ALIVE)

    def health_score(self) -> int:
        """Lifeguard's local health: 0 healthy, up to awareness_max_multiplier − 1; probe interval scales by score + 1."""
        return self._awareness.score

    def cluster_size(self) -> int:
        """memberlist's estNumNodes: this node and every member still in the probe ring (dead ones until reaped)."""
        return len(self._ring) + 1

    def next_deadline(self) -> float:
        """The latest time by which the runtime must call tick (math.inf before the first input)."""
        if self._now is None:
            return math.inf
        times = [self._next_push_pull, self._next_retry]
        if self._probe is not None:
            times.append(self._probe.deadline if self._probe.indirect else self._probe.timeout_at)
        elif not self._left:
            times.append(self._next_probe)
        if self._queue:
            # An idle gossip ticker skips its empty ticks; the next one that has something to send is on its phase.
            self._next_gossip = _next_tick(self._next_gossip, self.config.gossip_interval, self._now - 1e-9)
            times.append(self._next_gossip)
        times.extend(r.deadline for r in self._relays.values())
        times.extend(s.deadline for s in self._suspicions.values())
        return min(times)

    # --- inputs ----------------------------------------------------------------------------------------------

    def join(self, seeds: Iterable[Addr]) -> None:
        """Push-pull with every seed now, and again every dead_retry_interval while we know no other live member."""
        self._seeds = [s for s in seeds if s != self.addr]
        self._joined = False
        self.push_pull_requests.extend(self._seeds)

    def tick(self, now: float) -> None:
        self._start(now)
        for seq, relay in list(self._relays.items()):
            if now >= relay.deadline:
                del self._relays[seq]
                if relay.nack:
                    self._send(relay.requester, Nack(relay.seq))
        self._advance_probe(now)
        for node, suspicion in list(self._suspicions.items()):
            if now >= suspicion.deadline:
                del self._suspicions[node]
                m = self._members.get(node)
                if m is not None and m.state is MemberState.SUSPECT:
                    self._on_dead(now, Dead(m.incarnation, node, self.node_id))
        if now >= self._next_gossip:
            self._gossip(now)
            self._next_gossip = _next_tick(self._next_gossip, self.config.gossip_interval, now)
        if now >= self._next_push_pull:
            if not self._left:
                peers = [m for m in self._others() if m.state is MemberState.ALIVE]
                if peers:
                    self.push_pull_requests.append(self.rng.choice(peers).addr)
            interval = _push_pull_scale(self.config.push_pull_interval, self.cluster_size())
            self._next_push_pull = _next_tick(self._next_push_pull, interval, now)
        if now >= self._next_retry:
            self._retry_dead(now)
            self._next_retry = _next_tick(self._next_retry, self.config.dead_retry_interval, now)

    def receive(self, now: float, source: Addr, message: Message) -> None:
        """One datagram's message from `source` (replies go to the address the message names, as memberlist's do)."""
        self._start(now)
        parts = message.parts if isinstance(message, Compound) else (message,)
        for part in parts:
            self._handle(now, part)

    def leave(self, now: float) -> None:
        """Announce that we leave (a Dead about ourselves); keep ticking until leave_done, or a timeout, then stop."""
        self._start(now)
        if self._left:
            return
        self._left = True
        self._probe = None
        me = self._members[self.node_id]
        self._on_dead(now, Dead(me.incarnation, self.node_id, self.node_id))

    def set_meta(self, now: float, meta: bytes) -> None:
        """New meta for this node: a higher incarnation, announced as an Alive."""
        self._start(now)
        me = self._members[self.node_id]
        me.meta = meta
        me.incarnation += 1
        self._queue.queue(("member", self.node_id), self._my_alive())

    def broadcast(self, notice: DocumentNotice) -> None:
        """Gossip an application notice; it replaces any queued notice about the same node."""
        self._documents[notice.node] = max(self._documents.get(notice.node, (-1, -1)), (notice.generation, notice.version))
        self._queue.queue(("document", notice.node), notice)

    def push_pull_state(self) -> PushPull:
        """Everything we know, for a TCP push-pull; `join` until a first exchange has succeeded."""
        members = tuple(Member(m.node, m.addr, m.incarnation, m.state, m.meta) for m in self._members.values())
        return PushPull(members, join=not self._joined)

    def push_pull_received(self, now: float, remote: PushPull) -> PushPull:
        """Serve a push-pull: merge the remote state, then answer ours (after merging, so a refutation rides the answer)."""
        self._start(now)
        self._merge(now, remote)
        return dataclasses.replace(self.push_pull_state(), join=remote.join)

    def push_pull_reply(self, now: float, addr: Addr, remote: PushPull) -> None:
        """The answer to a push-pull we asked `addr` for; a runtime need not report failures."""
        self._start(now)
        before = self.incarnation
        self._merge(now, remote)
        self._joined = True
        if self.incarnation != before:
            # The peer thinks we are dead or suspect: tell it at once rather than wait for it to hear the gossip.
            self._send(addr, self._my_alive())

    def tcp_ping_result(self, now: float, node: str, ok: bool) -> None:
        probe = self._probe
        if ok and probe is not None and probe.node == node and now <= probe.deadline:
            probe.tcp_ok = True

    def answer_tcp_ping(self, ping: Ping) -> Ack | None:
        """What the runtime's TCP server answers to a fallback ping: an Ack if the ping is for us."""
        return Ack(ping.seq) if ping.target == self.node_id else None

    # --- probing ---------------------------------------------------------------------------------------------

    def _start(self, now: float) -> None:
        if self._now is None:
            c = self.config
            # Random stagger, as memberlist's tickers start: nodes started together do not probe in lock step.
            self._next_probe = now + self.rng.uniform(0, c.probe_interval)
            self._next_gossip = now + self.rng.uniform(0, c.gossip_interval)
            self._next_push_pull = now + self.rng.uniform(0, c.push_pull_interval)
            self._next_retry = now + self.rng.uniform(0, c.dead_retry_interval)
            self._members[self.node_id].since = now
        self._now = now if self._now is None else max(self._now, now)

    def _advance_probe(self, now: float) -> None:
        probe = self._probe
        if probe is not None:
            if not probe.indirect and now >= probe.timeout_at:
                self._probe_indirectly(probe, now)
            if probe.indirect and now >= probe.deadline:
                self._probe = None
                self._probe_failed(probe, now)
        if self._probe is None and not self._left and now >= self._next_probe:
            self._next_probe = _next_tick(self._next_probe, self.config.probe_interval, now)
            self._probe_next(now)

    def _probe_next(self, now: float) -> None:
        checked = 0
        while checked <= len(self._ring):
            if self._probe_index >= len(self._ring):
                self._reset_ring(now)
                self._probe_index = 0
                checked += 1
                continue
            m = self._members[self._ring[self._probe_index]]
            self._probe_index += 1
            if m.state in (MemberState.DEAD, MemberState.LEFT):
                checked += 1
                continue
            self._probe_member(m, now)
            return

    def _probe_member(self, m: _Member, now: float) -> None:
        seq = self._next_seq()
        interval = self._awareness.scale(self.config.probe_interval)
        self._probe = _Probe(m.node, seq, now, now + self.config.probe_timeout, now + interval)
        ping = Ping(seq, m.node, self.node_id, self.addr)
        # The buddy system: a suspect hears of its suspicion from the next node that probes it, and can refute at once.
        buddy = (Suspect(m.incarnation, m.node, self.node_id),) if m.state is MemberState.SUSPECT else ()
        self._send(m.addr, ping, buddy)

    def _probe_indirectly(self, probe: _Probe, now: float) -> None:
        probe.indirect = True
        if now >= probe.deadline:
            # We ran late (a stalled loop): the indirect pings still get their full time before we suspect anyone.
            probe.deadline = now + (probe.deadline - probe.timeout_at)
        target = self._members.get(probe.node)
        if target is None:
            return
        relays = [m for m in self._others() if m.state is MemberState.ALIVE and m.node != target.node]
        for relay in self.rng.sample(relays, min(self.config.indirect_checks, len(relays))):
            self._send(relay.addr, IndirectPing(probe.seq, target.node, target.addr, self.node_id, self.addr, nack=True))
            probe.expected_nacks += 1
        if self.config.tcp_fallback_ping:
            ping = Ping(probe.seq, target.node, self.node_id, self.addr)
            self.tcp_ping_requests.append(TcpPing(target.node, target.addr, ping, probe.deadline))

    def _probe_failed(self, probe: _Probe, now: float) -> None:
        if probe.tcp_ok:
            return  # UDP fails but TCP works: a misconfigured network, not a dead node (memberlist warns and moves on)
        # Lifeguard: relays that answered Nack could not reach the target either, so the target is to blame; each
        # missing Nack hints that our own network or loop is the trouble. With no relays, any failure counts once.
        if probe.expected_nacks > 0:
            self._awareness.apply(max(0, probe.expected_nacks - probe.nacks))
        else:
            self._awareness.apply(1)
        m = self._members.get(probe.node)
        if m is not None:
            self._on_suspect(now, Suspect(m.incarnation, m.node, self.node_id))

    def _reset_ring(self, now: float) -> None:
        """A new probe round: drop members dead past gossip_to_the_dead_time from the ring (not from the view), shuffle."""
        keep: list[str] = []
        for node in self._ring:
            m = self._members.get(node)
            if m is None:
                continue
            if m.state in (MemberState.DEAD, MemberState.LEFT) and now - m.since > self.config.gossip_to_the_dead_time:
                m.in_ring = False
                continue
            keep.append(node)
        self.rng.shuffle(keep)
        self._ring = keep

    def _add_to_ring(self, m: _Member) -> None:
        # At a random place, as memberlist does: appending would leave a newcomer unprobed for a whole round.
        if m.in_ring or m.node == self.node_id:
            return
        m.in_ring = True
        offset = self.rng.randrange(len(self._ring) + 1)
        self._ring.append(m.node)
        self._ring[offset], self._ring[-1] = self._ring[-1], self._ring[offset]

    # --- gossip and anti-entropy -----------------------------------------------------------------------------

    def _gossip(self, now: float) -> None:
        if not self._queue:
            return
        targets = [
            m
            for m in self._others()
            if m.state in (MemberState.ALIVE, MemberState.SUSPECT)
            or (m.state is MemberState.DEAD and now - m.since <= self.config.gossip_to_the_dead_time)
        ]
        for m in self.rng.sample(targets, min(self.config.gossip_nodes, len(targets))):
            parts = self._queue.take(self.config.datagram_budget, self.cluster_size())
            if not parts:
                return
            self.outbox.append((m.addr, parts[0] if len(parts) == 1 else Compound(tuple(parts))))

    def _retry_dead(self, now: float) -> None:
        for m in [m for m in self._members.values() if m.node != self.node_id]:
            if m.state in (MemberState.DEAD, MemberState.LEFT) and now - m.since > self.config.reconnect_timeout:
                del self._members[m.node]
                if m.in_ring:
                    self._ring.remove(m.node)
            elif m.state is MemberState.DEAD and not self._left:
                self.push_pull_requests.append(m.addr)
        if self._seeds and not self._left and not any(m.state in (MemberState.ALIVE, MemberState.SUSPECT) for m in self._others()):
            self.push_pull_requests.extend(self._seeds)

    def _merge(self, now: float, remote: PushPull) -> None:
        for r in remote.members:
            if r.state is MemberState.ALIVE:
                self._on_alive(now, Alive(r.incarnation, r.node, r.addr, r.meta))
            elif r.state is MemberState.LEFT:
                self._on_dead(now, Dead(r.incarnation, r.node, r.node))
            else:
                # memberlist: a remote "dead" only makes us suspect, so the member gets its chance to refute.
                self._on_suspect(now, Suspect(r.incarnation, r.node, self.node_id))

    # --- messages --------------------------------------------------------------------------------------------

    def _handle(self, now: float, message: Message) -> None:
        match message:
            case Ping():
                if message.target == self.node_id:
                    self._send(message.source_addr, Ack(message.seq))
            case IndirectPing():
                seq = self._next_seq()
                self._relays[seq] = _Relay(message.seq, message.source_addr, message.nack, now + self.config.probe_timeout)
                self._send(message.target_addr, Ping(seq, message.target, self.node_id, self.addr))
            case Ack():
                probe = self._probe
                if probe is not None and message.seq == probe.seq:
                    self._probe = None
                    self._awareness.apply(-1)
                relay = self._relays.pop(message.seq, None)
                if relay is not None:
                    self._send(relay.requester, Ack(relay.seq))
            case Nack():
                if self._probe is not None and message.seq == self._probe.seq:
                    self._probe.nacks += 1
            case Alive():
                self._on_alive(now, message)
            case Suspect():
                self._on_suspect(now, message)
            case Dead():
                self._on_dead(now, message)
            case DocumentNotice():
                seen = self._documents.get(message.node)
                if seen is None or (message.generation, message.version) > seen:
                    self._documents[message.node] = (message.generation, message.version)
                    self.notices.append(message)
                    self._queue.queue(("document", message.node), message)
                elif (message.generation, message.version) < seen and not self._queue.has(("document", message.node)):
                    # Behind what we heard: a late copy, or a node started from older state (a VM restored from a
                    # snapshot) whose documents every member would ignore. The newer notice is told again, so
                    # the node hears of it and starts a generation above it (as a node refutes an old incarnation).
                    self._queue.queue(("document", message.node), DocumentNotice(message.node, *seen))
            case PushPull() | Compound():
                pass  # push-pull travels over TCP; a Compound inside a Compound is not a thing senders make

    def _on_alive(self, now: float, a: Alive) -> None:
        me = a.node == self.node_id
        if me and self._left:
            return
        m = self._members.get(a.node)
        if m is None:
            m = _Member(a.node, a.addr, a.incarnation, MemberState.ALIVE, a.meta, now)
            self._members[a.node] = m
            self._add_to_ring(m)
            self._queue.queue(("member", a.node), a)
            self.events.append(Event(EventKind.JOINED, a.node))
            return
        if me:
            if a.incarnation < m.incarnation or (a.incarnation == m.incarnation and a.meta == m.meta and a.addr == m.addr):
                return
            self._refute(a.incarnation)  # someone announces us with other facts: a previous life of ours, or an impostor
            return
        if a.incarnation <= m.incarnation:
            return
        self._suspicions.pop(a.node, None)
        self._queue.queue(("member", a.node), a)
        changed = a.meta != m.meta or a.addr != m.addr
        m.incarnation, m.meta, m.addr = a.incarnation, a.meta, a.addr
        if m.state is not MemberState.ALIVE:
            m.state = MemberState.ALIVE
            m.since = now
            self._add_to_ring(m)
            self.events.append(Event(EventKind.ALIVE, a.node))
        elif changed:
            self.events.append(Event(EventKind.UPDATED, a.node))

    def _on_suspect(self, now: float, s: Suspect) -> None:
        m = self._members.get(s.node)
        if m is None or s.incarnation < m.incarnation:
            return
        suspicion = self._suspicions.get(s.node)
        if suspicion is not None:
            # A new, independent accuser shortens the timeout; re-gossip it so the others count it too.
            if suspicion.confirm(s.source):
                self._queue.queue(("member", s.node), s)
            return
        if m.state is not MemberState.ALIVE:
            return
        if s.node == self.node_id:
            if not self._left:
                self._refute(s.incarnation)
            return
        self._queue.queue(("member", s.node), s)
        m.incarnation = s.incarnation
        m.state = MemberState.SUSPECT
        m.since = now
        self.events.append(Event(EventKind.SUSPECT, s.node))
        c = self.config
        n = self.cluster_size()
        shortest = suspicion_timeout(c.suspicion_mult, n, c.probe_interval)
        k = expected_confirmations(c.suspicion_mult, n)
        self._suspicions[s.node] = Suspicion(now, k, shortest, c.suspicion_max_timeout_mult * shortest, s.source)

    def _on_dead(self, now: float, d: Dead) -> None:
        m = self._members.get(d.node)
        if m is None or d.incarnation < m.incarnation:
            return
        self._suspicions.pop(d.node, None)
        if m.state in (MemberState.DEAD, MemberState.LEFT):
            return
        if d.node == self.node_id and not self._left:
            self._refute(d.incarnation)
            return
        self._queue.queue(("member", d.node), d)
        m.incarnation = d.incarnation
        m.state = MemberState.LEFT if d.source == d.node else MemberState.DEAD
        m.since = now
        if d.node != self.node_id:
            self.events.append(Event(EventKind.LEFT if m.state is MemberState.LEFT else EventKind.DEAD, d.node))

    def _refute(self, accused: int) -> None:
        me = self._members[self.node_id]
        me.incarnation = max(me.incarnation, accused) + 1
        self._awareness.apply(1)  # Lifeguard: being accused hints that we are the slow one
        self._queue.queue(("member", self.node_id), self._my_alive())

    # --- helpers ---------------------------------------------------------------------------------------------

    def _send(self, addr: Addr, message: Message, extra: tuple[Message, ...] = ()) -> None:
        """One datagram: the message, then what fits of the broadcast queue (memberlist piggybacks on every packet)."""
        parts = [message, *extra]
        budget = self.config.datagram_budget - sum(self.size_of(p) for p in parts)
        parts.extend(self._queue.take(budget, self.cluster_size()))
        self.outbox.append((addr, parts[0] if len(parts) == 1 else Compound(tuple(parts))))

    def _my_alive(self) -> Alive:
        me = self._members[self.node_id]
        return Alive(me.incarnation, self.node_id, self.addr, me.meta)

    def _others(self) -> list[_Member]:
        """Every other member still in the probe ring (alive, suspect, or dead and not yet reaped)."""
        return [m for m in self._members.values() if m.in_ring]

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq


def _push_pull_scale(interval: float, n: int) -> float:
    """memberlist's pushPullScale: the interval grows by one step per doubling of the cluster above 32 members."""
    if n <= PUSH_PULL_SCALE_THRESHOLD:
        return interval
    return (math.ceil(math.log2(n) - math.log2(PUSH_PULL_SCALE_THRESHOLD)) + 1.0) * interval
