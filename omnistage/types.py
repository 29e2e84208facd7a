"""The few types every layer shares: what a caller hands the runtime (`OmniRequest`), what crosses an
engine's boundary (`StageInput` chunks in, `StageOutput` deltas out), and what the caller gets back
(`OmniOutput` deltas).

They stay small and typed: the orchestrator routes them, families' handoffs build them, and a process
backend serialises them (tensors as raw bytes, never pickled).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from omnistage.sampling_params import SamplingParams


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
    # "last" | "mean": the prompt's final hidden states pooled into one embedding is the output (AR stages whose
    # family configures the "last" hidden-state layer); nothing is generated
    pooling: str | None = None


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

    @classmethod
    def failure(cls, request_id: str, stage: str, error: str, status: int = 500) -> StageOutput:
        """The last output of a request that failed in `stage`: `error` says why, `status` is the caller's."""
        return cls(request_id, stage, finished=True, finish_reason="error", error=error, error_status=status)

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


@dataclass
class OmniRequest:
    """One user request as the orchestrator sees it. Exactly one of `messages`, `prompt`,
    `prompt_token_ids` is set."""

    request_id: str = field(default_factory=lambda: f"req-{uuid.uuid4().hex}")
    messages: list[dict[str, Any]] | None = None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    media: dict[str, list[Any]] = field(default_factory=dict)  # decoded images / audio / video
    output_modalities: tuple[str, ...] = ("text",)
    # Per-stage params by stage name; a stage not listed uses its deploy-config defaults.
    stage_params: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)  # voice, audio format, ...
    # Scratch space of the model family for this request: what its preprocessing leaves for its
    # handoffs, and what a streamed handoff carries from one delta to the next. Never the caller's.
    pipeline_state: dict[str, Any] = field(default_factory=dict)
    arrival_time: float = field(default_factory=time.monotonic)

    def params_for(self, stage: str, default: SamplingParams | None = None) -> Any:
        return self.stage_params.get(stage, default)


@dataclass
class StageMetrics:
    stage: str
    start_time: float = field(default_factory=time.monotonic)  # when the request was sent to the stage
    first_output_time: float | None = None
    finish_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0


@dataclass
class OmniOutput:
    """A delta the caller sees. Streaming callers get many; offline callers get one merged."""

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    audio: np.ndarray | None = None  # float32 at `sample_rate`: [samples] mono, or time-major [samples, channels]
    sample_rate: int | None = None
    images: list[Any] = field(default_factory=list)
    videos: list[np.ndarray] = field(default_factory=list)  # uint8 [frames, H, W, 3] each, at `fps`
    fps: float | None = None
    embedding: np.ndarray | None = None  # float32 [hidden], for a pooling request
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    error_status: int = 500
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    metrics: dict[str, StageMetrics] = field(default_factory=dict)
    progress: tuple[int, int] | None = None  # (steps done, steps) of a diffusion request, on each step's delta

    @classmethod
    def failure(cls, request_id: str, error: str, status: int = 500) -> OmniOutput:
        """The last delta of a request that failed: `error` says why, `status` is its HTTP status."""
        return cls(request_id, finished=True, finish_reason="error", error=error, error_status=status)

    def merge(self, later: OmniOutput) -> OmniOutput:
        self.text += later.text
        self.token_ids = self.token_ids + later.token_ids
        if later.logprobs is not None:
            self.logprobs = (self.logprobs or []) + later.logprobs
        if later.audio is not None:
            self.audio = later.audio if self.audio is None else np.concatenate([self.audio, later.audio])
            self.sample_rate = later.sample_rate
        self.images += later.images
        self.videos += later.videos
        self.fps = later.fps or self.fps
        if later.embedding is not None:
            self.embedding = later.embedding
        for attr in ("finished", "finish_reason", "error", "error_status", "metrics"):
            setattr(self, attr, getattr(later, attr))
        self.progress = later.progress or self.progress
        self.num_prompt_tokens = later.num_prompt_tokens or self.num_prompt_tokens
        self.num_cached_tokens = later.num_cached_tokens or self.num_cached_tokens
        self.num_output_tokens = later.num_output_tokens or self.num_output_tokens
        return self
