"""Node documents: signed by their node alone, newest wins, age on the receiver's clock, published calmly."""

from __future__ import annotations

import hashlib
from typing import Any

import msgpack
import pytest
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from hypothesis import given
from hypothesis import strategies as st

from gpubroker.gossip.documents import (
    LABELS_ROOM,
    MISSING_LEASES_LISTED,
    MISSING_LISTED,
    ROUNDING,
    ClusterView,
    DocumentError,
    NodeDocument,
    Publisher,
    listed_leases,
    listed_missing,
    listed_unreadable,
    open_document,
    sign_document,
    summarize,
)

GIB = 2**30


def raw(key: Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def node_id_of(public_key: bytes) -> str:
    return "n-" + hashlib.sha256(public_key).hexdigest()[:16]


def verify(public_key: bytes, data: bytes, signature: bytes) -> bool:
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, data)
    except (InvalidSignature, ValueError):
        return False
    return True


KEY, OTHER = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
NODE = node_id_of(raw(KEY))


def document(generation: int = 1, version: int = 1, body: dict[str, Any] | None = None, key: Ed25519PrivateKey = KEY) -> NodeDocument:
    return NodeDocument(node_id_of(raw(key)), generation, version, 1000.0, body or {"name": "tower"}, raw(key))


def test_a_document_signed_by_its_node_opens_with_every_field() -> None:
    sent = document(body={"name": "tower", "gpus": [{"index": 0}]})
    opened = open_document(sign_document(sent, KEY.sign), verify, node_id_of)
    assert (opened.node, opened.order, opened.body, opened.made_at) == (NODE, (1, 1), sent.body, 1000.0)


def test_a_document_signed_by_another_key_is_rejected() -> None:
    forged = sign_document(document(), OTHER.sign)  # names NODE and carries its key, but OTHER signed it
    with pytest.raises(DocumentError, match="not signed by its node"):
        open_document(forged, verify, node_id_of)


def test_a_document_naming_a_node_whose_key_it_does_not_carry_is_rejected() -> None:
    impostor = NodeDocument(NODE, 9, 9, 0.0, {"name": "evil"}, raw(OTHER))
    with pytest.raises(DocumentError, match="not that node's"):
        open_document(sign_document(impostor, OTHER.sign), verify, node_id_of)


def test_a_tampered_body_is_rejected() -> None:
    signed, signature = msgpack.unpackb(sign_document(document(), KEY.sign), raw=False)
    fields = msgpack.unpackb(signed, raw=False)
    fields[4] = {"name": "tower", "gpus": ["all mine"]}
    tampered = msgpack.packb([msgpack.packb(fields, use_bin_type=True), signature], use_bin_type=True)
    with pytest.raises(DocumentError):
        open_document(tampered, verify, node_id_of)


@given(st.binary(max_size=2000))
def test_any_bytes_are_a_document_or_a_document_error(data: bytes) -> None:
    try:
        open_document(data, verify, node_id_of)
    except DocumentError:
        pass


@given(st.data())
def test_a_cut_or_altered_document_is_a_document_error(data: st.DataObject) -> None:
    good = bytearray(sign_document(document(), KEY.sign))
    if data.draw(st.booleans()):
        good = good[: data.draw(st.integers(0, len(good) - 1))]
    else:
        at = data.draw(st.integers(0, len(good) - 1))
        good[at] ^= data.draw(st.integers(1, 255))
    with pytest.raises(DocumentError):
        open_document(bytes(good), verify, node_id_of)


def test_the_highest_generation_then_version_wins() -> None:
    view = ClusterView()
    assert view.apply(document(1, 5), now=10.0)
    assert not view.apply(document(1, 4), now=11.0)
    assert not view.apply(document(1, 5), now=11.0)
    assert view.apply(document(2, 1), now=12.0)  # a restarted node starts a new generation at version 1
    assert view.knows(NODE) == (2, 1)


def test_age_is_measured_on_the_receivers_clock_not_the_senders() -> None:
    view = ClusterView()
    from_the_future = NodeDocument(NODE, 1, 1, 9_999_999_999.0, {"name": "tower"}, raw(KEY))
    view.apply(from_the_future, now=100.0)
    assert view.age(NODE, now=103.5) == 3.5
    assert view.age("n-unknown", now=103.5) is None


def test_a_new_version_is_published_only_on_change_and_at_most_once_a_second() -> None:
    publisher = Publisher(NODE, generation=3, public_key=raw(KEY))
    first = publisher.next({"leased": 1}, now=0.0)
    assert first is not None
    assert first.order == (3, 1)
    assert publisher.next({"leased": 1}, now=5.0) is None  # nothing changed
    assert publisher.next({"leased": 2}, now=5.5) is not None
    assert publisher.next({"leased": 3}, now=6.0) is None  # too soon after the last
    later = publisher.next({"leased": 3}, now=6.6)
    assert later is not None
    assert later.order == (3, 3)


def test_the_summary_rounds_figures_and_names_external_processes() -> None:
    node = {
        "node": {"id": NODE, "name": "tower", "version": "0.1.0", "production_eligible": True},
        "gpus": [
            {
                "index": 0, "uuid": "GPU-0", "name": "RTX 4090", "pressure": False,
                "figures": {"total": 24 * GIB, "external": 6 * GIB + 5, "leased": 0},
                "processes": [
                    {"pid": 1, "name": "ollama", "bytes": 4 * GIB, "lease": None},
                    {"pid": 2, "name": "ollama", "bytes": 2 * GIB, "lease": None},
                    {"pid": 3, "name": "python", "bytes": GIB, "lease": "l-1"},
                ],
            }
        ],
        "cpu": {"cores": 16, "leased": 0, "schedulable": 16},
        "memory": {"total": 64 * GIB + 3, "leased": 0, "schedulable": 64 * GIB + 3},
        "queue": {"background": 2},
    }  # fmt: skip
    leases = [
        {"id": "l-1", "state": "granted", "holder": {"name": "train"}, "priority": "background",
         "gpus": [{"index": 0, "bytes": GIB}], "expires_at": "2026-11-30T10:00:00.000Z"},
        {"id": "l-2", "state": "queued", "holder": {"name": "later"}, "priority": "background"},
    ]  # fmt: skip
    body = summarize(node, leases)
    gpu = body["gpus"][0]
    assert gpu["figures"]["external"] == 6 * GIB
    assert gpu["figures"]["external"] % ROUNDING == 0
    assert gpu["external"] == {"ollama": 6 * GIB}
    assert body["memory"]["schedulable"] == 64 * GIB  # room is rounded down: a peer is never promised more than there is
    near = {**node, "gpus": [{**node["gpus"][0], "figures": {"leased": 1100 * 2**20, "schedulable": 1100 * 2**20}}]}
    assert summarize(near, [])["gpus"][0]["figures"] == {"leased": 1088 * 2**20, "schedulable": 1088 * 2**20}
    near = {**node, "gpus": [{**node["gpus"][0], "figures": {"leased": 1120 * 2**20, "schedulable": 1120 * 2**20}}]}
    assert summarize(near, [])["gpus"][0]["figures"] == {"leased": 1152 * 2**20, "schedulable": 1088 * 2**20}
    assert body["leases"] == [
        {
            "id": "l-1",
            "holder": "train",
            "priority": "background",
            "gpus": [[0, GIB]],
            "epochs": [None, [None]],
            "preemption": None,
            "granted_at": None,
            "expires_at": "2026-11-30T10:00:00.000Z",
        }
    ]
    assert body["leases_not_listed"] == 0
    assert body["queue"] == {"background": 2}
    assert body["memory"]["total"] == 64 * GIB


def test_an_unchanged_document_is_made_again_after_ten_seconds_so_its_age_stays_bounded() -> None:
    publisher = Publisher(NODE, generation=1, public_key=raw(KEY))
    assert publisher.next({"leased": 1}, now=0.0) is not None
    assert publisher.next({"leased": 1}, now=9.9) is None
    again = publisher.next({"leased": 1}, now=10.0)
    assert again is not None
    assert again.order == (1, 2)


def test_a_leases_labels_are_listed_as_far_as_labels_room_holds_them_so_one_lease_cannot_crowd_out_the_others() -> None:
    node = {"node": {"id": NODE, "name": "tower", "version": "0.1.0"}, "gpus": [], "cpu": {}, "memory": {}, "queue": {}}
    lease = {"id": "l-1", "state": "granted", "holder": {"name": "train"}, "priority": "batch", "gpus": [], "epoch": 1,
             "preemption": "never", "granted_at": "2026-11-30T10:00:00.000Z", "expires_at": "2026-11-30T10:05:00.000Z"}  # fmt: skip
    small = {"project": "lora", "team": "vision"}
    big = {f"k{i:02d}": "v" * 256 for i in range(32)}  # the most a request may carry: 32 labels of 256 characters
    body = summarize(node, [{**lease, "labels": small}, {**lease, "id": "l-2", "labels": big}, {**lease, "id": "l-3", "labels": {}}])
    assert body["leases"][0]["labels"] == small
    cut = body["leases"][1]["labels"]
    assert 0 < len(cut) < len(big)
    assert list(cut) == sorted(big)[: len(cut)]  # the first keys, whole
    assert all(cut[key] == big[key] for key in cut)
    assert len(msgpack.packb(cut)) <= LABELS_ROOM + 8
    assert "labels" not in body["leases"][2]  # none, and no bytes spent saying so
    assert [listed["labels"] for listed in listed_leases(body, NODE)] == [small, cut, {}]


def test_a_listed_lease_names_its_card_by_the_index_the_driver_gives_that_card_now() -> None:
    gpu = {"index": 0, "uuid": "GPU-b", "name": "RTX 4090", "figures": {"total": 24 * GIB}, "processes": []}
    node = {"node": {"id": NODE, "name": "tower"}, "gpus": [gpu], "cpu": {}, "memory": {}, "queue": {}}
    lease = {"id": "l-1", "state": "granted", "holder": {"name": "train"}, "priority": "batch", "epoch": 1,
             "gpus": [{"index": 1, "uuid": "GPU-b", "bytes": GIB, "epoch": 1}], "expires_at": "2026-11-30T10:05:00.000Z"}  # fmt: skip
    body = summarize(node, [lease])
    assert body["leases"][0]["gpus"] == [[0, GIB]]  # granted as GPU 1; GPU-b is GPU 0 since the other card went
    assert listed_leases(body, NODE)[0]["gpus"][0]["uuid"] == "GPU-b"
    on_a = {**lease, "gpus": [{"index": 0, "uuid": "GPU-a", "bytes": GIB, "epoch": 1}]}
    assert summarize(node, [on_a])["leases"][0]["gpus"] == []  # GPU-a is gone, and its index is GPU-b's now: not shown on it
    on_c = {**lease, "gpus": [{"index": 3, "uuid": "GPU-c", "bytes": GIB, "epoch": 1}]}
    assert summarize(node, [on_c])["leases"][0]["gpus"] == [[3, GIB]]  # gone too, but no other card is GPU 3
    # Peers name that card by its UUID, from the GPUs the document says are missing.
    gone_c = {"index": 3, "uuid": "GPU-c", "name": "RTX 4090", "since": "2026-11-30T10:00:00.000Z", "leases": ["l-1"], "bytes": GIB}
    body = summarize({**node, "missing_gpus": [gone_c]}, [on_c, lease])
    assert [listed["gpus"][0]["uuid"] for listed in listed_leases(body, NODE)] == ["GPU-c", "GPU-b"]


def test_a_node_with_more_leases_than_a_document_holds_lists_what_fits_and_counts_the_rest() -> None:
    node = {"node": {"id": NODE, "name": "tower", "version": "0.1.0"}, "gpus": [], "cpu": {}, "memory": {}, "queue": {}}
    leases = [
        {"id": f"l-{i:012x}", "state": "granted", "holder": {"name": "h" * 64 + "é" * 192}, "priority": "background",
         "gpus": [{"index": 0, "bytes": GIB, "epoch": i}], "epoch": i, "preemption": "never",
         "granted_at": "2026-11-30T10:00:00.000Z", "expires_at": "2026-11-30T10:05:00.000Z"}
        for i in range(3000)
    ]  # fmt: skip
    body = summarize(node, leases)
    assert 0 < len(body["leases"]) < 3000
    assert len(body["leases"]) + body["leases_not_listed"] == 3000
    assert [r["id"] for r in body["leases"]] == [lease["id"] for lease in leases[: len(body["leases"])]]
    signed = sign_document(document(body=body), KEY.sign)
    assert open_document(signed, verify, node_id_of).body == body  # it fits MAX_DOCUMENT, so every peer takes it
    assert summarize(node, leases[:3])["leases_not_listed"] == 0


def test_a_gpu_that_leases_hold_and_the_driver_no_longer_lists_travels_in_the_document_so_peers_show_it() -> None:
    """As the node answers it, its bytes rounded, its time moved onto the reader's clock; as many GPUs and lease ids
    as MISSING_LISTED and MISSING_LEASES_LISTED hold, counting the leases left out, so the document stays bounded."""
    gone = {"index": 1, "uuid": "GPU-1", "name": "RTX 4090", "since": "2026-11-30T10:00:00.000Z", "leases": ["l-1"], "bytes": 4 * GIB + 5}
    node = {"node": {"id": NODE, "name": "tower"}, "gpus": [], "cpu": {}, "memory": {}, "queue": {}, "missing_gpus": [gone]}
    body = summarize(node, [])
    assert listed_missing(body) == [{**gone, "bytes": 4 * GIB, "leases_not_listed": 0}]
    assert listed_missing(body, shift=60.0)[0]["since"] == "2026-11-30T10:01:00.000Z"

    crowded = [{**gone, "uuid": f"GPU-{i}", "leases": [f"l-{j:012x}" for j in range(1000)]} for i in range(MISSING_LISTED + 5)]
    body = summarize({**node, "missing_gpus": crowded}, [])
    shown = listed_missing(body)
    assert [gpu["uuid"] for gpu in shown] == [f"GPU-{i}" for i in range(MISSING_LISTED)]
    assert all(len(gpu["leases"]) == MISSING_LEASES_LISTED and gpu["leases_not_listed"] == 1000 - MISSING_LEASES_LISTED for gpu in shown)
    assert open_document(sign_document(document(body=body), KEY.sign), verify, node_id_of).body == body


def test_a_document_without_missing_gpus_an_older_brokers_reads_as_none_and_an_entry_not_in_a_known_shape_is_left_out() -> None:
    node = {"node": {"id": NODE, "name": "tower"}, "gpus": [], "cpu": {}, "memory": {}, "queue": {}}
    older = summarize(node, [])
    del older["missing_gpus"]
    assert listed_missing(older) == []
    known = {"index": 1, "uuid": "GPU-1", "name": None, "since": "2026-11-30T10:00:00.000Z", "leases": ["l-1"], "bytes": GIB}
    odd = [{**known, "index": "1"}, {**known, "uuid": None}, {**known, "since": 5}, {**known, "leases": [1]}, {**known, "bytes": -1}, "x"]
    assert listed_missing({"missing_gpus": [known, *odd]}) == [{**known, "leases_not_listed": 0}]
    assert listed_missing({"missing_gpus": "x"}) == []
    # What a reader of the document knew before is read as before, the GPUs missing beside it.
    with_missing = summarize({**node, "missing_gpus": [known]}, [])
    assert (listed_unreadable(with_missing), listed_leases(with_missing, NODE)) == (listed_unreadable(older), listed_leases(older, NODE))
