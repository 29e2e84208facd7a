"""The generation engine: non-autoregressive stages (vocoders, codec decoders, encoders).

A request collects its input chunks. Each `step()` hands every ready request (up to `max_num_seqs`)
to the model in one call, so the model may batch however its computation allows. The model is a
family's object with `generate(inputs) -> [(output tensors, finished)]`, one pair per input, and
optionally `ready(inp) -> bool`: by default a request is ready once its input is final; a streaming
model (a vocoder decoding windows of codes) says when enough has arrived, and keeps its progress in
the request's params between calls.

A model may also have `launch(inputs) -> InFlight`, which the engine then calls instead: the batch's device
work queued, its outputs to come. The engine takes new inputs while that work runs and launches the next
batch once the device has passed the previous one's `busy` mark: token2wav solves a request's next window
while the vocoder still turns the last one into audio. Outputs leave in launch order either way.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from omnistage.config.deploy import StageConfig
from omnistage.errors import OmniError, stage_failure
from omnistage.types import StageInput, StageOutput

logger = logging.getLogger(__name__)

Results = list[tuple[dict[str, torch.Tensor], bool]]


class Mark(Protocol):
    """A point in a device queue (a CUDA event): passed or not, or wait for it."""

    def query(self) -> bool: ...
    def synchronize(self) -> None: ...


@dataclass
class InFlight:
    """A launched batch. `finished` per input is known at launch; `collect()` gives each input's output tensors
    once `done` has passed. `busy`: the part of the work a next batch would queue behind (token2wav's solve):
    the engine launches no batch before it has passed, so inputs that arrive meanwhile still join the next
    batch as they did when each call waited for its outputs."""

    finished: list[bool]
    busy: Mark
    done: Mark
    collect: Callable[[], list[dict[str, torch.Tensor]]]


class GenerationModel(Protocol):
    def generate(self, inputs: list[StageInput]) -> Results: ...


def _concat(first: StageInput, chunk: StageInput) -> StageInput:
    first.token_ids = first.token_ids + chunk.token_ids
    for key, value in chunk.tensors.items():
        first.tensors[key] = torch.cat([first.tensors[key], value]) if key in first.tensors else value
    first.final = chunk.final
    return first


@dataclass
class _Launched:
    request_ids: list[str | None]  # None: aborted since
    finished: list[bool]
    flight: InFlight | None = None  # None: the outputs are already here
    outputs: list[dict[str, torch.Tensor]] = field(default_factory=list)
    error: tuple[str, int] | None = None  # the batch failed: (message, HTTP status) for each of its requests


class GenerationEngine:
    def __init__(self, name: str, model: GenerationModel, max_num_seqs: int = 16):
        self.name = name
        self.model = model
        self.max_num_seqs = max_num_seqs
        self.requests: dict[str, StageInput] = {}  # arrival order is kept by the dict
        self._model_ready = getattr(model, "ready", lambda inp: inp.final)
        self.failed: list[StageOutput] = []  # failures found outside a step, handed out by the next one
        self.launch = getattr(model, "launch", None)
        self.launched: collections.deque[_Launched] = collections.deque()  # outputs not handed out yet, in order
        self.num_steps = 0

    @classmethod
    def from_stage(cls, name: str, model: GenerationModel, cfg: StageConfig) -> GenerationEngine:
        """The engine of stage `name` as its deploy config sizes it (the model takes its own settings)."""
        return cls(name, model, cfg.max_num_seqs)

    @property
    def device(self) -> torch.device | None:
        return getattr(self.model, "device", None)

    def describe(self) -> str:
        detail = getattr(self.model, "describe", None)
        return f"{self.device}, batches of up to {self.max_num_seqs}" + (f", {detail()}" if detail else "")

    def add_request(self, inp: StageInput) -> None:
        self.requests[inp.request_id] = inp

    def add_input_chunk(self, request_id: str, chunk: StageInput) -> None:
        if request_id in self.requests:
            _concat(self.requests[request_id], chunk)

    def abort(self, request_id: str) -> None:
        """Drops the request; outputs of its work still in flight are dropped when it lands."""
        self.requests.pop(request_id, None)
        for launched in self.launched:
            launched.request_ids = [None if rid == request_id else rid for rid in launched.request_ids]

    def ready(self, inp: StageInput) -> bool:
        """The model's `ready`; one that raises fails its request (at the next step), not the stage."""
        try:
            return self._model_ready(inp)
        except Exception as exc:
            logger.exception("stage %s: request %r failed", self.name, inp.request_id)
            self.requests.pop(inp.request_id, None)
            self.failed.append(StageOutput.failure(inp.request_id, self.name, *self._error(exc)))
            return False

    def has_work(self) -> bool:
        return bool(self.launched or self.failed) or any(self.ready(inp) for inp in list(self.requests.values()))

    def stats(self) -> dict[str, Any]:
        ready = sum(self.ready(inp) for inp in list(self.requests.values()))
        return {"num_running": ready, "num_waiting": len(self.requests) - ready, "num_steps": self.num_steps,
                "num_in_flight": sum(launched.flight is not None for launched in self.launched)}

    def step(self) -> list[StageOutput]:
        """Launches the ready requests, or, while the device is still on earlier work, waits for its next mark
        (then returns, so the caller can take inputs that arrived meanwhile). Returns the outputs that landed."""
        newest = self.launched[-1].flight if self.launched else None
        if newest is not None and not newest.busy.query():
            newest.busy.synchronize()
            return self._landed()
        batch = [inp for inp in list(self.requests.values()) if self.ready(inp)][: self.max_num_seqs]
        if batch:
            self._launch(batch)
        elif self.launched and self.launched[0].flight is not None:
            self.launched[0].flight.done.synchronize()
        return self._landed()

    def _launch(self, batch: list[StageInput]) -> None:
        self.num_steps += 1
        ids = [inp.request_id for inp in batch]
        try:
            result = self.launch(batch) if self.launch is not None else self.model.generate(batch)
            if isinstance(result, InFlight):
                launched = _Launched(ids, list(result.finished), flight=result)
            else:
                launched = _Launched(ids, [finished for _, finished in result], outputs=[t for t, _ in result])
            if len(launched.finished) != len(ids):
                raise RuntimeError(f"the model answered {len(launched.finished)} of {len(ids)} inputs")
        except Exception as exc:  # a failed batch fails its requests, not the stage
            logger.exception("stage %s: step failed", self.name)
            for rid in ids:
                del self.requests[rid]
            self.launched.append(_Launched(ids, [True] * len(ids), error=self._error(exc, "this step")))
            return
        for rid, finished in zip(ids, launched.finished, strict=True):
            if finished:
                del self.requests[rid]
        self.launched.append(launched)

    def _landed(self) -> list[StageOutput]:
        """Outputs of launched batches whose work is done, oldest first, stopping at the first still running."""
        outputs, self.failed = self.failed, []
        while self.launched:
            launched = self.launched[0]
            if launched.flight is not None:
                if not launched.flight.done.query():
                    break
                try:
                    launched.outputs = launched.flight.collect()
                except Exception as exc:
                    logger.exception("stage %s: collecting a step's outputs failed", self.name)
                    launched.error = self._error(exc, "this step")
                launched.flight = None
            self.launched.popleft()
            for n, (rid, finished) in enumerate(zip(launched.request_ids, launched.finished, strict=True)):
                if rid is None:  # aborted while in flight
                    continue
                error = launched.error
                if error is None:
                    try:
                        tensors = launched.outputs[n]
                        if not isinstance(tensors, dict):
                            raise TypeError(f"the model's output {n} is a {type(tensors).__name__}, not a dict")
                        outputs.append(StageOutput(rid, self.name, tensors=tensors, finished=finished,
                                                   finish_reason="stop" if finished else None))
                    except Exception as exc:  # this request's output: it alone fails
                        logger.exception("stage %s: request %r failed", self.name, rid)
                        error = self._error(exc)
                if error is not None:
                    self.abort(rid)  # and its later windows' outputs
                    outputs.append(StageOutput.failure(rid, self.name, *error))
        return outputs

    def _error(self, exc: Exception, scope: str = "this request") -> tuple[str, int]:
        """(message, status) for the caller: an OmniError's own; otherwise only the stage (the log has the rest)."""
        if isinstance(exc, OmniError):
            return f"stage {self.name!r}: {exc.message}", exc.status
        return stage_failure(self.name, scope), 500

    def shutdown(self) -> None:
        self.requests.clear()
        self.launched.clear()
