"""A lease: what was granted, to whom, for how long, under which fencing epochs (SPEC §3)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
from dataclasses import dataclass, field, fields
from typing import Any

from gpubroker.units import rfc3339

LIVE = "granted"
ENDED = ("released", "expired", "revoked")


@dataclass(slots=True)
class Holder:
    """Who a lease belongs to: a name, and on the Unix socket the kernel's pid, uid and start time."""

    name: str | None = None
    pid: int | None = None
    uid: int | None = None
    start_time: float | None = None  # the pid's start time, so a reused pid is not mistaken for it

    @property
    def called(self) -> str:
        """How messages name it: its name, or that it has none."""
        return self.name or "an unnamed holder"

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "uid": self.uid, "pid": self.pid}


@dataclass(frozen=True, slots=True)
class LeasedGpu:
    index: int
    uuid: str
    bytes: int
    epoch: int  # that accelerator's fencing epoch at this grant


@dataclass(slots=True)
class Lease:
    id: str
    node: str
    state: str
    epoch: int
    priority: str
    preemption: str
    bind: str
    holder: Holder
    gpus: list[LeasedGpu]
    exclusive: bool
    cpu_cores: int
    memory: int
    labels: dict[str, str]
    token_hash: str
    requested_at: float
    granted_at: float
    expires_at: float
    ttl: float
    pgids: list[int] = field(default_factory=list)  # process groups registered with the lease
    pgid_uids: list[int] = field(default_factory=list)  # the uid that owned each group when it was registered
    # When each group's leader started, as registered (`holders.group_started`), so that a later group with a reused
    # id is not taken for it. Shorter than `pgids` in a lease stored by an earlier version: those go by id alone.
    pgid_started: list[float | None] = field(default_factory=list)
    ended_at: float | None = None
    reason: str | None = None
    # Its expiry on the elapsed clock (the boot's monotonic clock, the same in every process): a broker started again
    # on the same boot finds how long it has left there, whatever steps of the wall clock did to `expires_at`.
    deadline: float | None = None

    @property
    def live(self) -> bool:
        return self.state == LIVE

    def bytes_on(self, uuid: str) -> int:
        return sum(g.bytes for g in self.gpus if g.uuid == uuid)

    def groups_started(self) -> list[float | None]:
        """`pgid_started` for each of `pgids`: None where none was recorded."""
        return [*self.pgid_started[: len(self.pgids)], *[None] * (len(self.pgids) - len(self.pgid_started))]

    def env(self) -> dict[str, str]:
        # Empty without GPUs: work under a CPU-only lease sees no GPU, rather than every GPU it inherited.
        env = {"GPUBROKER_LEASE": self.id, "CUDA_VISIBLE_DEVICES": ",".join(g.uuid for g in self.gpus)}
        if self.gpus:
            env["GPUBROKER_GPU_MEMORY"] = str(self.gpus[0].bytes)
        return env

    def token_matches(self, token: str | None) -> bool:
        return token is not None and hmac.compare_digest(hash_token(token), self.token_hash)

    def to_json(self, token: str | None = None) -> dict[str, Any]:
        """The API's shape; the token only for the requester, who alone ever sees it."""
        out: dict[str, Any] = {
            "id": self.id,
            "state": self.state,
            "node": self.node,
            "epoch": self.epoch,
            "priority": self.priority,
            "preemption": self.preemption,
            "bind": self.bind,
            "holder": self.holder.to_json(),
            "gpus": [{"index": g.index, "uuid": g.uuid, "bytes": g.bytes, "epoch": g.epoch} for g in self.gpus],
            "exclusive": self.exclusive,
            "cpu_cores": self.cpu_cores,
            "memory": self.memory,
            "labels": self.labels,
            "env": self.env(),
            "granted_at": rfc3339(self.granted_at),
            "expires_at": rfc3339(self.expires_at),
            "ttl": self.ttl,
            "process_groups": self.pgids,
        }
        if token is not None:
            out["token"] = token
        if self.ended_at is not None:
            out["ended_at"] = rfc3339(self.ended_at)
            out["reason"] = self.reason
        return out

    def to_record(self) -> dict[str, Any]:
        """What the store keeps (written out by hand: `asdict` costs a deep copy on every grant)."""
        h = self.holder
        return {
            "id": self.id, "node": self.node, "state": self.state, "epoch": self.epoch, "priority": self.priority,
            "preemption": self.preemption, "bind": self.bind,
            "holder": {"name": h.name, "pid": h.pid, "uid": h.uid, "start_time": h.start_time},
            "gpus": [{"index": g.index, "uuid": g.uuid, "bytes": g.bytes, "epoch": g.epoch} for g in self.gpus],
            "exclusive": self.exclusive, "cpu_cores": self.cpu_cores, "memory": self.memory, "labels": self.labels,
            "token_hash": self.token_hash, "requested_at": self.requested_at, "granted_at": self.granted_at,
            "expires_at": self.expires_at, "ttl": self.ttl, "pgids": list(self.pgids), "pgid_uids": list(self.pgid_uids),
            "pgid_started": list(self.pgid_started), "ended_at": self.ended_at,
            "reason": self.reason, "deadline": self.deadline,
        }  # fmt: skip

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Lease:
        """A stored lease. Fields this version does not know (a newer broker's, before a downgrade) are left out:
        the lease is kept as far as this version understands it, rather than the store called unreadable."""
        known = _known(Lease, record)
        known["holder"] = Holder(**_known(Holder, record["holder"]))
        known["gpus"] = [LeasedGpu(**_known(LeasedGpu, g)) for g in record["gpus"]]
        return cls(**known)


def _known(kind: type, record: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in fields(kind)}
    return {key: value for key, value in record.items() if key in names}


def unknown_fields(record: dict[str, Any]) -> set[str]:
    """The fields of a stored lease this version does not know (`holder.cgroup`, say): what `from_record` leaves out."""
    unknown = set(record) - {f.name for f in fields(Lease)}
    holder, gpus = record.get("holder"), record.get("gpus")
    if isinstance(holder, dict):
        unknown |= {f"holder.{key}" for key in set(holder) - {f.name for f in fields(Holder)}}
    if isinstance(gpus, list):
        unknown |= {f"gpus.{key}" for gpu in gpus if isinstance(gpu, dict) for key in set(gpu) - {f.name for f in fields(LeasedGpu)}}
    return unknown


def hash_token(token: str) -> str:
    """Tokens are kept as hashes: the store never holds what would let a reader act on a lease."""
    # surrogateescape: a header that was not UTF-8 must hash (and fail to match), not raise.
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).hexdigest()


# Ids and tokens come from getrandom(2) as os.getrandom calls it: it keeps the GIL, where os.urandom
# gives it up and may then wait for the store's writer thread before the loop can go on.


def new_lease_id() -> str:
    """48 random bits: `l-` and 12 hex digits."""
    return f"l-{os.getrandom(6).hex()}"


def new_token() -> str:
    """192 random bits, URL-safe, as secrets.token_urlsafe(24) writes them (32 characters)."""
    return base64.urlsafe_b64encode(os.getrandom(24)).decode()
