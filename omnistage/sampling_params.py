"""Per-request sampling parameters for autoregressive stages."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from omnistage.errors import RequestError

# vLLM's SamplingParams fields that omnistage accepts and does not act on, so a vLLM client's params dict can
# be sent whole (in a request body or a `sampling_params_list` entry); the server logs them at debug level.
VLLM_IGNORED_FIELDS = frozenset({
    "detokenize",  # text is always produced
    "spaces_between_special_tokens",  # fast (Rust) tokenizers have no such option
    "prompt_logprobs",
    "output_kind", "output_text_buffer_length", "truncate_prompt_tokens", "guided_decoding", "structured_outputs",
    "logits_processors", "allowed_token_ids", "extra_args", "flat_logprobs", "skip_clone",
    "use_beam_search", "length_penalty", "early_stopping",  # beam search (older vLLM)
    "_real_n", "_all_stop_token_ids", "_bad_words_token_ids",  # vLLM's private fields, when a dict carries them
})
# vLLM's fields checked rather than applied: n and best_of belong to the request, not to a stage; logit_bias and
# bad_words are refused when non-empty (unsupported: silently ignoring them would change what is sampled).
VLLM_CHECKED_FIELDS = frozenset({"n", "best_of", "logit_bias", "bad_words"})


class InvalidParams(RequestError):
    """A sampling parameter is out of range; the message says which and how to fix it."""


@dataclass
class SamplingParams:
    """How one AR stage samples for one request. `temperature == 0` means greedy."""

    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    bad_token_ids: list[int] = field(default_factory=list)  # never sampled (e.g. a talker's control codes)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per token; 0 = only the sampled token's
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        """Whether a penalty needs the request's earlier tokens."""
        return self.repetition_penalty != 1.0 or bool(self.frequency_penalty) or bool(self.presence_penalty)

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing that needs the logits on the host: the argmax alone decides."""
        return self.greedy and self.logprobs is None and not self.bad_token_ids and not self.penalised

    def validate(self) -> None:
        def bad(name: str, why: str) -> InvalidParams:
            return InvalidParams(f"{name}={getattr(self, name)!r} is invalid: {why}", name)

        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", "must be at least 1")
        if self.min_tokens < 0:
            raise bad("min_tokens", "must be >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must not exceed max_tokens ({self.max_tokens})")
        if not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", "must be in [0, 100]")
        if self.top_k < -1:
            raise bad("top_k", "must be -1 or 0 (disabled) or a positive integer")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise bad("repetition_penalty", "must be in (0, 10]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise bad(name, "must be in [-2, 2]")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise bad("logprobs", "must be in [0, 20]")
        if any(not s for s in self.stop):
            raise bad("stop", "stop strings must be non-empty")
        if len(self.stop) > 16:
            raise bad("stop", "at most 16 stop strings")

    def with_overrides(self, **overrides) -> SamplingParams:
        known = {f.name for f in fields(self)}
        return replace(self, **{k: v for k, v in overrides.items() if k in known and v is not None})
