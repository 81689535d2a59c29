"""Node documents (SPEC §7): what each node holds, written and signed by that node alone.

A document carries its node's accelerators' seven figures and processes (external ones by
name), the accelerators it cannot read and those its leases hold that its driver no longer lists,
one record per lease, the queue and the CPU and memory budgets. The highest
(generation, version) wins: the generation grows at every start of the broker, the version at
every change within one run. Figures are rounded and a new version is made at most about once
a second, so gossip does not storm. The age of a view is measured on the receiving node's
clock, from when it was received; the sender's clock is shown, never trusted.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import msgpack

from gpubroker.units import rfc3339

ROUNDING = 64 * 2**20  # figures are published to the nearest 64 MiB: finer changes are noise, not news
MIN_INTERVAL = 1.0  # seconds between two versions of a document, at least
MAX_INTERVAL = 10.0  # a document is made again after this even unchanged, so every view's age stays bounded
MAX_DOCUMENT = 256 * 2**10  # bytes; more is refused before it is parsed

Sign = Callable[[bytes], bytes]
Verify = Callable[[bytes, bytes, bytes], bool]  # (public key, data, signature) → genuine
NodeIdOf = Callable[[bytes], str]  # public key → node id


class DocumentError(Exception):
    """A document that is malformed, too large, or not signed by the node it names: dropped, never applied."""


def round_bytes(size: int, down: bool = False) -> int:
    """A figure to the nearest ROUNDING; room (`down`) below it, so no peer's view, nor a hint read from it,
    promises more than there is."""
    if down:
        return size // ROUNDING * ROUNDING
    return int(round(size / ROUNDING)) * ROUNDING


def external_by_name(gpu: dict[str, Any]) -> dict[str, int]:
    """A GPU's external memory (as `GET /v1/node` lists its processes) summed by process name."""
    external: dict[str, int] = {}
    for process in gpu.get("processes", []):
        if process.get("lease") is None and process.get("bytes"):
            name = process.get("name") or "unnamed"
            external[name] = external.get(name, 0) + process["bytes"]
    return external


LEASES_ROOM = 192 * 2**10  # bytes of lease records a document lists at most; MAX_DOCUMENT's rest holds the node's figures
UNREADABLE_LISTED = 64  # GPUs the driver lists but cannot read, at most, that a document names (with their errors)
UNREADABLE_ERROR_ROOM = 512  # characters of each one's error a document keeps
MISSING_LISTED = 16  # GPUs that leases hold and the driver no longer lists, at most, that a document names
MISSING_LEASES_LISTED = 16  # lease ids of each, at most, that a document names (and how many more there are)
LABELS_ROOM = 512  # bytes of one lease's labels a document lists at most: one lease's labels must not crowd out others


def summarize(node: dict[str, Any], leases: list[dict[str, Any]]) -> dict[str, Any]:
    """The published part of `GET /v1/node` and the live leases: figures rounded, external processes by name,
    as many leases as LEASES_ROOM holds (and how many more there are), so the document never outgrows MAX_DOCUMENT."""
    gpus = []
    for gpu in node.get("gpus", []):
        external = external_by_name(gpu)
        gpus.append(
            {
                "index": gpu["index"],
                "uuid": gpu["uuid"],
                "name": gpu["name"],
                "figures": {k: round_bytes(v, down=k == "schedulable") for k, v in gpu["figures"].items()},
                "external": {name: round_bytes(size) for name, size in sorted(external.items())},
                "pressure": bool(gpu.get("pressure")),
                # Its node's verdict, on its own elapsed clock: a time of reading would be read against another's clock.
                **({"stale": True} if gpu.get("stale") else {}),
            }
        )
    # A lease's card by its UUID, as the driver numbers the cards now; a card it no longer lists is left out where
    # another card now has its index (peers read a lease's card by index), and kept at its index where none has.
    now_at = {gpu["uuid"]: gpu["index"] for gpu in node.get("gpus", [])}
    taken = set(now_at.values())
    records = [
        {
            "id": lease["id"],
            "holder": lease["holder"].get("name"),
            "priority": lease["priority"],
            "gpus": [[now_at.get(g.get("uuid"), g["index"]), g["bytes"]] for g in lease.get("gpus", []) if _shown(g, now_at, taken)],
            "epochs": [lease.get("epoch"), [g.get("epoch") for g in lease.get("gpus", [])]],  # the lease's, and each GPU's
            "preemption": lease.get("preemption"),
            "granted_at": lease.get("granted_at"),
            "expires_at": lease["expires_at"],
            **({"labels": fitting_labels(labels)} if (labels := lease.get("labels")) else {}),
        }
        for lease in leases
        if lease.get("state") == "granted"
    ]
    return {
        "name": node["node"]["name"],
        "version_of_broker": node["node"].get("version"),
        "production_eligible": node["node"].get("production_eligible", True),
        "driver_error": node.get("driver_error"),
        "unreadable_gpus": [
            {"index": gpu["index"], "uuid": gpu["uuid"], "error": gpu["error"][:UNREADABLE_ERROR_ROOM]}
            for gpu in node.get("unreadable_gpus", [])[:UNREADABLE_LISTED]
        ],
        # Readers that do not know it (an older broker) leave it unread: they show the GPUs listed, as before.
        "missing_gpus": [
            {
                "index": gpu["index"],
                "uuid": gpu["uuid"],
                "name": gpu["name"],
                "since": gpu["since"],
                "leases": gpu["leases"][:MISSING_LEASES_LISTED],
                "leases_not_listed": max(0, len(gpu["leases"]) - MISSING_LEASES_LISTED),
                "bytes": round_bytes(gpu["bytes"]),
            }
            for gpu in node.get("missing_gpus", [])[:MISSING_LISTED]
        ],
        "gpus": gpus,
        "cpu": node.get("cpu", {}),
        "memory": {k: round_bytes(v, down=k == "schedulable") for k, v in node.get("memory", {}).items()},
        "queue": dict(node.get("queue", {})),
        "leases": (listed := _fitting(records, LEASES_ROOM)),
        "leases_not_listed": len(records) - len(listed),
    }


def _shown(gpu: dict[str, Any], now_at: dict[str, int], taken: set[int]) -> bool:
    """Whether a lease's card is listed: unless the driver no longer lists it and another card now has its index."""
    return gpu.get("uuid") is None or gpu["uuid"] in now_at or gpu["index"] not in taken


def _fitting(records: list[Any], room: int) -> list[Any]:
    """The first records whose packed sizes add up to at most `room` bytes."""
    fitting = []
    for record in records:
        room -= len(msgpack.packb(record))
        if room < 0:
            break
        fitting.append(record)
    return fitting


def fitting_labels(labels: dict[str, str]) -> dict[str, str]:
    """A lease's labels as its node's document lists them: in order of key, as many as LABELS_ROOM holds."""
    return dict(_fitting([[key, value] for key, value in sorted(labels.items())], LABELS_ROOM))


def listed_lease(body: dict[str, Any], node: str, record: dict[str, Any], shift: float = 0.0) -> dict[str, Any] | None:
    """A lease a node's document lists, in the API's shape of a lease as far as the document tells it
    (None if the record is not one): a granted lease of `node`, its holder by name, each GPU with its UUID (a card the
    driver no longer lists too); its times moved by `shift` onto the reader's clock (`ClusterView.shift`)."""
    lease_epoch, gpu_epochs = _epochs(record.get("epochs"))
    gpus = record.get("gpus")
    if not (
        isinstance(record.get("id"), str)
        and isinstance(record.get("priority"), str)
        and isinstance(gpus, list)
        and all(isinstance(g, list) and len(g) == 2 and all(_count(n) for n in g) for g in gpus)
    ):
        return None  # not a record this reader knows: a newer broker's, or a broken one
    try:
        # A card the driver no longer lists keeps its index where no listed card has it (as `summarize` shows it).
        uuids = {gpu["index"]: gpu["uuid"] for gpu in listed_missing(body)}
        uuids.update({gpu["index"]: gpu["uuid"] for gpu in body.get("gpus", []) if isinstance(gpu, dict)})
        gpu_epochs += [None] * len(record["gpus"])
        return {
            "id": record["id"],
            "state": "granted",
            "node": node,
            "epoch": lease_epoch,
            "priority": record["priority"],
            "preemption": record.get("preemption"),
            "holder": {"name": record["holder"] if isinstance(record.get("holder"), str) else None},
            "gpus": [
                {"index": index, "uuid": uuids.get(index), "bytes": size, "epoch": epoch}
                for (index, size), epoch in zip(record["gpus"], gpu_epochs, strict=False)
            ],
            "granted_at": _shifted(record.get("granted_at"), shift),
            "expires_at": _shifted(record.get("expires_at"), shift),
            "labels": _labels(record.get("labels")),
        }
    except (KeyError, TypeError, ValueError, IndexError):
        return None


def listed_leases(body: dict[str, Any], node: str, shift: float = 0.0) -> list[dict[str, Any]]:
    """The leases a node's document lists, as `listed_lease` reads them: a record it cannot read (a newer
    broker's, say) is left out, never a failed page or answer."""
    listed = (listed_lease(body, node, r, shift) for r in body.get("leases", []) if isinstance(r, dict))
    return [lease for lease in listed if lease is not None]


def listed_unreadable(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The GPUs a node's document says its driver lists but cannot read, each as `{index, uuid, error}`; none where the
    document does not say (an older broker's), and an entry in a shape not known is left out."""
    entries = body.get("unreadable_gpus")
    if not isinstance(entries, list):
        return []
    return [
        {"index": entry["index"], "uuid": entry.get("uuid"), "error": entry["error"]}
        for entry in entries
        if isinstance(entry, dict)
        and _count(entry.get("index"))
        and isinstance(entry.get("uuid"), str | None)
        and isinstance(entry.get("error"), str)
    ]


def listed_missing(body: dict[str, Any], shift: float = 0.0) -> list[dict[str, Any]]:
    """The GPUs a node's document says leases hold and its driver no longer lists, in the shape `GET /v1/node` gives
    them with `leases_not_listed` beside, `since` moved by `shift` onto the reader's clock; none where the document
    does not say (an older broker's), and an entry in a shape not known is left out."""
    entries = body.get("missing_gpus")
    if not isinstance(entries, list):
        return []
    return [
        {
            "index": entry["index"],
            "uuid": entry["uuid"],
            "name": entry.get("name"),
            "since": _shifted(entry["since"], shift),
            "leases": entry["leases"],
            "leases_not_listed": entry.get("leases_not_listed", 0),
            "bytes": entry["bytes"],
        }
        for entry in entries
        if isinstance(entry, dict)
        and _count(entry.get("index"))
        and isinstance(entry.get("uuid"), str)
        and isinstance(entry.get("name"), str | None)
        and isinstance(entry.get("since"), str)
        and isinstance(entry.get("leases"), list)
        and all(isinstance(lease, str) for lease in entry["leases"])
        and _count(entry.get("leases_not_listed", 0))
        and _count(entry.get("bytes"))
    ]


def _shifted(stamp: object, shift: float) -> object:
    """Another node's time (RFC 3339, as leases are written) moved by `shift` onto this node's clock; as it was where
    there is nothing to move, or it is no time this reader knows."""
    if not shift or not isinstance(stamp, str):
        return stamp
    try:
        return rfc3339(datetime.fromisoformat(stamp).timestamp() + shift)
    except (ValueError, OverflowError, OSError):
        return stamp


def _labels(labels: object) -> dict[str, str]:
    """A listed lease's labels; none where the document gives none (an older broker's) or gives them in a shape not known."""
    if not isinstance(labels, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
        return {}
    return labels


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _epochs(epochs: object) -> tuple[int | None, list[int | None]]:
    """A listed lease's epochs, and each GPU's; None where the document does not say (an older broker's)."""
    if not (isinstance(epochs, list) and len(epochs) == 2 and isinstance(epochs[1], list)):
        return None, []
    known = [e if _count(e) else None for e in [epochs[0], *epochs[1]]]
    return known[0], known[1:]


@dataclass(frozen=True, slots=True)
class NodeDocument:
    node: str
    generation: int
    version: int
    made_at: float  # the sender's clock: shown, never used to judge freshness
    body: dict[str, Any]
    public_key: bytes
    signature: bytes = b""

    @property
    def order(self) -> tuple[int, int]:
        return self.generation, self.version

    def signed_part(self) -> bytes:
        payload = [self.node, self.generation, self.version, self.made_at, self.body, self.public_key]
        packed: bytes = msgpack.packb(payload, use_bin_type=True)
        return packed


def sign_document(document: NodeDocument, sign: Sign) -> bytes:
    """The document as bytes: its signed part and the signature over it."""
    data = document.signed_part()
    packed: bytes = msgpack.packb([data, sign(data)], use_bin_type=True)
    return packed


def open_document(data: bytes, verify: Verify, node_id_of: NodeIdOf) -> NodeDocument:
    """A document from bytes, only if its node's own key signed it and that key is the node's id."""
    if len(data) > MAX_DOCUMENT:
        raise DocumentError(f"a document of {len(data)} bytes is over {MAX_DOCUMENT}")
    try:
        # unpackb bounds every length by the input's size, which is already bounded above.
        signed, signature = msgpack.unpackb(data, raw=False, strict_map_key=True)
        node, generation, version, made_at, body, public_key = msgpack.unpackb(signed, raw=False, strict_map_key=True)
    except Exception as error:  # any malformation: msgpack raises many kinds, and unpacking a wrong shape more
        raise DocumentError(f"not a node document: {type(error).__name__}") from None
    if not (
        isinstance(signed, bytes)
        and isinstance(signature, bytes)
        and isinstance(node, str)
        and all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 2**63 for n in (generation, version))
        and isinstance(made_at, int | float)
        and isinstance(body, dict)
        and isinstance(public_key, bytes)
    ):
        raise DocumentError("not a node document: a field has the wrong type")
    if node_id_of(public_key) != node:
        raise DocumentError(f"document of {node!r} carries a key that is not that node's")
    if not verify(public_key, signed, signature):
        raise DocumentError(f"document of {node!r} is not signed by its node")
    return NodeDocument(node, generation, version, float(made_at), body, public_key, signature)


@dataclass(slots=True)
class _Held:
    document: NodeDocument
    received_at: float  # the receiving node's elapsed clock (never its wall clock, which NTP may step)


@dataclass(slots=True)
class ClusterView:
    """Every node's latest document as this node holds it, with how old each is on this node's clock."""

    held: dict[str, _Held] = field(default_factory=dict)

    def apply(self, document: NodeDocument, now: float) -> bool:
        """Keep the document if it is newer than the one held; True if it was."""
        current = self.held.get(document.node)
        if current is not None and current.document.order >= document.order:
            return False
        self.held[document.node] = _Held(document, now)
        return True

    def knows(self, node: str) -> tuple[int, int] | None:
        held = self.held.get(node)
        return held.document.order if held else None

    def age(self, node: str, now: float) -> float | None:
        held = self.held.get(node)
        return None if held is None else max(0.0, now - held.received_at)

    def shift(self, node: str, now: float, wall: float) -> float:
        """How far to move `node`'s times (a lease's grant and expiry) to read them on this node's wall clock `wall`
        (`now` on the elapsed clock): its clock may be minutes or hours off this one's (a box without a real-time
        clock, a VM restored from a snapshot). Its document was made at `made_at` on its clock and received at
        `received_at` on this node's, so what was due some time after its making is due that long after the receipt
        (later by the document's way here, well under a second on a LAN, where the clocks agree)."""
        held = self.held.get(node)
        if held is None:
            return 0.0
        shift = wall - (now - held.received_at) - held.document.made_at
        return shift if math.isfinite(shift) else 0.0

    def forget(self, node: str) -> None:
        self.held.pop(node, None)

    def documents(self) -> list[tuple[NodeDocument, float]]:
        return [(held.document, held.received_at) for held in self.held.values()]


@dataclass(slots=True)
class Publisher:
    """This node's own document: a new version when the rounded summary changes, at most once per MIN_INTERVAL."""

    node: str
    generation: int
    public_key: bytes
    version: int = 0
    last_body: dict[str, Any] | None = None
    last_made: float = float("-inf")  # on the elapsed clock: a step of the wall clock back must not hold documents back

    def next(self, body: dict[str, Any], now: float, wall: float | None = None) -> NodeDocument | None:
        """A new document if the body changed and the last one is old enough, or if the last is MAX_INTERVAL old;
        `now` on the elapsed clock, `wall` (the document's made_at, shown only) on the wall clock, `now` if not given."""
        since = now - self.last_made
        if since < MIN_INTERVAL or (body == self.last_body and since < MAX_INTERVAL):
            return None
        self.version += 1
        self.last_body, self.last_made = body, now
        return NodeDocument(self.node, self.generation, self.version, now if wall is None else wall, body, self.public_key)
