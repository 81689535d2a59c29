"""Properties of gossip.wire: every message round-trips, datagrams fit their budget, and any bytes raise only WireError."""

from __future__ import annotations

import asyncio
import tracemalloc
from typing import Any

import msgpack
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gpubroker.gossip import wire
from gpubroker.gossip.keyring import OVERHEAD
from gpubroker.gossip.messages import (
    Ack,
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
from gpubroker.gossip.wire import (
    MAGIC,
    MAX_DATAGRAM,
    MAX_META,
    PROTOCOL_MAX,
    PROTOCOL_MIN,
    IncompatibleVersion,
    MessageTooLarge,
    UnknownMessage,
    WireError,
    decode,
    encode,
    frame,
    pack_compound,
    read_frame,
)

# --- strategies ---------------------------------------------------------------------------------

node_ids = st.text(min_size=1, max_size=wire.MAX_NODE_ID)
hosts = st.one_of(st.ip_addresses().map(str), st.text(min_size=1, max_size=wire.MAX_HOST))
addrs = st.tuples(hosts, st.integers(0, 65535))
uints = st.integers(0, 2**64 - 1)
incarnations = st.integers(0, 2**63 - 1)
metas = st.binary(max_size=MAX_META)

pings = st.builds(Ping, seq=uints, target=node_ids, source=node_ids, source_addr=addrs)
indirect_pings = st.builds(
    IndirectPing, seq=uints, target=node_ids, target_addr=addrs, source=node_ids, source_addr=addrs, nack=st.booleans()
)
acks = st.builds(Ack, seq=uints, payload=st.binary(max_size=256))
nacks = st.builds(Nack, seq=uints)
alives = st.builds(Alive, incarnation=incarnations, node=node_ids, addr=addrs, meta=metas)
suspects = st.builds(Suspect, incarnation=incarnations, node=node_ids, source=node_ids)
deads = st.builds(Dead, incarnation=incarnations, node=node_ids, source=node_ids)
notices = st.builds(DocumentNotice, node=node_ids, generation=uints, version=uints)
members = st.builds(Member, node=node_ids, addr=addrs, incarnation=incarnations, state=st.sampled_from(MemberState), meta=metas)
push_pulls = st.builds(PushPull, members=st.lists(members, max_size=8).map(tuple), join=st.booleans())

simple_messages: st.SearchStrategy[Message] = st.one_of(pings, indirect_pings, acks, nacks, alives, suspects, deads, notices, push_pulls)
compounds = st.builds(Compound, parts=st.lists(simple_messages, max_size=6).map(tuple))
messages: st.SearchStrategy[Message] = st.one_of(simple_messages, compounds)
# What gossip piggybacks: small enough that any one fits a datagram on its own.
small_ids = st.text(min_size=1, max_size=24)
small_addrs = st.tuples(st.ip_addresses().map(str), st.integers(0, 65535))
broadcasts: st.SearchStrategy[Message] = st.one_of(
    st.builds(Alive, incarnation=incarnations, node=small_ids, addr=small_addrs, meta=st.binary(max_size=200)),
    st.builds(Suspect, incarnation=incarnations, node=small_ids, source=small_ids),
    st.builds(Dead, incarnation=incarnations, node=small_ids, source=small_ids),
    st.builds(DocumentNotice, node=small_ids, generation=uints, version=uints),
    st.builds(Ping, seq=uints, target=small_ids, source=small_ids, source_addr=small_addrs),
    st.builds(Ack, seq=uints, payload=st.binary(max_size=64)),
)


def flatten(decoded: Message) -> list[Message]:
    return list(decoded.parts) if isinstance(decoded, Compound) else [decoded]


def crafted(body: Any, low: int = PROTOCOL_MIN, high: int = PROTOCOL_MAX) -> bytes:
    """A datagram as another version of the program could write it."""
    packed: bytes = msgpack.packb(body, use_bin_type=True)
    return MAGIC + bytes((low, high)) + packed


def decode_or_error(data: bytes) -> Message | WireError:
    try:
        return decode(data)
    except WireError as error:
        return error


# --- round trips --------------------------------------------------------------------------------


@given(messages)
@example(Ack(seq=0))
@example(Compound())
@example(PushPull(members=()))
def test_every_message_round_trips_through_encode_and_decode(message: Message) -> None:
    assert decode(encode(message)) == message


@given(messages)
def test_every_encoding_starts_with_the_magic_and_our_protocol_range(message: Message) -> None:
    data = encode(message)
    assert data[:3] == MAGIC + bytes((PROTOCOL_MIN, PROTOCOL_MAX))
    assert wire.read_versions(data) == (PROTOCOL_MIN, PROTOCOL_MAX)


def test_optional_fields_at_their_default_cost_no_bytes() -> None:
    assert len(encode(Ack(seq=7))) < len(encode(Ack(seq=7, payload=b"x")))
    default, other = IndirectPing(1, "t", ("h", 1), "s", ("h", 2)), IndirectPing(1, "t", ("h", 1), "s", ("h", 2), nack=False)
    assert len(encode(default)) < len(encode(other))


@pytest.mark.parametrize(
    "message",
    [
        Ping(seq=-1, target="a", source="b", source_addr=("h", 1)),
        Ping(seq=2**64, target="a", source="b", source_addr=("h", 1)),
        Ping(seq=1, target="", source="b", source_addr=("h", 1)),
        Ping(seq=1, target="a" * (wire.MAX_NODE_ID + 1), source="b", source_addr=("h", 1)),
        Ping(seq=1, target="a", source="b", source_addr=("h", 65536)),
        Ping(seq=1, target="a", source="b", source_addr=("", 1)),
        Ping(seq=True, target="a", source="b", source_addr=("h", 1)),
        Alive(incarnation=1, node="a", addr=("h", 1), meta=b"m" * (MAX_META + 1)),
        PushPull(members=(Member("a", ("h", 1), 1, "alive"),)),  # type: ignore[arg-type]
        Compound(parts=(Compound(),)),
    ],
    ids=[
        "negative seq",
        "seq past uint64",
        "empty id",
        "long id",
        "port",
        "empty host",
        "bool seq",
        "big meta",
        "plain-str state",
        "nested compound",
    ],
)
def test_encode_refuses_a_value_that_peers_would_refuse(message: Message) -> None:
    with pytest.raises(WireError):
        encode(message)


# --- compound packing ---------------------------------------------------------------------------


@given(st.lists(broadcasts, max_size=90), st.integers(200, MAX_DATAGRAM))
def test_packed_datagrams_never_exceed_the_limit_once_sealed_and_lose_no_message(batch: list[Message], limit: int) -> None:
    try:
        datagrams = pack_compound(batch, limit)
    except MessageTooLarge:
        assert any(len(encode(m)) > limit - OVERHEAD for m in batch)
        return
    assert all(len(d) + OVERHEAD <= limit for d in datagrams)
    assert [m for d in datagrams for m in flatten(decode(d))] == batch


@given(st.lists(broadcasts, min_size=30, max_size=90))
def test_a_datagram_is_split_only_when_the_next_message_would_not_fit(batch: list[Message]) -> None:
    datagrams = pack_compound(batch)
    for first, second in zip(datagrams, datagrams[1:], strict=False):
        merged = encode(Compound((*flatten(decode(first)), flatten(decode(second))[0])))
        assert len(merged) + OVERHEAD > MAX_DATAGRAM, "the first message of the next datagram would have fitted in this one"


def test_one_message_alone_travels_bare_not_in_a_compound() -> None:
    (datagram,) = pack_compound([Nack(seq=3)])
    assert decode(datagram) == Nack(seq=3)


def test_nothing_to_send_makes_no_datagram() -> None:
    assert pack_compound([]) == []


def test_a_message_too_big_for_any_datagram_is_an_error_naming_its_size() -> None:
    crowd = PushPull(members=tuple(Member(f"n-{i:016d}", ("10.0.0.1", 9741), i, MemberState.ALIVE, b"m" * 100) for i in range(20)))
    with pytest.raises(MessageTooLarge) as raised:
        pack_compound([Nack(seq=1), crowd])
    assert raised.value.limit == MAX_DATAGRAM - OVERHEAD
    assert raised.value.size > raised.value.limit
    assert decode(encode(crowd)) == crowd  # over TCP it goes as one frame


def test_compound_parts_given_to_pack_compound_are_packed_as_their_parts() -> None:
    parts = (Nack(seq=1), Nack(seq=2))
    assert decode(pack_compound([Compound(parts), Nack(seq=3)])[0]) == Compound((*parts, Nack(seq=3)))


# --- hostile bytes ------------------------------------------------------------------------------


@given(st.binary(max_size=2000))
@example(b"")
@example(MAGIC)
@example(MAGIC + b"\x01\x01")
@example(MAGIC + b"\x01\x01" + b"\x91" * 5000 + b"\xc0")  # deeper than msgpack's stack
@example(MAGIC + b"\x01\x01" + b"\xdd\xff\xff\xff\xff")  # an array claiming 4 billion elements
@example(MAGIC + b"\x01\x01" + b"\xdb\x7f\xff\xff\xff")  # a string claiming 2 GiB
@example(MAGIC + b"\x01\x01" + b"\xc1")  # a byte msgpack never uses
@example(MAGIC + b"\x01\x01" + b"\xd6\xff\x00\x00\x00\x00")  # a timestamp extension
def test_random_bytes_raise_only_wire_error(data: bytes) -> None:
    result = decode_or_error(data)
    if not isinstance(result, WireError):
        assert decode(encode(result)) == result  # what decode accepts, encode can write


@given(messages, st.data())
def test_a_truncated_encoding_raises_only_wire_error(message: Message, data: st.DataObject) -> None:
    encoded = encode(message)
    cut = data.draw(st.integers(0, len(encoded) - 1))
    assert isinstance(decode_or_error(encoded[:cut]), WireError)


@given(messages, st.data())
def test_a_mutated_encoding_raises_only_wire_error_or_decodes_to_a_writable_message(message: Message, data: st.DataObject) -> None:
    encoded = bytearray(encode(message))
    for _ in range(data.draw(st.integers(1, 4))):
        position = data.draw(st.integers(0, len(encoded) - 1))
        encoded[position] = data.draw(st.integers(0, 255))
    encoded += data.draw(st.binary(max_size=8))
    result = decode_or_error(bytes(encoded))
    if not isinstance(result, WireError):
        assert decode(encode(result)) == result


field_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(),
    st.text(max_size=8),
    st.binary(max_size=8),
    st.lists(st.one_of(st.text(max_size=4), st.integers(-5, 70000)), max_size=3),
    st.dictionaries(st.text(max_size=2), st.integers(-5, 5), max_size=2),
)


@given(
    st.integers(-2, 12),
    st.dictionaries(st.sampled_from(["q", "t", "s", "sa", "ta", "k", "p", "i", "n", "a", "m", "g", "v", "j"]), field_values),
)
def test_well_formed_msgpack_with_wrong_field_types_raises_only_wire_error(code: int, fields: dict[str, Any]) -> None:
    result = decode_or_error(crafted([code, fields]))
    if not isinstance(result, WireError):
        assert decode(encode(result)) == result


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ([wire.T_PING, {"q": -1, "t": "a", "s": "b", "sa": ["h", 1]}], "negative seq"),
        ([wire.T_PING, {"q": 1, "t": "a", "s": "b", "sa": ["h", -1]}], "negative port"),
        ([wire.T_PING, {"q": 1, "t": "a", "s": "b"}], "missing field"),
        ([wire.T_PING, {"q": 1.0, "t": "a", "s": "b", "sa": ["h", 1]}], "float seq"),
        ([wire.T_PING, {"q": 1, "t": b"a", "s": "b", "sa": ["h", 1]}], "bytes where text belongs"),
        ([wire.T_ACK, {"q": 1, "p": "text"}], "text where bytes belong"),
        ([wire.T_PUSH_PULL, {"m": [{"n": "a", "a": ["h", 1], "i": -5, "s": "alive"}]}], "negative incarnation"),
        ([wire.T_PUSH_PULL, {"m": "many"}], "members not an array"),
        ([wire.T_COMPOUND, {"p": [[wire.T_NACK, {"q": 1}], "junk"]}], "a part that is not a message"),
        ([wire.T_COMPOUND, {"p": [[wire.T_COMPOUND, {"p": []}]]}], "nested compound"),
        ({"q": 1}, "not an array"),
        ([wire.T_NACK], "no fields"),
    ],
)
def test_well_formed_msgpack_that_is_not_a_valid_message_raises_wire_error(body: Any, why: str) -> None:
    with pytest.raises(WireError):
        decode(crafted(body))


def _array(n: int) -> bytes:
    return b"\xdd" + n.to_bytes(4, "big")


@pytest.mark.parametrize(
    "body",
    [
        _array(10_000) + b"\x80" * 9_999,  # empty maps: the costliest bytes there are
        _array(10_000) + b"\x81\xa0\xc0" * 9_999,  # one-entry maps
        _array(10_000) + b"\x90" * 9_999,  # empty arrays
        _array(10_000) + b"\xc4\x01x" * 9_999,  # one-byte binaries
        _array(2**31),  # a claim far beyond the input
        b"\xdb\x7f\xff\xff\xff",  # a 2 GiB string claimed
    ],
    ids=["empty maps", "small maps", "empty arrays", "small binaries", "huge array claim", "huge string claim"],
)
@pytest.mark.parametrize("size", [MAX_DATAGRAM, wire.MAX_FRAME])
def test_decoding_hostile_bytes_costs_at_most_about_eighty_times_their_length(body: bytes, size: int) -> None:
    data = (MAGIC + bytes((PROTOCOL_MIN, PROTOCOL_MAX)) + body * (size // len(body) + 1))[:size]
    tracemalloc.start()
    try:
        with pytest.raises(WireError):
            decode(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 100 * len(data), f"decoding {len(data)} bytes peaked at {peak} bytes"


def test_a_non_utf8_string_raises_wire_error() -> None:
    body = msgpack.packb([wire.T_NACK, {"q": 1}])
    # fixstr of length 1 holding 0xff, in place of the key "q"
    broken = body.replace(b"\xa1q", b"\xa1\xff")
    assert broken != body
    with pytest.raises(WireError):
        decode(MAGIC + bytes((PROTOCOL_MIN, PROTOCOL_MAX)) + broken)


def test_an_integer_map_key_raises_wire_error() -> None:
    with pytest.raises(WireError):
        decode(crafted([wire.T_NACK, {1: 1}]))


def test_an_unknown_message_on_its_own_is_refused_naming_its_type() -> None:
    with pytest.raises(UnknownMessage) as raised:
        decode(crafted([99, {"x": 1}]))
    assert raised.value.type_code == 99


# --- versions -----------------------------------------------------------------------------------


def test_a_newer_node_is_understood_where_the_ranges_overlap() -> None:
    body = [
        wire.T_COMPOUND,
        {
            "p": [
                [77, {"future": "a message type we do not know"}],
                [wire.T_PING, {"q": 5, "t": "n-b", "s": "n-a", "sa": ["10.0.0.1", 9741], "zz": "a field we do not know"}],
                [wire.T_PUSH_PULL, {"m": [{"n": "n-c", "a": ["10.0.0.3", 9741], "i": 2, "s": "hibernating"}], "j": True}],
            ],
            "extra": [1, 2, 3],
        },
        "an element appended by a later version",
    ]
    decoded = decode(crafted(body, low=PROTOCOL_MIN, high=PROTOCOL_MAX + 4))
    assert decoded == Compound(
        parts=(Ping(seq=5, target="n-b", source="n-a", source_addr=("10.0.0.1", 9741)), PushPull(members=(), join=True))
    )


def test_a_node_whose_versions_do_not_overlap_ours_is_refused_with_both_ranges() -> None:
    with pytest.raises(IncompatibleVersion) as raised:
        decode(crafted([wire.T_NACK, {"q": 1}], low=PROTOCOL_MAX + 1, high=PROTOCOL_MAX + 3))
    assert raised.value.theirs == (PROTOCOL_MAX + 1, PROTOCOL_MAX + 3)
    assert raised.value.ours == (PROTOCOL_MIN, PROTOCOL_MAX)
    assert f"{PROTOCOL_MAX + 1}..{PROTOCOL_MAX + 3}" in str(raised.value)


def test_an_older_node_below_our_range_is_refused() -> None:
    with pytest.raises(IncompatibleVersion):
        decode(crafted([wire.T_NACK, {"q": 1}], low=0, high=PROTOCOL_MIN - 1))


def test_an_inverted_version_range_is_malformed() -> None:
    with pytest.raises(WireError, match="malformed protocol range"):
        decode(crafted([wire.T_NACK, {"q": 1}], low=PROTOCOL_MAX + 1, high=PROTOCOL_MIN))


def test_bytes_without_the_magic_are_refused() -> None:
    with pytest.raises(WireError, match="magic"):
        decode(b"\x00" + encode(Nack(seq=1))[1:])


# --- TCP frames ---------------------------------------------------------------------------------


def reader_of(data: bytes, eof: bool = True) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    if eof:
        reader.feed_eof()
    return reader


@settings(max_examples=30)
@given(st.lists(push_pulls, max_size=4))
async def test_frames_read_back_one_by_one_then_none_at_the_end(payloads: list[PushPull]) -> None:
    reader = reader_of(b"".join(frame(encode(p)) for p in payloads))
    assert [decode(await read_frame(reader) or b"") for _ in payloads] == payloads
    assert await read_frame(reader) is None


async def test_a_frame_split_across_reads_is_assembled() -> None:
    payload = encode(PushPull(members=(Member("n-a", ("10.0.0.1", 1), 1, MemberState.ALIVE),)))
    framed = frame(payload)
    reader = reader_of(framed[:3], eof=False)
    pending = asyncio.ensure_future(read_frame(reader))
    await asyncio.sleep(0)  # let it block on the partial length
    assert not pending.done()
    reader.feed_data(framed[3:])
    assert await pending == payload


async def test_a_frame_longer_than_the_maximum_is_refused_before_it_is_read() -> None:
    reader = reader_of((wire.MAX_FRAME + 1).to_bytes(4, "big"), eof=False)  # no payload follows: it must not wait for one
    with pytest.raises(MessageTooLarge) as raised:
        await read_frame(reader)
    assert raised.value.size == wire.MAX_FRAME + 1


async def test_a_custom_maximum_applies() -> None:
    with pytest.raises(MessageTooLarge):
        await read_frame(reader_of(frame(b"x" * 11)), max_size=10)


@pytest.mark.parametrize("cut", [1, 3, 4, 9])
async def test_a_stream_that_ends_inside_a_frame_is_a_wire_error(cut: int) -> None:
    with pytest.raises(WireError, match="stream ended inside"):
        await read_frame(reader_of(frame(b"0123456789")[:cut]))


def test_frame_refuses_a_payload_over_the_maximum() -> None:
    with pytest.raises(MessageTooLarge):
        frame(b"\0" * (wire.MAX_FRAME + 1))
    with pytest.raises(MessageTooLarge):
        frame(b"\0" * 11, max_size=10)
    assert frame(b"\0" * (wire.MAX_FRAME + 1), max_size=wire.MAX_FRAME + 1)[:4] == (wire.MAX_FRAME + 1).to_bytes(4, "big")


def test_decode_refuses_bytes_over_the_frame_maximum() -> None:
    with pytest.raises(MessageTooLarge):
        decode(encode(Ack(seq=1, payload=b"\0" * wire.MAX_FRAME)))
