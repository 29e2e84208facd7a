"""The orchestrator admits requests, routes each stage's outputs along the pipeline's edges,
hands the caller its deltas, and cancels. It never runs model code: routing happens on the
worker's callback under one short lock, so no request ever waits on another.

It also keeps the replicas: a new request goes to the live replica with the fewest outstanding
requests, and stays there for all its chunks. A replica that dies has failed its own requests
already (worker.py); the orchestrator restarts it (up to `max_restarts`, or on `restart_replica`).
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from omnistage import envs
from omnistage.config.deploy import did_you_mean
from omnistage.errors import OmniError, RequestError, StageError, stage_failure
from omnistage.families.base import Pipeline
from omnistage.runtime.metrics import RequestStats, StatsLogger
from omnistage.runtime.worker import AddChunk, AddRequest, ExitCallback, OutputCallback, StageWorker
from omnistage.sampling_params import InvalidParams, SamplingParams
from omnistage.types import OmniOutput, OmniRequest, StageInput, StageMetrics, StageOutput

logger = logging.getLogger(__name__)
Sink = Callable[[OmniOutput], None]
WorkerFactory = Callable[[str, int, OutputCallback, ExitCallback], StageWorker]


@dataclass
class _RequestState:
    request: OmniRequest
    sink: Sink
    stages: list[str]  # every stage this request runs
    pending_outputs: set[str]  # output stages not finished yet
    replica: dict[str, int] = field(default_factory=dict)  # stage -> replica serving it
    merged: dict[str, StageOutput] = field(default_factory=dict)  # src stage -> output so far (non-streamed edges)
    metrics: dict[str, StageMetrics] = field(default_factory=dict)
    text_finish_reason: str | None = None  # why the text ended: what the caller's finish_reason reports


class Orchestrator:
    def __init__(self, pipeline: Pipeline, make_worker: WorkerFactory,
                 on_shutdown: Callable[[], None] | None = None):
        """`on_shutdown` runs once every worker has stopped (e.g. to give back a Ray placement group)."""
        self.pipeline = pipeline
        self.on_shutdown = on_shutdown
        self.async_chunk = pipeline.deploy.async_chunk
        self.lock = threading.Lock()
        self.requests: dict[str, _RequestState] = {}
        self.edges_from = {s.name: [e for e in pipeline.edges if e.src == s.name] for s in pipeline.stages}
        self.text_stages = {s.name for s in pipeline.stages if "text" in s.outputs}
        self.outputs_of = {s.name: set(s.outputs) for s in pipeline.stages}
        self.request_stats = RequestStats(self.text_stages, {s.name for s in pipeline.stages if "audio" in s.outputs})
        self.make_worker = make_worker
        self.workers: dict[str, list[StageWorker]] = {}
        self.load: dict[str, list[int]] = {}
        self.restarts: Counter[tuple[str, int]] = Counter()
        self.finished: Counter[str] = Counter()  # requests by outcome: "ok", "error", "abort"
        self.closed = False
        # sends of the step being routed (_send)
        self._outbox: dict[StageWorker, list[AddRequest | AddChunk]] | None = None
        self._restarting = threading.RLock()  # one restart at a time
        try:
            for spec in pipeline.stages:
                replicas = pipeline.stage_config(spec.name).replicas
                self.workers[spec.name] = [self._new_worker(spec.name, r) for r in range(replicas)]
                self.load[spec.name] = [0] * replicas
            deadline = time.monotonic() + pipeline.deploy.startup_timeout_s
            for workers in self.workers.values():  # they all load at once; wait for each
                for worker in workers:
                    worker.wait_ready(max(deadline - time.monotonic(), 0.0))
            # What exists now (models, tokenizers, graphs) lives as long as the server: out of the cyclic
            # collector's scans, a full collection while serving pauses every stage's thread for less.
            gc.collect()
            gc.freeze()
            self.stats_logger = StatsLogger(self, envs.LOG_STATS_INTERVAL_S.get())
        except BaseException:
            self.shutdown()
            raise

    def _new_worker(self, stage: str, replica: int) -> StageWorker:
        return self.make_worker(stage, replica, self._on_outputs, self._on_exit)

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
        self._check_stage_params(request)
        entry_input = self.pipeline.preprocess(request)
        stages = self.pipeline.route(request.output_modalities)
        outputs = {s for s in stages if self.outputs_of[s] & set(request.output_modalities)}
        state = _RequestState(request, sink, stages, outputs)
        with self.lock:
            if request.request_id in self.requests:
                raise RequestError(f"request id {request.request_id!r} is already in flight", "request_id")
            self._send(state, self.pipeline.entry, entry_input)  # StageError (503) if no replica is up
            self.requests[request.request_id] = state

    def _check_stage_params(self, request: OmniRequest) -> None:
        """Per-stage params must name a stage of this pipeline ('*': the entry stage) and be valid SamplingParams
        (checked again: a caller may have changed them since they were built), their token ids in the stage's
        vocabulary."""
        names = [s.name for s in self.pipeline.stages]
        for name, params in request.stage_params.items():
            where = f"stage_params[{name!r}]"
            if name != "*" and name not in names:
                raise RequestError(f"{where}: this model has no stage {name!r} (its stages: {', '.join(names)}; "
                                   f"'*' means the entry stage){did_you_mean(name, names)}", "stage_params")
            if not isinstance(params, SamplingParams):
                raise RequestError(f"{where} must be a SamplingParams, not {type(params).__name__}", "stage_params")
            try:
                params.validate()
                if (vocab := self.vocab_size(name)) is not None:
                    params.check_token_ids(vocab)
            except InvalidParams as exc:
                raise exc.at(where) from None

    def vocab_size(self, stage: str) -> int | None:
        """The vocabulary of `stage` ('*': the entry stage), as its engine reported it (AR stages); else None."""
        workers = self.workers.get(self.pipeline.entry if stage == "*" else stage, [])
        return next((w.vocab_size for w in workers if getattr(w, "vocab_size", None)), None)

    def abort(self, request_id: str) -> None:
        with self.lock:
            state = self.requests.pop(request_id, None)
            if state is not None:
                self.finished["abort"] += 1
                self.request_stats.observe(state.request.arrival_time, state.metrics, "abort", time.monotonic())
                self._release(state, abort=True)

    def health(self) -> tuple[bool, str]:
        dead = [s for s, ws in self.workers.items() if not any(w.is_alive() for w in ws)]
        return (not dead, f"no live replica for stage(s): {', '.join(dead)}" if dead else "ok")

    def stats(self) -> dict[str, dict]:
        """Per stage, its replicas' engine and loop counters summed."""
        out: dict[str, dict] = {}
        for stage, per_replica in self.replica_stats().items():
            out[stage] = {k: sum(r.get(k, 0) for r in per_replica) for k in set().union(*per_replica)}
        return out

    def replica_stats(self) -> dict[str, list[dict]]:
        """Per stage, one dict per replica: engine stats, loop and transfer counters, liveness,
        outstanding requests and restarts."""
        return {
            stage: [{**w.stats(), "alive": int(w.is_alive()), "outstanding": self.load[stage][r],
                     "restarts": self.restarts[(stage, r)]} for r, w in enumerate(workers)]
            for stage, workers in self.workers.items()
        }

    def restart_replica(self, stage: str, replica: int) -> None:
        """Replace a replica (dead or alive) with a fresh one. Requests it held fail; blocks until
        the new one is ready (StageError if it cannot start)."""
        with self._restarting:
            self._restart(stage, replica)

    def _restart(self, stage: str, replica: int) -> None:
        old = self.workers[stage][replica]
        old.shutdown()  # frees its devices; fails what it still held
        new = self._new_worker(stage, replica)
        try:
            new.wait_ready(self.pipeline.deploy.startup_timeout_s)
        except BaseException:
            new.shutdown()
            raise
        with self.lock:
            if self.closed:
                new.shutdown()
                return
            self.workers[stage][replica] = new
            self.restarts[(stage, replica)] += 1

    def shutdown(self) -> None:
        self.closed = True
        if getattr(self, "stats_logger", None) is not None:
            self.stats_logger.stop.set()
        workers = [w for ws in self.workers.values() for w in ws]
        threads = [threading.Thread(target=w.shutdown) for w in workers]  # stop them all at once
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if self.on_shutdown is not None:
            self.on_shutdown, release = None, self.on_shutdown
            release()

    def _on_exit(self, stage: str, replica: int, why: str) -> None:
        """A replica died (its requests have failed already): restart it in the background. Called by the dying
        worker, whose thread may still run: what tells a restart done meanwhile is another worker in its place."""
        if self.closed or self.restarts[(stage, replica)] >= self.pipeline.deploy.max_restarts:
            logger.error("stage %r replica %d died (%s) and is not restarted (max_restarts=%d)", stage, replica,
                         why, self.pipeline.deploy.max_restarts)
            return
        dead = self.workers[stage][replica]

        def restart() -> None:
            try:
                with self._restarting:
                    if self.workers[stage][replica] is not dead:
                        return  # somebody restarted it meanwhile
                    self._restart(stage, replica)
                logger.warning("stage %r replica %d restarted after: %s", stage, replica, why)
            except Exception as exc:
                logger.error("stage %r replica %d could not be restarted: %s", stage, replica, exc)

        threading.Thread(target=restart, name=f"restart-{stage}-{replica}", daemon=True).start()

    # ---- routing --------------------------------------------------------------------------

    def _send(self, state: _RequestState, stage: str, inp: StageInput) -> None:
        """To the request's replica of `stage` (chosen now if it has none). While a step's outputs are routed,
        collected per worker in `_outbox`, for one add_many when the step's routing ends."""
        if stage in state.replica:
            worker = self.workers[stage][state.replica[stage]]
            command: AddRequest | AddChunk = AddChunk(inp.request_id, inp)
        else:
            loads = self.load[stage]
            live = [r for r, w in enumerate(self.workers[stage]) if w.is_alive()]
            if not live:
                raise StageError(f"stage {stage!r} has no live replica (restarting?); try again shortly", status=503)
            replica = min(live, key=loads.__getitem__)  # least outstanding requests
            loads[replica] += 1
            state.replica[stage] = replica
            state.metrics[stage] = StageMetrics(stage)
            worker = self.workers[stage][replica]
            command = AddRequest(inp)
        if self._outbox is not None and hasattr(worker, "add_many"):
            self._outbox.setdefault(worker, []).append(command)
        elif isinstance(command, AddRequest):
            worker.add_request(inp)
        else:
            worker.add_input_chunk(inp.request_id, inp)

    def _release(self, state: _RequestState, abort: bool) -> None:
        if abort and self._outbox:  # inputs of this request not handed over yet: never hand them over
            rid = state.request.request_id
            for commands in self._outbox.values():
                commands[:] = [c for c in commands if c.request_id != rid]
        for stage, replica in state.replica.items():
            self.load[stage][replica] -= 1
            if abort:
                self.workers[stage][replica].abort(state.request.request_id)

    def _on_outputs(self, stage: str, replica: int, outputs: list[StageOutput]) -> None:
        """One step's outputs of a replica: routed on under the lock, each next stage's inputs handed over
        together (add_many)."""
        with self.lock:
            self._outbox = {}
            try:
                for out in outputs:
                    state = self.requests.get(out.request_id)
                    if state is not None and state.replica.get(stage) == replica:
                        self._route(state, stage, out)
            finally:
                outbox, self._outbox = self._outbox, None
                for worker, commands in outbox.items():
                    if commands:  # (a failed request's may have been dropped)
                        self._hand_over(worker, commands)

    def _hand_over(self, worker: StageWorker, commands: list[AddRequest | AddChunk]) -> None:
        try:
            worker.add_many(commands)
        except Exception as exc:  # the stage could not take them: those requests fail, the others go on
            logger.exception("stage %r could not take its inputs", worker.stage)
            known = isinstance(exc, OmniError)  # our own message; anything else stays in the log
            message = exc.message if known else stage_failure(worker.stage)
            for rid in {c.request_id for c in commands}:
                state = self.requests.get(rid)
                if state is not None:
                    self._finish(state, OmniOutput.failure(rid, message, exc.status if known else 500), abort=True)

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
            self._finish(state, OmniOutput.failure(out.request_id, out.error, out.error_status), abort=True)
            return

        edges = [e for e in self.edges_from[stage] if e.dst in state.stages]
        if any(not (self.async_chunk and e.streamed) for e in edges):  # someone needs the whole output
            merged = state.merged.setdefault(stage, StageOutput(out.request_id, stage)).merge(out)
        for edge in edges:
            if self.async_chunk and edge.streamed:
                inp = edge.handoff(state.request, out)
            else:
                inp = edge.handoff(state.request, merged) if out.finished else None
            if inp is not None:
                try:
                    self._send(state, edge.dst, inp)
                except StageError as exc:
                    self._finish(state, OmniOutput.failure(out.request_id, exc.message, exc.status), abort=True)
                    return

        if stage in state.pending_outputs:
            delta = self.pipeline.to_output(stage, out)
            if out.finished:
                state.pending_outputs.discard(stage)
                if stage in self.text_stages:
                    state.text_finish_reason = out.finish_reason
                # the text's reason ("length" when max_tokens cut it) survives a later stage's own "stop"
                delta.finish_reason = state.text_finish_reason or out.finish_reason
            if not state.pending_outputs:
                self._finish(state, delta, abort=False)
            else:
                self._deliver(state, delta)

    def _finish(self, state: _RequestState, last: OmniOutput, abort: bool) -> None:
        del self.requests[state.request.request_id]
        self.finished["error" if last.error else "ok"] += 1
        status = str(last.error_status) if last.error else "ok"
        self.request_stats.observe(state.request.arrival_time, state.metrics, status, time.monotonic())
        self._release(state, abort)
        last.finished = True
        last.metrics = state.metrics
        self._deliver(state, last)

    @staticmethod
    def _deliver(state: _RequestState, out: OmniOutput) -> None:
        try:
            state.sink(out)
        except Exception:  # e.g. the caller's event loop is gone; other requests go on
            logger.exception("could not deliver output of request %r", out.request_id)
