"""GET /metrics: the runtime's Prometheus metrics (omnistage.runtime.metrics), text format."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from omnistage.runtime.metrics import CONTENT_TYPE_LATEST, make_registry, render

router = APIRouter()


@router.get("/metrics", include_in_schema=False)
def metrics(request: Request) -> Response:
    state = request.app.state
    if getattr(state, "metrics_registry", None) is None:
        state.metrics_registry = make_registry(getattr(state.engine, "orchestrator", None))
    return Response(render(state.metrics_registry), media_type=CONTENT_TYPE_LATEST)
