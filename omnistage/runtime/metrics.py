"""Prometheus metrics of the runtime, read at scrape time from the orchestrator's per-replica
stats: the engine loops and links only bump plain counters, and a scrape costs nothing when
nobody scrapes.

Per stage and replica: up, restarts, queue depth, running and outstanding requests, KV blocks,
step time and batch size (summaries: count = steps), the engine loop's time outside steps (applying
arriving inputs, routing outputs on), and payload transfers to and from the
stage (bytes, count, seconds spent encoding/putting and getting/decoding on both ends).
Per server: requests in flight and finished, by outcome and status; prompt, cached-prompt and generated token
counts; latency histograms (time to first token, time per output token, end to end, time to first audio) and
each stage's time to its first output (queueing plus prefill), recorded as requests finish (`RequestStats`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)
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


_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)


class _Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.bounds, self.counts, self.sum = buckets, [0] * (len(buckets) + 1), 0.0

    def observe(self, value: float) -> None:
        self.counts[next((i for i, b in enumerate(self.bounds) if value <= b), len(self.bounds))] += 1
        self.sum += value

    def buckets(self) -> list[tuple[str, int]]:
        total, out = 0, []
        for bound, count in zip((*map(str, self.bounds), "+Inf"), self.counts, strict=True):
            total += count
            out.append((bound, total))
        return out


class RequestStats:
    """Per-request figures, recorded once as each request finishes (the orchestrator calls `observe`)."""

    HISTOGRAMS = {  # name -> (help, buckets)
        "time_to_first_token_seconds": ("Arrival to the first text token", _LATENCY_BUCKETS),
        "time_per_output_token_seconds": ("Mean time between text tokens after the first", _TPOT_BUCKETS),
        "e2e_request_latency_seconds": ("Arrival to the last output", _LATENCY_BUCKETS),
        "time_to_first_audio_seconds": ("Arrival to the first audio (speech replies)", _LATENCY_BUCKETS),
    }

    def __init__(self, text_stages: set[str], audio_stages: set[str]) -> None:
        self.text_stages, self.audio_stages = text_stages, audio_stages
        self.lock = threading.Lock()
        self.hist = {name: _Histogram(buckets) for name, (_, buckets) in self.HISTOGRAMS.items()}
        self.stage_first = {}  # stage -> histogram of its time to first output
        self.tokens = {"prompt": 0, "cached_prompt": 0, "generation": 0}
        self.status: dict[str, int] = {}

    def observe(self, arrival: float, metrics: dict[str, Any], status: str, now: float) -> None:
        """`metrics`: the request's StageMetrics by stage; `status`: "ok", an HTTP status, or "abort"."""
        with self.lock:
            self.status[status] = self.status.get(status, 0) + 1
            self.hist["e2e_request_latency_seconds"].observe(now - arrival)
            for stage, m in metrics.items():
                if m.first_output_time is None:
                    continue
                first = self.stage_first.setdefault(stage, _Histogram(_LATENCY_BUCKETS))
                first.observe(m.first_output_time - m.start_time)
                if stage in self.text_stages:
                    self.tokens["prompt"] += m.num_prompt_tokens
                    self.tokens["cached_prompt"] += m.num_cached_tokens
                    self.tokens["generation"] += m.num_output_tokens
                    self.hist["time_to_first_token_seconds"].observe(m.first_output_time - arrival)
                    if m.finish_time is not None and m.num_output_tokens > 1:
                        tpot = (m.finish_time - m.first_output_time) / (m.num_output_tokens - 1)
                        self.hist["time_per_output_token_seconds"].observe(tpot)
                if stage in self.audio_stages:
                    self.hist["time_to_first_audio_seconds"].observe(m.first_output_time - arrival)

    def collect(self) -> Iterator[Metric]:
        with self.lock:
            for name, (doc, _) in self.HISTOGRAMS.items():
                family = HistogramMetricFamily(f"omnistage_{name}", doc)
                family.add_metric([], self.hist[name].buckets(), self.hist[name].sum)
                yield family
            first = HistogramMetricFamily("omnistage_stage_time_to_first_output_seconds", "A stage's time from "
                                          "receiving a request to its first output (queueing plus prefill)",
                                          labels=["stage"])
            for stage, hist in self.stage_first.items():
                first.add_metric([stage], hist.buckets(), hist.sum)
            yield first
            for kind, doc in (("prompt", "Prompt tokens of finished requests"),
                              ("cached_prompt", "Prompt tokens served from the prefix cache"),
                              ("generation", "Text tokens generated")):
                counter = CounterMetricFamily(f"omnistage_{kind}_tokens", doc)
                counter.add_metric([], self.tokens[kind])
                yield counter
            outcome = CounterMetricFamily("omnistage_requests_by_status", "Finished requests by outcome: ok, an "
                                          "error's HTTP status, or abort", labels=["status"])
            for status, count in sorted(self.status.items()):
                outcome.add_metric([status], count)
            yield outcome


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
        preemptions = CounterMetricFamily("omnistage_stage_preemptions", "Requests preempted (KV cache full) and "
                                          "recomputed later (AR stages)", labels=_LABELS)
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
            if "num_preemptions" in s:
                preemptions.add_metric([stage, r], s["num_preemptions"])
            for part in ("command", "report"):
                if f"{part}_seconds" in s:
                    loop.add_metric([stage, r, part], s[f"{part}_seconds"])
            steps.add_metric([stage, r], s.get("steps", 0), s.get("step_seconds", 0.0))
            batch.add_metric([stage, r], s.get("steps", 0), s.get("step_outputs", 0))
            for d, peer in (("in", "in_recv_seconds"), ("out", "out_recv_seconds")):
                if f"{d}_transfers" in s:  # out-of-process replicas only
                    xfer_bytes.add_metric([stage, r, d], s[f"{d}_bytes"])
                    xfer_time.add_metric([stage, r, d], s[f"{d}_transfers"], s[f"{d}_seconds"] + s.get(peer, 0.0))
        yield from (restarts, preemptions, steps, batch, loop, xfer_bytes, xfer_time)
        in_flight = GaugeMetricFamily("omnistage_requests_in_flight", "Requests admitted and not finished")
        in_flight.add_metric([], len(self.orchestrator.requests))
        yield in_flight
        finished = CounterMetricFamily("omnistage_requests_finished", "Finished requests", labels=["outcome"])
        for outcome in ("ok", "error", "abort"):
            finished.add_metric([outcome], self.orchestrator.finished[outcome])
        yield finished
        stats = getattr(self.orchestrator, "request_stats", None)
        if stats is not None:
            yield from stats.collect()


class StatsLogger:
    """A line in the log every `interval_s` while the server is busy: per stage, requests running / waiting and KV
    cache use, generated tokens a second, and requests in flight. Quiet while idle."""

    def __init__(self, orchestrator: Any, interval_s: float) -> None:
        self.orchestrator, self.interval_s = orchestrator, interval_s
        self.stop = threading.Event()
        self.last_tokens: dict[str, int] = {}
        self.last_time = time.monotonic()
        self.thread = threading.Thread(target=self._run, name="omnistage-stats", daemon=True)
        if interval_s > 0:
            self.thread.start()

    def line(self) -> str | None:
        stats, parts, new_tokens = self.orchestrator.stats(), [], 0
        now, busy = time.monotonic(), bool(self.orchestrator.requests)
        for stage, s in stats.items():
            part = f"{stage} {s.get('num_running', 0)} running {s.get('num_waiting', 0)} waiting"
            if s.get("kv_blocks_total"):
                part += f" KV {100 * s['kv_blocks_used'] / s['kv_blocks_total']:.0f}%"
            parts.append(part)
            tokens = s.get("num_output_tokens", 0)
            new_tokens += tokens - self.last_tokens.get(stage, 0)
            self.last_tokens[stage] = tokens
        rate, self.last_time = new_tokens / max(now - self.last_time, 1e-6), now
        if not (busy or new_tokens):
            return None
        return f"{len(self.orchestrator.requests)} in flight, {rate:.0f} tokens/s | " + " | ".join(parts)

    def _run(self) -> None:
        while not self.stop.wait(self.interval_s):
            try:
                if (line := self.line()) is not None:
                    logging.getLogger("omnistage.stats").info(line)
            except Exception:  # a stage being restarted, say: the next interval tries again
                logging.getLogger("omnistage.stats").debug("stats line failed", exc_info=True)


def make_registry(orchestrator: Any | None) -> CollectorRegistry:
    """A registry of its own (not the process-global one), so several servers can live in one process."""
    registry = CollectorRegistry(auto_describe=False)
    if orchestrator is not None:
        registry.register(RuntimeCollector(orchestrator))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
