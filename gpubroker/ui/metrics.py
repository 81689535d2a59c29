"""Prometheus metrics, `gpubroker_*`, joinable to dcgm-exporter on the GPU UUID."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from gpubroker.broker.budget import FIGURES
from gpubroker.broker.service import Broker
from gpubroker.config import CLASSES


class _BrokerCollector(Collector):
    """Figures, leases and queues read from the broker at scrape time, never stored twice."""

    def __init__(self, broker: Broker) -> None:
        self._broker = broker

    def collect(self) -> Iterator[GaugeMetricFamily]:
        broker = self._broker
        figures = {
            name: GaugeMetricFamily(
                f"gpubroker_gpu_{name}_bytes", f"the {name} figure of each GPU (SPEC §2)", labels=["uuid", "index", "name"]
            )
            for name in FIGURES
        }
        unattributed = GaugeMetricFamily(
            "gpubroker_gpu_unattributed_bytes", "external memory that no process list explains", labels=["uuid", "index", "name"]
        )
        pressure = GaugeMetricFamily(
            "gpubroker_gpu_external_pressure",
            "1 while external usage has grown into leased or reserved memory",
            labels=["uuid", "index", "name"],
        )
        over = GaugeMetricFamily(
            "gpubroker_leases_over_declared", "live leases using more than 110% of what they declared", labels=["uuid"]
        )
        for budget in broker.budgets():
            labels = [budget.reading.uuid, str(budget.reading.index), budget.reading.name]
            for name in FIGURES:
                figures[name].add_metric(labels, getattr(budget.figures, name))
            if budget.unattributed is not None:
                unattributed.add_metric(labels, budget.unattributed)
            pressure.add_metric(labels, 1.0 if budget.pressure else 0.0)
            over.add_metric([budget.reading.uuid], sum(1 for lease in budget.leases if lease.id in broker.over_declared_ids))
        yield from figures.values()
        yield unattributed
        yield pressure
        yield over
        leases = GaugeMetricFamily("gpubroker_leases", "leases by state and class", labels=["state", "priority"])
        counts: dict[tuple[str, str], int] = {(s, c): 0 for s in ("queued", "granted") for c in CLASSES}
        for lease in broker.leases.values():
            counts["granted", lease.priority] += 1
        for waiter in broker.waiters:
            counts["queued", waiter.request.priority] += 1
        for (state, priority), count in counts.items():
            leases.add_metric([state, priority], count)
        yield leases
        depth = GaugeMetricFamily("gpubroker_queue_depth", "requests waiting, by class", labels=["priority"])
        for priority in CLASSES:
            depth.add_metric([priority], counts["queued", priority])
        yield depth
        up = GaugeMetricFamily("gpubroker_driver_ok", "1 when the GPUs can be read")
        up.add_metric([], 0.0 if broker.driver_error else 1.0)
        yield up


class Metrics:
    def __init__(self, broker: Broker) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_BrokerCollector(broker))
        self.decisions = Counter(
            "gpubroker_requests", "lease requests by result code (GRANTED or a failure code)", ["code"], registry=self.registry
        )
        self.latency = Histogram(
            "gpubroker_grant_latency_seconds",
            "time from request to durable grant",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0, 30.0),
            registry=self.registry,
        )
        broker.stats.on_decision = self._observe

    def _observe(self, code: str, seconds: float) -> None:
        self.decisions.labels(code).inc()
        if code == "GRANTED":
            self.latency.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
