"""The generation engine: non-autoregressive stages (vocoders, codec decoders, encoders).

A request collects its input chunks; once its input is final it is ready, and each `step()` hands
every ready request (up to `max_num_seqs`) to the model in one call. The model is a family's object
with `generate(inputs: list[StageInput]) -> list[dict[str, Tensor]]`, one dict of output tensors per
input, so it may batch however its computation allows.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import torch

from omnistage.engine.types import StageInput, StageOutput
from omnistage.errors import OmniError

logger = logging.getLogger(__name__)


class GenerationModel(Protocol):
    def generate(self, inputs: list[StageInput]) -> list[dict[str, torch.Tensor]]: ...


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
        self.num_steps = 0

    def add_request(self, inp: StageInput) -> None:
        self.requests[inp.request_id] = inp

    def add_input_chunk(self, request_id: str, chunk: StageInput) -> None:
        if request_id in self.requests:
            _concat(self.requests[request_id], chunk)

    def abort(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def has_work(self) -> bool:
        return any(inp.final for inp in self.requests.values())

    def stats(self) -> dict[str, Any]:
        ready = sum(inp.final for inp in self.requests.values())
        return {"num_running": ready, "num_waiting": len(self.requests) - ready, "num_steps": self.num_steps}

    def step(self) -> list[StageOutput]:
        batch = [inp for inp in self.requests.values() if inp.final][: self.max_num_seqs]
        if not batch:
            return []
        for inp in batch:
            del self.requests[inp.request_id]
        self.num_steps += 1
        try:
            results = self.model.generate(batch)
        except Exception as exc:  # a failed batch fails its requests, not the stage
            logger.exception("stage %s: step failed", self.name)
            status = exc.status if isinstance(exc, OmniError) else 500
            return [StageOutput(inp.request_id, self.name, finished=True, finish_reason="error",
                                error=f"stage {self.name!r} failed: {exc}", error_status=status) for inp in batch]
        return [StageOutput(inp.request_id, self.name, tensors=tensors, finished=True, finish_reason="stop")
                for inp, tensors in zip(batch, results, strict=True)]

    def shutdown(self) -> None:
        self.requests.clear()
