"""Prompt encoding of diffusion requests: which prompts a request encodes, and the stage that encodes them apart
from the denoising loop.

`encode_requests` is the one place that turns requests into conditioning; the diffusion engine calls it for
requests that arrive unencoded, and `PromptEncoder` (the model of a separate `generation` stage, when a deploy
config puts the text encoders in a stage of their own) calls it for every ready request of one engine step, so
encoders are shared by and batched across requests. Both give the same tensors for the same request.

A request's encoding is a dict of tensors, the shape a stage input carries across a connector:
- "cond.<name>": its positive prompt's conditioning row [1, ...] for each tensor the family's `encode` returns;
- "uncond.<name>": its negative prompt's row, only when it runs a CFG branch (`model.cfg_scale` not None);
- "prompt_tokens": int64 [1], the positive prompt's text tokens for usage (0 if the family does not count them).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch

from omnistage.engine.diffusion.params import DiffusionParams
from omnistage.types import StageInput

COND, UNCOND, PROMPT_TOKENS = "cond.", "uncond.", "prompt_tokens"
Encoding = dict[str, torch.Tensor]


def is_encoded(tensors: dict[str, torch.Tensor]) -> bool:
    """Whether a stage input already carries its conditioning (it came from an encode stage)."""
    return PROMPT_TOKENS in tensors


def encode_requests(model: Any, params: list[DiffusionParams], inputs: list[dict[str, torch.Tensor]]
                    ) -> list[Encoding]:
    """One `model.encode` call per batch key over the requests' prompts (positive, then negative under CFG);
    `inputs[i]` are request i's input tensors (edit models' images)."""
    groups: dict[Hashable, list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault(model.batch_key(p), []).append(i)
    out: list[Encoding] = [{} for _ in params]
    for members in groups.values():
        prompts, owners, owner_inputs, slots = [], [], [], []
        for i in members:
            p, guided = params[i], model.cfg_scale(params[i]) is not None
            branches = [p.prompt] + ([p.negative_prompt or ""] if guided else [])
            prompts += branches
            owners += [p] * len(branches)
            owner_inputs += [inputs[i]] * len(branches)
            slots += [(i, COND)] + ([(i, UNCOND)] if guided else [])
        cond = model.encode(prompts, owners, owner_inputs)
        for row, (i, prefix) in enumerate(slots):
            out[i].update({prefix + k: v[row:row + 1] for k, v in cond.items()})
        for i in members:
            positive = {k[len(COND):]: v for k, v in out[i].items() if k.startswith(COND)}
            tokens = model.prompt_tokens(params[i], positive) if hasattr(model, "prompt_tokens") else 0
            out[i][PROMPT_TOKENS] = torch.tensor([tokens], dtype=torch.int64)
    return out


def branch(encoding: Encoding, prefix: str, rows: int) -> dict[str, torch.Tensor] | None:
    """One branch's conditioning (prefix COND or UNCOND) repeated to the request's `rows` images, on the tensors'
    device; None when the request has no such branch."""
    cond = {k[len(prefix):]: v.repeat_interleave(rows, dim=0) for k, v in encoding.items() if k.startswith(prefix)}
    return cond or None


class PromptEncoder:
    """The model of an encode stage (a generation engine): encodes every ready request of a step in one pass and
    hands each its encoding, on the CPU so any connector can carry it to the DiT stage."""

    def __init__(self, model: Any):
        self.model = model
        self.device = model.device

    def describe(self) -> str:
        return "text encoders of a diffusion model"

    @torch.inference_mode()
    def generate(self, inputs: list[StageInput]) -> list[tuple[dict[str, torch.Tensor], bool]]:
        params = [DiffusionParams.of(inp.params) for inp in inputs]
        encodings = encode_requests(self.model, params, [inp.tensors for inp in inputs])
        return [({k: v.cpu() for k, v in enc.items()}, True) for enc in encodings]
