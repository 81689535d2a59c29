from dataclasses import asdict

from gpubroker.broker.lease import Holder, Lease, LeasedGpu, hash_token


def test_a_lease_record_keeps_every_field_and_reads_back_equal() -> None:
    lease = Lease(
        id="l-1", node="n-1", state="granted", epoch=7, priority="background", preemption="drain", bind="caller",
        holder=Holder("train", 42, 1000, 123.5), gpus=[LeasedGpu(0, "GPU-0", 2**30, 3)], exclusive=False,
        cpu_cores=2, memory=2**20, labels={"a": "b"}, token_hash=hash_token("t"), requested_at=1.0,
        granted_at=2.0, expires_at=3.0, ttl=1.0, pgids=[42], pgid_uids=[1000], pgid_started=[120.25],
    )  # fmt: skip
    record = lease.to_record()
    assert record == asdict(lease)
    assert Lease.from_record(record) == lease
    assert lease.token_matches("t")
    assert not lease.token_matches("u")
    assert not lease.token_matches(None)


def test_a_record_from_a_newer_broker_reads_as_far_as_this_one_knows_it() -> None:
    lease = Lease(
        id="l-1", node="n-1", state="granted", epoch=7, priority="background", preemption="never", bind="none",
        holder=Holder("train"), gpus=[LeasedGpu(0, "GPU-0", 2**30, 3)], exclusive=False, cpu_cores=0, memory=0,
        labels={}, token_hash=hash_token("t"), requested_at=1.0, granted_at=2.0, expires_at=3.0, ttl=1.0,
    )  # fmt: skip
    record = lease.to_record()
    newer = {**record, "affinity": "numa0", "holder": {**record["holder"], "cgroup": "/x"}, "gpus": [{**record["gpus"][0], "mig": 1}]}
    assert Lease.from_record(newer) == lease  # after a downgrade, its leases are kept, not the store called damaged


def test_a_record_from_an_earlier_broker_reads_its_groups_as_known_by_their_ids_alone() -> None:
    """Groups registered before their leaders' start times were kept: each goes by its id, as it did then."""
    lease = Lease(
        id="l-1", node="n-1", state="granted", epoch=7, priority="background", preemption="never", bind="none",
        holder=Holder("train"), gpus=[LeasedGpu(0, "GPU-0", 2**30, 3)], exclusive=False, cpu_cores=0, memory=0,
        labels={}, token_hash=hash_token("t"), requested_at=1.0, granted_at=2.0, expires_at=3.0, ttl=1.0,
        pgids=[42, 43], pgid_uids=[1000, 1000],
    )  # fmt: skip
    record = lease.to_record()
    del record["pgid_started"]
    earlier = Lease.from_record(record)
    assert (earlier.pgids, earlier.groups_started()) == ([42, 43], [None, None])
