"""The mesh at run time: membership over encrypted UDP, documents and push-pull over mutual TLS, discovery.

One `Mesh` per broker. It ticks the membership state machine, carries what it asks for on the
two transports, publishes this node's document and fetches newer ones, works out the
coordinator, and answers what peers ask over TCP. Gossip carries views, never decisions: only
a GPU's own node grants on it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import math
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgpack
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from gpubroker.broker.request import LeaseRequest
from gpubroker.broker.service import ADMINS, Broker, Caller, RefusalBudget
from gpubroker.errors import BrokerError, FailureCode
from gpubroker.gossip import wire
from gpubroker.gossip.cluster import MAX_PENDING, ClusterError, ClusterState, JoinGrant, decode_token, new_key_b64
from gpubroker.gossip.coordinator import GONE, PROVISIONAL, Candidate, Coordinator, choose, merge, provisional
from gpubroker.gossip.discovery import Discovery, Sighting
from gpubroker.gossip.documents import (
    ClusterView,
    DocumentError,
    NodeDocument,
    Publisher,
    listed_lease,
    listed_leases,
    open_document,
    sign_document,
    summarize,
)
from gpubroker.gossip.identity import Identity, IdentityError, node_id_of, node_id_of_certificate, public_key_of
from gpubroker.gossip.keyring import cluster_hash, key_id
from gpubroker.gossip.membership import Membership, MembershipConfig, MemberView
from gpubroker.gossip.messages import Addr, DocumentNotice, MemberState, Message, PushPull
from gpubroker.gossip.transport import Datagrams, PeerError, PeerServer, PeerUnreachable, call_for_join, call_member, call_unpinned
from gpubroker.units import printable_text, rfc3339

log = logging.getLogger(__name__)
PUBLISH_EVERY = 0.5  # seconds between looks at our own figures; the Publisher keeps versions ≥ 1 s apart
# Seconds after its start by which a node announces its own choice of coordinator even without having heard every
# member's document (some may be down): a push-pull interval, in which a live member publishes three times.
SETTLE_WITHIN = 30.0
# Seconds after which it announces its choice even while members it hears alive have not sent their documents (a
# peer whose documents cannot be fetched must not leave the cluster without a coordinator for good).
SETTLE_AT_MOST = 5 * SETTLE_WITHIN
REMOVAL_NOTICE_WITHIN = 2.0  # seconds a removal waits to tell the removed node; it is told at most once, best effort


@dataclass(frozen=True, slots=True)
class MeshSettings:
    gossip: Addr  # where UDP and TCP listen
    advertise: str  # the address peers should use
    peers: tuple[Addr, ...] = ()
    priority: int = 0  # coordinator priority: lower is preferred
    mdns: bool = True


@dataclass(slots=True)
class _Meta:
    name: str
    api: str
    priority: int

    def encode(self) -> bytes:
        packed: bytes = msgpack.packb([self.name, self.api, self.priority])
        return packed

    @classmethod
    def decode(cls, data: bytes) -> _Meta | None:
        try:
            name, api, priority = msgpack.unpackb(data, raw=False)
            return cls(str(name), str(api), int(priority))
        except Exception:  # a newer node's meta we cannot read: shown without it
            return None


async def join_cluster(token: str, identity: Identity, name: str, state_dir: Any) -> ClusterState:
    """Redeem a join token at its seed over the join handshake, and keep what it grants."""
    parsed = decode_token(token)
    request = {"op": "join", "secret": parsed.secret, "cert": identity.certificate_pem().decode(), "name": name}
    try:
        answer = await call_for_join(parsed.seed, parsed.fingerprint, request)
    except PeerUnreachable as error:
        # Only the member that issued the token can redeem it: no other member will do, however many are up.
        raise ClusterError(
            f"the member that issued this token, {parsed.seed[0]}:{parsed.seed[1]}, does not answer ({error.reason}): "
            "start its broker or check that this machine reaches that address, then run this again"
        ) from None
    if "error" in answer:
        raise ClusterError(f"the seed {parsed.seed[0]}:{parsed.seed[1]} refused to admit this node: {answer['error']}")
    return ClusterState.adopt(state_dir, identity, name, JoinGrant.from_dict(answer["grant"]), token=parsed)


ASK_EVERY = 2.0  # seconds between a waiting node's requests to the members it found
ASK_FRESH = 120.0  # a request's proof is good for this long either way of the member's clock
MAX_SAID = 256  # characters of a refused joiner's error an event keeps, as the API keeps of a caller's text


def ask_proof(server_fingerprint: str, at: float) -> bytes:
    """What an asking node signs: bound to the member it talks to and to the moment, so it cannot be replayed elsewhere."""
    return f"gpubroker-ask|{server_fingerprint}|{at:.3f}".encode()


@dataclass(slots=True)
class Asker:
    """A node with no cluster and no token: it asks the members it finds to admit it, then waits for an operator."""

    settings: MeshSettings
    identity: Identity
    name: str
    state_dir: Any
    on_event: Callable[[str, str], None]
    clock: Callable[[], float] = time.time
    targets: set[Addr] = field(default_factory=set)
    # How far each member's clock is ahead of ours, as it said when it found our request stale: a box without a
    # real-time clock may be hours off, and its requests would be stale for good; they are stamped on the member's.
    offsets: dict[Addr, float] = field(default_factory=dict)

    def _sighted(self, sighting: Sighting) -> None:
        if sighting.cluster:  # a member of some cluster; mDNS finds, the operator decides
            self.targets.add(sighting.addr)

    async def run(self) -> ClusterState:
        """Returns the cluster once a member grants admission (after `gpubroker nodes approve`)."""
        self.targets.update(self.settings.peers)
        discovery = None
        if self.settings.mdns:
            discovery = Discovery(self.identity.node_id, "", self.settings.advertise, self.settings.gossip[1], self._sighted)
            await discovery.start()
        told: set[Addr] = set()
        try:
            while True:
                for addr in sorted(self.targets):
                    grant = await self._ask(addr)
                    if grant is not None:
                        return ClusterState.adopt(self.state_dir, self.identity, self.name, grant)
                    if addr not in told:
                        told.add(addr)
                        self.on_event(
                            "mesh.ask",
                            f"asked {addr[0]}:{addr[1]} to admit this node; approve it there with `gpubroker nodes approve {self.identity.node_id}`",
                        )
                await asyncio.sleep(ASK_EVERY)
        finally:
            if discovery is not None:
                await discovery.close()

    async def _ask(self, addr: Addr) -> JoinGrant | None:
        answer = await self._asked(addr)
        their = answer.get("now") if answer is not None else None
        if isinstance(their, int | float) and math.isfinite(their):
            self.offsets[addr] = their - self.clock()  # stale on its clock: asked again at once, stamped on its clock
            answer = await self._asked(addr)
        grant = answer.get("grant") if answer is not None else None
        if isinstance(grant, dict):
            with contextlib.suppress(ClusterError):
                return JoinGrant.from_dict(grant)
        return None

    async def _asked(self, addr: Addr) -> dict[str, Any] | None:
        """The answer of the member at `addr` to a request to be admitted, or None when it cannot be reached."""
        at = self.clock() + self.offsets.get(addr, 0.0)

        def request(server_fingerprint: str) -> dict[str, Any]:
            return {
                "op": "ask",
                "cert": self.identity.certificate_pem().decode(),
                "name": self.name,
                "addr": [self.settings.advertise, self.settings.gossip[1]],
                "at": at,
                "proof": self.identity.sign(ask_proof(server_fingerprint, at)),
            }

        try:
            return await call_unpinned(addr, request)
        except PeerError:
            return None


DOCUMENT_RETRIES = (0.0, 0.5, 1.0, 2.0, 4.0)  # seconds before each try to fetch an announced document


@dataclass(slots=True)
class Mesh:
    settings: MeshSettings
    broker: Broker
    identity: Identity
    cluster: ClusterState
    # Two clocks. `clock`, the wall clock, stamps what is kept or compared with another machine's (invites, requests to
    # join, admissions, removals, a document's made_at). `elapsed` only moves forward at one pace: every timer (SWIM's
    # probes, suspicions, gossip, push-pulls, the publisher's pace) and every age (a view's, a member's state's) is
    # measured on it, so a step of the wall clock (NTP arriving on a box without a real-time clock) neither stops the
    # mesh for the length of a step back nor fails every suspect and ages every view at a step forward.
    clock: Callable[[], float] = time.time
    elapsed: Callable[[], float] = time.monotonic
    view: ClusterView = field(default_factory=ClusterView)
    coordinator: Coordinator | None = None
    dropped_documents: int = 0
    _membership: Membership | None = None
    _datagrams: Datagrams | None = None
    _server: PeerServer | None = None
    _discovery: Discovery | None = None
    _publisher: Publisher | None = None
    _own_document: bytes = b""
    _tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    _removed: bool = False
    _learning: set[str] = field(default_factory=set)
    _told: set[str] = field(default_factory=set)  # removed nodes that called and were told so, in this run
    _unsaid: set[str] = field(default_factory=set)  # pending nodes whose asks fell outside the refusal budget, unsaid yet
    _fetching: set[str] = field(default_factory=set)  # nodes whose document is being fetched on sight
    _started: float = float("-inf")  # when run() began, on self.elapsed
    # The budget of the events of joins refused and asks to join, which anyone reaching the gossip port can send: its
    # own, so that a flood of them from the network does not silence this node's refusals of its own users.
    _refusals: RefusalBudget = field(init=False)

    def __post_init__(self) -> None:
        self._refusals = RefusalBudget(self.elapsed)

    @property
    def node_id(self) -> str:
        return self.identity.node_id

    @property
    def membership(self) -> Membership:
        assert self._membership is not None
        return self._membership

    async def run(self) -> None:
        """Listen, join, and keep the mesh going until cancelled; nothing, for a node removed from its cluster."""
        self._started = self.elapsed()
        if self.cluster.is_removed(self.node_id):  # told so before this start: it gossips with no member again
            self._removed = True
            self.broker.record_event("mesh.removed", "this node was removed from its cluster: its mesh is not started", details={})
            return
        generation = self.cluster.next_generation()
        self._publisher = Publisher(self.node_id, generation, self.identity.public_key_bytes)
        meta = _Meta(self.broker.config.name, self.broker.config.listen, self.settings.priority)
        self._datagrams = await Datagrams.open(self.settings.gossip, self.cluster.keyring, self._on_datagram)
        bound = self._datagrams.address
        self._membership = Membership(
            self.node_id,
            (self.settings.advertise, bound[1]),
            MembershipConfig(),
            random.Random(),
            incarnation=self.cluster.incarnation,
            meta=meta.encode(),
            size_of=lambda m: len(wire.encode(m)) - wire.HEADER_SIZE,
        )
        self._server = await PeerServer.start(
            (self.settings.gossip[0], bound[1]), self.identity, self.cluster.members_der, self._on_request, removed=self.cluster.removed_der
        )
        try:
            if self.settings.mdns:
                self._discovery = Discovery(
                    self.node_id, cluster_hash(self.cluster.cluster_id), self.settings.advertise, bound[1], self._sighted
                )
                await self._discovery.start()
            seeds = [addr for addr in self.settings.peers]
            self.membership.join(seeds)
            async with asyncio.TaskGroup() as group:
                group.create_task(self._tick_loop())
                group.create_task(self._publish_loop())
        finally:
            await self.close()

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._membership is not None and self._datagrams is not None and not self._removed:
            await self._leave()
        if self._discovery is not None:
            await self._discovery.close()
            self._discovery = None
        if self._server is not None:
            await self._server.close()
            self._server = None
        if self._datagrams is not None:
            self._datagrams.close()
            self._datagrams = None

    async def _leave(self, within: float = 1.0) -> None:
        """Say we leave, so a stop (systemd, Ctrl-C) shows as "left" on the others, not as a failure found 10 s later."""
        deadline = self.elapsed() + within
        self.membership.leave(self.elapsed())
        while True:
            now = self.elapsed()
            self.membership.tick(now)
            self._drain(now)
            for task in list(self._tasks):  # what draining asked for (pings, pulls) is not waited on now
                task.cancel()
            if self.membership.leave_done or now >= deadline:
                return
            await asyncio.sleep(0.05)

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ----- driving the membership ----------------------------------------

    async def _tick_loop(self) -> None:
        while not self._removed:
            self._tick()
            wait = max(0.005, min(0.2, self.membership.next_deadline() - self.elapsed()))
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), wait)

    def _tick(self) -> None:
        now = self.elapsed()
        self.membership.tick(now)
        self._drain(now)

    def _on_datagram(self, source: Addr, message: Message) -> None:
        if self._membership is None:
            return  # before the membership exists (the first instants of a start)
        now = self.elapsed()
        self.membership.receive(now, source, message)
        self._drain(now)

    def _drain(self, now: float) -> None:
        """Carry out what the membership asked for."""
        m = self.membership
        if self._datagrams is not None:
            by_addr: dict[Addr, list[Message]] = {}
            for addr, message in m.outbox:
                by_addr.setdefault(addr, []).append(message)
            m.outbox.clear()
            for addr, messages in by_addr.items():
                self._datagrams.send(addr, messages)
        for addr in m.push_pull_requests:
            self._spawn(self._push_pull(addr))
        m.push_pull_requests.clear()
        for request in m.tcp_ping_requests:
            self._spawn(self._tcp_ping(request))
        m.tcp_ping_requests.clear()
        for event in m.events:
            self._member_event(str(event.kind), event.node)
        m.events.clear()
        for notice in m.notices:
            if notice.node == self.node_id:
                self._outrun(notice)
            else:
                self._spawn(self._fetch_document(notice))
        m.notices.clear()
        if self.cluster.incarnation != m.incarnation:
            self.cluster.save_incarnation(m.incarnation)
        self._elect()

    def _outrun(self, notice: DocumentNotice) -> None:
        """Members hold a document of this node newer than any of this run's: its state was restored from a snapshot or
        a backup taken before later starts, and they would ignore its documents (and show the old one's leases and
        figures) until its versions passed that one's. Its documents go on from a generation above it."""
        publisher = self._publisher
        if publisher is None or (notice.generation, notice.version) <= (publisher.generation, publisher.version):
            return
        if notice.generation >= 2**63 - 1:  # no document can go on above it (open_document's bound): a forged notice
            return
        publisher.generation = self.cluster.raise_generation(notice.generation + 1)
        publisher.version, publisher.last_made = 0, float("-inf")  # the next look publishes at once
        log.info(
            "members hold document %d.%d of this node: its documents go on at generation %d",
            notice.generation,
            notice.version,
            publisher.generation,
        )

    def _member_event(self, kind: str, node: str) -> None:
        if self.cluster.is_removed(node):
            return  # a removed node heard of again is not news
        if kind in ("dead", "left"):
            self.broker.record_event(f"mesh.member.{kind}", f"node {self._name_of(node)} ({node}) is {kind}", details={"node": node})
        elif kind in ("joined", "alive"):
            said = "joined: first heard of here, alive" if kind == "joined" else "is alive"
            self.broker.record_event(f"mesh.member.{kind}", f"node {self._name_of(node)} ({node}) {said}", details={"node": node})
            if node not in self.cluster.members and node not in self._learning:
                self._learning.add(node)
                self._spawn(self._learn_member(node))
            elif self.view.knows(node) is None and node not in self._fetching:
                # Its document is fetched on sight: it announces the next only on a change or after 10 s unchanged, and
                # until then this node (just started, say) would show the member with no figures and no leases.
                self._fetching.add(node)
                self._spawn(self._fetch_on_sight(node))

    async def _learn_member(self, node: str) -> None:
        """A node admitted by another member is heard of by gossip before its certificate arrives; a push-pull with a
        member whose certificate we have brings it at once (not at the next periodic one, up to 30 s away), so TLS
        with the newcomer, and its document, work from the start."""
        try:
            for attempt in range(3):
                known = [m for m in self._others() if m.node != node and m.node in self.cluster.members and m.state == MemberState.ALIVE]
                random.shuffle(known)
                for member in known[:2]:
                    await self._push_pull(member.addr)
                    if node in self.cluster.members:
                        return
                await asyncio.sleep(1.0 + attempt)
        finally:
            self._learning.discard(node)

    def _others(self) -> list[Any]:
        """The other nodes the membership knows, but for removed ones: a removed node may still gossip with the
        cluster key until the next key change, but it is no member, no coordinator and no peer to show."""
        return [m for m in self.membership.members() if m.node != self.node_id and not self.cluster.is_removed(m.node)]

    def _name_of(self, node: str) -> str:
        member = self.membership.member(node)
        meta = _Meta.decode(member.meta) if member is not None else None
        return meta.name if meta else node

    def _elect(self) -> None:
        candidates = {Candidate(self.settings.priority, self.node_id): MemberState.ALIVE}
        for member in self._others():
            meta = _Meta.decode(member.meta)
            candidates[Candidate(meta.priority if meta else 0, member.node)] = member.state
        if self.coordinator is not None and self.coordinator.epoch > PROVISIONAL:
            chosen = choose(self.coordinator, candidates)
        else:  # nothing announced heard yet: this node's own choice must not outrank an incumbent's announcement
            chosen = provisional(candidates)
        for document in self._documents():
            announced = document.body.get("coordinator")
            if isinstance(announced, list) and len(announced) == 3:
                with contextlib.suppress(TypeError, ValueError):
                    theirs = Coordinator(str(announced[0]), int(announced[1]), int(announced[2]))
                    if any(c.node == theirs.node and s.value in ("alive", "suspect") for c, s in candidates.items()):
                        chosen = merge(chosen, theirs)
        if chosen is not None and chosen.epoch == PROVISIONAL and self._settled():
            chosen = choose(chosen, candidates)  # no member announces one: this node's choice is announced, at epoch 1
        if chosen != self.coordinator and chosen is not None:
            self.coordinator = chosen
            if chosen.epoch == PROVISIONAL:
                return  # not news: nobody is told of it
            self.broker.record_event(
                "mesh.coordinator",
                f"coordinator is {chosen.node} (epoch {chosen.epoch})",
                details={"node": chosen.node, "epoch": chosen.epoch},
            )

    def _settled(self) -> bool:
        """Whether this node has heard what every other member announces: it holds the document of each member
        alive or suspected (its announcement is on its way), and of each not heard of at all unless it started
        SETTLE_WITHIN ago (those may be down: a cluster of one, for now, chooses for itself); or SETTLE_AT_MOST
        has passed."""
        waited = self.elapsed() - self._started
        if waited >= SETTLE_AT_MOST:
            return True
        timed_out = waited >= SETTLE_WITHIN
        for node in self.cluster.members:
            if node == self.node_id or node in self.view.held:
                continue
            member = self.membership.member(node)
            if (member is None and not timed_out) or (member is not None and member.state not in GONE):
                return False
        return True

    # ----- TCP: push-pull, pings, documents ----------------------------------

    async def _call(self, addr: Addr, request: dict[str, Any], expect: str | None = None) -> dict[str, Any] | None:
        """The answer of the member at `addr` (only `expect`'s, when given: an address may since be another member's), or None."""
        try:
            return await call_member(addr, self.identity, self.cluster.members_der(), request, expect=expect)
        except PeerError as error:
            log.debug("peer %s: %s", addr, error)
            return None

    async def _push_pull(self, addr: Addr) -> None:
        ours = self.membership.push_pull_state()
        answer = await self._call(
            addr,
            {
                "op": "push_pull",
                "state": wire.encode(ours),
                "cluster": self.cluster.export(),
                "primary": self._primary(),
                "keys": self.cluster.keys_state(),
            },
        )
        if answer is None:
            return
        self._merge_cluster(answer.get("cluster"))
        self._learn_keys(answer.get("primary"), answer.get("keys"))
        try:
            remote = wire.decode(answer["state"])
        except (KeyError, TypeError, wire.WireError):
            return
        if isinstance(remote, PushPull):
            now = self.elapsed()
            self.membership.push_pull_reply(now, addr, remote)
            self._drain(now)

    def _primary(self) -> str:
        return base64.b64encode(self.cluster.keyring.primary).decode()

    def _learn_keys(self, primary: object, keys: object) -> None:
        """Take in a member's keyring as push-pull carries it: the newer keyring wins, removed keys stay removed (a
        member that was down during a rotation adopts it rather than bringing the old key back everywhere)."""
        before = self.cluster.keyring.primary
        if not self.cluster.keys_merge(primary, keys):
            return
        if self._datagrams is not None:
            self._datagrams.keyring = self.cluster.keyring
        if self.cluster.keyring.primary != before:
            self.broker.record_event(
                "mesh.keys",
                f"this node missed a keyring change and now seals with key {key_id(self.cluster.keyring.primary)}, as the members do",
                details={"version": self.cluster.keys_version},
            )

    async def _tcp_ping(self, request: Any) -> None:
        answer = await self._call(request.addr, {"op": "ping", "ping": wire.encode(request.ping)}, expect=request.node)
        ok = bool(answer and answer.get("ack"))
        now = self.elapsed()
        self.membership.tcp_ping_result(now, request.node, ok)
        self._drain(now)

    async def _fetch_on_sight(self, node: str) -> None:
        """A member's document, whatever its version, by one fetch at a time however often it is heard alive meanwhile."""
        try:
            await self._fetch_document(DocumentNotice(node, 0, 0))
        finally:
            self._fetching.discard(node)

    async def _fetch_document(self, notice: DocumentNotice) -> None:
        """Fetch the document a notice announces; a failed fetch is tried again shortly (the node may not publish
        another version for 10 s, and until then this view would lack it)."""
        for delay in DOCUMENT_RETRIES:
            if delay:
                await asyncio.sleep(delay)
            known = self.view.knows(notice.node)
            if known is not None and known >= (notice.generation, notice.version):
                return
            member = self.membership.member(notice.node)
            if member is None:
                return
            answer = await self._call(member.addr, {"op": "document", "node": notice.node}, expect=notice.node)
            if answer and isinstance(answer.get("document"), bytes) and answer["document"]:  # empty: it has made none yet
                self._take_document(answer["document"])
                return

    def _take_document(self, data: bytes) -> None:
        try:
            document = open_document(data, Identity.verify, node_id_of)
        except DocumentError:
            self.dropped_documents += 1
            return
        if document.node == self.node_id or document.node not in self.cluster.members:
            return
        self.view.apply(document, self.elapsed())

    def _merge_cluster(self, remote: object, sender: str | None = None) -> None:
        if not isinstance(remote, dict):
            return
        if sender is not None and sender in (remote.get("removed") or {}):
            return  # a node removed itself has no say in who else is (what it last heard may be behind this node's view)
        changed = self.cluster.merge(remote, self.clock())
        for node in changed:
            if self.cluster.is_removed(node):
                # As where the removal was made: its leases are no longer shown here, nor its releases forwarded to it.
                self.view.forget(node)
        if changed and self._server is not None:
            members = self.cluster.members_der()
            for node in changed:
                if node in members:
                    self._server.trust(members[node])
        if self.cluster.is_removed(self.node_id) and not self._removed:  # told once, though several members may tell it
            self.broker.record_event("mesh.removed", "this node was removed from its cluster; it stops gossiping", details={})
            self._removed = True  # the mesh stops; the broker goes on alone

    async def _on_request(self, peer: str | None, request: dict[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        if peer is None:
            if op == "join":
                return self._join_request(request)
            return self._ask_request(request) if op == "ask" else {"error": "members only"}
        if self.cluster.is_removed(peer):
            return self._removed_request(peer)
        if op == "push_pull":
            self._merge_cluster(request.get("cluster"), sender=peer)
            self._learn_keys(request.get("primary"), request.get("keys"))
            try:
                remote = wire.decode(request["state"])
            except (KeyError, TypeError, wire.WireError):
                return {"error": "not a push-pull"}
            if not isinstance(remote, PushPull):
                return {"error": "not a push-pull"}
            now = self.elapsed()
            ours = self.membership.push_pull_received(now, remote)
            self._drain(now)
            return {
                "state": wire.encode(ours),
                "cluster": self.cluster.export(),
                "primary": self._primary(),
                "keys": self.cluster.keys_state(),
            }
        if op == "ping":
            try:
                ping = wire.decode(request["ping"])
            except (KeyError, TypeError, wire.WireError):
                return {"error": "not a ping"}
            ack = self.membership.answer_tcp_ping(ping)  # type: ignore[arg-type]
            return {"ack": wire.encode(ack) if ack is not None else None}
        if op == "document":
            node = request.get("node")
            if node == self.node_id:
                return {"document": self._own_document}
            return {"error": "only a node's own document is served by it"}
        if op == "release":
            return await self._forwarded_release(peer, request)
        if op == "removed":  # a member removed this node: its tombstones, as a push-pull would carry them
            self._merge_cluster(request.get("cluster"), sender=peer)
            return {"removed": self.cluster.is_removed(self.node_id)}
        if op == "keys" and isinstance(request.get("change"), dict) and len(request["change"]) == 1:
            self._learn_keys(request.get("primary"), request.get("keys"))  # first: the sender's order, if this node missed a change
            removed = request["change"].get("remove")
            if isinstance(removed, str) and removed in self.cluster.removed_keys:
                return {"ok": True}  # that order lists the key as removed, so taking it in removed it here: the change is made
            try:
                self._apply_keys(request["change"])
            except (ClusterError, KeyError, TypeError, ValueError) as error:
                return {"error": str(error)}
            return {"ok": True}
        return {"error": f"unknown op {op!r}"}

    def _removed_request(self, peer: str) -> dict[str, Any]:
        """A removed node that calls (back after being down through its removal, its join's push-pull) is answered
        with its own tombstone, as a push-pull carries tombstones: it takes it in as a node told while up does, and
        stops. Its own alone: its certificate must not learn which other nodes were removed since, nor when."""
        if peer not in self._told:
            self._told.add(peer)
            self.broker.record_event(
                "mesh.member.removed", f"node {peer}, removed from the cluster, called and was told", details={"node": peer, "told": True}
            )
        own = {peer: self.cluster.removed[peer]}
        return {"error": "this node was removed from the cluster", "removed": True, "cluster": {"removed": own}}

    def _join_request(self, request: dict[str, Any]) -> dict[str, Any]:
        try:
            grant = self.cluster.redeem(
                bytes(request["secret"]), str(request["cert"]), str(request.get("name", "")), self.clock(), self.node_id
            )
        except (ClusterError, KeyError, TypeError, ValueError) as error:
            # Anyone who reaches the gossip port may ask: kept within the gossip port's refusal budget, so a flood of
            # them does not push the leases' events out of those kept.
            why = printable_text(str(error) if isinstance(error, ClusterError) else f"not a join request ({error!r})")[:MAX_SAID]
            details = self._refusals.keep({"reason": why})
            if details is not None:
                self.broker.record_event("mesh.join.refused", f"a join was refused: {why}", code=FailureCode.UNAUTHORIZED, details=details)
            return {"error": str(error)}
        if self._server is not None:
            for der in self.cluster.members_der().values():
                self._server.trust(der)
        node = node_id_of_certificate(
            x509.load_pem_x509_certificate(str(request["cert"]).encode()).public_bytes(serialization.Encoding.DER)
        )
        self.broker.record_event(
            "mesh.join.admitted",
            f"node {request.get('name')} ({node}) was admitted with a join token",
            details={"node": node, "name": request.get("name")},
        )
        return {"grant": grant.to_dict()}

    def _ask_request(self, request: dict[str, Any]) -> dict[str, Any]:
        """A node with no cluster asks to be admitted (recorded for approval), or, once approved, fetches its grant."""
        try:
            cert = str(request["cert"])
            at = float(request["at"])
            proof = bytes(request["proof"])
            der = x509.load_pem_x509_certificate(cert.encode()).public_bytes(serialization.Encoding.DER)
            node = node_id_of_certificate(der)
            genuine = Identity.verify(public_key_of(der), ask_proof(self.identity.fingerprint(), at), proof)
        except (KeyError, TypeError, ValueError, IdentityError):
            return {"error": "not a request to be admitted"}
        if not genuine:
            return {"error": "the request is not signed by the node it names"}
        now = self.clock()
        if abs(now - at) > ASK_FRESH:  # this clock is told: the asker's may be hours off (no real-time clock)
            return {"error": f"the request is stamped {at - now:+.0f} s off this member's clock", "now": now}
        if self.cluster.is_member(node):
            return {"grant": self.cluster.grant().to_dict()}
        addr = request.get("addr")
        try:
            first = node not in {p.node_id for p in self.cluster.pending_list()}
            self.cluster.ask(
                node,
                cert,
                str(request.get("name", "")),
                (str(addr[0]), int(addr[1])) if isinstance(addr, list) and len(addr) == 2 else ("", 0),
                self.clock(),
            )
        except (ClusterError, TypeError, ValueError) as error:
            return {"error": str(error)}
        if first or node in self._unsaid:
            # Anyone who reaches the gossip port may ask, under a fresh identity each time: kept within the gossip
            # port's refusal budget, as a refused join is. A real node asks again every ASK_EVERY until approved, so
            # one whose first ask fell outside the budget is said at a later one.
            details = self._refusals.keep({"node": node})
            if details is None:
                self._unsaid.add(node)
                if len(self._unsaid) > MAX_PENDING:  # those no longer pending will not be said: forget them
                    self._unsaid &= {p.node_id for p in self.cluster.pending_list()}
            else:
                self._unsaid.discard(node)
                self.broker.record_event(
                    "mesh.node.pending",
                    f"node {request.get('name')} ({node}) asks to join; approve with `gpubroker nodes approve {node}`",
                    details=details,
                )
        return {"pending": True}

    def _refuse_if_removed(self) -> None:
        """A node removed from its cluster administers it no more: what it last heard may be behind the members' view."""
        if self.cluster.is_removed(self.node_id):
            raise BrokerError(
                FailureCode.CAPABILITY_UNAVAILABLE,
                "this node was removed from its cluster: it may no longer invite, approve, remove or change keys",
                {"node": self.node_id},
            )

    def approve(self, node: str) -> dict[str, Any]:
        self._refuse_if_removed()
        try:
            self.cluster.approve(node, self.node_id, self.clock())
        except ClusterError as error:
            raise BrokerError(FailureCode.NOT_FOUND, f"{error}{self._named(node)}", {"node": node}) from None
        if self._server is not None:
            self._server.trust(self.cluster.members_der()[node])
        self.broker.record_event("mesh.join.approved", f"node {node} was approved and may join", details={"node": node})
        return self.nodes_json()

    async def _forwarded_release(self, peer: str | None, request: dict[str, Any]) -> dict[str, Any]:
        lease = request.get("lease")
        token = request.get("token")
        admin = request.get("admin")
        if not isinstance(lease, str) or not (token is None or isinstance(token, str)) or not (admin is None or isinstance(admin, str)):
            return {"error": "release needs a lease id"}
        # An admin of a member (signed in to its UI, its API token, root on its socket) may release here: the member
        # is authenticated by mutual TLS, and the reason names it by its own identity, whatever the request says.
        caller = Caller("peer", admin=admin, admin_of=self._name_of(peer)) if admin in ADMINS and peer else Caller("peer")
        try:
            released = await self.broker.release(lease, caller, token)
        except BrokerError as error:
            return {"failure": error.to_json()}
        return {"lease": released.to_json()}

    # ----- publishing -----------------------------------------------------

    async def _publish_loop(self) -> None:
        while not self._removed:
            self.publish()
            await asyncio.sleep(PUBLISH_EVERY)

    def publish(self) -> None:
        assert self._publisher is not None
        body = summarize(self.broker.node_json(), self.broker.list_leases("granted", 100_000))
        if self.coordinator is not None and self.coordinator.epoch > PROVISIONAL:  # a provisional choice is not announced
            body["coordinator"] = [self.coordinator.node, self.coordinator.priority, self.coordinator.epoch]
        document = self._publisher.next(body, self.elapsed(), self.clock())
        if document is None:
            return
        self._own_document = sign_document(document, self.identity.sign)
        self.membership.broadcast(DocumentNotice(self.node_id, document.generation, document.version))
        self._wake.set()

    # ----- discovery --------------------------------------------------------

    def _sighted(self, sighting: Sighting) -> None:
        if sighting.cluster != cluster_hash(self.cluster.cluster_id) or sighting.node not in self.cluster.members:
            return  # another cluster, or not admitted: mDNS only finds peers, it admits nobody
        member = self.membership.member(sighting.node)
        if member is None or member.state.value in ("dead", "left"):
            self.membership.join([sighting.addr])
            self._wake.set()

    # ----- acting on another node's lease ----------------------------------------

    def _documents(self) -> Iterator[NodeDocument]:
        """The other nodes' documents, but for removed nodes': a removal learnt by push-pull may race a document in flight."""
        for document, _ in self.view.documents():
            if not self.cluster.is_removed(document.node):
                yield document

    def _records(self) -> Iterator[tuple[Any, dict[str, Any]]]:
        """Each lease record of the other nodes' documents, with its document."""
        for document in self._documents():
            for record in document.body.get("leases", []):
                if isinstance(record, dict):
                    yield document, record

    def resolve_node(self, node: str) -> str | None:
        """The id of the member `node` names: its id, or its name as admitted or as its document now says (a member
        restarted under another name answers to both); None for no member. A name several members share is the live
        one's (a reinstalled machine rejoins under its old name while its old identity is dead or gone); when that
        leaves more than one, INVALID_REQUEST lists their ids, for the caller to give one."""
        members = self.cluster.members
        if node in members:
            return node
        named = {nid for nid, entry in members.items() if entry["name"] == node}
        named |= {d.node for d in self._documents() if d.body.get("name") == node and d.node in members}
        if self.broker.config.name == node:
            named.add(self.node_id)
        if len(named) <= 1:
            return next(iter(named), None)
        live = {nid for nid in named if nid == self.node_id or self._is_live(nid)}
        if len(live) == 1:
            return live.pop()
        matching = sorted(live or named)
        raise BrokerError(
            FailureCode.INVALID_REQUEST,
            f"{len(matching)} {'live ' if live else ''}members are named {node!r} ({', '.join(matching)}): give the id of the one meant",
            {"node": node, "matching": matching},
        )

    def _is_live(self, node: str) -> bool:
        member = self.membership.member(node)
        return member is not None and member.state not in GONE

    def leases_of(self, node: str, limit: int) -> list[dict[str, Any]]:
        """The granted leases the document of the node with id `node` lists (as `listed_leases` reads them); none
        for a node whose document is not held (`resolve_node` turns a name into the id)."""
        held = self.view.held.get(node)
        if held is None or self.cluster.is_removed(node):
            return []
        return listed_leases(held.document.body, node, self.shift_of(node))[:limit]

    def lease_of(self, lease_id: str) -> dict[str, Any] | None:
        """A lease another node's document lists, as `leases_of` shows it; None if no document lists it (readably)."""
        return next((listed_lease(d.body, d.node, r, self.shift_of(d.node)) for d, r in self._records() if r.get("id") == lease_id), None)

    def shift_of(self, node: str) -> float:
        """How far `node`'s times are moved to read on this node's clock: its own clock is shown, never trusted."""
        return self.view.shift(node, self.elapsed(), self.clock())

    def owner_of(self, lease_id: str) -> str | None:
        """The node whose document lists this lease, if any (by its id alone: the rest of the record may be newer than this reader)."""
        return next((d.node for d, r in self._records() if r.get("id") == lease_id), None)

    async def forward_release(self, lease_id: str, token: str | None, admin: str | None = None) -> dict[str, Any] | None:
        """Ask the lease's own node to release it; it authorises the request (the token, or this node's admin). None: no node holds it."""
        owner = self.owner_of(lease_id)
        if owner is None:
            return None
        if self._removed:
            raise BrokerError(
                FailureCode.CAPABILITY_UNAVAILABLE,
                f"lease {lease_id} is held by node {self._name_of(owner)}, but this node was removed from the cluster and no member answers it",
                {"node": owner},
            )
        member = self.membership.member(owner)
        if member is None or member.state in GONE:
            raise self._owner_gone(lease_id, owner, member)
        # Only the owner may answer: the address it had may now be another member's, which must not release in its name.
        answer = await self._call(member.addr, {"op": "release", "lease": lease_id, "token": token, "admin": admin}, expect=owner)
        if answer is None:
            raise BrokerError(
                FailureCode.TIMEOUT, f"lease {lease_id} is held by node {self._name_of(owner)}, which did not answer", {"node": owner}
            )
        if "failure" in answer and isinstance(answer["failure"], dict):
            failure = answer["failure"].get("error", {})
            try:
                code = FailureCode(failure.get("code"))
            except ValueError:
                code = FailureCode.INVALID_REQUEST
            raise BrokerError(code, str(failure.get("message")), {**dict(failure.get("details") or {}), "node": owner})
        lease: dict[str, Any] | None = answer.get("lease")
        return lease

    def _owner_gone(self, lease_id: str, owner: str, member: MemberView | None) -> BrokerError:
        """Why a lease whose node is dead, has left or is no longer heard of cannot be released from here now."""
        entry = self.cluster.members.get(owner) if member is None else None
        name = entry["name"] if entry else self._name_of(owner)
        details: dict[str, Any]
        if member is None:  # dead or gone long enough for the membership to have dropped it
            what, details = "is not heard of", {"node": owner, "state": None, "ago": None}
        else:
            ago = max(0.0, self.elapsed() - member.since)
            what = f"{'left' if member.state is MemberState.LEFT else 'failed'} {ago:.0f} s ago"
            details = {"node": owner, "state": member.state.value, "ago": round(ago, 3)}
        return BrokerError(
            FailureCode.LEASE_CONFLICT,
            f"lease {lease_id} is held by node {name}, which {what}; its leases cannot be released until it returns",
            {**details, "lease": lease_id},
        )

    # ----- administration (the API checks who may) ---------------------------------

    def invite(self, ttl: float) -> str:
        """A one-time join token naming this node as the seed."""
        self._refuse_if_removed()
        port = self._datagrams.address[1] if self._datagrams else self.settings.gossip[1]
        token = self.cluster.invite((self.settings.advertise, port), self.identity, ttl, self.clock())
        self.broker.record_event("mesh.invite", f"a join token valid for {ttl:g}s was issued", details={"ttl": ttl})
        return token

    def nodes_json(self) -> dict[str, Any]:
        # A removed node hears no member any more: the states it last heard would show its former cluster alive for ever.
        removed = self.cluster.is_removed(self.node_id)
        heard = {m.node: m for m in self.membership.members()} if self._membership else {}
        states = {node: m.state.value for node, m in heard.items()} if not removed else {}

        def name_now(node: str, admitted_as: str) -> str:
            # A node started again with another --name goes by it: the name it was admitted with is kept beside it.
            if node == self.node_id:
                return self.broker.config.name
            meta = _Meta.decode(heard[node].meta) if node in heard else None
            return meta.name if meta else admitted_as

        members = [
            {
                "id": node,
                "name": name_now(node, entry["name"]),
                "admitted_as": entry["name"],
                "admitted_by": entry["admitted_by"],
                "state": "self" if node == self.node_id else states.get(node, "unknown"),
            }
            for node, entry in sorted(self.cluster.members.items())
        ]
        pending = [
            {"id": p.node_id, "name": p.name, "addr": _host_port(p.addr), "fingerprint": p.fingerprint} for p in self.cluster.pending_list()
        ]
        return {"members": members, "pending": pending, "removed": sorted(self.cluster.removed)}

    async def remove(self, node: str) -> dict[str, Any]:
        """A removed member's certificate is refused from its next connection on, everywhere the removal reaches; the
        node itself is told, if it can be reached now, so that it stops (no member will talk to it again), and otherwise
        when it next calls a member that held its certificate (`_removed_request`); so are the members alive now, by a
        push-pull each (the next periodic one is up to 30 s away)."""
        self._refuse_if_removed()
        der = self.cluster.members_der().get(node)
        member = self.membership.member(node) if self._membership is not None else None
        try:
            self.cluster.remove(node, self.clock())
        except ClusterError as error:
            unknown = "unknown" in str(error)
            raise BrokerError(
                FailureCode.NOT_FOUND if unknown else FailureCode.FORBIDDEN,
                f"{error}{self._named(node) if unknown else ''}",
                {"node": node},
            ) from None
        self.view.forget(node)
        for other in self._others():
            if other.node != node and other.state == MemberState.ALIVE:
                self._spawn(self._push_pull(other.addr))
        told = der is not None and member is not None and member.state not in GONE and await self._tell_removed(node, member.addr, der)
        self.broker.record_event(
            "mesh.member.removed",
            f"node {node} was removed from the cluster ({'it was told' if told else 'it could not be told now, and will be when it next calls a member'})",
            details={"node": node, "told": told},
        )
        return self.nodes_json()

    def _named(self, given: str) -> str:
        """What to add to a refusal for an unknown node id when a member or a node asking to join goes by that name."""
        listed = self.nodes_json()
        ids = sorted(n["id"] for n in listed["members"] + listed["pending"] if given in (n["name"], n.get("admitted_as")))
        return f"; {given} is the name of {', '.join(ids)}: give the node's id, as `gpubroker nodes list` shows it" if ids else ""

    async def _tell_removed(self, node: str, addr: Addr, der: bytes) -> bool:
        """Send the removed node this cluster's tombstones over mutual TLS, pinned to the certificate it was admitted
        with (no longer a member's here); whether it took them. It still trusts this node, which is still a member."""
        request = {"op": "removed", "cluster": self.cluster.export()}
        try:
            answer = await call_member(addr, self.identity, {node: der}, request, expect=node, timeout=REMOVAL_NOTICE_WITHIN)
        except PeerError as error:
            log.debug("removed node %s: %s", node, error)
            return False
        return answer.get("removed") is True

    def keys_json(self) -> dict[str, Any]:
        return {"keys": [{"id": key, "primary": primary} for key, primary in self.cluster.keys_list()]}

    def _apply_keys(self, change: dict[str, Any]) -> dict[str, str]:
        """One keyring change here; the change as it can be sent on (an installed key travels as itself)."""
        if "install" in change:
            value = change["install"]
            key = value if isinstance(value, str) else new_key_b64()
            self.cluster.keys_install(key)
            applied = {"install": key}
        elif "use" in change:
            applied = {"use": self.cluster.keys_use(str(change["use"]))}
        else:
            applied = {"remove": self.cluster.keys_remove(str(change["remove"]))}
        if self._datagrams is not None:
            self._datagrams.keyring = self.cluster.keyring
        return applied

    async def change_keys(self, change: dict[str, Any]) -> dict[str, Any]:
        """Change the keyring here, then on every live member (over mutual TLS), as `keys` in Serf does; every other
        member is answered too, as not reached and why, so the caller knows its keyring now differs."""
        self._refuse_if_removed()
        try:
            applied = self._apply_keys(change)
        except ClusterError as error:
            raise BrokerError(FailureCode.INVALID_REQUEST, str(error), {}) from None
        self.broker.record_event("mesh.keys", f"keyring change {next(iter(applied))} made here and sent to the members", details={})
        live = [m for m in self._others() if m.state is MemberState.ALIVE]
        sent = {"op": "keys", "change": applied, "primary": self._primary(), "keys": self.cluster.keys_state()}
        answers = await asyncio.gather(*(self._call(m.addr, sent, expect=m.node) for m in live))
        results = {
            m.node: ("ok" if a is not None and "error" not in a else str((a or {}).get("error", "no answer")))
            for m, a in zip(live, answers, strict=True)
        }
        for node in self.cluster.members:
            if node != self.node_id and node not in results:
                member = self.membership.member(node)
                results[node] = f"not reached ({member.state.value if member is not None else 'not heard of'})"
        return {**self.keys_json(), "members": dict(sorted(results.items()))}

    # ----- what the API shows ---------------------------------------------------

    def elsewhere(self, request: LeaseRequest) -> list[dict[str, Any]] | None:
        """Live peers whose documents show room for the request's GPUs now, freshest first; None for a request pinned
        to a GPU (a card of this node, which no peer has)."""
        if request.gpu is not None:
            return None
        now = self.elapsed()
        found = []
        for member in self._others():
            held = self.view.held.get(member.node)
            if held is None or member.state is not MemberState.ALIVE:
                continue
            body = held.document.body
            # The indexes of the GPUs its leases are on: an exclusive request fits only on one with none.
            leased = {g["index"] for lease in listed_leases(body, member.node) for g in lease["gpus"]} if request.exclusive else set()
            roomy = [g for g in body.get("gpus", []) if isinstance(g, dict) and _has_room(g, request, leased)]
            if len(roomy) >= max(1, request.gpus):
                found.append(
                    {
                        "node": member.node,
                        "name": body.get("name"),
                        "age": round(now - held.received_at, 3),
                        "gpus": [{"index": g.get("index"), "uuid": g.get("uuid"), "figures": g.get("figures")} for g in roomy],
                    }
                )
        return sorted(found, key=lambda f: f["age"])

    def cluster_json(self) -> dict[str, Any]:
        """Every node the mesh knows; a node removed from its cluster shows only itself, and when it was removed (RFC 3339)."""
        now = self.elapsed()
        removed = self.cluster.removed.get(self.node_id)
        nodes: list[dict[str, Any]] = [
            {
                "id": self.node_id,
                "name": self.broker.config.name,
                "state": "alive" if removed is None else "removed",
                "self": True,
                "incarnation": self.membership.incarnation if self._membership is not None else self.cluster.incarnation,
                "age": 0.0,
                **self.broker.node_json(),
            }
        ]
        for member in self._others() if removed is None else ():  # what a removed node last heard is no view of anyone
            meta = _Meta.decode(member.meta)
            held = self.view.held.get(member.node)
            entry: dict[str, Any] = {
                "id": member.node,
                "name": meta.name if meta else None,
                "state": member.state.value,
                "self": False,
                "incarnation": member.incarnation,
                "addr": _host_port(member.addr),
                "age": self.view.age(member.node, now),
            }
            if held is not None:
                entry["document"] = {"generation": held.document.generation, "version": held.document.version, **held.document.body}
            nodes.append(entry)
        announced = self.coordinator if self.coordinator is not None and self.coordinator.epoch > PROVISIONAL else None
        coordinator = {"id": announced.node, "epoch": announced.epoch} if announced and removed is None else None
        health = self.membership.health_score() if self._membership is not None else None
        return {"nodes": nodes, "coordinator": coordinator, "health": health, "removed": None if removed is None else rfc3339(removed)}


def _has_room(gpu: dict[str, Any], request: LeaseRequest, leased: set[int]) -> bool:
    """Whether a GPU of another node's document shows room for `request`, as that node would decide (decide._room);
    `leased`: the indexes of that node's GPUs its document lists leases on."""
    figures = gpu.get("figures")
    if not isinstance(figures, dict) or gpu.get("stale"):  # its node decides on no stale reading: SCHEDULER_STATE_STALE
        return False
    if not request.exclusive:
        return bool(figures.get("schedulable", 0) >= request.gpu_memory)
    # Exclusive: the whole GPU, so none of its memory may be leased, whatever is still schedulable beside a lease.
    if figures.get("leased", 0) or gpu.get("index") in leased:
        return False
    room = figures.get("schedulable", 0)  # with nothing leased, all the room there is (published rounded down, never over)
    return bool(room > 0 and room >= request.gpu_memory)


def _host_port(addr: tuple[str, int] | list[Any]) -> str:
    """An address as people write it: 10.0.0.5:9741, [fe80::1]:9741."""
    host, port = addr[0], addr[1]
    return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
