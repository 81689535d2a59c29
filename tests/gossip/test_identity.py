"""A node's identity: an id that follows the key, a certificate that carries it, signatures that only it can make."""

from __future__ import annotations

import datetime as dt
import ipaddress
import ssl
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.x509.oid import NameOID
from hypothesis import given
from hypothesis import strategies as st

from gpubroker.gossip.identity import (
    CERT_FILE,
    CERT_VALIDITY,
    KEY_FILE,
    Identity,
    IdentityError,
    fingerprint,
    node_id_of,
    node_id_of_certificate,
    public_key_of,
    ui_certificate,
)

NOW = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_node_id_is_stable_across_reloads(tmp_path: Path) -> None:
    first = Identity.load_or_create(tmp_path)
    again = Identity.load_or_create(tmp_path)
    assert again.node_id == first.node_id
    assert again.public_key_bytes == first.public_key_bytes


def test_two_nodes_get_different_ids(tmp_path: Path) -> None:
    assert Identity.load_or_create(tmp_path / "a").node_id != Identity.load_or_create(tmp_path / "b").node_id


def test_the_node_id_is_n_dash_and_sixteen_lowercase_base32_characters_of_the_key_hash() -> None:
    identity = Identity.generate()
    assert identity.node_id.startswith("n-")
    assert len(identity.node_id) == 18
    assert set(identity.node_id[2:]) <= set("abcdefghijklmnopqrstuvwxyz234567")
    assert node_id_of(identity.public_key_bytes) == identity.node_id


def test_the_key_and_certificate_files_are_0600_in_a_0700_directory(tmp_path: Path) -> None:
    identity = Identity.load_or_create(tmp_path)
    identity.certificate()
    directory = tmp_path / "identity"
    assert mode(directory) == 0o700
    assert mode(directory / KEY_FILE) == 0o600
    assert mode(directory / CERT_FILE) == 0o600
    assert identity.key_path == directory / KEY_FILE
    assert identity.cert_path == directory / CERT_FILE
    assert not [p for p in directory.iterdir() if p.name.startswith(".")], "no temporary file is left behind"


def test_a_key_file_with_loose_permissions_is_tightened_on_load(tmp_path: Path) -> None:
    Identity.load_or_create(tmp_path)
    key_file = tmp_path / "identity" / KEY_FILE
    key_file.chmod(0o644)
    Identity.load_or_create(tmp_path)
    assert mode(key_file) == 0o600


def test_the_certificate_carries_the_key_and_names_the_node(tmp_path: Path) -> None:
    identity = Identity.load_or_create(tmp_path)
    cert = identity.certificate(NOW)
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == identity.node_id
    assert cert.issuer == cert.subject
    key = cert.public_key()
    assert isinstance(key, Ed25519PublicKey)
    assert key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw) == identity.public_key_bytes
    assert cert.not_valid_before_utc < NOW < cert.not_valid_after_utc
    assert cert.not_valid_after_utc - NOW == CERT_VALIDITY
    assert node_id_of_certificate(identity.certificate_der(NOW)) == identity.node_id


def test_the_certificate_is_kept_across_reloads_while_valid(tmp_path: Path) -> None:
    first = Identity.load_or_create(tmp_path).certificate(NOW)
    assert Identity.load_or_create(tmp_path).certificate(NOW + dt.timedelta(days=365)) == first


def test_a_certificate_past_its_end_is_kept_as_its_members_pinned_it(tmp_path: Path) -> None:
    """Made on a board whose clock still read 1970, it ends in 1980: once NTP sets the clock, a renewed one would be
    refused by every member, which trusts the very certificate it pinned, whatever its dates."""
    identity = Identity.load_or_create(tmp_path)
    made_in_1970 = identity.certificate(dt.datetime(1970, 1, 1, 0, 1, tzinfo=dt.UTC))
    assert made_in_1970.not_valid_after_utc < NOW
    assert Identity.load_or_create(tmp_path).certificate(NOW) == made_in_1970
    assert x509.load_pem_x509_certificate((tmp_path / "identity" / CERT_FILE).read_bytes()) == made_in_1970


def test_a_missing_or_damaged_certificate_is_made_again_with_the_same_id(tmp_path: Path) -> None:
    identity = Identity.load_or_create(tmp_path)
    identity.certificate(NOW)
    cert_file = tmp_path / "identity" / CERT_FILE
    cert_file.unlink()
    assert node_id_of_certificate(Identity.load_or_create(tmp_path).certificate_der(NOW)) == identity.node_id
    cert_file.write_bytes(b"-----BEGIN CERTIFICATE-----\ngarbage\n")
    assert node_id_of_certificate(Identity.load_or_create(tmp_path).certificate_der(NOW)) == identity.node_id


def test_a_certificate_for_another_key_is_replaced(tmp_path: Path) -> None:
    Identity.load_or_create(tmp_path / "other").certificate(NOW)
    identity = Identity.load_or_create(tmp_path / "mine")
    (tmp_path / "mine" / "identity" / CERT_FILE).write_bytes((tmp_path / "other" / "identity" / CERT_FILE).read_bytes())
    assert node_id_of_certificate(Identity.load_or_create(tmp_path / "mine").certificate_der(NOW)) == identity.node_id


def test_a_corrupt_key_file_is_an_error_and_is_never_replaced(tmp_path: Path) -> None:
    key_file = tmp_path / "identity" / KEY_FILE
    key_file.parent.mkdir(parents=True)
    key_file.write_bytes(b"not a key")
    with pytest.raises(IdentityError) as raised:
        Identity.load_or_create(tmp_path)
    assert raised.value.path == key_file
    assert key_file.read_bytes() == b"not a key"


def test_a_key_of_another_algorithm_is_refused(tmp_path: Path) -> None:
    key_file = tmp_path / "identity" / KEY_FILE
    key_file.parent.mkdir(parents=True)
    other = ec.generate_private_key(ec.SECP256R1())
    key_file.write_bytes(other.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    with pytest.raises(IdentityError, match="not Ed25519"):
        Identity.load_or_create(tmp_path)


def test_a_signature_verifies_with_the_signers_public_key() -> None:
    identity = Identity.generate()
    signature = identity.sign(b"document v7")
    assert len(signature) == 64
    assert Identity.verify(identity.public_key_bytes, b"document v7", signature)


def test_a_signature_by_another_key_or_over_other_data_fails() -> None:
    signer, forger = Identity.generate(), Identity.generate()
    signature = signer.sign(b"document v7")
    assert not Identity.verify(signer.public_key_bytes, b"document v8", signature)
    assert not Identity.verify(signer.public_key_bytes, b"document v7", forger.sign(b"document v7"))
    assert not Identity.verify(forger.public_key_bytes, b"document v7", signature)


@given(st.binary(max_size=40), st.binary(max_size=20), st.binary(max_size=80))
def test_verify_with_garbage_returns_false(public_key: bytes, data: bytes, signature: bytes) -> None:
    assert Identity.verify(public_key, data, signature) is False


@pytest.mark.parametrize(
    ("public_key", "data", "signature"),
    [(None, b"x", b"s" * 64), (b"k" * 32, None, b"s" * 64), (b"k" * 32, b"x", None), ("k" * 32, "x", "s" * 64)],
)
def test_verify_with_values_of_the_wrong_type_returns_false(public_key: object, data: object, signature: object) -> None:
    assert Identity.verify(public_key, data, signature) is False  # type: ignore[arg-type]


def test_a_signature_with_one_flipped_bit_fails() -> None:
    identity = Identity.generate()
    signature = bytearray(identity.sign(b"doc"))
    signature[10] ^= 0x01
    assert not Identity.verify(identity.public_key_bytes, b"doc", bytes(signature))


@pytest.mark.parametrize("bad", [b"", b"k" * 31, b"k" * 33])
def test_node_id_of_refuses_what_is_not_a_raw_public_key(bad: bytes) -> None:
    with pytest.raises(IdentityError):
        node_id_of(bad)


def test_a_non_ed25519_or_malformed_certificate_proves_no_node_id() -> None:
    cert_pem, _ = ui_certificate(["localhost"])
    der = x509.load_pem_x509_certificate(cert_pem).public_bytes(serialization.Encoding.DER)
    with pytest.raises(IdentityError, match="Ed25519"):
        node_id_of_certificate(der)
    with pytest.raises(IdentityError, match="not a DER certificate"):
        public_key_of(b"\x30\x03garbage")


def test_the_fingerprint_is_the_sha256_of_the_der_and_changes_only_with_the_certificate(tmp_path: Path) -> None:
    identity = Identity.load_or_create(tmp_path)
    before = identity.fingerprint(NOW)
    assert before == fingerprint(identity.certificate_der(NOW))
    assert len(before) == 64
    assert identity.fingerprint(NOW + CERT_VALIDITY) == before  # never renewed: a join token pins it
    (tmp_path / "identity" / CERT_FILE).unlink()
    assert Identity.load_or_create(tmp_path).fingerprint(NOW) != before  # made again


def test_an_in_memory_identity_has_a_certificate_but_no_files() -> None:
    identity = Identity.generate()
    assert node_id_of_certificate(identity.certificate_der()) == identity.node_id
    with pytest.raises(IdentityError, match="in memory"):
        _ = identity.key_path


def test_two_nodes_complete_mutual_tls_pinned_to_each_others_certificate(tmp_path: Path) -> None:
    """As the mesh will use them: TLS 1.3, CERT_REQUIRED both ways, each trusting exactly the other's certificate."""
    a, b = Identity.load_or_create(tmp_path / "a"), Identity.load_or_create(tmp_path / "b")
    client_side = tls_context(ssl.PROTOCOL_TLS_CLIENT, a, trusts=b)
    server_side = tls_context(ssl.PROTOCOL_TLS_SERVER, b, trusts=a)
    client_cert, server_cert = handshake(client_side, server_side)
    assert node_id_of_certificate(server_cert) == b.node_id
    assert node_id_of_certificate(client_cert) == a.node_id


@pytest.mark.parametrize("stranger_is", ["client", "server"])
def test_mutual_tls_refuses_a_node_whose_certificate_is_not_pinned(tmp_path: Path, stranger_is: str) -> None:
    a, b, stranger = (Identity.load_or_create(tmp_path / n) for n in "abs")
    if stranger_is == "client":
        client_side, server_side = (
            tls_context(ssl.PROTOCOL_TLS_CLIENT, stranger, trusts=b),
            tls_context(ssl.PROTOCOL_TLS_SERVER, b, trusts=a),
        )
    else:
        client_side, server_side = (
            tls_context(ssl.PROTOCOL_TLS_CLIENT, a, trusts=b),
            tls_context(ssl.PROTOCOL_TLS_SERVER, stranger, trusts=a),
        )
    with pytest.raises(ssl.SSLCertVerificationError, match="certificate verify failed"):
        handshake(client_side, server_side)


def tls_context(protocol: int, own: Identity, trusts: Identity) -> ssl.SSLContext:
    context = ssl.SSLContext(protocol)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.check_hostname = False
    context.verify_mode = ssl.CERT_REQUIRED
    context.verify_flags |= ssl.VERIFY_X509_STRICT  # Python 3.13 sets it by default; the certificates must pass it
    context.load_cert_chain(own.cert_path, own.key_path)
    context.load_verify_locations(cadata=trusts.certificate_pem().decode())
    return context


def connect(
    client_context: ssl.SSLContext, server_context: ssl.SSLContext, server_hostname: str | None = None
) -> tuple[ssl.SSLObject, ssl.SSLObject]:
    """A TLS connection in memory, handshake done and one byte sent each way; (client, server)."""
    c_in, c_out, s_in, s_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    client = client_context.wrap_bio(c_in, c_out, server_side=False, server_hostname=server_hostname)
    server = server_context.wrap_bio(s_in, s_out, server_side=True)
    done = {"client": False, "server": False}
    for _ in range(20):
        for name, side in (("client", client), ("server", server)):
            if not done[name]:
                try:
                    side.do_handshake()
                    done[name] = True
                except ssl.SSLWantReadError:
                    pass
        s_in.write(c_out.read())
        c_in.write(s_out.read())
        if all(done.values()):
            break
    # TLS 1.3: the server learns of a refused client certificate only when the client's alert arrives
    server.write(b"x")
    c_in.write(s_out.read())
    assert client.read(1) == b"x"
    client.write(b"y")
    s_in.write(c_out.read())
    assert server.read(1) == b"y"
    return client, server


def handshake(client_context: ssl.SSLContext, server_context: ssl.SSLContext) -> tuple[bytes, bytes]:
    """(the client's certificate as the server saw it, the server's as the client saw it)."""
    client, server = connect(client_context, server_context)
    client_cert, server_cert = server.getpeercert(binary_form=True), client.getpeercert(binary_form=True)
    assert client_cert is not None
    assert server_cert is not None
    return client_cert, server_cert


def test_the_ui_certificate_is_ecdsa_p256_and_names_every_host() -> None:
    cert_pem, key_pem = ui_certificate(["broker.lan", "127.0.0.1", "::1"], now=NOW)
    cert = x509.load_pem_x509_certificate(cert_pem)
    key = serialization.load_pem_private_key(key_pem, password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    assert isinstance(key.curve, ec.SECP256R1)
    public = cert.public_key()
    assert isinstance(public, ec.EllipticCurvePublicKey)
    assert public.public_numbers() == key.public_key().public_numbers()
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["broker.lan"]
    assert names.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")]
    assert cert.not_valid_before_utc < NOW < cert.not_valid_after_utc <= NOW + dt.timedelta(days=398)


def test_the_ui_certificate_serves_https_to_a_client_that_trusts_it(tmp_path: Path) -> None:
    cert_pem, key_pem = ui_certificate(["localhost"])
    (tmp_path / "ui.pem").write_bytes(cert_pem)
    (tmp_path / "ui-key.pem").write_bytes(key_pem)
    server_context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_context.load_cert_chain(tmp_path / "ui.pem", tmp_path / "ui-key.pem")
    client_context = ssl.create_default_context(cadata=cert_pem.decode())  # a browser that was told to trust it
    client_context.verify_flags |= ssl.VERIFY_X509_STRICT
    client, _ = connect(client_context, server_context, server_hostname="localhost")
    assert client.getpeercert() is not None
    with pytest.raises(ssl.SSLCertVerificationError):
        connect(client_context, server_context, server_hostname="elsewhere.lan")


def test_the_ui_certificate_needs_a_hostname() -> None:
    with pytest.raises(IdentityError):
        ui_certificate([])
    with pytest.raises(IdentityError, match="neither"):
        ui_certificate(["bad..name"])
