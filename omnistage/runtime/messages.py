"""What the caller hands the runtime and what it gets back."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omnistage.engine.types import TokenLogprob
from omnistage.sampling_params import SamplingParams


@dataclass
class OmniRequest:
    """One user request as the orchestrator sees it. Exactly one of `messages`, `prompt`,
    `prompt_token_ids` is set."""

    request_id: str
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
    audio: np.ndarray | None = None  # mono float32 samples at `sample_rate`
    sample_rate: int | None = None
    images: list[Any] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    error_status: int = 500
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    metrics: dict[str, StageMetrics] = field(default_factory=dict)

    def merge(self, later: OmniOutput) -> OmniOutput:
        self.text += later.text
        self.token_ids = self.token_ids + later.token_ids
        if later.logprobs is not None:
            self.logprobs = (self.logprobs or []) + later.logprobs
        if later.audio is not None:
            self.audio = later.audio if self.audio is None else np.concatenate([self.audio, later.audio])
            self.sample_rate = later.sample_rate
        self.images += later.images
        for attr in ("finished", "finish_reason", "error", "error_status", "metrics"):
            setattr(self, attr, getattr(later, attr))
        self.num_prompt_tokens = later.num_prompt_tokens or self.num_prompt_tokens
        self.num_cached_tokens = later.num_cached_tokens or self.num_cached_tokens
        self.num_output_tokens = later.num_output_tokens or self.num_output_tokens
        return self
