"""The mesh's transports on real loopback sockets: sealed datagrams, and mutual TLS that admits only current members."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, cast

import pytest

from gpubroker.gossip import wire
from gpubroker.gossip.identity import Identity
from gpubroker.gossip.keyring import Keyring, new_key
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
from gpubroker.gossip.transport import (
    JOIN_MAX_FRAME,
    Datagrams,
    PeerBadAnswer,
    PeerError,
    PeerRejected,
    PeerServer,
    PeerUnreachable,
    call_for_join,
    call_member,
    join_context,
    member_context,
    pack_map,
    unpack_map,
)

LOOPBACK: Addr = ("127.0.0.1", 0)
WAIT = 5.0  # seconds: only ever reached when a test is failing

EVERY_MESSAGE: list[Message] = [
    Ping(seq=1, target="n-b", source="n-a", source_addr=("127.0.0.1", 7946)),
    IndirectPing(seq=2, target="n-c", target_addr=("10.0.0.3", 7946), source="n-a", source_addr=("10.0.0.1", 7946), nack=False),
    Ack(seq=3, payload=b"health"),
    Nack(seq=4),
    Alive(incarnation=5, node="n-a", addr=("10.0.0.1", 7946), meta=b"meta"),
    Suspect(incarnation=6, node="n-c", source="n-a"),
    Dead(incarnation=7, node="n-c", source="n-a"),
    DocumentNotice(node="n-a", generation=8, version=9),
    PushPull(members=(Member("n-a", ("10.0.0.1", 7946), 1, MemberState.ALIVE, b"m"),), join=True),
    Compound(parts=(Nack(seq=10), DocumentNotice(node="n-b", generation=1, version=2))),
]


# --- UDP helpers ------------------------------------------------------------------------------------


class Inbox:
    """What an endpoint delivered, awaited without sleeping."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[tuple[Addr, Message]] = asyncio.Queue()

    def __call__(self, source: Addr, message: Message) -> None:
        self.queue.put_nowait((source, message))

    async def next(self) -> tuple[Addr, Message]:
        async with asyncio.timeout(WAIT):
            return await self.queue.get()


class RawSocket(asyncio.DatagramProtocol):
    """A bare UDP socket: sends any bytes and records the exact datagrams it receives."""

    def __init__(self) -> None:
        self.received: asyncio.Queue[bytes] = asyncio.Queue()
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)  # the selector's transport does not subclass it

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.received.put_nowait(data)

    @property
    def address(self) -> Addr:
        assert self.transport is not None
        host, port = self.transport.get_extra_info("sockname")[:2]
        return host, port

    def send(self, data: bytes, addr: Addr) -> None:
        assert self.transport is not None
        self.transport.sendto(data, addr)

    async def next(self) -> bytes:
        async with asyncio.timeout(WAIT):
            return await self.received.get()


@pytest.fixture
async def open_udp() -> AsyncIterator[Callable[..., Any]]:
    """A factory for Datagrams endpoints and raw sockets on loopback; all closed afterwards."""
    opened: list[Datagrams | asyncio.DatagramTransport] = []

    async def endpoint(keyring: Keyring, inbox: Inbox | None = None, loss: Callable[[], bool] | None = None) -> Datagrams:
        made = await Datagrams.open(LOOPBACK, keyring, inbox or Inbox(), loss)
        opened.append(made)
        return made

    async def raw() -> RawSocket:
        transport, protocol = await asyncio.get_running_loop().create_datagram_endpoint(RawSocket, local_addr=LOOPBACK)
        opened.append(transport)
        return protocol

    endpoint.raw = raw  # type: ignore[attr-defined]
    yield endpoint
    for item in opened:
        item.close()


SENTINEL = Nack(seq=999_999)


async def drain_until_sentinel(inbox: Inbox) -> list[Message]:
    """Everything delivered before SENTINEL: a datagram sent earlier from the same socket has been handled by then."""
    seen: list[Message] = []
    while True:
        _, message = await inbox.next()
        if message == SENTINEL:
            return seen
        seen.append(message)


# --- UDP ------------------------------------------------------------------------------------------


async def test_two_endpoints_exchange_every_message_type(open_udp: Any) -> None:
    keyring = Keyring.generate()
    inbox_a, inbox_b = Inbox(), Inbox()
    a, b = await open_udp(keyring, inbox_a), await open_udp(keyring, inbox_b)

    for message in EVERY_MESSAGE:
        a.send(b.address, [message])
        b.send(a.address, [message])
    for message in EVERY_MESSAGE:
        assert await inbox_b.next() == (a.address, message)
        assert await inbox_a.next() == (b.address, message)

    assert a.sent_bytes == b.received_bytes > 0
    assert b.sent_bytes == a.received_bytes
    assert a.sent_datagrams == b.received_datagrams == len(EVERY_MESSAGE)


async def test_several_messages_sent_together_arrive_as_one_compound(open_udp: Any) -> None:
    keyring = Keyring.generate()
    inbox = Inbox()
    a, b = await open_udp(keyring), await open_udp(keyring, inbox)

    a.send(b.address, [Ping(seq=1, target="n-b", source="n-a", source_addr=a.address), Nack(seq=2)])

    _, message = await inbox.next()
    assert message == Compound(parts=(Ping(seq=1, target="n-b", source="n-a", source_addr=a.address), Nack(seq=2)))
    assert a.sent_datagrams == 1


async def test_a_datagram_sealed_with_a_key_the_receiver_lacks_is_dropped_counted_and_never_delivered(open_udp: Any) -> None:
    inbox = Inbox()
    shared = Keyring.generate()
    a, b = await open_udp(Keyring.generate()), await open_udp(shared, inbox)

    a.send(b.address, [Nack(seq=1)])
    a.keyring = shared
    a.send(b.address, [SENTINEL])

    assert await drain_until_sentinel(inbox) == []
    assert b.dropped["undecryptable"] == 1
    assert b.received_datagrams == 2


async def test_random_bytes_and_unreadable_plaintexts_are_dropped_by_reason_and_never_delivered(open_udp: Any) -> None:
    keyring = Keyring.generate()
    inbox = Inbox()
    b = await open_udp(keyring, inbox)
    raw = await open_udp.raw()

    raw.send(os.urandom(300), b.address)  # not sealed at all
    raw.send(b"\x01", b.address)  # shorter than any sealed datagram
    raw.send(keyring.seal(b"\x00" + os.urandom(299)), b.address)  # sealed, but not a message (no magic byte)
    raw.send(keyring.seal(wire.MAGIC + bytes((200, 201)) + b"\x90"), b.address)  # a protocol range we do not speak
    raw.send(keyring.seal(wire.MAGIC + bytes((1, 1)) + b"\x92\x7f\x80"), b.address)  # a message type we do not know
    raw.send(os.urandom(wire.MAX_DATAGRAM + 1), b.address)
    raw.send(keyring.seal(wire.encode(SENTINEL)), b.address)

    assert await drain_until_sentinel(inbox) == []
    assert dict(b.dropped) == {"undecryptable": 2, "malformed": 1, "incompatible": 1, "unknown": 1, "oversized": 1}


async def test_a_handler_that_raises_does_not_stop_the_next_datagram(open_udp: Any) -> None:
    keyring = Keyring.generate()
    delivered: list[Message] = []
    both = asyncio.Event()

    def fragile(source: Addr, message: Message) -> None:
        delivered.append(message)
        if len(delivered) == 2:
            both.set()
        if message == Nack(seq=1):
            raise RuntimeError("a bug in the protocol code")

    b = await Datagrams.open(LOOPBACK, keyring, fragile)
    try:
        a = await open_udp(keyring)
        a.send(b.address, [Nack(seq=1)])
        a.send(b.address, [Nack(seq=2)])
        async with asyncio.timeout(WAIT):
            await both.wait()
        assert delivered == [Nack(seq=1), Nack(seq=2)]
        assert b.handler_errors == 1
    finally:
        b.close()


async def test_a_key_rotation_loses_no_datagram(open_udp: Any) -> None:
    old, new = new_key(), new_key()
    inbox = Inbox()
    a, b = await open_udp(Keyring(old)), await open_udp(Keyring(old), inbox)

    b.keyring.install(new)  # install everywhere first...
    a.keyring.install(new)
    a.keyring.use(new)  # ...then the sender switches
    a.send(b.address, [Nack(seq=1)])
    assert await inbox.next() == (a.address, Nack(seq=1))

    b.keyring.use(new)
    b.keyring.remove(old)
    a.keyring = Keyring(new)  # a whole new keyring object takes effect on the next send too
    a.send(b.address, [Nack(seq=2)])
    assert await inbox.next() == (a.address, Nack(seq=2))

    a.keyring = Keyring(old)  # the removed key no longer opens anything
    a.send(b.address, [Nack(seq=3)])
    a.keyring = Keyring(new)
    a.send(b.address, [SENTINEL])
    assert await drain_until_sentinel(inbox) == []
    assert b.dropped["undecryptable"] == 1


async def test_many_messages_are_packed_into_datagrams_of_at_most_1400_bytes_on_the_wire(open_udp: Any) -> None:
    keyring = Keyring.generate()
    a = await open_udp(keyring)
    receiver = await open_udp.raw()
    messages: list[Message] = [Alive(incarnation=i, node=f"n-{i:016d}", addr=("10.0.0.1", 7946), meta=bytes(100)) for i in range(60)]

    a.send(receiver.address, messages)

    sizes: list[int] = []
    delivered: list[Message] = []
    while len(delivered) < len(messages):
        datagram = await receiver.next()
        sizes.append(len(datagram))
        decoded = wire.decode(keyring.open(datagram))
        delivered.extend(decoded.parts if isinstance(decoded, Compound) else [decoded])
    assert delivered == messages
    assert len(sizes) > 1
    assert max(sizes) <= wire.MAX_DATAGRAM
    assert max(sizes) > wire.MAX_DATAGRAM - 150  # packed full, not one message a datagram
    assert a.sent_bytes == sum(sizes)
    assert a.sent_datagrams == len(sizes)


async def test_the_loss_hook_drops_outgoing_datagrams_and_counts_them(open_udp: Any) -> None:
    keyring = Keyring.generate()
    inbox = Inbox()
    verdicts = iter([True, False, True, False])
    a = await open_udp(keyring, loss=lambda: next(verdicts))
    b = await open_udp(keyring, inbox)

    for seq in (1, 2, 3):
        a.send(b.address, [Nack(seq=seq)])
    a.send(b.address, [SENTINEL])

    assert await drain_until_sentinel(inbox) == [Nack(seq=2)]
    assert a.unsent["lost"] == 2
    assert a.sent_datagrams == 2


async def test_sending_to_a_name_an_unreachable_port_or_after_close_never_raises(open_udp: Any) -> None:
    keyring = Keyring.generate()
    a = await open_udp(keyring)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as closed:
        closed.bind(LOOPBACK)
        nobody: Addr = closed.getsockname()
    a.send(nobody, [Nack(seq=1)])
    a.send(("peer.example.invalid", 7946), [Nack(seq=2)])  # never resolved on the event loop
    a.send(("::1", 7946), [Nack(seq=3)])  # an IPv6 peer from an IPv4 socket
    assert a.unsent["unaddressable"] == 2

    a.close()
    await asyncio.sleep(0)  # connection_lost is called on the next loop iteration
    a.send(nobody, [Nack(seq=4)])
    assert a.unsent["closed"] == 1


async def test_a_message_too_large_for_any_datagram_is_the_callers_error() -> None:
    a = await Datagrams.open(LOOPBACK, Keyring.generate(), Inbox())
    try:
        with pytest.raises(wire.MessageTooLarge):
            a.send(("127.0.0.1", 9), [Ack(seq=1, payload=bytes(wire.MAX_DATAGRAM))])
    finally:
        a.close()


# --- TLS helpers ----------------------------------------------------------------------------------


@pytest.fixture
def identities(tmp_path: Path) -> Callable[[str], Identity]:
    made: dict[str, Identity] = {}

    def identity(name: str) -> Identity:
        if name not in made:
            made[name] = Identity.load_or_create(tmp_path / name)
        return made[name]

    return identity


class Handler:
    """on_request that records every call and answers who asked."""

    def __init__(self) -> None:
        self.calls: list[tuple[str | None, dict[str, Any]]] = []

    async def __call__(self, peer: str | None, request: dict[str, Any]) -> dict[str, Any]:
        self.calls.append((peer, request))
        if request.get("op") == "crash":
            raise RuntimeError("a bug in the handler")
        return {"you": peer, "op": request.get("op")}


@pytest.fixture
async def servers() -> AsyncIterator[Callable[..., Any]]:
    started: list[PeerServer] = []

    async def start(identity: Identity, members: dict[str, bytes], handler: Handler, **options: Any) -> PeerServer:
        server = await PeerServer.start(LOOPBACK, identity, lambda: members, handler, **options)
        started.append(server)
        return server

    yield start
    for server in started:
        await server.close()


def roster(*identities: Identity) -> dict[str, bytes]:
    return {i.node_id: i.certificate_der() for i in identities}


# --- TLS ------------------------------------------------------------------------------------------


def test_an_in_memory_identity_has_no_files_so_tls_needs_a_stored_one() -> None:
    from gpubroker.gossip.identity import IdentityError

    with pytest.raises(IdentityError):
        member_context(Identity.generate(), {})


async def test_two_members_call_each_other_both_ways(identities: Any, servers: Any) -> None:
    a, b = identities("a"), identities("b")
    members = roster(a, b)
    handler_a, handler_b = Handler(), Handler()
    server_a, server_b = await servers(a, members, handler_a), await servers(b, members, handler_b)

    assert await call_member(server_b.address, a, members, {"op": "ping"}, expect=b.node_id) == {"you": a.node_id, "op": "ping"}
    assert await call_member(server_a.address, b, members, {"op": "ping"}, expect=a.node_id) == {"you": b.node_id, "op": "ping"}
    assert handler_a.calls == [(b.node_id, {"op": "ping"})]
    assert handler_b.calls == [(a.node_id, {"op": "ping"})]


async def test_a_member_refuses_to_talk_to_a_server_that_is_not_the_node_it_expects(identities: Any, servers: Any) -> None:
    a, b, c = identities("a"), identities("b"), identities("c")
    members = roster(a, b, c)
    handler = Handler()
    server_b = await servers(b, members, handler)

    with pytest.raises(PeerRejected, match=f"is {b.node_id}, not {c.node_id}"):
        await call_member(server_b.address, a, members, {"op": "fetch"}, expect=c.node_id)
    assert handler.calls == []  # nothing was sent to the wrong node


async def test_a_member_refuses_a_server_whose_certificate_is_not_a_members(identities: Any, servers: Any) -> None:
    a, b, stranger = identities("a"), identities("b"), identities("stranger")
    server = await servers(stranger, roster(a, b, stranger), Handler())

    with pytest.raises(PeerRejected, match="TLS"):
        await call_member(server.address, a, roster(a, b), {"op": "fetch"})


async def test_a_member_stops_trusting_a_server_as_soon_as_its_members_drop_it(identities: Any, servers: Any) -> None:
    a, b = identities("a"), identities("b")
    server_b = await servers(b, roster(a, b), Handler())
    assert await call_member(server_b.address, a, roster(a, b), {"op": "fetch"}) == {"you": a.node_id, "op": "fetch"}

    with pytest.raises(PeerRejected):
        await call_member(server_b.address, a, roster(a), {"op": "fetch"})  # a reused TLS context must not still trust b


async def test_a_node_that_is_not_a_member_is_refused_before_on_request_runs(identities: Any, servers: Any) -> None:
    a, b, stranger = identities("a"), identities("b"), identities("stranger")
    handler = Handler()
    server = await servers(a, roster(a, b), handler)

    with pytest.raises(PeerRejected):
        await call_member(server.address, stranger, roster(a), {"op": "fetch"})  # it trusts a, but a does not trust it
    assert handler.calls == []
    assert server.refused["handshake"] == 1


async def test_a_removed_member_is_refused_on_its_next_connection(identities: Any, servers: Any) -> None:
    a, b = identities("a"), identities("b")
    members = roster(a, b)
    handler = Handler()
    server = await servers(a, members, handler)
    assert await call_member(server.address, b, members, {"op": "fetch"}) == {"you": b.node_id, "op": "fetch"}

    del members[b.node_id]  # `nodes remove b`
    with pytest.raises(PeerRejected):
        await call_member(server.address, b, roster(a, b), {"op": "fetch"})
    assert server.refused["handshake"] == 1

    # Even while the TLS context still trusts b's certificate, the member check refuses it before any request.
    server.trust(b.certificate_der())
    with pytest.raises(PeerRejected, match="without answering"):
        await call_member(server.address, b, roster(a, b), {"op": "fetch"})
    assert server.refused["not_member"] == 1
    assert handler.calls == [(b.node_id, {"op": "fetch"})]


async def test_a_newly_admitted_member_is_accepted_without_restarting_the_server(identities: Any, servers: Any) -> None:
    a, c = identities("a"), identities("c")
    members = roster(a)
    handler = Handler()
    server = await servers(a, members, handler)
    with pytest.raises(PeerRejected):
        await call_member(server.address, c, roster(a), {"op": "fetch"})

    members.update(roster(c))
    assert await call_member(server.address, c, roster(a), {"op": "fetch"}) == {"you": c.node_id, "op": "fetch"}


async def test_a_client_without_a_certificate_may_join_but_do_nothing_else(identities: Any, servers: Any) -> None:
    a = identities("a")
    handler = Handler()
    server = await servers(a, roster(a), handler)

    assert await call_for_join(server.address, a.fingerprint(), {"op": "join", "secret": "s"}) == {"you": None, "op": "join"}
    answer = await call_for_join(server.address, a.fingerprint(), {"op": "fetch"})
    assert "may only join or ask" in answer["error"]
    assert handler.calls == [(None, {"op": "join", "secret": "s"})]
    assert server.refused["anonymous_op"] == 1


async def test_a_join_refuses_a_server_whose_fingerprint_differs_before_sending_anything(identities: Any, servers: Any) -> None:
    a, impostor = identities("a"), identities("impostor")
    handler = Handler()
    server = await servers(impostor, roster(impostor), handler)

    with pytest.raises(PeerRejected, match="fingerprint"):
        await call_for_join(server.address, a.fingerprint(), {"op": "join", "secret": "s"})
    await server.close()  # waits for the connection: the server saw it end without a request
    assert handler.calls == []
    assert server.refused["empty"] == 1


async def send_raw(addr: Addr, context: Any, data: bytes) -> bytes:
    """Send `data` over TLS as it is and return whatever comes back until the server closes."""
    reader, writer = await asyncio.open_connection(addr[0], addr[1], ssl=context)
    try:
        writer.write(data)
        await writer.drain()
        async with asyncio.timeout(WAIT):
            return await reader.read()
    finally:
        writer.close()


async def test_an_oversized_frame_is_refused_without_reading_it(identities: Any, servers: Any) -> None:
    a, b = identities("a"), identities("b")
    members = roster(a, b)
    handler = Handler()
    server = await servers(a, members, handler)

    answer = await send_raw(server.address, member_context(b, members), (wire.MAX_FRAME + 1).to_bytes(4, "big"))
    assert "over the limit" in unpack_map(answer[4:])["error"]
    # A client without a certificate gets a much smaller frame.
    answer = await send_raw(server.address, join_context(), (JOIN_MAX_FRAME + 1).to_bytes(4, "big"))
    assert "over the limit" in unpack_map(answer[4:])["error"]
    assert server.refused["oversized"] == 2
    assert handler.calls == []

    with pytest.raises(PeerError, match="cannot be sent"):
        await call_member(server.address, b, members, {"op": "push_pull", "state": bytes(wire.MAX_FRAME)})


async def test_a_malformed_request_is_answered_with_an_error_and_never_handled(identities: Any, servers: Any) -> None:
    a, b = identities("a"), identities("b")
    members = roster(a, b)
    handler = Handler()
    server = await servers(a, members, handler)

    for payload in (b"not msgpack", pack_map({"op": "x"})[:-1], wire.MAGIC + bytes((1, 1)) + b"\x93\x01\x02\x03"):
        answer = await send_raw(server.address, member_context(b, members), wire.frame(payload))
        assert "error" in unpack_map(answer[4:])
    assert server.refused["malformed"] == 3
    assert handler.calls == []


async def test_a_handler_that_raises_answers_an_error_and_the_server_goes_on(identities: Any, servers: Any) -> None:
    a, b = identities("a"), identities("b")
    members = roster(a, b)
    server = await servers(a, members, Handler())

    assert await call_member(server.address, b, members, {"op": "crash"}) == {"error": "internal error"}
    assert await call_member(server.address, b, members, {"op": "fetch"}) == {"you": b.node_id, "op": "fetch"}
    assert server.handler_errors == 1


async def test_a_call_to_a_closed_port_is_unreachable(identities: Any) -> None:
    a = identities("a")
    with socket.socket() as closed:
        closed.bind(LOOPBACK)
        nobody: Addr = closed.getsockname()
    with pytest.raises(PeerUnreachable, match="cannot connect"):
        await call_member(nobody, a, roster(a), {"op": "fetch"})


async def test_a_call_to_a_peer_that_never_answers_times_out(identities: Any) -> None:
    a = identities("a")
    hold = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await hold.wait()
        writer.close()

    listener = await asyncio.start_server(silent, *LOOPBACK)
    try:
        with pytest.raises(PeerUnreachable, match="no answer within 0.2 s"):
            await call_member(listener.sockets[0].getsockname(), a, roster(a), {"op": "fetch"}, timeout=0.2)
    finally:
        hold.set()
        listener.close()
        await listener.wait_closed()


async def test_an_answer_that_is_not_a_map_is_a_bad_answer(identities: Any) -> None:
    a = identities("a")
    from gpubroker.gossip.transport import server_context

    async def wrong(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await wire.read_frame(reader)
        writer.write(wire.frame(b"\xb7\x01\x01\x91\x01"))  # a list, not a map
        await writer.drain()
        writer.close()

    listener = await asyncio.start_server(wrong, *LOOPBACK, ssl=server_context(a, roster(a)))
    try:
        with pytest.raises(PeerBadAnswer, match="map"):
            await call_member(listener.sockets[0].getsockname(), a, roster(a), {"op": "fetch"})
    finally:
        listener.close()
        await listener.wait_closed()


async def test_a_peer_that_stalls_is_disconnected_after_the_read_timeout(identities: Any, servers: Any) -> None:
    a, b = identities("a"), identities("b")
    members = roster(a, b)
    handler = Handler()
    server = await servers(a, members, handler, read_timeout=0.5)  # ample for a loopback handshake on a busy machine

    # One connection never starts its handshake; the other completes it and never sends a request.
    plain_reader, plain_writer = await asyncio.open_connection(*server.address)
    tls_reader, tls_writer = await asyncio.open_connection(*server.address, ssl=member_context(b, members))
    async with asyncio.timeout(WAIT):
        assert await plain_reader.read() == b""
        assert await tls_reader.read() == b""
    plain_writer.close()
    tls_writer.close()
    assert server.refused["timeout"] == 2
    assert handler.calls == []


async def test_a_server_at_its_connection_limit_closes_new_connections_before_their_handshake(identities: Any, servers: Any) -> None:
    a, b = identities("a"), identities("b")
    members = roster(a, b)
    entered, release = asyncio.Event(), asyncio.Event()

    async def slow(peer: str | None, request: dict[str, Any]) -> dict[str, Any]:
        entered.set()
        await release.wait()
        return {"op": request["op"]}

    server = await servers(a, members, slow, max_connections=1)
    holder = asyncio.create_task(call_member(server.address, b, members, {"op": "hold"}))
    async with asyncio.timeout(WAIT):
        await entered.wait()  # the only slot is taken
    with pytest.raises(PeerError):
        await call_member(server.address, b, members, {"op": "fetch"})
    assert server.refused["busy"] == 1

    release.set()
    assert await holder == {"op": "hold"}
    assert await call_member(server.address, b, members, {"op": "fetch"}) == {"op": "fetch"}  # the slot is free again


async def test_closing_the_server_ends_the_connections_in_progress(identities: Any, servers: Any) -> None:
    a, b = identities("a"), identities("b")
    members = roster(a, b)
    entered, release = asyncio.Event(), asyncio.Event()

    async def slow(peer: str | None, request: dict[str, Any]) -> dict[str, Any]:
        entered.set()
        await release.wait()
        return {}

    server = await PeerServer.start(LOOPBACK, a, lambda: members, slow)
    call = asyncio.create_task(call_member(server.address, b, members, {"op": "fetch"}))
    async with asyncio.timeout(WAIT):
        await entered.wait()
        await server.close()
        with pytest.raises(PeerError):
            await call
    assert server.connections == 0
    await server.close()  # idempotent
