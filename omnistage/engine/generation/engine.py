"""The generation engine: non-autoregressive stages (vocoders, codec decoders, encoders).

A request collects its input chunks. Each `step()` hands every ready request (up to `max_num_seqs`)
to the model in one call, so the model may batch however its computation allows. The model is a
family's object with `generate(inputs) -> [(output tensors, finished)]`, one pair per input, and
optionally `ready(inp) -> bool`: by default a request is ready once its input is final; a streaming
model (a vocoder decoding windows of codes) says when enough has arrived, and keeps its progress in
the request's params between calls.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import torch

from omnistage.engine.types import StageInput, StageOutput
from omnistage.errors import OmniError

logger = logging.getLogger(__name__)


class GenerationModel(Protocol):
    def generate(self, inputs: list[StageInput]) -> list[tuple[dict[str, torch.Tensor], bool]]: ...


def _concat(first: StageInput, chunk: StageInput) -> StageInput:
    first.token_ids = first.token_ids + chunk.token_ids
    for key, value in chunk.tensors.items():
        first.tensors[key] = torch.cat([first.tensors[key], value]) if key in first.tensors else value
    first.final = chunk.final
    return first


class GenerationEngine:
    def __init__(self, name: str, model: GenerationModel, max_num_seqs: int = 16):
        self.name = name
        self.model = model
        self.max_num_seqs = max_num_seqs
        self.requests: dict[str, StageInput] = {}  # arrival order is kept by the dict
        self.ready = getattr(model, "ready", lambda inp: inp.final)
        self.num_steps = 0

    @property
    def device(self) -> torch.device | None:
        return getattr(self.model, "device", None)

    def add_request(self, inp: StageInput) -> None:
        self.requests[inp.request_id] = inp

    def add_input_chunk(self, request_id: str, chunk: StageInput) -> None:
        if request_id in self.requests:
            _concat(self.requests[request_id], chunk)

    def abort(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def has_work(self) -> bool:
        return any(self.ready(inp) for inp in self.requests.values())

    def stats(self) -> dict[str, Any]:
        ready = sum(self.ready(inp) for inp in self.requests.values())
        return {"num_running": ready, "num_waiting": len(self.requests) - ready, "num_steps": self.num_steps}

    def step(self) -> list[StageOutput]:
        batch = [inp for inp in self.requests.values() if self.ready(inp)][: self.max_num_seqs]
        if not batch:
            return []
        self.num_steps += 1
        try:
            results = self.model.generate(batch)
        except Exception as exc:  # a failed batch fails its requests, not the stage
            logger.exception("stage %s: step failed", self.name)
            for inp in batch:
                del self.requests[inp.request_id]
            status = exc.status if isinstance(exc, OmniError) else 500
            return [StageOutput(inp.request_id, self.name, finished=True, finish_reason="error",
                                error=f"stage {self.name!r} failed: {exc}", error_status=status) for inp in batch]
        outputs = []
        for inp, (tensors, finished) in zip(batch, results, strict=True):
            if finished:
                del self.requests[inp.request_id]
            outputs.append(StageOutput(inp.request_id, self.name, tensors=tensors, finished=finished,
                                       finish_reason="stop" if finished else None))
        return outputs

    def shutdown(self) -> None:
        self.requests.clear()
