"""The cluster keyring: sealed datagrams open under any installed key, and nothing else opens at all."""

from __future__ import annotations

import json

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from gpubroker.gossip.keyring import KEY_SIZE, NONCE_SIZE, OVERHEAD, VERSION, Keyring, KeyringError, cluster_hash, key_id, new_key

plaintexts = st.binary(max_size=1400)


def opens(keyring: Keyring, data: bytes, aad: bytes = b"") -> bool:
    try:
        keyring.open(data, aad)
    except KeyringError:
        return False
    return True


@given(plaintexts, st.binary(max_size=32))
def test_a_sealed_datagram_opens_to_its_plaintext(plaintext: bytes, aad: bytes) -> None:
    keyring = Keyring.generate()
    sealed = keyring.seal(plaintext, aad)
    assert len(sealed) == len(plaintext) + OVERHEAD
    assert sealed[0] == VERSION
    assert keyring.open(sealed, aad) == plaintext


def test_sealing_the_same_plaintext_twice_gives_different_bytes() -> None:
    keyring = Keyring.generate()
    assert keyring.seal(b"ping") != keyring.seal(b"ping")  # a fresh nonce each time


def test_a_rotation_loses_no_datagram_and_the_removed_key_stops_opening() -> None:
    old, new = new_key(), new_key()
    sender, receiver = Keyring(old), Keyring(old)
    before = sender.seal(b"sealed under the old key")

    receiver.install(new)
    sender.install(new)
    sender.use(new)
    during = sender.seal(b"sealed under the new key")
    assert receiver.open(before) == b"sealed under the old key"
    assert receiver.open(during) == b"sealed under the new key"  # the receiver still seals with old, but opens new

    receiver.use(new)
    receiver.remove(old)
    assert receiver.keys() == [new]
    with pytest.raises(KeyringError, match="no installed key"):
        receiver.open(before)
    assert receiver.open(during) == b"sealed under the new key"


def test_a_keyring_without_the_key_cannot_open() -> None:
    assert not opens(Keyring.generate(), Keyring.generate().seal(b"secret"))


@given(plaintexts, st.data())
def test_any_flipped_bit_in_a_sealed_datagram_makes_it_fail(plaintext: bytes, data: st.DataObject) -> None:
    keyring = Keyring.generate()
    sealed = bytearray(keyring.seal(plaintext))
    position = data.draw(st.integers(0, len(sealed) - 1), label="byte")  # version, nonce, ciphertext or tag
    sealed[position] ^= 1 << data.draw(st.integers(0, 7), label="bit")
    assert not opens(keyring, bytes(sealed))


def test_a_different_aad_makes_it_fail() -> None:
    keyring = Keyring.generate()
    sealed = keyring.seal(b"ping", aad=b"10.0.0.1:9741")
    assert opens(keyring, sealed, aad=b"10.0.0.1:9741")
    assert not opens(keyring, sealed, aad=b"10.0.0.2:9741")
    assert not opens(keyring, sealed)


@given(st.binary(max_size=200))
@example(b"")
@example(bytes([VERSION]) + b"\0" * (OVERHEAD - 1))
@example(bytes([VERSION + 1]) + b"\0" * 40)
def test_random_bytes_fail_with_keyring_error_only(data: bytes) -> None:
    assert not opens(Keyring(new_key(), [new_key(), new_key()]), data)


def test_a_truncated_datagram_names_the_minimum_size() -> None:
    with pytest.raises(KeyringError, match=f"at least {OVERHEAD} bytes"):
        Keyring.generate().open(b"\x01short")


def test_an_unknown_encryption_version_is_refused_before_any_key_is_tried() -> None:
    keyring = Keyring.generate()
    sealed = bytearray(keyring.seal(b"ping"))
    sealed[0] = VERSION + 1
    with pytest.raises(KeyringError, match="unknown encryption version"):
        keyring.open(bytes(sealed))


def test_the_layout_is_version_then_nonce_then_ciphertext_and_tag() -> None:
    assert OVERHEAD == 1 + NONCE_SIZE + 16
    keyring = Keyring.generate()
    first, second = keyring.seal(b""), keyring.seal(b"")
    assert len(first) == OVERHEAD
    assert first[1 : 1 + NONCE_SIZE] != second[1 : 1 + NONCE_SIZE]


def test_the_primary_cannot_be_removed() -> None:
    keyring = Keyring.generate()
    with pytest.raises(KeyringError, match="primary"):
        keyring.remove(keyring.primary)
    assert keyring.keys() == [keyring.primary]


def test_a_key_must_be_installed_before_it_is_used() -> None:
    keyring = Keyring.generate()
    stranger = new_key()
    with pytest.raises(KeyringError, match="not installed"):
        keyring.use(stranger)
    assert keyring.primary != stranger


@pytest.mark.parametrize("key", [b"", b"k" * 16, b"k" * (KEY_SIZE + 1), "k" * KEY_SIZE])
def test_a_key_of_the_wrong_size_or_type_is_refused(key: bytes) -> None:
    keyring = Keyring.generate()
    with pytest.raises(KeyringError, match=f"{KEY_SIZE} bytes"):
        keyring.install(key)
    with pytest.raises(KeyringError):
        Keyring(key)


def test_installing_twice_keeps_one_copy_and_removing_an_unknown_key_changes_nothing() -> None:
    keyring = Keyring.generate()
    other = new_key()
    keyring.install(other)
    keyring.install(other)
    keyring.remove(new_key())
    assert keyring.keys() == [keyring.primary, other]
    assert other in keyring


def test_keys_lists_the_primary_first_after_a_switch() -> None:
    first, second, third = new_key(), new_key(), new_key()
    keyring = Keyring(first, [second, third])
    keyring.use(third)
    assert keyring.keys() == [third, first, second]


def test_a_keyring_survives_json_with_its_primary() -> None:
    keyring = Keyring(new_key(), [new_key()])
    keyring.use(keyring.keys()[1])
    again = Keyring.from_json(keyring.to_json())
    assert again.keys() == keyring.keys()
    assert again.primary == keyring.primary
    assert again.open(keyring.seal(b"ping")) == b"ping"


@pytest.mark.parametrize(
    "text",
    [
        "",
        "[]",
        "{}",
        '{"primary": "not base64!", "keys": []}',
        '{"primary": "AAAA", "keys": []}',
        json.dumps({"primary": "A" * 44, "keys": 5}),
        json.dumps({"primary": 5, "keys": []}),
    ],
)
def test_from_json_refuses_anything_but_a_saved_keyring(text: str) -> None:
    with pytest.raises(KeyringError):
        Keyring.from_json(text)


def test_the_cluster_hash_is_short_stable_and_distinct_per_cluster() -> None:
    assert cluster_hash("cluster-a") == cluster_hash("cluster-a")
    assert cluster_hash("cluster-a") != cluster_hash("cluster-b")
    assert len(cluster_hash("cluster-a")) == 16
    assert int(cluster_hash("cluster-a"), 16) >= 0  # hex


def test_a_key_id_names_a_key_without_containing_it() -> None:
    key = new_key()
    assert key_id(key) == key_id(key) != key_id(new_key())
    assert key.hex()[:12] != key_id(key)
    assert len(key_id(key)) == 12
