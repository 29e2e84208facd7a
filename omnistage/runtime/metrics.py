"""Prometheus metrics of the runtime, read at scrape time from the orchestrator's per-replica
stats: the engine loops and links only bump plain counters, and a scrape costs nothing when
nobody scrapes.

Per stage and replica: up, restarts, queue depth, running and outstanding requests, KV blocks,
step time and batch size (summaries: count = steps), the engine loop's time outside steps (applying
arriving inputs, routing outputs on), and payload transfers to and from the
stage (bytes, count, seconds spent encoding/putting and getting/decoding on both ends).
Per server: requests in flight and finished, by outcome.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily
from prometheus_client.registry import Collector

__all__ = ["CONTENT_TYPE_LATEST", "RuntimeCollector", "make_registry", "render"]

_LABELS = ["stage", "replica"]
_GAUGES = [  # (metric, stats key, help)
    ("omnistage_stage_up", "alive", "1 if the replica is running and ready"),
    ("omnistage_stage_queue_depth", "num_waiting", "Requests waiting in the engine's queue"),
    ("omnistage_stage_running", "num_running", "Requests the engine is running"),
    ("omnistage_stage_outstanding", "outstanding", "Requests routed to the replica and not finished"),
    ("omnistage_stage_kv_blocks_used", "kv_blocks_used", "KV cache blocks in use (AR stages)"),
    ("omnistage_stage_kv_blocks_total", "kv_blocks_total", "KV cache blocks (AR stages)"),
]


class RuntimeCollector(Collector):
    def __init__(self, orchestrator: Any):
        self.orchestrator = orchestrator

    def collect(self) -> Iterator[Metric]:
        replicas = [(stage, str(r), s) for stage, per in self.orchestrator.replica_stats().items()
                    for r, s in enumerate(per)]
        for name, key, doc in _GAUGES:
            gauge = GaugeMetricFamily(name, doc, labels=_LABELS)
            for stage, r, s in replicas:
                if key in s:
                    gauge.add_metric([stage, r], s[key])
            yield gauge
        restarts = CounterMetricFamily("omnistage_stage_restarts", "Restarts of the replica", labels=_LABELS)
        steps = SummaryMetricFamily("omnistage_stage_step_seconds", "Engine step time", labels=_LABELS)
        batch = SummaryMetricFamily("omnistage_stage_batch_size", "Requests with output per engine step",
                                    labels=_LABELS)
        labels = [*_LABELS, "direction"]
        xfer_bytes = CounterMetricFamily("omnistage_stage_transfer_bytes", "Payload bytes moved", labels=labels)
        xfer_time = SummaryMetricFamily("omnistage_stage_transfer_seconds",
                                        "Time per payload transfer (both ends)", labels=labels)
        loop = CounterMetricFamily("omnistage_stage_loop_seconds", "Engine loop time outside steps: applying "
                                   "arriving inputs (commands) and routing outputs on (report)",
                                   labels=[*_LABELS, "part"])
        for stage, r, s in replicas:
            restarts.add_metric([stage, r], s.get("restarts", 0))
            for part in ("command", "report"):
                if f"{part}_seconds" in s:
                    loop.add_metric([stage, r, part], s[f"{part}_seconds"])
            steps.add_metric([stage, r], s.get("steps", 0), s.get("step_seconds", 0.0))
            batch.add_metric([stage, r], s.get("steps", 0), s.get("step_outputs", 0))
            for d, peer in (("in", "in_recv_seconds"), ("out", "out_recv_seconds")):
                if f"{d}_transfers" in s:  # out-of-process replicas only
                    xfer_bytes.add_metric([stage, r, d], s[f"{d}_bytes"])
                    xfer_time.add_metric([stage, r, d], s[f"{d}_transfers"], s[f"{d}_seconds"] + s.get(peer, 0.0))
        yield from (restarts, steps, batch, loop, xfer_bytes, xfer_time)
        in_flight = GaugeMetricFamily("omnistage_requests_in_flight", "Requests admitted and not finished")
        in_flight.add_metric([], len(self.orchestrator.requests))
        yield in_flight
        finished = CounterMetricFamily("omnistage_requests_finished", "Finished requests", labels=["outcome"])
        for outcome in ("ok", "error", "abort"):
            finished.add_metric([outcome], self.orchestrator.finished[outcome])
        yield finished


def make_registry(orchestrator: Any | None) -> CollectorRegistry:
    """A registry of its own (not the process-global one), so several servers can live in one process."""
    registry = CollectorRegistry(auto_describe=False)
    if orchestrator is not None:
        registry.register(RuntimeCollector(orchestrator))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
