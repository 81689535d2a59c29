"""Prometheus metrics, `gpubroker_*`, joinable to dcgm-exporter on the GPU UUID."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from gpubroker.broker.budget import FIGURES, over_declared
from gpubroker.broker.service import LATENCY_BUCKETS, Broker
from gpubroker.config import CLASSES

# What each of the seven figures is, for a reader of the series who has no SPEC at hand.
FIGURE_HELP = {
    "total": "bytes of memory the GPU has",
    "observed": "bytes in use on the GPU now as the driver reports them, every process's",
    "external": "bytes in use that no lease or resident accounts for (observed less theirs), driver and context memory included",
    "resident": "bytes held by resident model servers",
    "leased": "bytes held for live leases: each lease's declared bytes, or what its processes use when that is more",
    "reserve": "bytes kept free as the safety margin",
    "schedulable": "bytes a new lease can be granted: total less external, resident, leased and reserve, at least 0",
}


class _BrokerCollector(Collector):
    """Figures, leases and queues read from the broker at scrape time, never stored twice."""

    def __init__(self, broker: Broker) -> None:
        self._broker = broker

    def collect(self) -> Iterator[Metric]:
        broker = self._broker

        def per_gpu(name: str, documentation: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, documentation, labels=["uuid", "index", "name"])

        figures = {name: per_gpu(f"gpubroker_gpu_{name}_bytes", FIGURE_HELP[name]) for name in FIGURES}
        unattributed = per_gpu(
            "gpubroker_gpu_unattributed_bytes",
            "bytes of the external memory that no process list explains (absent while a listed process's use is unknown)",
        )
        pressure = per_gpu("gpubroker_gpu_external_pressure", "1 while external usage has grown into leased or reserved memory")
        observed_at = per_gpu(
            "gpubroker_gpu_observed_timestamp_seconds", "when the reading the figures come from was taken, in Unix seconds"
        )
        stale = per_gpu("gpubroker_gpu_stale", "1 while the reading is older than staleness: no decision is made on it")
        over = GaugeMetricFamily(
            "gpubroker_leases_over_declared", "live leases using more than 110% of what they declared", labels=["uuid"]
        )
        now = broker.readings_now()
        for budget in broker.budgets():
            labels = [budget.reading.uuid, str(budget.reading.index), budget.reading.name]
            for name in FIGURES:
                figures[name].add_metric(labels, getattr(budget.figures, name))
            observed_at.add_metric(labels, budget.reading.observed_at)
            stale.add_metric(labels, 1.0 if broker.is_stale(budget, now) else 0.0)
            if budget.unattributed is not None:
                unattributed.add_metric(labels, budget.unattributed)
            pressure.add_metric(labels, 1.0 if budget.pressure else 0.0)
            # From this reading, GPU by GPU: the leases ever reported were counted on each of their GPUs, and until released.
            over.add_metric([budget.reading.uuid], len(over_declared(budget)))
        yield from figures.values()
        yield observed_at
        yield stale
        yield unattributed
        yield pressure
        yield over
        leases = GaugeMetricFamily(
            "gpubroker_leases",
            "granted leases (state granted) and requests waiting for one (state queued), by priority class",
            labels=["state", "priority"],
        )
        counts: dict[tuple[str, str], int] = {(s, c): 0 for s in ("queued", "granted") for c in CLASSES}
        for lease in broker.leases.values():
            if lease.live:  # not one whose release is on its way to disk
                counts["granted", lease.priority] += 1
        for waiter in broker.waiters:
            counts["queued", waiter.request.priority] += 1
        for (state, priority), count in counts.items():
            leases.add_metric([state, priority], count)
        yield leases
        depth = GaugeMetricFamily("gpubroker_queue_depth", "requests waiting for a lease, by priority class", labels=["priority"])
        for priority in CLASSES:
            depth.add_metric([priority], counts["queued", priority])
        yield depth
        up = GaugeMetricFamily("gpubroker_driver_ok", "1 when the GPUs can be read")
        up.add_metric([], 0.0 if broker.driver_error else 1.0)
        yield up
        unreadable = GaugeMetricFamily(
            "gpubroker_gpu_unreadable", "1 for each GPU the driver lists but cannot read (not offered)", labels=["uuid", "index"]
        )
        for gpu in broker.unreadable_json():
            unreadable.add_metric([gpu["uuid"] or "", str(gpu["index"])], 1.0)
        yield unreadable
        missing = GaugeMetricFamily(
            "gpubroker_gpu_missing",
            "1 for each GPU that leases hold and the driver no longer lists (not offered), by its last index",
            labels=["uuid", "index"],
        )
        for gpu in broker.missing_json():
            missing.add_metric([gpu["uuid"], str(gpu["index"])], 1.0)
        yield missing
        store = CounterMetricFamily(
            "gpubroker_store_write_failures",
            "transactions the state store could not write (full, or a disk fault), since the broker started",
        )
        store.add_metric([], broker.store.failures)
        yield store
        stats = broker.stats
        requests = CounterMetricFamily(
            "gpubroker_requests",
            "lease requests answered, by result code (GRANTED or a failure code), since the broker started",
            labels=["code"],
        )
        for code, count in sorted(stats.results.items()):
            requests.add_metric([code], count)
        yield requests
        cumulative, buckets = 0, []
        for bound, count in zip((*LATENCY_BUCKETS, float("inf")), stats.grant_buckets, strict=True):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else str(bound), cumulative))
        latency = HistogramMetricFamily(
            "gpubroker_grant_latency_seconds",
            "seconds from a lease request to its durable grant, its wait in the queue included, since the broker started",
        )
        latency.add_metric([], buckets, sum_value=stats.grant_seconds)
        yield latency


class Metrics:
    def __init__(self, broker: Broker) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_BrokerCollector(broker))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def negotiate(self, accept: str) -> tuple[bytes, str]:
        """The exposition and its Content-Type for an Accept header, as prometheus_client's own handlers answer:
        OpenMetrics to a scraper that asks for it (Prometheus does, first), else the text format with its version."""
        encode, content_type = choose_encoder(accept)
        return encode(self.registry), content_type
