"""The cluster keyring: AES-256-GCM for gossip datagrams, with rotation as in HashiCorp memberlist.

    KeyringError    a key of the wrong size, removing the primary, a datagram no installed key opens

A sealed datagram is `VERSION (1 byte) | nonce (12 bytes) | ciphertext | tag (16 bytes)`. The primary key
seals; every installed key is tried to open, so a rotation is install everywhere, then use everywhere,
then remove everywhere, and no datagram is lost in between. The caller persists the keyring
(`to_json`/`from_json`) and counts the datagrams `open` refuses.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
from collections.abc import Iterable

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

VERSION = 1
KEY_SIZE = 32
NONCE_SIZE = 12
TAG_SIZE = 16
OVERHEAD = 1 + NONCE_SIZE + TAG_SIZE  # bytes `seal` adds to a plaintext: 29


class KeyringError(Exception):
    """A keyring operation refused, or a datagram that no installed key opens (it must be dropped unparsed)."""


def new_key() -> bytes:
    """A fresh random 32-byte key."""
    return os.urandom(KEY_SIZE)


def key_id(key: bytes) -> str:
    """A short name for a key that reveals nothing of it (for `keys list` and logs): sha256 hex, first 12."""
    return hashlib.sha256(b"gpubroker-key-id\0" + key).hexdigest()[:12]


def cluster_hash(cluster_id: str) -> str:
    """Names the cluster in the mDNS TXT record without revealing a key: sha256 hex of the id, first 16."""
    return hashlib.sha256(cluster_id.encode()).hexdigest()[:16]


def _check(key: bytes) -> bytes:
    if not isinstance(key, bytes) or len(key) != KEY_SIZE:
        size = len(key) if isinstance(key, bytes | bytearray) else type(key).__name__
        raise KeyringError(f"a key must be {KEY_SIZE} bytes, got {size}")
    return key


class Keyring:
    """The installed keys; the primary seals, any of them opens."""

    def __init__(self, primary: bytes, others: Iterable[bytes] = ()) -> None:
        self._ciphers: dict[bytes, AESGCM] = {}  # insertion-ordered; the primary is tried first anyway
        self._primary = _check(primary)
        self.install(primary)
        for key in others:
            self.install(key)

    @classmethod
    def generate(cls) -> Keyring:
        """A keyring holding one fresh key (what `gpubroker init` creates)."""
        return cls(new_key())

    @property
    def primary(self) -> bytes:
        return self._primary

    def keys(self) -> list[bytes]:
        """Every installed key, the primary first."""
        return [self._primary, *(k for k in self._ciphers if k != self._primary)]

    def __contains__(self, key: object) -> bool:
        return key in self._ciphers

    def install(self, key: bytes) -> None:
        """Accept datagrams sealed with `key` too; installing a key twice changes nothing."""
        if _check(key) not in self._ciphers:
            self._ciphers[key] = AESGCM(key)

    def use(self, key: bytes) -> None:
        """Seal with `key` from now on; it must be installed first."""
        if _check(key) not in self._ciphers:
            raise KeyringError(f"key {key_id(key)} is not installed: install it before using it")
        self._primary = key

    def remove(self, key: bytes) -> None:
        """Stop accepting `key`; refused for the primary; removing a key that is not installed changes nothing."""
        if _check(key) == self._primary:
            raise KeyringError(f"key {key_id(key)} is the primary: use another key before removing it")
        self._ciphers.pop(key, None)

    def seal(self, plaintext: bytes, aad: bytes = b"") -> bytes:
        """`plaintext` encrypted under the primary key: VERSION | nonce | ciphertext+tag (OVERHEAD bytes more)."""
        nonce = os.urandom(NONCE_SIZE)
        return bytes((VERSION,)) + nonce + self._ciphers[self._primary].encrypt(nonce, plaintext, aad)

    def open(self, data: bytes, aad: bytes = b"") -> bytes:
        """The plaintext, tried under the primary then every other key; KeyringError when none opens it."""
        if len(data) < OVERHEAD:
            raise KeyringError(f"a sealed datagram has at least {OVERHEAD} bytes, got {len(data)}")
        if data[0] != VERSION:
            raise KeyringError(f"unknown encryption version {data[0]} (expected {VERSION})")
        nonce, sealed = data[1 : 1 + NONCE_SIZE], data[1 + NONCE_SIZE :]
        for key in self.keys():
            try:
                return self._ciphers[key].decrypt(nonce, sealed, aad)
            except InvalidTag:
                continue
        raise KeyringError(f"no installed key opens this datagram (tried {len(self._ciphers)})")

    def to_json(self) -> str:
        """The keyring for the caller to persist (it holds secrets: store it 0600)."""
        encoded = [base64.b64encode(k).decode("ascii") for k in self.keys()]
        return json.dumps({"primary": encoded[0], "keys": encoded})

    @classmethod
    def from_json(cls, text: str) -> Keyring:
        """The keyring `to_json` wrote; KeyringError for anything else."""
        try:
            doc = json.loads(text)
            primary = base64.b64decode(doc["primary"], validate=True)
            others = [base64.b64decode(k, validate=True) for k in doc["keys"]]
        except (ValueError, TypeError, KeyError, binascii.Error) as exc:
            raise KeyringError(f"not a saved keyring: {type(exc).__name__}: {exc}") from None
        return cls(primary, others)
