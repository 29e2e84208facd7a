"""The orchestrator admits requests, routes each stage's outputs along the pipeline's edges,
hands the caller its deltas, and cancels. It never runs model code: routing happens on the
worker's callback under one short lock, so no request ever waits on another."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from omnistage.engine.types import StageInput, StageOutput
from omnistage.errors import RequestError
from omnistage.families.base import Pipeline
from omnistage.runtime.messages import OmniOutput, OmniRequest, StageMetrics
from omnistage.runtime.worker import OutputCallback, StageWorker

Sink = Callable[[OmniOutput], None]
WorkerFactory = Callable[[str, int, OutputCallback], StageWorker]


@dataclass
class _RequestState:
    request: OmniRequest
    sink: Sink
    stages: list[str]  # every stage this request runs
    pending_outputs: set[str]  # output stages not finished yet
    replica: dict[str, int] = field(default_factory=dict)  # stage -> replica serving it
    merged: dict[str, StageOutput] = field(default_factory=dict)  # src stage -> output so far (non-streamed edges)
    metrics: dict[str, StageMetrics] = field(default_factory=dict)


class Orchestrator:
    def __init__(self, pipeline: Pipeline, make_worker: WorkerFactory):
        self.pipeline = pipeline
        self.async_chunk = pipeline.deploy.async_chunk
        self.lock = threading.Lock()
        self.requests: dict[str, _RequestState] = {}
        self.edges_from = {s.name: [e for e in pipeline.edges if e.src == s.name] for s in pipeline.stages}
        self.outputs_of = {s.name: set(s.outputs) for s in pipeline.stages}
        self.workers: dict[str, list[StageWorker]] = {}
        self.load: dict[str, list[int]] = {}
        try:
            for spec in pipeline.stages:
                replicas = pipeline.stage_config(spec.name).replicas
                self.workers[spec.name] = [make_worker(spec.name, r, self._on_outputs) for r in range(replicas)]
                self.load[spec.name] = [0] * replicas
        except BaseException:
            self.shutdown()
            raise

    # ---- caller side ----------------------------------------------------------------------

    def submit(self, request: OmniRequest, sink: Sink) -> None:
        """Admit a request. Raises RequestError (before any work) if it cannot be served."""
        unsupported = set(request.output_modalities) - set(self.pipeline.output_modalities)
        if unsupported or not request.output_modalities:
            raise RequestError(
                f"this model cannot produce {sorted(unsupported) or 'nothing'}; it produces "
                f"{list(self.pipeline.output_modalities)}",
                "modalities",
            )
        entry_input = self.pipeline.preprocess(request)
        stages = self.pipeline.route(request.output_modalities)
        outputs = {s for s in stages if self.outputs_of[s] & set(request.output_modalities)}
        state = _RequestState(request, sink, stages, outputs)
        with self.lock:
            if request.request_id in self.requests:
                raise RequestError(f"request id {request.request_id!r} is already in flight", "request_id")
            self.requests[request.request_id] = state
            self._send(state, self.pipeline.entry, entry_input)

    def abort(self, request_id: str) -> None:
        with self.lock:
            state = self.requests.pop(request_id, None)
            if state is not None:
                self._release(state, abort=True)

    def health(self) -> tuple[bool, str]:
        dead = [s for s, ws in self.workers.items() if not any(w.is_alive() for w in ws)]
        return (not dead, f"no live replica for stage(s): {', '.join(dead)}" if dead else "ok")

    def stats(self) -> dict[str, dict]:
        out: dict[str, dict] = {}
        for stage, workers in self.workers.items():
            per_replica = [w.stats() for w in workers]
            out[stage] = {k: sum(r.get(k, 0) for r in per_replica) for k in set().union(*per_replica)}
        return out

    def shutdown(self) -> None:
        for workers in self.workers.values():
            for worker in workers:
                worker.shutdown()

    # ---- routing --------------------------------------------------------------------------

    def _send(self, state: _RequestState, stage: str, inp: StageInput) -> None:
        if stage in state.replica:
            self.workers[stage][state.replica[stage]].add_input_chunk(inp.request_id, inp)
            return
        loads = self.load[stage]
        replica = min(range(len(loads)), key=loads.__getitem__)  # least outstanding requests
        loads[replica] += 1
        state.replica[stage] = replica
        state.metrics[stage] = StageMetrics(stage)
        self.workers[stage][replica].add_request(inp)

    def _release(self, state: _RequestState, abort: bool) -> None:
        for stage, replica in state.replica.items():
            self.load[stage][replica] -= 1
            if abort:
                self.workers[stage][replica].abort(state.request.request_id)

    def _on_outputs(self, stage: str, replica: int, outputs: list[StageOutput]) -> None:
        with self.lock:
            for out in outputs:
                state = self.requests.get(out.request_id)
                if state is not None and state.replica.get(stage) == replica:
                    self._route(state, stage, out)

    def _route(self, state: _RequestState, stage: str, out: StageOutput) -> None:
        metrics = state.metrics[stage]
        now = time.monotonic()
        metrics.first_output_time = metrics.first_output_time or now
        metrics.num_prompt_tokens = out.num_prompt_tokens
        metrics.num_cached_tokens = out.num_cached_tokens
        metrics.num_output_tokens = out.num_output_tokens
        if out.finished:
            metrics.finish_time = now
        if out.error is not None:
            self._finish(state, OmniOutput(
                request_id=out.request_id, finished=True, finish_reason="error", error=out.error,
                error_status=out.error_status,
            ), abort=True)
            return

        for edge in self.edges_from[stage]:
            if edge.dst not in state.stages:
                continue
            if self.async_chunk:
                inp = edge.handoff(state.request, out)
            else:
                merged = state.merged.setdefault(stage, StageOutput(out.request_id, stage)).merge(out)
                inp = edge.handoff(state.request, merged) if out.finished else None
            if inp is not None:
                self._send(state, edge.dst, inp)

        if stage in state.pending_outputs:
            delta = self.pipeline.to_output(stage, out)
            if out.finished:
                state.pending_outputs.discard(stage)
                delta.finish_reason = out.finish_reason
            if not state.pending_outputs:
                self._finish(state, delta, abort=False)
            else:
                state.sink(delta)

    def _finish(self, state: _RequestState, last: OmniOutput, abort: bool) -> None:
        del self.requests[state.request.request_id]
        self._release(state, abort)
        last.finished = True
        last.metrics = state.metrics
        state.sink(last)
