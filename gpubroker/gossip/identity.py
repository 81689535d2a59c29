"""A node's Ed25519 identity: its key, the id derived from it, its self-signed certificate, and signatures.

    IdentityError   an unreadable or foreign key file, a certificate that is not a node's, bad UI hostnames

The node id is derived from the public key alone ("n-" + 16 lowercase base32 characters of its sha256),
so a renewed certificate keeps the id and a peer can check an id against the certificate it presents.
Browsers refuse Ed25519 certificates, so the web UI gets its own ECDSA P-256 one (`ui_certificate`).
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import ipaddress
import os
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

NODE_ID_PREFIX = "n-"
NODE_ID_CHARS = 16  # base32 characters: 80 bits of the key's hash
PUBLIC_KEY_SIZE = 32
SIGNATURE_SIZE = 64
CERT_VALIDITY = dt.timedelta(days=3650)
BACKDATE = dt.timedelta(days=1)  # peers' clocks may lag ours; a certificate "not yet valid" would be refused
UI_CERT_VALIDITY = dt.timedelta(days=397)  # Apple's and Chrome's ceiling for a server certificate

KEY_FILE = "key.pem"
CERT_FILE = "cert.pem"


class IdentityError(Exception):
    """An identity that cannot be loaded or a certificate that is not a node's; `path` when a file is to blame."""

    def __init__(self, message: str, path: Path | None = None) -> None:
        super().__init__(message)
        self.path = path


def node_id_of(public_key_bytes: bytes) -> str:
    """The node id of a raw 32-byte Ed25519 public key; IdentityError for anything else."""
    if not isinstance(public_key_bytes, bytes) or len(public_key_bytes) != PUBLIC_KEY_SIZE:
        raise IdentityError(f"an Ed25519 public key is {PUBLIC_KEY_SIZE} raw bytes")
    digest = hashlib.sha256(public_key_bytes).digest()
    return NODE_ID_PREFIX + base64.b32encode(digest).decode("ascii").lower()[:NODE_ID_CHARS]


def fingerprint(cert_der: bytes) -> str:
    """The sha256 of a DER certificate, in hex (what a join token names to pin its issuer)."""
    return hashlib.sha256(cert_der).hexdigest()


def public_key_of(cert_der: bytes) -> bytes:
    """The raw Ed25519 public key a node's certificate carries (a TLS peer's, say); IdentityError otherwise."""
    try:
        key = x509.load_der_x509_certificate(cert_der).public_key()
    except Exception as exc:  # cryptography raises ValueError and friends for malformed DER
        raise IdentityError(f"not a DER certificate: {exc}") from None
    if not isinstance(key, Ed25519PublicKey):
        raise IdentityError(f"a node's certificate carries an Ed25519 key, not {type(key).__name__}")
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def node_id_of_certificate(cert_der: bytes) -> str:
    """The node id a certificate proves (derived from its key, never read from its subject)."""
    return node_id_of(public_key_of(cert_der))


def write_private(path: Path, data: bytes) -> None:
    """Write `data` to `path` as 0600 from its first byte, atomically and durably: a crash or power cut leaves the old file or the new one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.chmod(tmp, 0o600)  # O_CREAT's mode does not apply to a leftover file from an earlier crash
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself must survive a power cut
    finally:
        os.close(dir_fd)


def _now(now: dt.datetime | None) -> dt.datetime:
    return now if now is not None else dt.datetime.now(dt.UTC)


class Identity:
    """One node's Ed25519 key, stored under `state_dir/identity/` (or held in memory, for tests)."""

    def __init__(self, private_key: Ed25519PrivateKey, directory: Path | None = None) -> None:
        self._key = private_key
        self._directory = directory
        self._cert: x509.Certificate | None = None
        self.public_key_bytes: bytes = private_key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        self.node_id: str = node_id_of(self.public_key_bytes)

    @classmethod
    def generate(cls) -> Identity:
        """A fresh identity kept in memory only (many nodes in one test process)."""
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def load_or_create(cls, state_dir: Path) -> Identity:
        """The identity under `state_dir/identity/`, created on first use; IdentityError for a corrupt or foreign key.

        An existing key is never replaced: a new key would be a new node id.
        """
        directory = state_dir / "identity"
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        directory.chmod(0o700)
        path = directory / KEY_FILE
        if not path.exists():
            key = Ed25519PrivateKey.generate()
            pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
            write_private(path, pem)
            return cls(key, directory)
        try:
            loaded = serialization.load_pem_private_key(path.read_bytes(), password=None)
        except Exception as exc:  # ValueError, TypeError, UnsupportedAlgorithm for what is not a plain PEM key
            raise IdentityError(f"cannot read the identity key {path}: {exc}", path) from None
        if not isinstance(loaded, Ed25519PrivateKey):
            raise IdentityError(f"the identity key {path} is {type(loaded).__name__}, not Ed25519", path)
        path.chmod(0o600)  # a key someone copied in with looser permissions is tightened, as ssh would insist
        return cls(loaded, directory)

    @property
    def key_path(self) -> Path:
        """The private key's PEM file (for `ssl.SSLContext.load_cert_chain`)."""
        return self._stored() / KEY_FILE

    @property
    def cert_path(self) -> Path:
        """The certificate's PEM file, made first if there is none."""
        self.certificate()
        return self._stored() / CERT_FILE

    def _stored(self) -> Path:
        if self._directory is None:
            raise IdentityError("this identity is held in memory only: it has no files")
        return self._directory

    def sign(self, data: bytes) -> bytes:
        """A 64-byte Ed25519 signature of `data`."""
        return self._key.sign(data)

    @staticmethod
    def verify(public_key_bytes: bytes, data: bytes, signature: bytes) -> bool:
        """Whether `signature` is the key's over `data`; False, never an exception, for any malformed input."""
        try:
            Ed25519PublicKey.from_public_bytes(public_key_bytes).verify(signature, data)
        except (InvalidSignature, ValueError, TypeError):
            return False
        except Exception:  # whatever else a hostile input provokes is still "not verified"
            return False
        return True

    def private_key_pem(self) -> bytes:
        return self._key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())

    def certificate(self, now: dt.datetime | None = None) -> x509.Certificate:
        """The self-signed certificate carrying this key (CN = node id), made anew only when missing or foreign.

        Never renewed for its dates: members trust it because this very certificate is pinned in their member lists,
        whatever its dates say (transport.NO_CHECK_TIME), and a new one would be refused by every one of them. A node
        whose first start came before its clock was set (1970, a board without a real-time clock) would otherwise
        renew it once the clock is right, and be cut off from its cluster for good."""
        at = _now(now)
        if self._cert is None and self._directory is not None:
            self._cert = self._load_certificate(self._directory / CERT_FILE)
        if self._cert is None or not self._carries_this_key(self._cert):
            self._cert = self._make_certificate(at)
            if self._directory is not None:
                write_private(self._directory / CERT_FILE, self._cert.public_bytes(serialization.Encoding.PEM))
        return self._cert

    def certificate_pem(self, now: dt.datetime | None = None) -> bytes:
        return self.certificate(now).public_bytes(serialization.Encoding.PEM)

    def certificate_der(self, now: dt.datetime | None = None) -> bytes:
        return self.certificate(now).public_bytes(serialization.Encoding.DER)

    def fingerprint(self, now: dt.datetime | None = None) -> str:
        """The sha256 hex of this node's current certificate."""
        return fingerprint(self.certificate_der(now))

    @staticmethod
    def _load_certificate(path: Path) -> x509.Certificate | None:
        try:
            return x509.load_pem_x509_certificate(path.read_bytes())
        except (OSError, ValueError):
            return None  # missing or damaged: a new one is made from the key, which is what matters

    def _carries_this_key(self, cert: x509.Certificate) -> bool:
        key = cert.public_key()
        return (
            isinstance(key, Ed25519PublicKey)
            and key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw) == self.public_key_bytes
        )

    def _make_certificate(self, at: dt.datetime) -> x509.Certificate:
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, self.node_id)])
        public = self._key.public_key()
        builder = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(public)
            .serial_number(x509.random_serial_number())
            .not_valid_before(at - BACKDATE)
            .not_valid_after(at + CERT_VALIDITY)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=False,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(self.node_id)]), critical=False)
        )
        return builder.sign(self._key, algorithm=None)  # Ed25519 takes no separate hash


def ui_certificate(hostnames: Sequence[str], now: dt.datetime | None = None) -> tuple[bytes, bytes]:
    """(certificate PEM, private key PEM) for the web UI: a fresh self-signed ECDSA P-256 certificate naming
    `hostnames` (DNS names or IP addresses) as subject alternative names, valid UI_CERT_VALIDITY."""
    if not hostnames:
        raise IdentityError("the UI certificate needs at least one hostname or address")
    names: list[x509.GeneralName] = []
    for host in hostnames:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            try:
                names.append(x509.DNSName(host.encode("idna").decode("ascii")))
            except UnicodeError:
                raise IdentityError(f"{host!r} is neither an IP address nor a valid DNS name") from None
    at = _now(now)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hostnames[0][:64])])
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(at - BACKDATE)
        .not_valid_after(at + UI_CERT_VALIDITY)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    return cert.public_bytes(serialization.Encoding.PEM), key_pem
