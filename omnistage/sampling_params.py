"""Per-request sampling parameters for autoregressive stages."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields, replace
from typing import Any

from omnistage.errors import RequestError

# vLLM's SamplingParams fields that omnistage accepts and does not act on, so a vLLM client's params dict can
# be sent whole (in a request body or a `sampling_params_list` entry); the server logs them at debug level.
VLLM_IGNORED_FIELDS = frozenset({
    "detokenize",  # text is always produced
    "spaces_between_special_tokens",  # fast (Rust) tokenizers have no such option
    "prompt_logprobs",
    "output_kind", "output_text_buffer_length", "truncate_prompt_tokens",
    "logits_processors", "allowed_token_ids", "extra_args", "flat_logprobs", "skip_clone",
    "use_beam_search", "length_penalty", "early_stopping",  # beam search (older vLLM)
    "_real_n", "_all_stop_token_ids", "_bad_words_token_ids",  # vLLM's private fields, when a dict carries them
})
# vLLM's fields checked rather than applied: n and best_of belong to the request, not to a stage; guided_decoding
# (older vLLM) is read as structured_outputs; bad_words is refused when non-empty (unsupported: silently ignoring
# it would change what is sampled).
VLLM_CHECKED_FIELDS = frozenset({"n", "best_of", "bad_words", "guided_decoding"})
MAX_LOGIT_BIAS = 300  # OpenAI's limit on logit_bias entries


# Bounds every entry point enforces (the engines rely on them).
MAX_LOGPROBS = 20  # vLLM's max_logprobs
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 512  # a streamed reply holds back this much text while it may be a stop string
MAX_TOKEN_IDS = 4096  # per list (stop_token_ids, bad_token_ids)
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed takes (vLLM: int64; also 0..2**64-1)

_OPTIONAL_INTS = ("max_tokens", "seed", "logprobs")  # None means: the default behaviour
_INTS = ("min_tokens", "top_k")
_FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
_BOOLS = ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output")
_ID_LISTS = ("stop_token_ids", "bad_token_ids")


def short_repr(value: Any, limit: int = 60) -> str:
    """A caller's value, as an error message may echo it: never longer than `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class InvalidParams(RequestError):
    """A sampling parameter has the wrong type or is out of range; the message names it and says why.
    `why` and `value` are kept so an entry point can name the field by its own path (`at`)."""

    def __init__(self, name: str, value: Any, why: str):
        super().__init__(f"{name}={short_repr(value)} is invalid: {why}", name)
        self.name, self.value, self.why = name, value, why

    def at(self, path: str, note: str = "") -> InvalidParams:
        """The same error named by the field's path in a request, e.g. `sampling_params_list[1].stop_token_ids`;
        `note` is appended (which stage the entry is for)."""
        err = InvalidParams(self.name, self.value, self.why)
        err.param = f"{path}.{self.name}" if path else self.name
        err.message = f"{err.param}: {self.why} (got {short_repr(self.value)}){note}"
        err.args = (err.message,)
        return err


# vLLM's StructuredOutputsParams / GuidedDecodingParams options: backend choices omnistage does not need
_VLLM_STRUCTURED_OPTIONS = frozenset({"backend", "_backend", "_backend_was_auto", "disable_fallback",
                                      "disable_any_whitespace", "disable_additional_properties",
                                      "whitespace_pattern", "structural_tag"})


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must match; exactly one field is set (vLLM's StructuredOutputsParams)."""

    json: str | None = None  # a JSON schema, serialised
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None  # EBNF (GBNF) or Lark

    def __post_init__(self) -> None:
        set_fields = [self.json is not None, self.json_object, self.regex is not None, self.choice is not None,
                      self.grammar is not None]
        if sum(set_fields) != 1:
            raise RequestError("structured output takes exactly one of json, json_object, regex, choice, grammar",
                               "structured_outputs")

    @classmethod
    def of(cls, spec: Any, where: str = "structured_outputs") -> StructuredOutput | None:
        """From vLLM's wire shape `{"json": schema | str, "regex": ..., "choice": [...], "grammar": ...,
        "json_object": true}`; None for an empty or absent spec."""
        if spec is None or isinstance(spec, StructuredOutput):
            return spec
        if not isinstance(spec, dict):
            raise RequestError(f"{where} must be an object such as {{\"json\": <schema>}}", where)
        if spec.get("structural_tag") is not None:
            raise RequestError(f"{where}.structural_tag is not supported; use json, regex, choice or grammar", where)
        spec = {k: v for k, v in spec.items() if k not in _VLLM_STRUCTURED_OPTIONS}
        unknown = set(spec) - {"json", "json_object", "regex", "choice", "grammar"}
        if unknown:
            raise RequestError(f"{where}: unknown field(s) {sorted(unknown)}; use json, json_object, regex, choice "
                               "or grammar", where)
        given = {k: v for k, v in spec.items() if v is not None and v is not False}
        if not given:
            return None
        schema = given.get("json")
        if schema is not None and not isinstance(schema, str | dict | bool):
            raise RequestError(f"{where}.json must be a JSON schema (an object)", f"{where}.json")
        choice = given.get("choice")
        if choice is not None and (not isinstance(choice, list) or not choice
                                   or not all(isinstance(c, str) for c in choice)):
            raise RequestError(f"{where}.choice must be a non-empty list of strings", f"{where}.choice")
        for key in ("regex", "grammar"):
            if key in given and not isinstance(given[key], str):
                raise RequestError(f"{where}.{key} must be a string", f"{where}.{key}")
        if "json_object" in given and given["json_object"] is not True:
            raise RequestError(f"{where}.json_object must be true or false", f"{where}.json_object")
        return cls(json=schema if isinstance(schema, str) or schema is None else json.dumps(schema),
                   json_object=given.get("json_object", False), regex=given.get("regex"),
                   choice=tuple(choice) if choice is not None else None, grammar=given.get("grammar"))


@dataclass
class SamplingParams:
    """How one AR stage samples for one request. `temperature == 0` means greedy.

    Construction validates types strictly (a list of ints is a list of ints, a bool is a bool) and ranges, so
    every entry point (HTTP fields, `sampling_params_list`, the Python API, deploy defaults) shares one schema
    and nothing unchecked reaches an engine. Token ids are checked against a vocabulary where one is known
    (`check_token_ids`)."""

    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None  # any int in [SEED_MIN, SEED_MAX]; the generator takes it modulo 2**64
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    bad_token_ids: list[int] = field(default_factory=list)  # never sampled (e.g. a talker's control codes)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per token; 0 = only the sampled token's
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # the output must match this grammar (vLLM's `structured_outputs`; OpenAI's response_format maps onto it)
    structured_outputs: StructuredOutput | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit, in [-100, 100]

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
        return (self.greedy and self.logprobs is None and not self.bad_token_ids and not self.penalised
                and self.structured_outputs is None and not self.logit_bias)

    def validate(self) -> None:
        """Types, then ranges; normalises numbers (ints where floats are asked become floats) and sequences
        (tuples become lists). Raises InvalidParams naming the first bad field."""

        def bad(name: str, why: str) -> InvalidParams:
            return InvalidParams(name, getattr(self, name), why)

        for name in _OPTIONAL_INTS + _INTS:
            value = getattr(self, name)
            if not (_is_int(value) or (value is None and name in _OPTIONAL_INTS)):
                raise bad(name, "must be an integer" + (" or null" if name in _OPTIONAL_INTS else ""))
        for name in _FLOATS:
            value = getattr(self, name)
            if not (_is_int(value) or isinstance(value, float)) or not math.isfinite(value):
                raise bad(name, "must be a finite number")
        for name in _BOOLS:
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be true or false")
        if isinstance(self.stop, tuple):
            self.stop = list(self.stop)
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise bad("stop", "must be a string or a list of strings")
        for name in _ID_LISTS:
            ids = getattr(self, name)
            if isinstance(ids, tuple):
                setattr(self, name, ids := list(ids))
            if not isinstance(ids, list) or not all(_is_int(t) for t in ids):
                raise bad(name, "must be a list of integer token ids")
            if len(ids) > MAX_TOKEN_IDS:
                raise bad(name, f"at most {MAX_TOKEN_IDS} token ids")
            if any(t < 0 for t in ids):
                raise bad(name, "token ids must be >= 0")

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
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise bad("seed", f"must be in [{SEED_MIN}, {SEED_MAX}]")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad("logprobs", f"must be in [0, {MAX_LOGPROBS}]")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise bad("stop", f"at most {MAX_STOP_STRINGS} stop strings")
        if any(not s for s in self.stop):
            raise bad("stop", "stop strings must be non-empty")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            raise bad("stop", f"a stop string has at most {MAX_STOP_STRING_CHARS} characters")
        for name in _FLOATS:
            setattr(self, name, float(getattr(self, name)))
        self._check_logit_bias(bad)
        if not isinstance(self.structured_outputs, StructuredOutput | None):
            try:
                self.structured_outputs = StructuredOutput.of(self.structured_outputs)
            except RequestError as exc:
                raise bad("structured_outputs", exc.message.removeprefix("structured_outputs").lstrip(": ")) from None

    def _check_logit_bias(self, bad: Any) -> None:
        """OpenAI's shape: token ids (as strings on the wire, ints here) to biases in [-100, 100]."""
        bias = self.logit_bias
        if bias is None:
            self.logit_bias = bias = {}
        if not isinstance(bias, dict):
            raise bad("logit_bias", "must map token ids to numbers")
        if len(bias) > MAX_LOGIT_BIAS:
            raise bad("logit_bias", f"at most {MAX_LOGIT_BIAS} entries")
        parsed = {}
        for key, value in bias.items():
            token = int(key) if isinstance(key, str) and key.isdigit() else key
            if not _is_int(token) or token < 0:
                raise bad("logit_bias", f"keys must be token ids (got {short_repr(key)})")
            if not (_is_int(value) or isinstance(value, float)) or not -100 <= value <= 100:
                raise bad("logit_bias", f"biases must be numbers in [-100, 100] (got {short_repr(value)})")
            parsed[token] = float(value)
        self.logit_bias = parsed

    def check_token_ids(self, vocab_size: int) -> None:
        """Token ids the caller gave must be ids of the stage's vocabulary (the sampler indexes its logits by
        them)."""
        for name in _ID_LISTS:
            if any(t >= vocab_size for t in getattr(self, name)):
                raise InvalidParams(name, getattr(self, name), f"token ids must be in [0, {vocab_size}), this "
                                    "stage's vocabulary")
        if any(t >= vocab_size for t in self.logit_bias):
            raise InvalidParams("logit_bias", self.logit_bias, f"token ids must be in [0, {vocab_size}), this "
                                "stage's vocabulary")

    def with_seed_offset(self, offset: int) -> SamplingParams:
        """Choice `offset` of an n-way fan-out: seed + offset, wrapped into the seed range (unseeded: as is)."""
        if not offset or self.seed is None:
            return self
        seed = self.seed + offset
        return replace(self, seed=seed % 2**64 if seed > SEED_MAX else seed)  # the generator's seed is mod 2**64

    @property
    def generator_seed(self) -> int | None:
        """The seed as torch.Generator.manual_seed takes it: the same 64 bits whatever the sign."""
        return None if self.seed is None else self.seed % 2**64

    def with_overrides(self, **overrides) -> SamplingParams:
        known = {f.name for f in fields(self)}
        return replace(self, **{k: v for k, v in overrides.items() if k in known and v is not None})
