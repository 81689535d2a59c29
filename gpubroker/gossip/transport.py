"""The mesh's two transports: sealed UDP datagrams for gossip, and calls over mutual TLS 1.3 between peers.

    PeerError               a call to a peer failed (also raised as itself for a request we cannot send); `addr` names the peer
    ├── PeerUnreachable     refused, reset or timed out: the peer may be down
    ├── PeerRejected        TLS failed, the peer is not the node we pinned, or it hung up without answering (it does not admit us)
    └── PeerBadAnswer       an answer we cannot read: truncated, oversized, not a msgpack map

Datagrams: `wire.pack_compound` packs the messages into datagrams under MAX_DATAGRAM once sealed, the keyring
seals each, and nothing is ever raised for the network's sake (failures are counted in `unsent`). Incoming
datagrams are opened, decoded and handed over whole (a Compound stays one Compound); anything that does not
open or decode is counted in `dropped` and never parsed further.

Calls: one request per connection — connect, handshake, one frame each way, close. A TLS 1.3 handshake costs
about a millisecond on a LAN, calls are rare (push-pull every 30 s, a document fetch, a forwarded action), and a
connection that carries one request can never outlive the membership it was admitted under. A frame's payload
is the wire header (magic, protocol min, max) followed by a msgpack map; a request holds an "op", an answer
either the result or {"error": "..."}.

The server admits a peer in two steps. OpenSSL verifies a client certificate against the admitted members'
certificates (the trust anchors); then, before a byte of application data is read, the certificate's node id
must be in `members()` with that very certificate. The CA store cannot forget a certificate, so the second
check is what makes `nodes remove` take effect at once; the server also rebuilds its context whenever
`members()` changes, so a removed certificate stops passing the handshake too. A removed node's certificate,
when the server is given it (`removed()`), passes instead, for the node to be told of its removal: its requests
are handed over as its own, and the handler answers a removed node nothing else. A client without a certificate
may only ask for op "join" (the join handshake), in a smaller frame.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import ssl
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, cast

import msgpack

from gpubroker.gossip import wire
from gpubroker.gossip.identity import Identity, IdentityError, fingerprint, node_id_of_certificate
from gpubroker.gossip.keyring import Keyring, KeyringError
from gpubroker.gossip.messages import Addr, Message

log = logging.getLogger(__name__)

READ_TIMEOUT = 10.0  # seconds a peer has for its handshake and its request (and to take our answer)
CALL_TIMEOUT = 5.0  # seconds a call may take, connecting included
CLOSE_TIMEOUT = 1.0  # seconds we wait for a TLS close_notify exchange before letting the transport go
MAX_CONNECTIONS = 64  # concurrent connections a server serves; more are closed before their handshake
JOIN_MAX_FRAME = 64 * 1024  # a request from a client without a certificate: a join carries a token and a certificate

JOIN_OP = "join"
ASK_OP = "ask"  # discovery-then-approve: a node with no cluster asks to be admitted, or polls for its grant
ANONYMOUS_OPS = (JOIN_OP, ASK_OP)

_HEADER = wire.MAGIC + bytes((wire.PROTOCOL_MIN, wire.PROTOCOL_MAX))

# Why an incoming datagram was dropped, and why an outgoing one never left (every key present, so a metric reads 0, not absent).
DROP_REASONS = ("oversized", "undecryptable", "incompatible", "malformed", "unknown")
UNSENT_REASONS = ("lost", "unaddressable", "error", "closed")
# Why a server closed a connection without calling on_request.
REFUSAL_REASONS = ("busy", "handshake", "not_member", "anonymous_op", "timeout", "oversized", "malformed", "empty")


# --- errors -------------------------------------------------------------------------------------


class PeerError(Exception):
    """A call to the peer at `addr` failed for `reason`; nothing was answered."""

    def __init__(self, addr: Addr, reason: str) -> None:
        super().__init__(f"{addr[0]}:{addr[1]}: {reason}")
        self.addr = addr
        self.reason = reason


class PeerUnreachable(PeerError):
    """Connection refused or reset, or no answer within the timeout: the peer may be down."""


class PeerRejected(PeerError):
    """The TLS handshake failed, the peer is not the node we pinned, or it closed without answering."""


class PeerBadAnswer(PeerError):
    """The peer answered with something we cannot read."""


# --- frames: the wire header and a msgpack map ---------------------------------------------------


def pack_map(value: Mapping[str, Any]) -> bytes:
    """A frame's payload for `value`; WireError when msgpack cannot write it."""
    try:
        packed: bytes = msgpack.packb(dict(value), use_bin_type=True)
    except Exception as exc:  # TypeError, OverflowError, ValueError for values msgpack cannot write
        raise wire.WireError(f"cannot encode the map: {type(exc).__name__}: {exc}") from None
    return _HEADER + packed


def unpack_map(payload: bytes) -> dict[str, Any]:
    """The map in a frame's payload; raises WireError (IncompatibleVersion among them) and nothing else."""
    wire.read_versions(payload)
    # As in wire.decode; the frame's own size bounds every length.
    value = wire.unpack_bounded(payload, max_array=len(payload), max_map=len(payload))
    if not isinstance(value, dict) or not all(isinstance(key, str) for key in value):
        raise wire.WireError(f"a request or answer must be a map with string keys, got {type(value).__name__}")
    return value


# --- UDP ------------------------------------------------------------------------------------------


def _udp_host(host: str, family: int) -> str | None:
    """`host` as the socket of `family` can send to it, or None when it is not an IP address of that family.

    Names are refused rather than resolved: socket.sendto would resolve them on the event loop, blocking it.
    """
    try:
        ip = ipaddress.ip_address(host.partition("%")[0])
    except ValueError:
        return None
    if family == socket.AF_INET6:
        return host if ip.version == 6 else f"::ffff:{ip}"  # a dual-stack socket reaches IPv4 through mapped addresses
    if ip.version == 4:
        return host
    return str(ip.ipv4_mapped) if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None else None


def _plain(addr: Any) -> Addr:
    """(host, port) of a socket address; an IPv4-mapped IPv6 address is given back as IPv4, as peers advertise it."""
    host, port = str(addr[0]), int(addr[1])
    with contextlib.suppress(ValueError):
        mapped = ipaddress.ip_address(host)
        if isinstance(mapped, ipaddress.IPv6Address) and mapped.ipv4_mapped is not None:
            host = str(mapped.ipv4_mapped)
    return host, port


class Datagrams(asyncio.DatagramProtocol):
    """Gossip datagrams: sealed with `keyring` (replaceable at any time, for rotation), delivered to `on_message`."""

    def __init__(self, keyring: Keyring, on_message: Callable[[Addr, Message], None], loss: Callable[[], bool] | None = None) -> None:
        self.keyring = keyring
        self._on_message = on_message
        self._loss = loss  # tests: True drops the outgoing datagram, as a lossy network would
        self._transport: asyncio.DatagramTransport | None = None
        self._family = socket.AF_INET
        self.sent_bytes = 0  # sealed bytes handed to the socket
        self.received_bytes = 0  # every datagram that arrived, dropped ones included
        self.sent_datagrams = 0
        self.received_datagrams = 0
        self.dropped: Counter[str] = Counter(dict.fromkeys(DROP_REASONS, 0))
        self.unsent: Counter[str] = Counter(dict.fromkeys(UNSENT_REASONS, 0))
        self.handler_errors = 0

    @classmethod
    async def open(
        cls,
        bind: Addr,
        keyring: Keyring,
        on_message: Callable[[Addr, Message], None],
        loss: Callable[[], bool] | None = None,
    ) -> Datagrams:
        """A socket bound to `bind` (port 0 picks one: see `address`)."""
        loop = asyncio.get_running_loop()
        _, protocol = await loop.create_datagram_endpoint(lambda: cls(keyring, on_message, loss), local_addr=bind)
        return protocol

    @property
    def address(self) -> Addr:
        """The address actually bound (an unspecified host such as 0.0.0.0 stays unspecified)."""
        if self._transport is None:
            raise RuntimeError("the datagram socket is closed")
        return _plain(self._transport.get_extra_info("sockname"))

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.DatagramTransport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            self._family = sock.family

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None

    def send(self, addr: Addr, messages: Sequence[Message]) -> None:
        """Pack, seal and send `messages` to `addr`; network failures are counted in `unsent`, never raised.

        Raises WireError only for messages no peer could read (one too large for a datagram by itself): a bug of the caller's.
        """
        datagrams = wire.pack_compound(messages)
        transport = self._transport
        if transport is None or transport.is_closing():
            self.unsent["closed"] += len(datagrams)
            return
        host = _udp_host(addr[0], self._family)
        if host is None:
            self.unsent["unaddressable"] += len(datagrams)
            return
        for datagram in datagrams:
            if self._loss is not None and self._loss():
                self.unsent["lost"] += 1
                continue
            sealed = self.keyring.seal(datagram)
            # The transport hands an OSError (unreachable, no route) to error_received rather than raising it.
            transport.sendto(sealed, (host, addr[1]))
            self.sent_bytes += len(sealed)
            self.sent_datagrams += 1

    def error_received(self, exc: Exception) -> None:
        self.unsent["error"] += 1
        log.debug("gossip datagram not sent: %s", exc)

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.received_bytes += len(data)
        self.received_datagrams += 1
        if len(data) > wire.MAX_DATAGRAM:
            self.dropped["oversized"] += 1  # no node of ours sends one: not worth a decryption attempt per key
            return
        try:
            plaintext = self.keyring.open(data)
        except KeyringError:
            self.dropped["undecryptable"] += 1
            return
        try:
            message = wire.decode(plaintext)
        except wire.IncompatibleVersion:
            self.dropped["incompatible"] += 1
            return
        except wire.UnknownMessage:
            self.dropped["unknown"] += 1  # a newer node's message type on its own
            return
        except wire.WireError:
            self.dropped["malformed"] += 1
            return
        try:
            self._on_message(_plain(addr), message)
        except Exception:  # a bug in the protocol code must not stop the socket from reading the next datagram
            self.handler_errors += 1
            log.exception("gossip message handler failed on %s from %s", type(message).__name__, addr)

    def close(self) -> None:
        """Close the socket; idempotent."""
        if self._transport is not None:
            self._transport.close()


# --- TLS contexts ---------------------------------------------------------------------------------


def _tls13(context: ssl.SSLContext) -> ssl.SSLContext:
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    return context


# OpenSSL's X509_V_FLAG_NO_CHECK_TIME, which Python names no constant for. A member is trusted because its very
# certificate is pinned (and a removal unpins it at once), not for the dates in it, which its own clock chose: a member
# whose clock ran days fast when it made its certificate, or this node's clock running days slow (a box without a
# real-time clock, before NTP), refused every TLS call both ways as "not yet valid", with gossip still saying alive.
NO_CHECK_TIME = ssl.VerifyFlags(0x200000)


def _trust_all(context: ssl.SSLContext, certificates: Mapping[str, bytes]) -> None:
    context.verify_flags |= NO_CHECK_TIME
    for node, der in certificates.items():
        try:
            context.load_verify_locations(cadata=der)
        except (ssl.SSLError, ValueError, TypeError) as exc:  # one unreadable certificate must not lock out the others
            log.warning("member %s: its certificate cannot be trusted: %s", node, exc)


def member_context(identity: Identity, members: Mapping[str, bytes]) -> ssl.SSLContext:
    """A client context that presents our certificate and trusts only `members`' certificates (IdentityError for an in-memory identity)."""
    context = _tls13(ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT))
    context.check_hostname = False  # the peer is pinned by its certificate, not a name: an address can change hands
    context.verify_mode = ssl.CERT_REQUIRED
    context.load_cert_chain(identity.cert_path, identity.key_path)
    _trust_all(context, members)
    return context


# Building a client context costs ~0.1 ms per member certificate (5 ms at 50 members); calls reuse it while
# neither the members nor our own certificate change. One entry per identity: a process has one (tests have a few).
_member_contexts: dict[str, tuple[frozenset[str], str, ssl.SSLContext]] = {}


def _reused_member_context(identity: Identity, members: Mapping[str, bytes]) -> ssl.SSLContext:
    trusted = frozenset(fingerprint(der) for der in members.values())
    ours = identity.fingerprint()
    cached = _member_contexts.get(identity.node_id)
    if cached is not None and cached[0] == trusted and cached[1] == ours:
        return cached[2]
    context = member_context(identity, members)
    _member_contexts[identity.node_id] = (trusted, ours, context)
    return context


def join_context() -> ssl.SSLContext:
    """A client context without a certificate that verifies nothing: the caller pins the server's fingerprint itself."""
    context = _tls13(ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT))
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


def server_context(identity: Identity, members: Mapping[str, bytes]) -> ssl.SSLContext:
    """A server context with our certificate that verifies a client certificate, when one is presented, against `members`."""
    context = _tls13(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER))
    context.load_cert_chain(identity.cert_path, identity.key_path)
    context.verify_mode = ssl.CERT_OPTIONAL  # a joining node has no admitted certificate yet
    _trust_all(context, members)
    return context


def _peer_certificate(writer: asyncio.StreamWriter) -> bytes | None:
    ssl_object = writer.get_extra_info("ssl_object")
    if ssl_object is None:
        return None
    der: bytes | None = ssl_object.getpeercert(binary_form=True)
    return der


def _member_of(der: bytes, members: Mapping[str, bytes]) -> str | None:
    """The node id `der` proves when it is that member's admitted certificate, else None."""
    try:
        node = node_id_of_certificate(der)
    except IdentityError:
        return None
    admitted = members.get(node)
    if admitted is None or fingerprint(admitted) != fingerprint(der):
        return None
    return node


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(OSError, TimeoutError):
        async with asyncio.timeout(CLOSE_TIMEOUT):
            await writer.wait_closed()


# --- TCP server -----------------------------------------------------------------------------------


class _Refused(Exception):
    """A connection closed without calling on_request, for `reason` (one of REFUSAL_REASONS)."""

    def __init__(self, reason: str, answer: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.answer = answer  # told to the peer as {"error": answer}, or nothing when None


class PeerServer:
    """Answers members' requests (and anonymous joins) over mutual TLS 1.3, one request per connection."""

    def __init__(
        self,
        identity: Identity,
        members: Callable[[], Mapping[str, bytes]],
        on_request: Callable[[str | None, dict[str, Any]], Awaitable[dict[str, Any]]],
        max_connections: int = MAX_CONNECTIONS,
        read_timeout: float = READ_TIMEOUT,
        removed: Callable[[], Mapping[str, bytes]] = dict,
    ) -> None:
        self._identity = identity
        self._members = members
        self._removed = removed
        self._on_request = on_request
        self.max_connections = max_connections
        self.read_timeout = read_timeout
        self._context: ssl.SSLContext | None = None
        self._context_key: tuple[frozenset[str], frozenset[str], str] = (frozenset(), frozenset(), "")
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[Any]] = set()
        self.served = 0
        self.refused: Counter[str] = Counter(dict.fromkeys(REFUSAL_REASONS, 0))
        self.handler_errors = 0

    @classmethod
    async def start(
        cls,
        bind: Addr,
        identity: Identity,
        members: Callable[[], Mapping[str, bytes]],
        on_request: Callable[[str | None, dict[str, Any]], Awaitable[dict[str, Any]]],
        max_connections: int = MAX_CONNECTIONS,
        read_timeout: float = READ_TIMEOUT,
        removed: Callable[[], Mapping[str, bytes]] = dict,
    ) -> PeerServer:
        """Listen on `bind`; `members()` and `removed()` are asked on every connection; `on_request(None, ...)` is a join."""
        server = cls(identity, members, on_request, max_connections, read_timeout, removed)
        server.context()  # an identity without files fails here, at start, rather than at the first peer
        server._server = await asyncio.start_server(server._accept, bind[0], bind[1])
        return server

    @property
    def address(self) -> Addr:
        if self._server is None or not self._server.sockets:
            raise RuntimeError("the peer server is not listening")
        return _plain(self._server.sockets[0].getsockname())

    @property
    def connections(self) -> int:
        """Connections being served now (handshakes included)."""
        return len(self._connections)

    def context(self) -> ssl.SSLContext:
        """The server context for the current members, rebuilt when `members()` or our certificate changes (a removed certificate is forgotten)."""
        members, removed = self._members(), self._removed()
        key = (  # a renewed certificate of ours too
            frozenset(fingerprint(der) for der in members.values()),
            frozenset(fingerprint(der) for der in removed.values()),
            self._identity.fingerprint(),
        )
        if self._context is None or key != self._context_key:
            self._context = server_context(self._identity, {**removed, **members})
            self._context_key = key
        return self._context

    def trust(self, cert_der: bytes) -> None:
        """Accept `cert_der` in handshakes from now on, before `members()` shows it; admission still follows `members()`."""
        self.context().load_verify_locations(cadata=cert_der)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if len(self._connections) >= self.max_connections:
            # Before the handshake, so a flood of connections costs us no cryptography.
            self.refused["busy"] += 1
            writer.transport.abort()
            return
        self._connections.add(task)
        try:
            await self._serve(reader, writer)
        except Exception:  # nobody awaits this task: what escapes would only surface as "exception never retrieved"
            self.handler_errors += 1
            log.exception("peer connection from %s failed", writer.get_extra_info("peername"))
        finally:
            self._connections.discard(task)
            await _close(writer)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            peer, request = await self._admit(reader, writer)
        except _Refused as refusal:
            self.refused[refusal.reason] += 1
            log.debug("peer connection from %s refused: %s", writer.get_extra_info("peername"), refusal.reason)
            if refusal.answer is not None:
                await self._answer(writer, {"error": refusal.answer})
            return
        try:
            answer = await self._on_request(peer, request)
        except Exception:  # the handler's bug is logged and told as an error; the server goes on
            self.handler_errors += 1
            log.exception("peer request %r from %s failed", request.get("op"), peer or "a joining node")
            answer = {"error": "internal error"}
        self.served += 1
        await self._answer(writer, answer)

    async def _admit(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> tuple[str | None, dict[str, Any]]:
        """The peer's node id, a member's or a removed node's (None for a client without a certificate), and its request, or _Refused."""
        try:
            async with asyncio.timeout(self.read_timeout):
                try:
                    await writer.start_tls(self.context(), ssl_handshake_timeout=self.read_timeout)
                except (ssl.SSLError, OSError) as exc:
                    raise _Refused("handshake") from exc
                # Checked before any application data is read: a removed member gets as far as a request only where
                # `removed()` names it, to be told it was removed.
                der = _peer_certificate(writer)
                peer = None
                if der is not None:
                    peer = _member_of(der, self._members()) or _member_of(der, self._removed())
                    if peer is None:
                        raise _Refused("not_member")
                try:
                    payload = await wire.read_frame(reader, wire.MAX_FRAME if peer is not None else JOIN_MAX_FRAME)
                except wire.MessageTooLarge as exc:
                    raise _Refused("oversized", str(exc)) from None
                except (wire.WireError, OSError) as exc:
                    raise _Refused("malformed") from exc
        except TimeoutError:
            raise _Refused("timeout") from None
        if payload is None:
            raise _Refused("empty")
        try:
            request = unpack_map(payload)
        except wire.WireError as exc:
            raise _Refused("malformed", str(exc)) from None
        if peer is None and request.get("op") not in ANONYMOUS_OPS:
            raise _Refused("anonymous_op", f"a node without an admitted certificate may only {' or '.join(ANONYMOUS_OPS)}")
        return peer, request

    async def _answer(self, writer: asyncio.StreamWriter, answer: Mapping[str, Any]) -> None:
        try:
            data = wire.frame(pack_map(answer))
        except wire.WireError as exc:
            self.handler_errors += 1
            log.error("peer answer cannot be sent: %s", exc)
            data = wire.frame(pack_map({"error": "internal error: the answer cannot be encoded"}))
        with contextlib.suppress(OSError, TimeoutError):
            writer.write(data)
            async with asyncio.timeout(self.read_timeout):
                await writer.drain()

    async def close(self) -> None:
        """Stop listening and end every connection in progress; idempotent."""
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        if self._connections:
            await asyncio.gather(*self._connections, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()


# --- TCP clients ----------------------------------------------------------------------------------


async def call_member(
    addr: Addr,
    identity: Identity,
    members: Mapping[str, bytes],
    request: dict[str, Any],
    expect: str | None = None,
    timeout: float = CALL_TIMEOUT,  # noqa: ASYNC109 - a caller's asyncio.timeout would raise TimeoutError, not PeerError
) -> dict[str, Any]:
    """The answer of the member at `addr` (which must be `expect` when given) to `request`; PeerError for any failure."""

    def check(der: bytes | None) -> None:
        if der is None:
            raise PeerRejected(addr, "the peer presented no certificate")
        node = _member_of(der, members)
        if node is None:
            raise PeerRejected(addr, "the peer's certificate is not an admitted member's")
        if expect is not None and node != expect:
            raise PeerRejected(addr, f"the peer is {node}, not {expect}")

    if not members:
        raise PeerRejected(addr, "no admitted member to trust")
    return await _call(addr, _reused_member_context(identity, members), request, timeout, check)


async def call_for_join(
    addr: Addr,
    fingerprint: str,
    request: dict[str, Any],
    timeout: float = CALL_TIMEOUT,  # noqa: ASYNC109 - as call_member's
) -> dict[str, Any]:
    """The answer, to `request` sent without a certificate, of the server at `addr` whose certificate has sha256 `fingerprint`."""
    pinned = fingerprint.lower()

    def check(der: bytes | None) -> None:
        # Before anything is sent: the join secret must reach only the node that issued the token.
        if der is None:
            raise PeerRejected(addr, "the peer presented no certificate")
        if _fingerprint(der) != pinned:
            raise PeerRejected(addr, f"the peer's certificate has fingerprint {_fingerprint(der)}, not {pinned}")

    return await _call(addr, join_context(), request, timeout, check)


_fingerprint = fingerprint  # call_for_join's parameter shadows the function


async def call_unpinned(
    addr: Addr,
    make_request: Callable[[str], dict[str, Any]],
    timeout: float = CALL_TIMEOUT,  # noqa: ASYNC109 - as call_member's
) -> dict[str, Any]:
    """Ask a server we have no pin for (trust on first use), building the request from its certificate's fingerprint.

    A request signed over the fingerprint cannot be relayed to another server by whoever answered.
    """
    seen: list[str] = []

    def check(der: bytes | None) -> None:
        if der is None:
            raise PeerRejected(addr, "the peer presented no certificate")
        seen.append(_fingerprint(der))

    return await _call(addr, join_context(), lambda: make_request(seen[0]), timeout, check)


def _framed(addr: Addr, request: dict[str, Any]) -> bytes:
    try:
        return wire.frame(pack_map(request))
    except wire.WireError as exc:
        raise PeerError(addr, f"the request cannot be sent: {exc}") from None


async def _call(
    addr: Addr,
    context: ssl.SSLContext,
    request: dict[str, Any] | Callable[[], dict[str, Any]],
    seconds: float,
    check: Callable[[bytes | None], None],
) -> dict[str, Any]:
    data = b""
    if isinstance(request, dict):  # framed before connecting: a request that cannot be sent costs no connection
        data = _framed(addr, request)
    writer: asyncio.StreamWriter | None = None
    try:
        async with asyncio.timeout(seconds):
            try:
                reader, writer = await asyncio.open_connection(addr[0], addr[1], ssl=context)
            except ssl.SSLError as exc:
                raise PeerRejected(addr, f"TLS handshake failed: {exc.reason or exc}") from None
            except OSError as exc:
                raise PeerUnreachable(addr, f"cannot connect: {exc.strerror or exc}") from None
            check(_peer_certificate(writer))
            writer.write(data or _framed(addr, request() if callable(request) else request))
            await writer.drain()
            payload = await wire.read_frame(reader)
    except TimeoutError:
        raise PeerUnreachable(addr, f"no answer within {seconds:g} s") from None
    except ssl.SSLError as exc:  # in TLS 1.3 the server's verdict on our certificate arrives after our handshake ends
        raise PeerRejected(addr, f"TLS failed: {exc.reason or exc}") from None
    except wire.WireError as exc:
        raise PeerBadAnswer(addr, str(exc)) from None
    except OSError as exc:
        raise PeerUnreachable(addr, f"connection lost: {exc.strerror or exc}") from None
    finally:
        if writer is not None:
            await _close(writer)
    if payload is None:
        raise PeerRejected(addr, "the peer closed the connection without answering")
    try:
        return unpack_map(payload)
    except wire.WireError as exc:
        raise PeerBadAnswer(addr, str(exc)) from None
