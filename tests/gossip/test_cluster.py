"""Who belongs to the cluster: tokens admit once, removals are for good, and members converge on the same list."""

from __future__ import annotations

import base64
import datetime as dt
import json
import stat
import tempfile
from pathlib import Path
from typing import Any

import msgpack
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.x509.oid import NameOID
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpubroker.gossip.cluster import (
    MAX_PENDING,
    STATE_FILE,
    TOKEN_PREFIX,
    ClusterError,
    ClusterState,
    JoinGrant,
    decode_token,
    new_key_b64,
)
from gpubroker.gossip.identity import Identity, node_id_of_certificate, ui_certificate
from gpubroker.gossip.keyring import Keyring, cluster_hash, key_id

NOW = 1_700_000_000.0
SEED = ("10.0.0.1", 9741)
DAY = 86400.0

# A few identities made once: key generation and certificates are the slow part of these tests.
A, B, C, D = (Identity.generate() for _ in range(4))
IDENTITIES = (A, B, C, D)


def pem(identity: Identity) -> str:
    return identity.certificate_pem().decode("ascii")


def make(root: Path, identity: Identity = A, name: str = "node-a") -> ClusterState:
    return ClusterState.init(root / identity.node_id, identity, name, now=NOW)


def secret_of(token: str) -> bytes:
    return decode_token(token).secret


def foreign_signed_certificate(identity: Identity) -> str:
    """A certificate carrying `identity`'s key but signed by another: not self-signed."""
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, identity.node_id)])
    public = Ed25519PublicKey.from_public_bytes(identity.public_key_bytes)
    at = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(public)
        .serial_number(1)
        .not_valid_before(at)
        .not_valid_after(at + dt.timedelta(days=1))
        .sign(Ed25519PrivateKey.generate(), algorithm=None)
    )
    return cert.public_bytes(serialization.Encoding.PEM).decode("ascii")


# -- creation and persistence ----------------------------------------------------------------------


def test_init_then_load_round_trips_the_cluster(tmp_path: Path) -> None:
    state = make(tmp_path)
    loaded = ClusterState.load(tmp_path / A.node_id)
    assert loaded is not None
    assert loaded.cluster_id == state.cluster_id
    assert len(state.cluster_id) == 32
    assert loaded.node_id == A.node_id
    assert loaded.keyring.keys() == state.keyring.keys()
    assert loaded.members == state.members == {A.node_id: {"cert": pem(A), "name": "node-a", "admitted_by": A.node_id, "admitted_at": NOW}}
    assert loaded.removed == {}
    assert loaded.pending_list() == []


def test_two_clusters_have_different_ids_and_keys(tmp_path: Path) -> None:
    one, two = make(tmp_path, A), make(tmp_path, B)
    assert one.cluster_id != two.cluster_id
    assert one.keyring.primary != two.keyring.primary


def test_a_second_init_is_refused(tmp_path: Path) -> None:
    make(tmp_path)
    with pytest.raises(ClusterError, match="already belongs"):
        make(tmp_path)


def test_a_state_directory_without_a_cluster_loads_as_none(tmp_path: Path) -> None:
    assert ClusterState.load(tmp_path) is None
    assert ClusterState.load(tmp_path / "missing") is None


def test_the_state_file_is_readable_by_its_owner_only(tmp_path: Path) -> None:
    state = make(tmp_path)
    path = tmp_path / A.node_id / STATE_FILE
    assert state.path == path
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    state.next_generation()  # a rewrite keeps the mode
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in path.parent.iterdir()] == [STATE_FILE]  # no temporary file is left behind


def test_a_damaged_state_file_is_a_cluster_error_naming_it(tmp_path: Path) -> None:
    make(tmp_path)
    path = tmp_path / A.node_id / STATE_FILE
    path.write_text('{"format": 1, "node_id": "x"}')
    with pytest.raises(ClusterError, match="cluster.json is damaged"):
        ClusterState.load(path.parent)
    path.write_text("not json")
    with pytest.raises(ClusterError, match="damaged"):
        ClusterState.load(path.parent)


def test_a_node_name_must_be_printable_text(tmp_path: Path) -> None:
    with pytest.raises(ClusterError, match="printable"):
        ClusterState.init(tmp_path, A, "bad\nname")
    with pytest.raises(ClusterError, match="printable"):
        ClusterState.init(tmp_path, A, "")


def test_the_generation_increments_across_loads(tmp_path: Path) -> None:
    state = make(tmp_path)
    assert state.generation == 0
    assert state.next_generation() == 1
    again = ClusterState.load(state.path.parent)
    assert again is not None
    assert again.generation == 1
    assert again.next_generation() == 2
    third = ClusterState.load(state.path.parent)
    assert third is not None
    assert third.next_generation() == 3


def test_the_incarnation_survives_a_restart(tmp_path: Path) -> None:
    state = make(tmp_path)
    assert state.incarnation == 0
    state.save_incarnation(7)
    loaded = ClusterState.load(state.path.parent)
    assert loaded is not None
    assert loaded.incarnation == 7


# -- tokens ----------------------------------------------------------------------------------------


def test_a_token_carries_the_seed_the_issuer_and_the_cluster(tmp_path: Path) -> None:
    state = make(tmp_path)
    token = state.invite(SEED, A, ttl=600, now=NOW)
    assert token.startswith(TOKEN_PREFIX)
    assert "=" not in token
    assert len(token) < 250
    decoded = decode_token(token)
    assert decoded.seed == SEED
    assert decoded.fingerprint == A.fingerprint()
    assert len(decoded.secret) == 32
    assert decoded.expires == NOW + 600
    assert decoded.cluster == cluster_hash(state.cluster_id)
    assert decoded.secret.hex() not in state.path.read_text()  # only the secret's hash is kept
    assert decode_token(f"  {token}\n") == decoded  # pasted with whitespace around it
    # ...or inside it, where a terminal or a mail wrapped it
    assert decode_token(f"{token[:80]}\n{token[80:160]}\r\n {token[160:]}") == decoded
    assert decode_token(f"{token[:100]} \u00a0{token[100:]}") == decoded


def test_a_token_with_a_stray_character_names_it_and_where_it_is(tmp_path: Path) -> None:
    token = make(tmp_path).invite(SEED, A, ttl=600, now=NOW)
    with pytest.raises(ClusterError, match=r"^not a join token: it has '\"' at character 31, outside base64url; copy it whole"):
        decode_token(f'{token[:30]}"{token[30:]}')


def test_two_invites_have_different_secrets(tmp_path: Path) -> None:
    state = make(tmp_path)
    assert secret_of(state.invite(SEED, A, 600, NOW)) != secret_of(state.invite(SEED, A, 600, NOW))


def test_an_invite_needs_a_positive_lifetime(tmp_path: Path) -> None:
    state = make(tmp_path)
    for ttl in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ClusterError, match="positive"):
            state.invite(SEED, A, ttl, NOW)


@pytest.mark.parametrize(
    "token",
    [
        "",
        "gbj1.",
        "gbj2.AAAA",
        "gbj1.!!!!",
        "gbj1.AAAA",
        TOKEN_PREFIX + base64.urlsafe_b64encode(msgpack.packb([1, 2, 3])).decode(),
        TOKEN_PREFIX + base64.urlsafe_b64encode(msgpack.packb({"seed": ["h", 1]})).decode(),
        TOKEN_PREFIX + "A" * 2000,
    ],
)
def test_a_malformed_token_is_a_cluster_error(token: str) -> None:
    with pytest.raises(ClusterError, match="join token"):
        decode_token(token)


@given(st.text(max_size=300) | st.text(max_size=300).map(lambda t: TOKEN_PREFIX + t))
def test_tokens_of_random_text_raise_only_cluster_errors(text: str) -> None:
    try:
        decode_token(text)
    except ClusterError:
        pass


msgpack_ints = st.integers(min_value=-(2**63), max_value=2**64 - 1)  # what msgpack can carry at all
token_values = st.recursive(
    st.none() | st.booleans() | msgpack_ints | st.floats() | st.text(max_size=70) | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
token_bodies = st.fixed_dictionaries(
    {},
    optional={
        "seed": token_values | st.tuples(st.text(max_size=10), msgpack_ints).map(list),
        "fp": token_values | st.just("ab" * 32),
        "secret": token_values | st.binary(min_size=32, max_size=32),
        "exp": token_values,
        "cluster": token_values,
    },
)


@given(token_bodies | token_values, st.integers(min_value=0, max_value=400))
def test_tokens_of_random_msgpack_raise_only_cluster_errors(body: object, cut: int) -> None:
    token = TOKEN_PREFIX + base64.urlsafe_b64encode(msgpack.packb(body, use_bin_type=True)).decode().rstrip("=")
    for text in (token, token[: len(TOKEN_PREFIX) + cut]):
        try:
            decoded = decode_token(text)
        except ClusterError:
            continue
        assert len(decoded.secret) == 32
        assert len(decoded.fingerprint) == 64


# -- redeeming -------------------------------------------------------------------------------------


def test_a_redeemed_invite_admits_the_node_and_the_grant_makes_it_a_member(tmp_path: Path) -> None:
    seed = make(tmp_path)
    token = decode_token(seed.invite(SEED, A, ttl=600, now=NOW))
    grant = seed.redeem(token.secret, pem(B), "node-b", NOW + 1, admitted_by=A.node_id)
    assert seed.is_member(B.node_id)
    assert seed.members[B.node_id] == {"cert": pem(B), "name": "node-b", "admitted_by": A.node_id, "admitted_at": NOW + 1}
    reloaded = ClusterState.load(seed.path.parent)
    assert reloaded is not None
    assert reloaded.is_member(B.node_id)

    wire = json.loads(json.dumps(grant.to_dict()))  # plain types only
    received = JoinGrant.from_dict(wire)
    assert received == grant
    joined = ClusterState.adopt(tmp_path / B.node_id, B, "node-b", received, now=NOW + 2, token=token)
    assert joined.cluster_id == seed.cluster_id
    assert joined.keyring.keys() == seed.keyring.keys()
    assert set(joined.members) == {A.node_id, B.node_id}
    assert joined.members[B.node_id]["admitted_by"] == A.node_id
    assert joined.members_der() == seed.members_der()
    assert ClusterState.load(tmp_path / B.node_id) is not None


def test_adopting_a_grant_for_another_cluster_than_the_token_names_is_refused(tmp_path: Path) -> None:
    seed, other = make(tmp_path, A), make(tmp_path, C)
    token = decode_token(other.invite(SEED, C, 600, NOW))
    grant = seed.redeem(secret_of(seed.invite(SEED, A, 600, NOW)), pem(B), "node-b", NOW, A.node_id)
    with pytest.raises(ClusterError, match="token names"):
        ClusterState.adopt(tmp_path / B.node_id, B, "node-b", grant, token=token)
    assert ClusterState.load(tmp_path / B.node_id) is None


def test_a_node_that_already_has_a_cluster_cannot_adopt_another(tmp_path: Path) -> None:
    seed, _ = make(tmp_path, A), make(tmp_path, B)
    grant = seed.redeem(secret_of(seed.invite(SEED, A, 600, NOW)), pem(B), "node-b", NOW, A.node_id)
    with pytest.raises(ClusterError, match="already belongs"):
        ClusterState.adopt(tmp_path / B.node_id, B, "node-b", grant)


def test_replaying_a_token_is_refused(tmp_path: Path) -> None:
    seed = make(tmp_path)
    secret = secret_of(seed.invite(SEED, A, 600, NOW))
    seed.redeem(secret, pem(B), "node-b", NOW, A.node_id)
    with pytest.raises(ClusterError, match="already used"):
        seed.redeem(secret, pem(C), "node-c", NOW + 1, A.node_id)
    with pytest.raises(ClusterError, match="already used"):
        seed.redeem(secret, pem(B), "node-b", NOW + 1, A.node_id)
    assert not seed.is_member(C.node_id)
    reloaded = ClusterState.load(seed.path.parent)  # "used" is persisted: a restart does not revive the token
    assert reloaded is not None
    with pytest.raises(ClusterError, match="already used"):
        reloaded.redeem(secret, pem(C), "node-c", NOW + 2, A.node_id)


def test_an_expired_token_is_refused(tmp_path: Path) -> None:
    seed = make(tmp_path)
    secret = secret_of(seed.invite(SEED, A, ttl=600, now=NOW))
    with pytest.raises(ClusterError, match="expired"):
        seed.redeem(secret, pem(B), "node-b", NOW + 600, A.node_id)
    assert not seed.is_member(B.node_id)


def test_a_token_forgotten_long_after_expiry_is_refused(tmp_path: Path) -> None:
    seed = make(tmp_path)
    old = secret_of(seed.invite(SEED, A, ttl=600, now=NOW))
    seed.invite(SEED, A, ttl=600, now=NOW + 2 * DAY)  # prunes the old one
    with pytest.raises(ClusterError, match="not issued here"):
        seed.redeem(old, pem(B), "node-b", NOW + 2 * DAY, A.node_id)


def test_a_token_with_a_wrong_secret_is_refused(tmp_path: Path) -> None:
    seed = make(tmp_path)
    secret = secret_of(seed.invite(SEED, A, 600, NOW))
    wrong = bytes([secret[0] ^ 1]) + secret[1:]
    with pytest.raises(ClusterError, match="not issued here"):
        seed.redeem(wrong, pem(B), "node-b", NOW, A.node_id)
    another_clusters = secret_of(make(tmp_path, C).invite(SEED, C, 600, NOW))
    with pytest.raises(ClusterError, match="not issued here"):
        seed.redeem(another_clusters, pem(B), "node-b", NOW, A.node_id)
    assert set(seed.members) == {A.node_id}


@pytest.mark.parametrize(
    "cert",
    [
        pytest.param(ui_certificate(["localhost"])[0].decode(), id="ecdsa"),
        pytest.param(foreign_signed_certificate(B), id="ed25519-signed-by-another-key"),
        pytest.param("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n", id="garbage-pem"),
        pytest.param("not a certificate", id="text"),
        pytest.param("é" * 10, id="non-ascii"),
        pytest.param("", id="empty"),
    ],
)
def test_redeeming_with_a_certificate_that_is_not_a_nodes_is_refused(tmp_path: Path, cert: str) -> None:
    seed = make(tmp_path)
    secret = secret_of(seed.invite(SEED, A, 600, NOW))
    with pytest.raises(ClusterError):
        seed.redeem(secret, cert, "node-b", NOW, A.node_id)
    assert set(seed.members) == {A.node_id}
    # The refusal did not spend the invite: the joiner can retry with its real certificate.
    seed.redeem(secret, pem(B), "node-b", NOW, A.node_id)
    assert seed.is_member(B.node_id)


def test_a_removed_node_cannot_be_admitted_by_redeem(tmp_path: Path) -> None:
    seed = make(tmp_path)
    seed.redeem(secret_of(seed.invite(SEED, A, 600, NOW)), pem(B), "node-b", NOW, A.node_id)
    seed.remove(B.node_id, NOW + 10)
    assert not seed.is_member(B.node_id)
    assert seed.is_removed(B.node_id)
    with pytest.raises(ClusterError, match="removed") as refused:
        seed.redeem(secret_of(seed.invite(SEED, A, 600, NOW)), pem(B), "node-b", NOW + 20, A.node_id)
    assert refused.value.node_id == B.node_id
    assert B.node_id not in seed.members_der()


# -- approval --------------------------------------------------------------------------------------


def test_a_node_that_asked_is_admitted_when_approved(tmp_path: Path) -> None:
    state = make(tmp_path)
    state.ask(B.node_id, pem(B), "node-b", ("10.0.0.2", 9741), NOW)
    state.ask(C.node_id, pem(C), "node-c", ("10.0.0.3", 9741), NOW - 5)
    assert [(p.node_id, p.name, p.addr, p.seen_at) for p in state.pending_list()] == [
        (C.node_id, "node-c", ("10.0.0.3", 9741), NOW - 5),
        (B.node_id, "node-b", ("10.0.0.2", 9741), NOW),
    ]
    assert state.pending_list()[1].fingerprint == B.fingerprint()
    assert not state.is_member(B.node_id)

    grant = state.approve(B.node_id, A.node_id, NOW + 1)
    assert state.is_member(B.node_id)
    assert B.node_id in grant.members
    assert [p.node_id for p in state.pending_list()] == [C.node_id]
    reloaded = ClusterState.load(state.path.parent)
    assert reloaded is not None
    assert reloaded.is_member(B.node_id)
    assert [p.node_id for p in reloaded.pending_list()] == [C.node_id]


def test_approving_a_node_that_did_not_ask_is_refused(tmp_path: Path) -> None:
    state = make(tmp_path)
    with pytest.raises(ClusterError, match="no pending request"):
        state.approve(B.node_id, A.node_id, NOW)


def test_a_request_whose_certificate_proves_another_node_is_refused(tmp_path: Path) -> None:
    state = make(tmp_path)
    with pytest.raises(ClusterError, match="proves node"):
        state.ask(C.node_id, pem(B), "node-b", ("10.0.0.2", 9741), NOW)
    with pytest.raises(ClusterError):
        state.ask(B.node_id, foreign_signed_certificate(B), "node-b", ("10.0.0.2", 9741), NOW)
    assert state.pending_list() == []


def test_a_member_or_a_removed_node_cannot_ask(tmp_path: Path) -> None:
    state = make(tmp_path)
    with pytest.raises(ClusterError, match="already a member"):
        state.ask(A.node_id, pem(A), "node-a", ("10.0.0.1", 9741), NOW)
    state.ask(B.node_id, pem(B), "node-b", ("10.0.0.2", 9741), NOW)
    state.remove(B.node_id, NOW)  # refusing a request is a removal
    assert state.pending_list() == []
    with pytest.raises(ClusterError, match="removed"):
        state.ask(B.node_id, pem(B), "node-b", ("10.0.0.2", 9741), NOW)


def test_pending_requests_are_capped_oldest_forgotten_first(tmp_path: Path) -> None:
    state = make(tmp_path)
    for i, identity in enumerate(IDENTITIES[1:]):
        state.ask(identity.node_id, pem(identity), f"n{i}", ("10.0.0.9", 9741), NOW + i)
    extra = [Identity.generate() for _ in range(MAX_PENDING)]
    for i, identity in enumerate(extra):
        state.ask(identity.node_id, pem(identity), f"x{i}", ("10.0.0.9", 9741), NOW + 100 + i)
    ids = [p.node_id for p in state.pending_list()]
    assert len(ids) == MAX_PENDING
    assert ids == [identity.node_id for identity in extra]


# -- removal ---------------------------------------------------------------------------------------


def test_removing_a_node_nobody_knows_says_it_is_unknown(tmp_path: Path) -> None:
    state = make(tmp_path)
    with pytest.raises(ClusterError, match="unknown node n-nobody"):  # the API answers 404 NOT_FOUND for "unknown"
        state.remove("n-nobody", 0.0)


def test_a_node_cannot_remove_itself(tmp_path: Path) -> None:
    state = make(tmp_path)
    with pytest.raises(ClusterError, match="cannot remove itself"):
        state.remove(A.node_id, NOW)
    assert state.is_member(A.node_id)


def test_removing_an_unknown_node_is_refused_and_removing_twice_changes_nothing(tmp_path: Path) -> None:
    state = make(tmp_path)
    with pytest.raises(ClusterError, match="neither a member"):
        state.remove(B.node_id, NOW)
    state.redeem(secret_of(state.invite(SEED, A, 600, NOW)), pem(B), "node-b", NOW, A.node_id)
    state.remove(B.node_id, NOW + 1)
    state.remove(B.node_id, NOW + 2)
    assert state.removed == {B.node_id: NOW + 1}


# -- replication -----------------------------------------------------------------------------------


def joined(tmp_path: Path, seed: ClusterState, identity: Identity, name: str, at: float) -> ClusterState:
    grant = seed.redeem(secret_of(seed.invite(SEED, A, 600, at)), pem(identity), name, at, seed.node_id)
    return ClusterState.adopt(tmp_path / identity.node_id, identity, name, JoinGrant.from_dict(grant.to_dict()), now=at)


def test_members_converge_whichever_way_they_merge(tmp_path: Path) -> None:
    a = make(tmp_path)
    b = joined(tmp_path, a, B, "node-b", NOW)
    # Each admits a node the other has not heard of; b removes a member a still lists.
    c = joined(tmp_path, a, C, "node-c", NOW + 1)
    b.ask(D.node_id, pem(D), "node-d", ("10.0.0.4", 9741), NOW + 2)
    b.approve(D.node_id, B.node_id, NOW + 2)
    assert b.merge(c.export(), NOW + 3) == [C.node_id]
    b.remove(C.node_id, NOW + 4)

    from_b = a.merge(b.export(), NOW + 5)
    from_a = b.merge(a.export(), NOW + 5)
    assert from_b == sorted([C.node_id, D.node_id])  # D admitted, C removed
    assert from_a == []
    assert a.export() == b.export()
    assert set(a.members) == {A.node_id, B.node_id, D.node_id}
    assert a.removed == {C.node_id: NOW + 4}
    assert a.merge(b.export(), NOW + 6) == []
    assert b.merge(a.export(), NOW + 6) == []
    reloaded = ClusterState.load(a.path.parent)
    assert reloaded is not None
    assert reloaded.export() == a.export()


def test_a_removed_node_cannot_come_back_by_merge(tmp_path: Path) -> None:
    a = make(tmp_path)
    b = joined(tmp_path, a, B, "node-b", NOW)
    joined(tmp_path, a, C, "node-c", NOW + 1)
    b.merge(a.export(), NOW + 2)
    a.remove(C.node_id, NOW + 3)
    stale = b.export()  # b has not heard of the removal: it still lists C
    assert C.node_id in stale["members"]
    assert a.merge(stale, NOW + 4) == []
    assert not a.is_member(C.node_id)
    assert b.merge(a.export(), NOW + 5) == [C.node_id]
    assert not b.is_member(C.node_id)
    assert b.is_removed(C.node_id)
    # Even an entry re-admitted elsewhere after the removal is ignored: tombstones win.
    readmitted = {"members": {C.node_id: {"cert": pem(C), "name": "again", "admitted_by": B.node_id, "admitted_at": NOW + 99}}}
    assert a.merge(readmitted, NOW + 100) == []
    assert not a.is_member(C.node_id)


def test_a_member_entry_whose_certificate_proves_another_id_is_ignored(tmp_path: Path) -> None:
    state = make(tmp_path)
    forged = {
        "members": {
            C.node_id: {"cert": pem(B), "name": "forged", "admitted_by": A.node_id, "admitted_at": NOW},
            D.node_id: {"cert": foreign_signed_certificate(D), "name": "d", "admitted_by": A.node_id, "admitted_at": NOW},
            B.node_id: {"cert": pem(B), "name": "node-b", "admitted_by": A.node_id, "admitted_at": NOW},
        }
    }
    assert state.merge(forged, NOW) == [B.node_id]
    assert set(state.members) == {A.node_id, B.node_id}


def test_a_renewed_certificate_replaces_the_old_one_everywhere(tmp_path: Path) -> None:
    a = make(tmp_path)
    b = joined(tmp_path, a, B, "node-b", NOW)
    same_key = Identity(serialization.load_pem_private_key(B.private_key_pem(), None))  # type: ignore[arg-type]
    renewed = same_key.certificate(dt.datetime.now(dt.UTC) + dt.timedelta(days=3000)).public_bytes(serialization.Encoding.PEM).decode()
    assert renewed != pem(B)
    assert node_id_of_certificate(x509.load_pem_x509_certificate(renewed.encode()).public_bytes(serialization.Encoding.DER)) == B.node_id
    newer = {"members": {B.node_id: {**b.members[B.node_id], "cert": renewed}}}
    assert a.merge(newer, NOW) == [B.node_id]
    assert a.members[B.node_id]["cert"] == renewed
    assert a.merge(b.export(), NOW) == []  # the older certificate does not win back
    assert a.members[B.node_id]["cert"] == renewed


def test_members_der_gives_each_members_certificate(tmp_path: Path) -> None:
    a = make(tmp_path)
    joined(tmp_path, a, B, "node-b", NOW)
    der = a.members_der()
    assert {node_id_of_certificate(cert) for cert in der.values()} == set(der) == {A.node_id, B.node_id}
    assert der[B.node_id] == B.certificate_der()


# Hostile replication input: structured enough to reach deep into `merge`, random enough to break it.
certs = st.sampled_from([pem(i) for i in IDENTITIES] + [foreign_signed_certificate(B), "", "x"])
node_ids = st.sampled_from([i.node_id for i in IDENTITIES]) | st.text(max_size=20)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10) | st.binary(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=10,
)
times = st.integers() | st.floats() | json_values
member_entries = (
    st.fixed_dictionaries(
        {},
        optional={
            "cert": certs | json_values,
            "name": st.text(max_size=20) | json_values,
            "admitted_by": node_ids | json_values,
            "admitted_at": times,
        },
    )
    | json_values
)
remotes = (
    st.fixed_dictionaries(
        {},
        optional={
            "members": st.dictionaries(node_ids | json_values.filter(lambda v: v.__hash__ is not None), member_entries, max_size=5)
            | json_values,
            "removed": st.dictionaries(node_ids, times, max_size=3) | json_values,
        },
    )
    | json_values
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(remotes, min_size=1, max_size=3))
def test_merging_random_input_never_raises_and_admits_only_proven_members(batch: list[object]) -> None:
    with tempfile.TemporaryDirectory() as root:
        state = ClusterState.init(Path(root), A, "node-a", now=NOW)
        for remote in batch:
            changed = state.merge(remote, NOW)
            assert changed == sorted(set(changed))
        for node_id, der in state.members_der().items():
            assert node_id_of_certificate(der) == node_id
            assert not state.is_removed(node_id)
        reloaded = ClusterState.load(Path(root))  # whatever was merged is still a loadable file
        assert reloaded is not None
        assert reloaded.export() == state.export()


@given(json_values)
def test_a_join_grant_from_random_input_is_a_cluster_error_or_well_formed(data: object) -> None:
    try:
        grant = JoinGrant.from_dict(data)
    except ClusterError:
        return
    Keyring.from_json(grant.keyring)


# -- keys ------------------------------------------------------------------------------------------


def test_a_key_rotation_persists_at_every_step(tmp_path: Path) -> None:
    state = make(tmp_path)
    old = key_id(state.keyring.primary)
    new = new_key_b64()
    new_id = key_id(base64.b64decode(new))
    assert state.keys_list() == [(old, True)]

    assert state.keys_install(new) == new_id
    assert sorted(state.keys_list()) == sorted([(old, True), (new_id, False)])
    assert state.keys_use(new_id) == new_id
    state.keys_remove(old)

    reloaded = ClusterState.load(state.path.parent)
    assert reloaded is not None
    assert reloaded.keys_list() == [(new_id, True)]
    assert reloaded.keyring.primary == base64.b64decode(new)


def test_a_key_may_be_named_by_its_base64_too(tmp_path: Path) -> None:
    state = make(tmp_path)
    old = base64.b64encode(state.keyring.primary).decode()
    new = new_key_b64()
    state.keys_install(new)
    state.keys_use(new)
    state.keys_remove(old)
    assert state.keys_list() == [(key_id(base64.b64decode(new)), True)]


def test_key_mistakes_are_refused_and_change_nothing(tmp_path: Path) -> None:
    state = make(tmp_path)
    primary = key_id(state.keyring.primary)
    with pytest.raises(ClusterError, match="primary"):
        state.keys_remove(primary)
    with pytest.raises(ClusterError, match="32 bytes"):
        state.keys_install(base64.b64encode(b"short").decode())
    with pytest.raises(ClusterError, match="32 bytes"):
        state.keys_install("not base64!")
    with pytest.raises(ClusterError, match="not installed"):
        state.keys_use(new_key_b64())
    with pytest.raises(ClusterError, match="no installed key"):
        state.keys_use("abcdef123456")
    reloaded = ClusterState.load(state.path.parent)
    assert reloaded is not None
    assert reloaded.keys_list() == [(primary, True)]


def test_a_member_that_missed_a_rotation_adopts_it_and_never_brings_the_removed_key_back(tmp_path: Path) -> None:
    a = make(tmp_path)
    b = joined(tmp_path, a, B, "node-b", NOW + 1)
    old = a.keyring.primary
    new = new_key_b64()
    a.keys_install(new)  # node-b is down for all three steps
    new_id = a.keys_use(key_id(base64.b64decode(new)))
    a.keys_remove(key_id(old))
    c = joined(tmp_path, a, C, "node-c", NOW + 2)  # admitted meanwhile: its grant carries the keyring's order

    # The push-pull when node-b comes back, in both directions: node-a and node-c ignore node-b's old primary...
    for member in (a, c):
        assert not member.keys_merge(base64.b64encode(b.keyring.primary).decode(), b.keys_state())
        assert member.keys_list() == [(new_id, True)]
    # ...and node-b uses the newer key and drops the removed one.
    assert b.keys_merge(base64.b64encode(a.keyring.primary).decode(), a.keys_state())
    assert b.keys_list() == [(new_id, True)] == c.keys_list()
    assert b.keys_version == a.keys_version == 3
    with pytest.raises(ClusterError, match="removed"):
        b.keys_install(base64.b64encode(old).decode())
    # A member still on a release that does not order keyrings offers only its primary: the removed key stays out.
    assert not b.keys_merge(base64.b64encode(old).decode(), None)
    reloaded = ClusterState.load(b.path.parent)
    assert reloaded is not None
    assert (reloaded.keys_list(), reloaded.keys_version, reloaded.removed_keys) == ([(new_id, True)], 3, {key_id(old)})


def test_until_a_member_is_told_to_remove_its_old_key_it_keeps_opening_what_is_sealed_with_it(tmp_path: Path) -> None:
    a = make(tmp_path)
    b = joined(tmp_path, a, B, "node-b", NOW + 1)
    old = a.keyring.primary
    new = new_key_b64()
    a.keys_install(new)
    a.keys_use(new)  # node-b missed both; nothing is removed yet
    assert b.keys_merge(base64.b64encode(a.keyring.primary).decode(), a.keys_state())
    assert b.keyring.primary == base64.b64decode(new)
    assert old in b.keyring  # a third member not yet told still seals with it
    sealed = Keyring(old).seal(b"ping")
    assert b.keyring.open(sealed) == b"ping"


def test_two_members_that_changed_their_keyrings_apart_agree_on_one_primary(tmp_path: Path) -> None:
    a = make(tmp_path)
    b = joined(tmp_path, a, B, "node-b", NOW + 1)
    for state in (a, b):  # the same number of changes, each its own new key, on either side of a partition
        state.keys_use(state.keys_install(new_key_b64()))
    offer_a, offer_b = ((base64.b64encode(s.keyring.primary).decode(), s.keys_state()) for s in (a, b))
    a.keys_merge(*offer_b)
    b.keys_merge(*offer_a)
    assert a.keyring.primary == b.keyring.primary


def offer(state: ClusterState) -> tuple[str, dict[str, Any]]:
    """What a push-pull carries of a member's keyring: its primary, and its order."""
    return base64.b64encode(state.keyring.primary).decode(), state.keys_state()


def test_a_primary_removed_on_one_side_gives_way_whatever_the_other_side_changed_meanwhile(tmp_path: Path) -> None:
    """A partition: one side rotates away from the old key and removes it; the other makes more changes of its
    own (spare keys) and still seals with the old key. Once healed, both seal with a key neither removed."""
    a = make(tmp_path)
    b = joined(tmp_path, a, B, "node-b", NOW + 1)
    old = a.keyring.primary
    new = a.keys_use(a.keys_install(new_key_b64()))
    a.keys_remove(key_id(old))  # version 3
    for _ in range(2):
        b.keys_install(new_key_b64())  # version 2, then 4 with the next two
    b.keys_remove(b.keys_install(new_key_b64()))
    assert b.keys_version > a.keys_version
    before_a, before_b = offer(a), offer(b)
    a.keys_merge(*before_b)
    b.keys_merge(*before_a)
    assert key_id(a.keyring.primary) == key_id(b.keyring.primary) == new
    assert old not in a.keyring
    assert old not in b.keyring


def test_concurrent_use_and_remove_of_one_key_end_with_both_sealing_with_a_key_neither_removed(tmp_path: Path) -> None:
    a = make(tmp_path)
    b = joined(tmp_path, a, B, "node-b", NOW + 1)
    spare = new_key_b64()
    for state in (a, b):
        state.keys_install(spare)
    a.keys_use(spare)  # one operator, on node-a
    b.keys_remove(key_id(base64.b64decode(spare)))  # another, on node-b, at the same time: both at version 2
    before_a, before_b = offer(a), offer(b)
    a.keys_merge(*before_b)
    b.keys_merge(*before_a)
    assert a.keyring.primary == b.keyring.primary != base64.b64decode(spare)


def test_keyrings_from_before_versions_never_make_a_member_seal_with_the_others_key(tmp_path: Path) -> None:
    """Keyrings saved by a release without versions load at version 0: the other's primary may be a key that release
    removed and could not remember, so it is installed (its datagrams open) but never used."""
    a = make(tmp_path)
    b = joined(tmp_path, a, B, "node-b", NOW + 1)
    b.keyring.install(base64.b64decode(new_key_b64()))
    b.keyring.use(b.keyring.keys()[-1])  # changed as an older release did: no version
    assert (a.keys_version, b.keys_version) == (0, 0)
    ours = a.keyring.primary
    assert a.keys_merge(*offer(b))
    assert a.keyring.primary == ours
    assert b.keyring.primary in a.keyring
