"""Who belongs to the cluster: its id, keyring and members, invites and join requests, kept in `state_dir/cluster.json`.

    ClusterError    a refused admission, a malformed join token, a removal of oneself, an unreadable state file

A cluster is created once (`ClusterState.init`). A node joins it in one of two ways, both ending in a
`JoinGrant` the new node stores with `ClusterState.adopt`:

- with a one-time token from `invite` ("gbj1." + base64url(msgpack)), which the seed redeems (`redeem`);
- by approval: a discovered node asks (`ask`), an operator approves it (`approve`).

Members replicate admissions and removals to each other with `export` and `merge`. Removals are tombstones
that win over admissions for ever: a removed node cannot come back by a merge from a member that had not
heard of the removal yet, at the price that a removed node id can never rejoin — a removed machine must
make a new identity key (a new node id) to be admitted again. Each member keeps the certificate a removed node
was admitted with, when it knew it, so that the node, back after being down through its removal, is recognised
when it calls and told.

Everything here is synchronous and does no networking: the runtime proves that a peer holds the key of the
certificate it presents (TLS) before it calls `redeem`, `ask` or `merge`, and calls them from one thread.
Every change is written to disk before the call returns (0600, atomically: temp file, fsync, rename).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import math
import re
import secrets
import time
import uuid
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, TypedDict

import msgpack
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.x509.oid import SignatureAlgorithmOID

from gpubroker.gossip.identity import Identity, IdentityError, fingerprint, node_id_of, write_private
from gpubroker.gossip.keyring import Keyring, KeyringError, cluster_hash, key_id, new_key
from gpubroker.gossip.messages import Addr

STATE_FILE = "cluster.json"
FORMAT = 1
TOKEN_PREFIX = "gbj1."
SECRET_SIZE = 32
MAX_TOKEN = 1024  # characters; a real token is about 200
MAX_CERT_PEM = 8192  # characters; a node's certificate is about 700
MAX_NAME = 255
MAX_HOST = 255
MAX_CLUSTER_ID = 128
MAX_PENDING = 64  # discovered nodes may ask without being anyone: the oldest request is forgotten first
MAX_REMOVED_KEYS = 4096  # key ids a peer may name as removed; a rotation a day for ten years is under it
INVITE_GRACE = 86400.0  # an expired invite is kept a day more, so its redemption is refused as "expired", not "unknown"

_NODE_ID = re.compile(r"n-[a-z2-7]{16}")
_FINGERPRINT = re.compile(r"[0-9a-f]{64}")
_KEY_ID = re.compile(r"[0-9a-f]{12}")


class ClusterError(Exception):
    """A cluster operation refused or input that is not what it claims; `node_id` names the node concerned, if any."""

    def __init__(self, message: str, node_id: str | None = None) -> None:
        super().__init__(message)
        self.node_id = node_id


class MemberEntry(TypedDict):
    cert: str  # PEM
    name: str
    admitted_by: str  # node id of the member that admitted it ("" when not known)
    admitted_at: float


class PendingEntry(TypedDict):
    cert: str
    name: str
    addr: list[Any]  # [host, port]
    seen_at: float


class InviteEntry(TypedDict):
    expires: float
    used: bool


@dataclass(frozen=True, slots=True)
class JoinToken:
    """What a join token says: where to redeem it, whom to trust there, and the secret to show."""

    seed: Addr
    fingerprint: str  # sha256 hex of the issuer's certificate: the joiner pins the seed's TLS certificate to it
    secret: bytes = field(repr=False)
    expires: float
    cluster: str  # cluster_hash(cluster_id), to match mDNS TXT records and the grant


@dataclass(frozen=True, slots=True)
class JoinGrant:
    """What an admitted node receives: enough to become a member (it holds the keyring: send it only over TLS)."""

    cluster_id: str
    keyring: str = field(repr=False)  # Keyring.to_json()
    members: dict[str, MemberEntry]
    removed: dict[str, float]
    keys_version: int = 0  # how many keyring changes the keyring has seen: a newcomer must not take an older one for newer
    removed_keys: frozenset[str] = frozenset()  # ids of keys removed from the cluster, never to be installed again

    def to_dict(self) -> dict[str, Any]:
        """Plain types for the wire (msgpack or JSON)."""
        return {
            "cluster_id": self.cluster_id,
            "keyring": self.keyring,
            "members": {nid: dict(entry) for nid, entry in self.members.items()},
            "removed": dict(self.removed),
            "keys": {"version": self.keys_version, "removed": sorted(self.removed_keys)},
        }

    @classmethod
    def from_dict(cls, data: object) -> JoinGrant:
        """The grant `to_dict` made; ClusterError for anything else. Malformed member entries are dropped."""
        if not isinstance(data, dict):
            raise ClusterError(f"a join grant is a map, not {type(data).__name__}")
        cluster_id, keyring = data.get("cluster_id"), data.get("keyring")
        if type(cluster_id) is not str or not 0 < len(cluster_id) <= MAX_CLUSTER_ID:
            raise ClusterError("a join grant names its cluster id")
        if type(keyring) is not str:
            raise ClusterError("a join grant carries the cluster keyring")
        try:
            Keyring.from_json(keyring)
        except KeyringError as exc:
            raise ClusterError(f"the join grant's keyring is unusable: {exc}") from None
        version, removed_keys = valid_keys_state(data.get("keys"))
        return cls(
            cluster_id, keyring, _valid_members(data.get("members")), _valid_removed(data.get("removed")), max(0, version), removed_keys
        )


@dataclass(frozen=True, slots=True)
class Pending:
    """A discovered node asking to join, waiting for an operator's approval."""

    node_id: str
    name: str
    addr: Addr
    seen_at: float
    fingerprint: str  # of its certificate, for the operator to compare with what the node prints


def new_key_b64() -> str:
    """A fresh keyring key, base64 (for `gpubroker keys install`)."""
    return base64.b64encode(new_key()).decode("ascii")


def decode_token(token: str) -> JoinToken:
    """The join token's contents; ClusterError, and nothing else, for any malformed input. Expiry is not checked."""
    if not isinstance(token, str):
        raise ClusterError(f"a join token is text, not {type(token).__name__}")
    # Whitespace is never part of a token: a terminal or a mail that wrapped it put line breaks or spaces inside it.
    token = "".join(token.split())
    if not token.startswith(TOKEN_PREFIX):
        raise ClusterError(f"not a join token: it must start with {TOKEN_PREFIX!r}")
    if len(token) > MAX_TOKEN:
        raise ClusterError(f"not a join token: {len(token)} characters, at most {MAX_TOKEN}")
    body = token[len(TOKEN_PREFIX) :]
    stray = re.search(r"[^A-Za-z0-9_-]", body)
    if stray is not None:
        raise ClusterError(
            f"not a join token: it has {stray.group()!r} at character {len(TOKEN_PREFIX) + stray.start() + 1}, outside base64url; "
            "copy it whole from `gpubroker invite`"
        )
    try:
        raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
        doc = msgpack.unpackb(
            raw, raw=False, strict_map_key=True, max_str_len=len(raw), max_bin_len=len(raw), max_array_len=8, max_map_len=8, max_ext_len=0
        )
    except Exception as exc:  # binascii.Error, msgpack's ValueError subclasses, UnicodeDecodeError, TypeError...
        raise ClusterError(
            f"not a join token: it is cut short or mistyped ({type(exc).__name__}); copy it whole from `gpubroker invite`"
        ) from None
    if not isinstance(doc, dict):
        raise ClusterError("not a join token: its body is not a map")
    seed, fp, secret, exp, cluster = (doc.get(k) for k in ("seed", "fp", "secret", "exp", "cluster"))
    if not (
        isinstance(seed, list)
        and len(seed) == 2
        and type(seed[0]) is str
        and 0 < len(seed[0]) <= MAX_HOST
        and type(seed[1]) is int
        and 0 < seed[1] < 65536
    ):
        raise ClusterError("not a join token: its seed is not [host, port]")
    if type(fp) is not str or not _FINGERPRINT.fullmatch(fp):
        raise ClusterError("not a join token: its fingerprint is not sha256 hex")
    if type(secret) is not bytes or len(secret) != SECRET_SIZE:
        raise ClusterError(f"not a join token: its secret is not {SECRET_SIZE} bytes")
    if not _is_time(exp):
        raise ClusterError("not a join token: its expiry is not a time")
    if type(cluster) is not str or not 0 < len(cluster) <= 64:
        raise ClusterError("not a join token: it names no cluster")
    return JoinToken((seed[0], seed[1]), fp, secret, float(exp), cluster)  # type: ignore[arg-type]


@lru_cache(maxsize=1024)
def _certificate(cert_pem: str) -> tuple[str, bytes, float]:
    """(node id, DER, not-valid-before timestamp) of a node's self-signed Ed25519 certificate; ClusterError otherwise.

    Validity dates are not checked here: pinning is by key, and a merge must not depend on the local clock.
    """
    if not isinstance(cert_pem, str) or len(cert_pem) > MAX_CERT_PEM:
        raise ClusterError("a certificate is PEM text of at most 8 KiB")
    try:
        cert = x509.load_pem_x509_certificate(cert_pem.encode("ascii"))
        key = cert.public_key()
        algorithm = cert.signature_algorithm_oid
        signature, tbs = cert.signature, cert.tbs_certificate_bytes
    except Exception as exc:  # ValueError, UnicodeEncodeError, and whatever else a hostile PEM provokes
        raise ClusterError(f"not a PEM certificate: {type(exc).__name__}") from None
    if not isinstance(key, Ed25519PublicKey) or algorithm != SignatureAlgorithmOID.ED25519:
        raise ClusterError(f"a node's certificate is Ed25519, not {type(key).__name__}")
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    if not Identity.verify(raw, tbs, signature):
        raise ClusterError("the certificate is not signed by its own key")
    try:
        return node_id_of(raw), cert.public_bytes(serialization.Encoding.DER), cert.not_valid_before_utc.timestamp()
    except IdentityError as exc:  # cannot happen for a 32-byte Ed25519 key; kept so nothing else escapes
        raise ClusterError(str(exc)) from None


def _is_time(value: object) -> bool:
    """A finite number of seconds (an int too large for a float would overflow later, so it is not one)."""
    if type(value) is int:
        return abs(value) < 2**53
    return type(value) is float and math.isfinite(value)


def _valid_name(value: object) -> bool:
    return type(value) is str and 0 < len(value) <= MAX_NAME and value.isprintable()


def _valid_member(node_id: object, entry: object) -> MemberEntry | None:
    """The entry as stored, or None when anything about it is wrong (its certificate must prove `node_id`)."""
    if type(node_id) is not str or not _NODE_ID.fullmatch(node_id) or not isinstance(entry, dict):
        return None
    cert, name = entry.get("cert"), entry.get("name")
    admitted_by, admitted_at = entry.get("admitted_by", ""), entry.get("admitted_at", 0.0)
    if type(cert) is not str or not _valid_name(name) or type(admitted_by) is not str or len(admitted_by) > 64 or not _is_time(admitted_at):
        return None
    try:
        if _certificate(cert)[0] != node_id:
            return None
    except ClusterError:
        return None
    return MemberEntry(cert=cert, name=name, admitted_by=admitted_by, admitted_at=float(admitted_at))  # type: ignore[typeddict-item]


def _valid_members(data: object) -> dict[str, MemberEntry]:
    if not isinstance(data, dict):
        return {}
    members = {}
    for node_id, entry in data.items():
        valid = _valid_member(node_id, entry)
        if valid is not None:
            members[node_id] = valid
    return members


def _valid_removed(data: object) -> dict[str, float]:
    if not isinstance(data, dict):
        return {}
    return {nid: float(at) for nid, at in data.items() if type(nid) is str and _NODE_ID.fullmatch(nid) and _is_time(at)}


def valid_keys_state(data: object) -> tuple[int, frozenset[str]]:
    """(keyring version, removed key ids) of what `keys_state` made; version -1 for anything else (a peer that
    does not order its keyring: never newer than this node's), malformed key ids dropped."""
    if not isinstance(data, dict):
        return -1, frozenset()
    version, removed = data.get("version"), data.get("removed")
    if type(version) is not int or version < 0:
        version = -1
    if not isinstance(removed, list) or len(removed) > MAX_REMOVED_KEYS:
        return version, frozenset()
    return version, frozenset(k for k in removed if type(k) is str and _KEY_ID.fullmatch(k))


def _rank(entry: MemberEntry) -> tuple[float, float, str, str, str]:
    """A total order on entries for the same node, so that every member keeps the same one: the newest
    certificate (a renewal), then the latest admission, then anything, deterministically."""
    return (_certificate(entry["cert"])[2], entry["admitted_at"], entry["cert"], entry["name"], entry["admitted_by"])


def _secret_hash(secret: bytes) -> str:
    return hashlib.sha256(secret).hexdigest()


class ClusterState:
    """The cluster as this node knows it; every method that changes it persists before returning."""

    def __init__(
        self,
        path: Path,
        node_id: str,
        cluster_id: str,
        keyring: Keyring,
        members: dict[str, MemberEntry],
        removed: dict[str, float] | None = None,
        pending: dict[str, PendingEntry] | None = None,
        invites: dict[str, InviteEntry] | None = None,
        generation: int = 0,
        incarnation: int = 0,
        keys_version: int = 0,
        removed_keys: set[str] | None = None,
        removed_certs: dict[str, str] | None = None,
    ) -> None:
        self.path = path
        self.node_id = node_id  # this node's
        self.cluster_id = cluster_id
        self.keyring = keyring
        self._members = members
        self._removed = removed or {}
        # The certificate (PEM) each removed node was admitted with, by node id, where this node held it: what
        # recognises the node when it calls again, so that it is told (tombstones carry no certificate).
        self._removed_certs = removed_certs or {}
        self._pending = pending or {}
        self._invites = invites or {}
        self._generation = generation
        self._incarnation = incarnation
        # Keyring changes are ordered: each install, use and remove counts one, and removed keys are remembered, so a
        # member that missed a rotation adopts it instead of bringing the old key back (see `keys_merge`).
        self._keys_version = keys_version
        self._removed_keys = removed_keys or set()

    # -- creation and persistence -------------------------------------------------------------------

    @classmethod
    def init(cls, state_dir: Path, identity: Identity, name: str, now: float | None = None) -> ClusterState:
        """Create a new cluster with this node as its only member; ClusterError if this node already has one."""
        at = _clock(now)
        state = cls._fresh(state_dir, identity, name, uuid.uuid4().hex, Keyring.generate(), {}, {})
        state._members[identity.node_id] = MemberEntry(
            cert=identity.certificate_pem().decode("ascii"), name=name, admitted_by=identity.node_id, admitted_at=at
        )
        state._save()
        return state

    @classmethod
    def adopt(
        cls, state_dir: Path, identity: Identity, name: str, grant: JoinGrant, now: float | None = None, token: JoinToken | None = None
    ) -> ClusterState:
        """Store the cluster this node was just admitted to; ClusterError if it already has one, if the grant says
        it was removed, or if the grant is for another cluster than `token` names."""
        if token is not None and cluster_hash(grant.cluster_id) != token.cluster:
            raise ClusterError(f"the seed granted cluster {cluster_hash(grant.cluster_id)}, but the token names {token.cluster}")
        if identity.node_id in grant.removed:
            raise ClusterError(f"{identity.node_id} was removed from this cluster: make a new identity to join again", identity.node_id)
        try:
            keyring = Keyring.from_json(grant.keyring)
        except KeyringError as exc:
            raise ClusterError(f"the join grant's keyring is unusable: {exc}") from None
        members = {nid: MemberEntry(**entry) for nid, entry in grant.members.items() if nid not in grant.removed}
        state = cls._fresh(state_dir, identity, name, grant.cluster_id, keyring, members, dict(grant.removed))
        state._keys_version, state._removed_keys = grant.keys_version, set(grant.removed_keys)
        mine = members.get(identity.node_id)
        state._members[identity.node_id] = MemberEntry(
            cert=identity.certificate_pem().decode("ascii"),
            name=name,
            admitted_by=mine["admitted_by"] if mine else "",
            admitted_at=mine["admitted_at"] if mine else _clock(now),
        )
        state._save()
        return state

    @classmethod
    def _fresh(
        cls,
        state_dir: Path,
        identity: Identity,
        name: str,
        cluster_id: str,
        keyring: Keyring,
        members: dict[str, MemberEntry],
        removed: dict[str, float],
    ) -> ClusterState:
        if not _valid_name(name):
            raise ClusterError(f"a node name is 1..{MAX_NAME} printable characters, not {name!r}")
        state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = state_dir / STATE_FILE
        if path.exists():
            raise ClusterError(f"this node already belongs to a cluster ({path}); remove that file to start over")
        return cls(path, identity.node_id, cluster_id, keyring, members, removed)

    @classmethod
    def load(cls, state_dir: Path) -> ClusterState | None:
        """The cluster saved under `state_dir`, or None when there is none yet; ClusterError for a damaged file."""
        path = state_dir / STATE_FILE
        try:
            text = path.read_text()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise ClusterError(f"cannot read {path}: {exc}") from None
        try:
            doc = json.loads(text)
            if doc["format"] != FORMAT:
                raise ValueError(f"format {doc['format']!r}, expected {FORMAT}")
            return cls(
                path,
                str(doc["node_id"]),
                str(doc["cluster_id"]),
                Keyring.from_json(json.dumps(doc["keyring"])),
                {str(nid): _stored_member(entry) for nid, entry in doc["members"].items()},
                {str(nid): float(at) for nid, at in doc["removed"].items()},
                {str(nid): _stored_pending(entry) for nid, entry in doc["pending"].items()},
                {str(h): InviteEntry(expires=float(inv["expires"]), used=bool(inv["used"])) for h, inv in doc["invites"].items()},
                int(doc["generation"]),
                int(doc["incarnation"]),
                int(doc.get("keys_version", 0)),  # absent from a file written before keyring changes were ordered
                {str(k) for k in doc.get("removed_keys", [])},
                {str(nid): str(cert) for nid, cert in doc.get("removed_certs", {}).items()},  # absent before they were kept
            )
        except (ValueError, TypeError, KeyError, AttributeError, KeyringError) as exc:
            raise ClusterError(f"{path} is damaged: {type(exc).__name__}: {exc}") from None

    def _save(self) -> None:
        doc = {
            "format": FORMAT,
            "node_id": self.node_id,
            "cluster_id": self.cluster_id,
            "keyring": json.loads(self.keyring.to_json()),
            "members": self._members,
            "removed": self._removed,
            "pending": self._pending,
            "invites": self._invites,
            "generation": self._generation,
            "incarnation": self._incarnation,
            "keys_version": self._keys_version,
            "removed_keys": sorted(self._removed_keys),
            "removed_certs": self._removed_certs,
        }
        write_private(self.path, json.dumps(doc, indent=1, sort_keys=True).encode())

    # -- counters -----------------------------------------------------------------------------------

    @property
    def generation(self) -> int:
        return self._generation

    def next_generation(self) -> int:
        """One more than the last broker start's generation, persisted first (node documents carry it)."""
        self._generation += 1
        self._save()
        return self._generation

    def raise_generation(self, at_least: int) -> int:
        """The generation raised to `at_least` (members hold a document of a later one: this state was restored),
        persisted first; as it is when it is already that high."""
        if at_least > self._generation:
            self._generation = at_least
            self._save()
        return self._generation

    @property
    def incarnation(self) -> int:
        return self._incarnation

    def save_incarnation(self, incarnation: int) -> None:
        """Persist the membership incarnation, so a restarted node never reuses a number it already announced."""
        if incarnation != self._incarnation:
            self._incarnation = incarnation
            self._save()

    # -- reading ------------------------------------------------------------------------------------

    @property
    def members(self) -> dict[str, MemberEntry]:
        """A copy of the admitted members, this node included."""
        return {nid: MemberEntry(**entry) for nid, entry in self._members.items()}

    @property
    def removed(self) -> dict[str, float]:
        return dict(self._removed)

    def is_member(self, node_id: str) -> bool:
        return node_id in self._members

    def is_removed(self, node_id: str) -> bool:
        return node_id in self._removed

    def members_der(self) -> dict[str, bytes]:
        """Each member's certificate as DER, by node id: what the mutual TLS layer pins."""
        return {nid: _certificate(entry["cert"])[1] for nid, entry in self._members.items()}

    def removed_der(self) -> dict[str, bytes]:
        """The certificate each removed node was admitted with, as DER, by node id, where this node held it: the
        mutual TLS layer admits it to be told of its removal, and to nothing else."""
        return {nid: _certificate(cert)[1] for nid, cert in self._removed_certs.items()}

    def grant(self) -> JoinGrant:
        """What a newly admitted node receives."""
        return JoinGrant(
            self.cluster_id, self.keyring.to_json(), self.members, dict(self._removed), self._keys_version, frozenset(self._removed_keys)
        )

    # -- invites ------------------------------------------------------------------------------------

    def invite(self, seed: Addr, identity: Identity, ttl: float, now: float) -> str:
        """A one-time join token, redeemable at `seed` (this node) until `now + ttl`; only its secret's hash is kept."""
        if not ttl > 0 or not math.isfinite(ttl):
            raise ClusterError(f"an invite lasts a positive number of seconds, not {ttl}")
        secret = secrets.token_bytes(SECRET_SIZE)
        expires = now + ttl
        body = {
            "seed": [seed[0], seed[1]],
            "fp": identity.fingerprint(),
            "secret": secret,
            "exp": expires,
            "cluster": cluster_hash(self.cluster_id),
        }
        self._prune_invites(now)
        self._invites[_secret_hash(secret)] = InviteEntry(expires=expires, used=False)
        self._save()  # before the token is shown: a token whose invite was never saved could not be redeemed
        return TOKEN_PREFIX + base64.urlsafe_b64encode(msgpack.packb(body, use_bin_type=True)).decode("ascii").rstrip("=")

    def _prune_invites(self, now: float) -> None:
        for digest in [d for d, inv in self._invites.items() if inv["expires"] + INVITE_GRACE < now]:
            del self._invites[digest]

    def redeem(self, secret: bytes, cert_pem: str, name: str, now: float, admitted_by: str) -> JoinGrant:
        """Admit the node whose certificate is `cert_pem` if `secret` is an unused, unexpired invite's; ClusterError otherwise.

        The invite is spent only when the admission succeeds, so a joiner refused for its certificate can retry.
        """
        wanted = _secret_hash(secret) if isinstance(secret, bytes) else ""
        found: str | None = None
        for digest in self._invites:  # every hash is compared, in constant time: timing reveals nothing of the secret
            if hmac.compare_digest(digest, wanted):
                found = digest
        if found is None:
            raise ClusterError("this join token was not issued here (or expired long ago)")
        invite = self._invites[found]
        if invite["used"]:
            raise ClusterError("this join token was already used: ask for a new one")
        if now >= invite["expires"]:
            raise ClusterError(f"this join token expired {now - invite['expires']:.0f} s ago: ask for a new one")
        node_id = self._admissible(cert_pem, name)
        invite["used"] = True
        self._admit(node_id, cert_pem, name, admitted_by, now)
        return self.grant()

    def _admissible(self, cert_pem: str, name: str, claimed: str | None = None) -> str:
        """The node id `cert_pem` proves, if that node may be admitted; ClusterError naming the reason otherwise."""
        if not _valid_name(name):
            raise ClusterError(f"a node name is 1..{MAX_NAME} printable characters, not {name!r}")
        node_id = _certificate(cert_pem)[0]
        if claimed is not None and claimed != node_id:
            raise ClusterError(f"the certificate proves node {node_id}, not {claimed}", claimed)
        if node_id in self._removed:
            raise ClusterError(f"{node_id} was removed from this cluster and cannot rejoin with the same key", node_id)
        return node_id

    def _admit(self, node_id: str, cert_pem: str, name: str, admitted_by: str, now: float) -> None:
        self._members[node_id] = MemberEntry(cert=cert_pem, name=name, admitted_by=admitted_by, admitted_at=now)
        self._pending.pop(node_id, None)
        self._save()

    # -- approval -----------------------------------------------------------------------------------

    def ask(self, node_id: str, cert_pem: str, name: str, addr: Addr, now: float) -> None:
        """Record a discovered node's request to join, for an operator to approve; ClusterError if it may not ask."""
        node_id = self._admissible(cert_pem, name, claimed=node_id)
        if node_id in self._members:
            raise ClusterError(f"{node_id} is already a member", node_id)
        host, port = addr if isinstance(addr, tuple | list) and len(addr) == 2 else ("", 0)
        if type(host) is not str or not 0 < len(host) <= MAX_HOST or type(port) is not int or not 0 < port < 65536:
            raise ClusterError(f"{node_id} asked from an invalid address {addr!r}", node_id)
        self._pending[node_id] = PendingEntry(cert=cert_pem, name=name, addr=[host, port], seen_at=now)
        while len(self._pending) > MAX_PENDING:
            del self._pending[min(self._pending, key=lambda nid: self._pending[nid]["seen_at"])]
        self._save()

    def pending_list(self) -> list[Pending]:
        """The requests waiting for approval, oldest first."""
        return sorted(
            (
                Pending(nid, p["name"], (p["addr"][0], p["addr"][1]), p["seen_at"], fingerprint(_certificate(p["cert"])[1]))
                for nid, p in self._pending.items()
            ),
            key=lambda p: (p.seen_at, p.node_id),
        )

    def approve(self, node_id: str, admitted_by: str, now: float) -> JoinGrant:
        """Admit a node that asked; ClusterError if it has not asked (or was removed since)."""
        request = self._pending.get(node_id)
        if request is None:
            raise ClusterError(f"no pending request from {node_id}", node_id)
        self._admissible(request["cert"], request["name"], claimed=node_id)
        self._admit(node_id, request["cert"], request["name"], admitted_by, now)
        return self.grant()

    def remove(self, node_id: str, now: float) -> None:
        """Remove a member (or refuse a pending request) for good; removing a removed node changes nothing."""
        if node_id == self.node_id:
            raise ClusterError("a node cannot remove itself: remove it from another member", node_id)
        if node_id in self._removed:
            return
        if node_id not in self._members and node_id not in self._pending:
            raise ClusterError(f"unknown node {node_id}: neither a member nor asking to join", node_id)
        self._removed[node_id] = now
        self._forget_member(node_id)
        self._save()

    def _forget_member(self, node_id: str) -> bool:
        """Drop a removed node's admission or request, keeping the certificate it was admitted with; whether it had one."""
        self._pending.pop(node_id, None)
        entry = self._members.pop(node_id, None)
        if entry is not None:
            self._removed_certs[node_id] = entry["cert"]
        return entry is not None

    # -- replication --------------------------------------------------------------------------------

    def export(self) -> dict[str, Any]:
        """Members and tombstones in plain types, for another member's `merge`."""
        return {"members": {nid: dict(entry) for nid, entry in self._members.items()}, "removed": dict(self._removed)}

    def merge(self, remote: object, now: float) -> list[str]:
        """Take in another member's `export`; the node ids whose admission changed (admitted, removed, certificate
        renewed), sorted. Malformed entries are ignored; nothing a remote sends makes it raise.

        Tombstones win: a node removed anywhere is removed everywhere, this node included (the runtime must
        check `is_removed(node_id)` after a merge and stop). A tombstone's time is kept at its earliest, never
        later than `now`, so members agree on it.
        """
        if not isinstance(remote, dict):
            return []
        changed: set[str] = set()
        dirty = False  # a tombstone's time may move earlier without any change of admission
        for node_id, at in _valid_removed(remote.get("removed")).items():
            at = min(at, now)
            if node_id not in self._removed or at < self._removed[node_id]:
                if node_id not in self._removed:
                    changed.add(node_id)
                self._removed[node_id] = at
                dirty = True
            dirty |= self._forget_member(node_id)
        members = remote.get("members")
        for node_id, entry in members.items() if isinstance(members, dict) else ():
            if node_id in self._removed:
                continue
            mine = self._members.get(node_id)
            if mine is not None and isinstance(entry, dict) and entry == mine:
                continue  # the common case on every push-pull: no certificate to parse again
            valid = _valid_member(node_id, entry)
            if valid is None or (mine is not None and _rank(valid) <= _rank(mine)):
                continue
            if mine is None or mine["cert"] != valid["cert"]:
                changed.add(node_id)
            self._members[node_id] = valid
            self._pending.pop(node_id, None)
            dirty = True
        if dirty:
            self._save()
        return sorted(changed)

    # -- keyring ------------------------------------------------------------------------------------

    def keys_list(self) -> list[tuple[str, bool]]:
        """(key id, is primary) of every installed key, the primary first."""
        primary = self.keyring.primary
        return [(key_id(k), k == primary) for k in self.keyring.keys()]

    @property
    def keys_version(self) -> int:
        return self._keys_version

    @property
    def removed_keys(self) -> frozenset[str]:
        return frozenset(self._removed_keys)

    def keys_state(self) -> dict[str, Any]:
        """The keyring's order in plain types, sent with its primary key for another member's `keys_merge`."""
        return {"version": self._keys_version, "removed": sorted(self._removed_keys)}

    def keys_install(self, key_b64: str) -> str:
        """Install a base64 key (accepted for opening, not yet used to seal); its key id. Refused for a removed key."""
        key = _decode_key(key_b64)
        if key_id(key) in self._removed_keys:
            raise ClusterError(f"key {key_id(key)} was removed from this cluster and cannot be installed again: install a new one")
        self.keyring.install(key)
        self._keys_version += 1
        self._save()
        return key_id(key)

    def keys_use(self, key: str) -> str:
        """Seal with an installed key, named by its key id or given in base64; its key id."""
        chosen = self._installed(key)
        self.keyring.use(chosen)
        self._keys_version += 1
        self._save()
        return key_id(chosen)

    def keys_remove(self, key: str) -> str:
        """Stop accepting an installed key, named by its key id or given in base64, for good; its key id. Refused for the
        primary."""
        chosen = self._installed(key)
        try:
            self.keyring.remove(chosen)
        except KeyringError as exc:
            raise ClusterError(str(exc)) from None
        self._removed_keys.add(key_id(chosen))
        self._keys_version += 1
        self._save()
        return key_id(chosen)

    def keys_merge(self, primary_b64: object, remote: object) -> bool:
        """Take in another member's primary key and `keys_state`; whether this keyring changed. Nothing a remote sends
        makes it raise.

        Removed keys are removed here too, and never installed again. A primary that was removed gives way to the
        other's; else the newer keyring (a higher version) wins: the older side uses the newer primary, keeping its
        own old primary installed (unless removed) so that datagrams sealed with it by members not yet told still
        open. A primary not newer, and not removed, is only installed: a member that runs a release without ordered
        keyrings is still heard.
        """
        version, removed = valid_keys_state(remote)
        changed = not removed <= self._removed_keys
        self._removed_keys |= removed
        try:
            primary: bytes | None = _decode_key(primary_b64) if isinstance(primary_b64, str) else None
        except ClusterError:
            primary = None
        if primary is not None and key_id(primary) not in self._removed_keys:
            # A removed primary gives way to any primary not removed, whatever the versions (a side of a partition
            # may have made more changes without that removal). Otherwise the newer keyring's primary is used, and at
            # equal versions the higher key id's, so concurrent changes agree; but never on the word of keyrings from
            # before versions (0): one of those may name a key an older release removed and could not remember.
            # Such a primary is only installed beside this one, so both sides open each other's datagrams.
            mine = (self._keys_version, key_id(self.keyring.primary))
            if key_id(self.keyring.primary) in self._removed_keys or (version > 0 and (version, key_id(primary)) > mine):
                self.keyring.install(primary)
                self.keyring.use(primary)
                self._keys_version = max(version, self._keys_version)
                changed = True
            elif primary not in self.keyring:
                self.keyring.install(primary)
                changed = True
        for key in self.keyring.keys():
            # The primary stays until this node uses another key: it must go on sealing with something the others open.
            if key_id(key) in self._removed_keys and key != self.keyring.primary:
                self.keyring.remove(key)
                changed = True
        if changed:
            self._save()
        return changed

    def _installed(self, key: str) -> bytes:
        for installed in self.keyring.keys():
            if key_id(installed) == key:
                return installed
        try:
            decoded = _decode_key(key)
        except ClusterError:
            raise ClusterError(f"no installed key has id {key!r}") from None
        if decoded not in self.keyring:
            raise ClusterError(f"key {key_id(decoded)} is not installed: install it first")
        return decoded


def _stored_member(entry: Any) -> MemberEntry:
    return MemberEntry(
        cert=str(entry["cert"]), name=str(entry["name"]), admitted_by=str(entry["admitted_by"]), admitted_at=float(entry["admitted_at"])
    )


def _stored_pending(entry: Any) -> PendingEntry:
    host, port = entry["addr"]
    return PendingEntry(cert=str(entry["cert"]), name=str(entry["name"]), addr=[str(host), int(port)], seen_at=float(entry["seen_at"]))


def _decode_key(key_b64: str) -> bytes:
    try:
        key = base64.b64decode(key_b64, validate=True)
        Keyring(key)  # checks the size
    except (ValueError, TypeError, binascii.Error, KeyringError) as exc:
        raise ClusterError(f"not a base64 key of 32 bytes: {exc}") from None
    return key


def _clock(now: float | None) -> float:
    return time.time() if now is None else now
