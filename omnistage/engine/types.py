"""What crosses an engine's boundary: one stage's input chunk and one step's output delta.

These stay small and typed: the orchestrator routes them, families' handoffs build them,
and a process backend serialises them (tensors as raw bytes, never pickled).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class StageInput:
    """What one stage consumes for one request (or one streamed chunk of it)."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    # Row-aligned with `token_ids` where given: embeddings that replace the token embedding.
    embeds: torch.Tensor | None = None
    params: Any = None  # SamplingParams for AR stages, engine-specific params otherwise
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # multimodal features, codes, ...
    final: bool = True  # False: more chunks will follow via add_input_chunk
    return_hidden_states: bool = False  # AR stages: also output the configured hidden-state layers
    # Rotary positions when they are not the token index (M-RoPE): [axes, len(token_ids)] for these
    # tokens, and `index + rope_delta` (on every axis) for the tokens after them.
    rope_positions: torch.Tensor | None = None
    rope_delta: int | None = None
    # Added to the input embeddings of generated tokens, one row per generated position in order (a
    # talker reading its thinker's reply as it is written). Such a request's prompt is whole from the
    # start and `final` speaks of these rows: chunks append rows, and once `final` is set,
    # `embed_add_default` serves every position after the last row. A tuple of equal-shape tensors adds their
    # sum: the engine sums the rows of a whole step at once (a sender does not launch a kernel per request).
    embed_adds: torch.Tensor | tuple[torch.Tensor, ...] | None = None
    embed_add_default: torch.Tensor | None = None


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class StageOutput:
    """What one engine step produced for one request: a delta, never cumulative."""

    request_id: str
    stage: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] | None = None
    hidden_states: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [n_new, hidden]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # codes, audio, images, ...
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    error_status: int = 500  # HTTP status for the caller when `error` is set
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0  # cumulative count, so usage is always at hand

    def merge(self, later: StageOutput) -> StageOutput:
        """Fold a later delta into this one (offline callers and non-streamed handoffs)."""
        self.token_ids = self.token_ids + later.token_ids
        self.text += later.text
        if later.logprobs is not None:
            self.logprobs = (self.logprobs or []) + later.logprobs
        for attr in ("hidden_states", "tensors"):
            mine, theirs = getattr(self, attr), getattr(later, attr)
            for key, value in theirs.items():
                mine[key] = torch.cat([mine[key], value]) if key in mine else value
        self.finished, self.finish_reason = later.finished, later.finish_reason
        self.error, self.error_status = later.error, later.error_status
        self.num_prompt_tokens = later.num_prompt_tokens or self.num_prompt_tokens
        self.num_cached_tokens = later.num_cached_tokens or self.num_cached_tokens
        self.num_output_tokens = later.num_output_tokens
        return self
