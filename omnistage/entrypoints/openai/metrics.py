"""GET /metrics: the runtime's Prometheus metrics (omnistage.runtime.metrics) and the HTTP edge's own
(admission: its limit, what is admitted, what was refused), text format."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from omnistage.runtime.metrics import CONTENT_TYPE_LATEST, make_registry, render

router = APIRouter()
REFUSALS = ("overloaded", "unavailable", "loading", "draining")


class EdgeCollector(Collector):
    """Read at scrape time from the server's `Edge` (server.py)."""

    def __init__(self, edge: Any) -> None:
        self.edge = edge

    def collect(self) -> Iterator[Metric]:
        limit = GaugeMetricFamily("omnistage_server_max_queued_requests",
                                  "Generations (prompts x n) the server admits at once; beyond it requests get 429")
        limit.add_metric([], self.edge.max_queued)
        admitted = GaugeMetricFamily("omnistage_server_requests_admitted",
                                     "Generations (prompts x n) admitted by the HTTP server and not finished")
        admitted.add_metric([], self.edge.in_flight)
        refused = CounterMetricFamily("omnistage_server_requests_refused",
                                      "Requests refused before any work (429 overloaded, 503 otherwise)",
                                      labels=["reason"])
        for reason in REFUSALS:
            refused.add_metric([reason], self.edge.rejected[reason])
        yield from (limit, admitted, refused)


@router.get("/metrics", include_in_schema=False)
def metrics(request: Request) -> Response:
    state = request.app.state
    registry = getattr(state, "metrics_registry", None)
    if registry is None:
        registry = make_registry(getattr(state.engine, "orchestrator", None))
        registry.register(EdgeCollector(state.edge))
        if state.engine is not None:  # kept once the runtime's metrics are in it
            state.metrics_registry = registry
    return Response(render(registry), media_type=CONTENT_TYPE_LATEST)
