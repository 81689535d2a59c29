"""The membership messages as bytes: msgpack behind a 3-byte header that carries the sender's protocol range.

    WireError                 anything that is not a message we can read; nothing was applied
    ├── IncompatibleVersion   the sender's (min, max) protocol range does not overlap ours
    ├── UnknownMessage        a well-formed message of a type this version does not know
    └── MessageTooLarge       a message that cannot fit one datagram (or a frame over MAX_FRAME)

A datagram (before encryption) or a TCP frame's payload is

    MAGIC  min  max  msgpack([type, {field: value, ...}])

where `min`/`max` are the sender's protocol versions, one byte each. A node writes only what a node at
its own `min` can read; a newer version may add fields (older readers ignore unknown keys) and message
types (older readers skip unknown parts of a Compound and refuse an unknown message on its own).
Optional fields equal to their default are left out, to save datagram bytes.

`decode` raises only `WireError`, for any input. msgpack runs with limits tied to the input's length
(no string, array or map may claim more than the input holds) and stops nesting at 128 levels, so what
hostile bytes can cost is bounded by their length: at most about 80 times it while decoding (a stream of
empty maps is the worst case), which is ~110 KB for a datagram and ~80 MB for a full frame, and frames
come only from admitted members over mutual TLS.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import msgpack

from gpubroker.gossip.keyring import OVERHEAD
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

PROTOCOL_MIN = 1
PROTOCOL_MAX = 1
MAGIC = b"\xb7"
HEADER_SIZE = len(MAGIC) + 2

MAX_DATAGRAM = 1400  # on the wire, after encryption: under the usual 1500-byte MTU with IP/UDP headers
MAX_FRAME = 1024 * 1024  # a TCP frame: push-pull of ~4,000 members with full meta; bounds decoding memory (above)
FRAME_PREFIX = 4  # big-endian unsigned length before every TCP frame

MAX_NODE_ID = 64
MAX_HOST = 255  # a DNS name is at most 253 characters; IPv6 with a zone fits too
MAX_META = 512  # as memberlist's MetaMaxSize
MAX_MEMBERS = 10_000  # in one push-pull; also the longest array msgpack will accept
MAX_FIELDS = 64  # keys in one message's map, unknown ones from newer versions included
MAX_UINT64 = 2**64 - 1


class WireError(Exception):
    """Bytes that are not a message we can read (or a message we cannot write); nothing was applied."""


class IncompatibleVersion(WireError):
    """The sender speaks protocol versions `theirs`, none of which is in `ours`."""

    def __init__(self, theirs: tuple[int, int], ours: tuple[int, int]) -> None:
        super().__init__(f"protocol versions {theirs[0]}..{theirs[1]} do not overlap ours {ours[0]}..{ours[1]}")
        self.theirs = theirs
        self.ours = ours


class UnknownMessage(WireError):
    """A well-formed message whose type code this version does not know (a newer node's)."""

    def __init__(self, type_code: int) -> None:
        super().__init__(f"unknown message type {type_code}")
        self.type_code = type_code


class MessageTooLarge(WireError):
    """`size` bytes where at most `limit` fit."""

    def __init__(self, what: str, size: int, limit: int) -> None:
        super().__init__(f"{what} is {size} bytes, over the limit of {limit}")
        self.size = size
        self.limit = limit


# Type codes never change meaning; a new message takes a new code.
T_PING = 1
T_INDIRECT_PING = 2
T_ACK = 3
T_NACK = 4
T_ALIVE = 5
T_SUSPECT = 6
T_DEAD = 7
T_DOCUMENT_NOTICE = 8
T_PUSH_PULL = 9
T_COMPOUND = 10


def _header() -> bytes:
    return MAGIC + bytes((PROTOCOL_MIN, PROTOCOL_MAX))


# --- encoding -----------------------------------------------------------------------------------


def _addr(addr: Addr) -> list[Any]:
    return [addr[0], addr[1]]


def _member(m: Member) -> dict[str, Any]:
    if not isinstance(m.state, MemberState):
        raise WireError(f"Member.state: expected a MemberState, got {m.state!r}")
    fields: dict[str, Any] = {"n": m.node, "a": _addr(m.addr), "i": m.incarnation, "s": str(m.state)}
    if m.meta:
        fields["m"] = m.meta
    return fields


def _fields(message: Message) -> tuple[int, dict[str, Any]]:
    match message:
        case Ping():
            return T_PING, {"q": message.seq, "t": message.target, "s": message.source, "sa": _addr(message.source_addr)}
        case IndirectPing():
            fields = {
                "q": message.seq,
                "t": message.target,
                "ta": _addr(message.target_addr),
                "s": message.source,
                "sa": _addr(message.source_addr),
            }
            if not message.nack:
                fields["k"] = False
            return T_INDIRECT_PING, fields
        case Ack():
            return T_ACK, {"q": message.seq, "p": message.payload} if message.payload else {"q": message.seq}
        case Nack():
            return T_NACK, {"q": message.seq}
        case Alive():
            fields = {"i": message.incarnation, "n": message.node, "a": _addr(message.addr)}
            if message.meta:
                fields["m"] = message.meta
            return T_ALIVE, fields
        case Suspect():
            return T_SUSPECT, {"i": message.incarnation, "n": message.node, "s": message.source}
        case Dead():
            return T_DEAD, {"i": message.incarnation, "n": message.node, "s": message.source}
        case DocumentNotice():
            return T_DOCUMENT_NOTICE, {"n": message.node, "g": message.generation, "v": message.version}
        case PushPull():
            fields = {"m": [_member(m) for m in message.members]}
            if message.join:
                fields["j"] = True
            return T_PUSH_PULL, fields
        case _:
            raise WireError(f"cannot encode {type(message).__name__} here")


def _body(message: Message) -> bytes:
    """One non-compound message as msgpack, checked by the decoder's own rules so peers never refuse it."""
    code, fields = _fields(message)
    _parse(code, fields)
    try:
        packed: bytes = msgpack.packb([code, fields], use_bin_type=True)
    except Exception as exc:  # values of a type msgpack cannot write
        raise WireError(f"cannot encode {type(message).__name__}: {exc}") from None
    return packed


_COMPOUND_PREFIX: bytes = msgpack.packb([T_COMPOUND, {"p": []}])[:-1]  # without the empty array's header


def _array_header(n: int) -> bytes:
    if n <= 15:
        return bytes((0x90 | n,))
    if n <= 0xFFFF:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def _compound(bodies: Sequence[bytes]) -> bytes:
    return _COMPOUND_PREFIX + _array_header(len(bodies)) + b"".join(bodies)


def _parts_of(message: Compound) -> list[bytes]:
    if any(isinstance(part, Compound) for part in message.parts):
        raise WireError("a Compound cannot contain a Compound")
    return [_body(part) for part in message.parts]


def encode(message: Message) -> bytes:
    """The message with its header; raises WireError for a value peers would refuse (an id too long, a port out of range)."""
    if isinstance(message, Compound):
        return _header() + _compound(_parts_of(message))
    return _header() + _body(message)


def pack_compound(messages: Sequence[Message], limit: int = MAX_DATAGRAM) -> list[bytes]:
    """The messages, in order, in as few datagrams as fit `limit` once sealed; one alone travels bare, not in a Compound.

    Raises MessageTooLarge (naming the size) when one message cannot fit a datagram by itself.
    """
    budget = limit - OVERHEAD
    bodies: list[bytes] = []
    for message in messages:
        if isinstance(message, Compound):
            bodies.extend(_parts_of(message))
        else:
            bodies.append(_body(message))
    datagrams: list[bytes] = []
    group: list[bytes] = []
    group_size = 0  # sum of the bodies in `group`
    for body in bodies:
        if HEADER_SIZE + len(body) > budget:
            raise MessageTooLarge("a message with its header", HEADER_SIZE + len(body), budget)
        grown = HEADER_SIZE + len(_COMPOUND_PREFIX) + len(_array_header(len(group) + 1)) + group_size + len(body)
        if group and grown > budget:
            datagrams.append(_datagram(group))
            group, group_size = [], 0
        group.append(body)
        group_size += len(body)
    if group:
        datagrams.append(_datagram(group))
    return datagrams


def _datagram(bodies: list[bytes]) -> bytes:
    return _header() + (bodies[0] if len(bodies) == 1 else _compound(bodies))


# --- decoding -----------------------------------------------------------------------------------


class _Fields:
    """A message's field map, read with the checks that keep hostile values out of the protocol code."""

    def __init__(self, kind: str, fields: dict[Any, Any]) -> None:
        self.kind = kind
        self.fields = fields

    def _get(self, key: str) -> Any:
        if key not in self.fields:
            raise WireError(f"{self.kind}: field {key!r} is missing")
        return self.fields[key]

    def _fail(self, key: str, expected: str, value: Any) -> WireError:
        return WireError(f"{self.kind}.{key}: expected {expected}, got {type(value).__name__}")

    def uint(self, key: str) -> int:
        value = self._get(key)
        # bool is an int in Python; a peer's True must not read as 1
        if type(value) is not int or not 0 <= value <= MAX_UINT64:
            raise self._fail(key, "an integer in 0..2**64-1", value)
        return value

    def text(self, key: str, max_len: int) -> str:
        value = self._get(key)
        if type(value) is not str or not 0 < len(value) <= max_len:
            raise self._fail(key, f"a string of 1..{max_len} characters", value)
        return value

    def blob(self, key: str, max_len: int | None = None) -> bytes:
        value = self.fields.get(key, b"")
        if type(value) is not bytes or (max_len is not None and len(value) > max_len):
            raise self._fail(key, "bytes" if max_len is None else f"at most {max_len} bytes", value)
        return value

    def flag(self, key: str, default: bool) -> bool:
        value = self.fields.get(key, default)
        if type(value) is not bool:
            raise self._fail(key, "a boolean", value)
        return value

    def addr(self, key: str) -> Addr:
        value = self._get(key)
        if not isinstance(value, list | tuple) or len(value) != 2:
            raise self._fail(key, "an address [host, port]", value)
        host, port = value
        if type(host) is not str or not 0 < len(host) <= MAX_HOST or type(port) is not int or not 0 <= port <= 65535:
            raise WireError(f"{self.kind}.{key}: expected [host of 1..{MAX_HOST} characters, port 0..65535]")
        return host, port

    def array(self, key: str) -> list[Any] | tuple[Any, ...]:
        value = self._get(key)
        if not isinstance(value, list | tuple):
            raise self._fail(key, "an array", value)
        return value


def _node(f: _Fields, key: str) -> str:
    return f.text(key, MAX_NODE_ID)


def _members(f: _Fields) -> tuple[Member, ...]:
    raw = f.array("m")
    if len(raw) > MAX_MEMBERS:
        raise WireError(f"PushPull: {len(raw)} members, over the limit of {MAX_MEMBERS}")
    members = []
    for item in raw:
        if not isinstance(item, dict) or len(item) > MAX_FIELDS:
            raise WireError("PushPull.m: each member must be a map")
        m = _Fields("Member", item)
        state = m._get("s")
        if type(state) is not str:
            raise m._fail("s", "a state name", state)
        if state not in _STATES:
            continue  # a state a newer version added: that member is learnt from later gossip instead
        members.append(
            Member(node=_node(m, "n"), addr=m.addr("a"), incarnation=m.uint("i"), state=_STATES[state], meta=m.blob("m", MAX_META))
        )
    return tuple(members)


_STATES = {str(s): s for s in MemberState}

_PARSERS: dict[int, Callable[[_Fields], Message]] = {
    T_PING: lambda f: Ping(seq=f.uint("q"), target=_node(f, "t"), source=_node(f, "s"), source_addr=f.addr("sa")),
    T_INDIRECT_PING: lambda f: IndirectPing(
        seq=f.uint("q"),
        target=_node(f, "t"),
        target_addr=f.addr("ta"),
        source=_node(f, "s"),
        source_addr=f.addr("sa"),
        nack=f.flag("k", True),
    ),
    T_ACK: lambda f: Ack(seq=f.uint("q"), payload=f.blob("p")),
    T_NACK: lambda f: Nack(seq=f.uint("q")),
    T_ALIVE: lambda f: Alive(incarnation=f.uint("i"), node=_node(f, "n"), addr=f.addr("a"), meta=f.blob("m", MAX_META)),
    T_SUSPECT: lambda f: Suspect(incarnation=f.uint("i"), node=_node(f, "n"), source=_node(f, "s")),
    T_DEAD: lambda f: Dead(incarnation=f.uint("i"), node=_node(f, "n"), source=_node(f, "s")),
    T_DOCUMENT_NOTICE: lambda f: DocumentNotice(node=_node(f, "n"), generation=f.uint("g"), version=f.uint("v")),
    T_PUSH_PULL: lambda f: PushPull(members=_members(f), join=f.flag("j", False)),
}
_NAMES = {
    T_PING: "Ping",
    T_INDIRECT_PING: "IndirectPing",
    T_ACK: "Ack",
    T_NACK: "Nack",
    T_ALIVE: "Alive",
    T_SUSPECT: "Suspect",
    T_DEAD: "Dead",
    T_DOCUMENT_NOTICE: "DocumentNotice",
    T_PUSH_PULL: "PushPull",
    T_COMPOUND: "Compound",
}


def _split(obj: Any) -> tuple[int, dict[Any, Any]]:
    """[type, fields, ...]: a newer version may append elements, which are ignored."""
    if not isinstance(obj, list | tuple) or len(obj) < 2:
        raise WireError("a message must be an array [type, fields]")
    code, fields = obj[0], obj[1]
    if type(code) is not int:
        raise WireError("a message type must be an integer")
    if not isinstance(fields, dict):
        raise WireError(f"the fields of message type {code} must be a map")
    if len(fields) > MAX_FIELDS:
        raise WireError(f"message type {code} has {len(fields)} fields, over the limit of {MAX_FIELDS}")
    return code, fields


def _parse(code: int, fields: dict[Any, Any]) -> Message:
    if code == T_COMPOUND:
        parts: list[Message] = []
        for item in _Fields("Compound", fields).array("p"):
            part_code, part_fields = _split(item)
            if part_code == T_COMPOUND:
                raise WireError("a Compound cannot contain a Compound")
            if part_code not in _PARSERS:
                continue  # a newer node's message type: skip it, keep the rest
            parts.append(_PARSERS[part_code](_Fields(_NAMES[part_code], part_fields)))
        return Compound(parts=tuple(parts))
    if code not in _PARSERS:
        raise UnknownMessage(code)
    return _PARSERS[code](_Fields(_NAMES[code], fields))


def read_versions(data: bytes) -> tuple[int, int]:
    """The sender's (min, max) protocol versions from the header; raises WireError when they do not overlap ours."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise WireError(f"expected bytes, got {type(data).__name__}")
    if len(data) < HEADER_SIZE or bytes(data[: len(MAGIC)]) != MAGIC:
        raise WireError("not a gpubroker gossip message (bad magic or too short)")
    low, high = data[len(MAGIC)], data[len(MAGIC) + 1]
    if low > high:
        raise WireError(f"malformed protocol range {low}..{high}")
    if high < PROTOCOL_MIN or low > PROTOCOL_MAX:
        raise IncompatibleVersion((low, high), (PROTOCOL_MIN, PROTOCOL_MAX))
    return low, high


def unpack_bounded(data: bytes, max_array: int, max_map: int) -> Any:
    """The msgpack value after the header; no length may claim more than the input holds. Raises WireError only."""
    body = bytes(data[HEADER_SIZE:])
    try:
        return msgpack.unpackb(
            body,
            raw=False,
            strict_map_key=True,
            max_str_len=len(body),
            max_bin_len=len(body),
            max_array_len=min(len(body), max_array),
            max_map_len=min(len(body), max_map),
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises ValueError, TypeError, its own subclasses of them...
        raise WireError(f"malformed msgpack: {type(exc).__name__}: {exc}") from None


def decode(data: bytes) -> Message:
    """The message in `data` (a datagram's plaintext or a frame's payload); raises WireError and nothing else."""
    read_versions(data)
    if len(data) > MAX_FRAME:
        raise MessageTooLarge("a message", len(data), MAX_FRAME)
    obj = unpack_bounded(data, max_array=MAX_MEMBERS, max_map=MAX_FIELDS)
    try:
        return _parse(*_split(obj))
    except WireError:
        raise
    except Exception as exc:  # a defence in depth: no bug in a parser may let a peer's bytes raise anything else
        raise WireError(f"unreadable message: {type(exc).__name__}: {exc}") from None


# --- TCP frames ---------------------------------------------------------------------------------


def frame(payload: bytes, max_size: int = MAX_FRAME) -> bytes:
    """`payload` behind its 4-byte big-endian length; raises MessageTooLarge over `max_size`."""
    if len(payload) > max_size or len(payload) >= 2 ** (8 * FRAME_PREFIX):
        raise MessageTooLarge("a frame", len(payload), max_size)
    return len(payload).to_bytes(FRAME_PREFIX, "big") + payload


async def read_frame(reader: asyncio.StreamReader, max_size: int = MAX_FRAME) -> bytes | None:
    """The next frame's payload; None at a clean end of stream; WireError for a truncated or oversized frame.

    The length is checked before anything is read, so a peer cannot make us buffer more than `max_size`.
    Connection errors (OSError) pass through.
    """
    try:
        prefix = await reader.readexactly(FRAME_PREFIX)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise WireError(f"stream ended inside a frame's length ({len(exc.partial)} of {FRAME_PREFIX} bytes)") from None
    size = int.from_bytes(prefix, "big")
    if size > max_size:
        raise MessageTooLarge("a frame", size, max_size)
    try:
        return await reader.readexactly(size)
    except asyncio.IncompleteReadError as exc:
        raise WireError(f"stream ended inside a frame ({len(exc.partial)} of {size} bytes)") from None
