"""The messages of the membership protocol, as plain values (SWIM with Lifeguard, after HashiCorp memberlist).

The protocol code builds and reads these; `gossip.wire` alone turns them into bytes and back.
Node ids are strings (`n-...`), addresses are (host, port) pairs, incarnations only grow.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

Addr = tuple[str, int]


class MemberState(StrEnum):
    ALIVE = "alive"
    SUSPECT = "suspect"
    DEAD = "dead"
    LEFT = "left"


@dataclass(frozen=True, slots=True)
class Ping:
    """Are you alive? `target` guards against a node answering for an address it no longer holds."""

    seq: int
    target: str
    source: str
    source_addr: Addr


@dataclass(frozen=True, slots=True)
class IndirectPing:
    """Ask a peer to ping `target` for us; with `nack`, the peer answers Nack if its own ping times out."""

    seq: int
    target: str
    target_addr: Addr
    source: str
    source_addr: Addr
    nack: bool = True


@dataclass(frozen=True, slots=True)
class Ack:
    seq: int
    payload: bytes = b""


@dataclass(frozen=True, slots=True)
class Nack:
    """Lifeguard: the relay could not reach the target either, so the prober's own health is not to blame."""

    seq: int


@dataclass(frozen=True, slots=True)
class Alive:
    incarnation: int
    node: str
    addr: Addr
    meta: bytes = b""  # the node's name, ports and protocol range, encoded by the caller


@dataclass(frozen=True, slots=True)
class Suspect:
    incarnation: int
    node: str
    source: str  # who suspects it: independent confirmations shrink the suspicion timeout


@dataclass(frozen=True, slots=True)
class Dead:
    incarnation: int
    node: str
    source: str  # the node itself when it leaves


@dataclass(frozen=True, slots=True)
class DocumentNotice:
    """A node's document has a new (generation, version): laggards fetch it over TCP."""

    node: str
    generation: int
    version: int


@dataclass(frozen=True, slots=True)
class Member:
    """One member as a push-pull exchange carries it."""

    node: str
    addr: Addr
    incarnation: int
    state: MemberState
    meta: bytes = b""


@dataclass(frozen=True, slots=True)
class PushPull:
    """Anti-entropy over TCP: each side sends every member it knows; `join` marks the first exchange."""

    members: tuple[Member, ...]
    join: bool = False


@dataclass(frozen=True, slots=True)
class Compound:
    """Several messages in one datagram (the piggybacked broadcasts ride here)."""

    parts: tuple[Message, ...] = field(default_factory=tuple)


Message = Ping | IndirectPing | Ack | Nack | Alive | Suspect | Dead | DocumentNotice | PushPull | Compound
