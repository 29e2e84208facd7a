"""OpenAI wire format: typed request models (validated strictly, so a bad request fails with a message
naming the field) and the response models the server renders. Nothing here knows a particular model."""

from __future__ import annotations

import contextlib
import difflib
import json
import logging
import time
from dataclasses import replace
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from omnistage.errors import RequestError
from omnistage.sampling_params import MAX_LOGPROBS, VLLM_IGNORED_FIELDS, InvalidParams, SamplingParams

# Bounds of one request (the engines' limits are checked by SamplingParams and by each stage).
MAX_N = 16  # choices per prompt
MAX_CHOICES = 64  # prompts x n: the generations one request may start
MAX_MESSAGES = 1024
log = logging.getLogger("omnistage.server")


def close_match(name: str, vocabulary: Any) -> str | None:
    """The one known name `name` is likely a typo of, if any (strict, so nonsense gets no suggestion)."""
    close = difflib.get_close_matches(name, sorted(vocabulary), n=1, cutoff=0.75)
    return close[0] if close else None


def merge_extra_body(data: Any) -> Any:
    """A literal `extra_body` object (sent by clients other than the openai SDK) merged into the body, as the
    SDK does; on a conflict the extra_body value wins."""
    if not isinstance(data, dict) or "extra_body" not in data:
        return data
    data = dict(data)
    while "extra_body" in data:
        extra = data.pop("extra_body")
        if extra is None:
            continue
        if not isinstance(extra, dict):
            raise ValueError("extra_body must be a JSON object (its fields are merged into the request)")
        data.update(extra)
    return data


def drop_ignored(data: dict[str, Any], where: str) -> dict[str, Any]:
    """`data` without vLLM's accepted-and-ignored fields (each logged at debug level)."""
    ignored = sorted(VLLM_IGNORED_FIELDS & data.keys())
    if ignored:
        log.debug("%s: ignoring vLLM fields %s (accepted, not implemented)", where, ignored)
    return {k: v for k, v in data.items() if k not in VLLM_IGNORED_FIELDS}


def _omit_none(value: Any) -> bool:
    return value is None


def _optional(default: Any = None) -> Any:
    """A response field left out of the JSON when unset (extensions and optional parts)."""
    return Field(default, exclude_if=_omit_none)


def _now() -> int:
    return int(time.time())


class _Strict(BaseModel):
    """Request models: no type coercion ("5" is not 5) and no unknown fields, like OpenAI itself."""

    model_config = ConfigDict(strict=True, extra="forbid")


# ---------------------------------------------------------------- requests: messages


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageURL(_Strict):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImageURLPart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL


class MediaURL(_Strict):
    url: str


class AudioURLPart(_Strict):
    type: Literal["audio_url"]
    audio_url: MediaURL


class VideoURLPart(_Strict):
    type: Literal["video_url"]
    video_url: MediaURL


class InputAudio(_Strict):
    data: str  # base64
    format: str


class InputAudioPart(_Strict):
    type: Literal["input_audio"]
    input_audio: InputAudio


ContentPart = Annotated[
    TextPart | ImageURLPart | AudioURLPart | VideoURLPart | InputAudioPart, Field(discriminator="type")
]


class FunctionCall(_Strict):
    name: str
    arguments: str  # a JSON object, serialised


class MessageToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's earlier calls

    @model_validator(mode="after")
    def _needs_content(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a '{self.role}' message needs 'content' (a string or a list of content parts)")
        return self

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for the runtime's chat template; 'developer' is OpenAI's newer name for 'system'."""
        out = self.model_dump(exclude_none=True)
        out.setdefault("content", "")
        if out["role"] == "developer":
            out["role"] = "system"
        for call in out.get("tool_calls") or []:  # templates write the arguments as an object (`| tojson`)
            with contextlib.suppress(json.JSONDecodeError):
                call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        return out


class FunctionDef(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class ToolName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: ToolName


class JSONSchemaFormat(_Strict):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('response_format {"type": "json_schema"} needs "json_schema": {"name", "schema"}')
        return self

    def structured(self) -> dict[str, Any] | None:
        if self.type == "json_object":
            return {"json_object": True}
        if self.type == "json_schema":
            return {"json": self.json_schema.schema_ or {"type": "object"}}
        return None


class StreamOptions(_Strict):
    include_usage: bool = False


class AudioOptions(_Strict):
    """Chat `audio` parameter: how spoken output is returned when `modalities` includes "audio"."""

    voice: str | None = None
    format: Literal["wav", "mp3", "flac", "opus", "pcm16"] = "wav"
    # the longest reply to speak, in seconds (the talker stops there); None: the deploy config's bound
    max_duration_s: float | None = Field(None, gt=0, le=3600)


# ---------------------------------------------------------------- requests: shared sampling fields


class _SamplingRequest(_Strict):
    """Fields common to chat and completions, plus omnistage extensions (top_k, min_p, ...)."""

    model: str | None = None  # None: the served model
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    bad_words: list[str] | None = None  # vLLM's; refused when non-empty
    return_token_ids: bool = False  # extension: each choice also carries its generated token ids
    # structured output (vLLM): {"json": schema} | {"regex": ...} | {"choice": [...]} | {"grammar": ...} |
    # {"json_object": true}; older vLLM's guided_* fields mean the same
    structured_outputs: dict[str, Any] | None = None
    guided_decoding: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # omnistage / vLLM-Omni extension: sampling params per stage, in pipeline order (e.g. [thinker, talker,
    # token2wav]); fewer entries leave the later stages at their defaults, one entry applies to every AR stage.
    # Fields as in SamplingParams, or a whole vLLM SamplingParams dict.
    sampling_params_list: list[dict[str, Any]] | None = Field(None, max_length=16)

    @model_validator(mode="before")
    @classmethod
    def _extra_body_and_vllm_fields(cls, data: Any) -> Any:
        """A literal extra_body is merged in; vLLM's SamplingParams fields that omnistage does not implement
        are accepted and dropped."""
        data = merge_extra_body(data)
        return drop_ignored(data, cls.__name__) if isinstance(data, dict) else data

    # check_fields=False: `logprobs` is declared by the subclasses (a bool in chat, an int in completions).
    @field_validator("n", "stream", "return_token_ids", "logprobs", mode="before", check_fields=False)
    @classmethod
    def _null_is_default(cls, value: Any, info: ValidationInfo) -> Any:
        """Some clients send `null` for every unset field; treat it as "not sent"."""
        return cls.model_fields[info.field_name].default if value is None else value

    @field_validator("bad_words")
    @classmethod
    def _no_bad_words(cls, value: list[str] | None) -> list[str] | None:
        if value:
            raise ValueError("bad_words is not supported; remove it")
        return value

    @model_validator(mode="after")
    def _best_of(self) -> _SamplingRequest:
        best_of = getattr(self, "best_of", None)
        if best_of is not None and best_of != self.n:
            raise ValueError("best_of is not supported (send n instead)")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _requested_max_tokens(self) -> int | None:
        raise NotImplementedError

    def _requested_logprobs(self) -> int | None:
        raise NotImplementedError

    def structured_spec(self) -> dict[str, Any] | None:
        """The one structured-output constraint the request asks for, in vLLM's shape; two is a 400."""
        specs = {}
        for name in ("structured_outputs", "guided_decoding"):
            if getattr(self, name):
                specs[name] = getattr(self, name)
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                          ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                specs[name] = {key: getattr(self, name)}
        specs.update(self._own_structured())
        if len(specs) > 1:
            raise RequestError(f"{' and '.join(sorted(specs))} both constrain the output; send only one",
                               sorted(specs)[1])
        return next(iter(specs.values()), None)

    def _own_structured(self) -> dict[str, dict[str, Any]]:
        return {}

    def to_sampling_params(self, defaults: SamplingParams) -> SamplingParams:
        """Deploy-config defaults overridden by what the client set. Raises InvalidParams (a 400) on
        out-of-range values, naming the parameter."""
        names = (
            "temperature", "top_p", "stop", "seed", "presence_penalty", "frequency_penalty", "top_k", "min_p",
            "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "skip_special_tokens",
            "include_stop_str_in_output", "logit_bias",
        )  # fmt: skip
        try:
            params = defaults.with_overrides(**{name: getattr(self, name) for name in names})
            # Set even when None: None max_tokens lets the runtime fill the remaining context.
            return replace(params, max_tokens=self._requested_max_tokens(), logprobs=self._requested_logprobs(),
                           structured_outputs=self.structured_spec() or defaults.structured_outputs)
        except InvalidParams as exc:
            raise exc.at("") from None


def _call_schema(tool: ToolDef) -> dict[str, Any]:
    return {"type": "object", "properties": {"name": {"const": tool.function.name},
                                             "arguments": tool.function.parameters or {"type": "object"}},
            "required": ["name", "arguments"], "additionalProperties": False}


def forced_tool_schema(tools: list[ToolDef], choice: Any) -> dict[str, Any]:
    """The JSON a forced tool choice must produce: the named tool's call, or ("required") a list of calls."""
    if isinstance(choice, NamedToolChoice):
        return _call_schema(next(t for t in tools if t.function.name == choice.function.name))
    return {"type": "array", "minItems": 1, "items": {"anyOf": [_call_schema(t) for t in tools]}}


def seeded_copies(params: SamplingParams, n: int) -> list[SamplingParams]:
    """One params per choice of an n-way fan-out; a seeded request gets seeds seed, seed+1, ... so the
    choices differ yet the whole response stays reproducible."""
    return [params.with_seed_offset(i) for i in range(n)]


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(max_length=MAX_MESSAGES)
    best_of: int | None = None  # vLLM's; only best_of == n
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    modalities: list[str] | None = None
    audio: AudioOptions | None = None
    tools: list[ToolDef] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    # chat template controls (vLLM's)
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    mm_processor_kwargs: dict[str, Any] | None = None
    # Accepted for client compatibility.
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None

    @field_validator("messages")
    @classmethod
    def _non_empty(cls, value: list[ChatMessage]) -> list[ChatMessage]:
        if not value:
            raise ValueError("messages must contain at least one message")
        return value

    @property
    def tool_mode(self) -> str:
        """How the reply's tool calls are read: "none" (no tools, or tool_choice none), "auto" (Hermes-style
        blocks in the text), "named" / "required" (the grammar forces a JSON call / a JSON list of calls)."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    def _own_structured(self) -> dict[str, dict[str, Any]]:
        own = {}
        if self.response_format is not None and (spec := self.response_format.structured()):
            own["response_format"] = spec
        if self.tool_mode in ("named", "required"):
            own["tool_choice"] = {"json": forced_tool_schema(self.tools, self.tool_choice)}
        return own

    def template_options(self) -> dict[str, Any]:
        """What the family's chat template and processor get besides the messages."""
        options: dict[str, Any] = {"add_generation_prompt": self.add_generation_prompt,
                                   "continue_final_message": self.continue_final_message}
        if self.tools and self.tool_choice != "none":
            options["tools"] = [t.model_dump(exclude_none=True) for t in self.tools]
        if self.chat_template_kwargs:
            options["chat_template_kwargs"] = dict(self.chat_template_kwargs)
        if self.mm_processor_kwargs:
            options["mm_processor_kwargs"] = dict(self.mm_processor_kwargs)
        return options

    @model_validator(mode="after")
    def _consistent(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        both = self.max_tokens is not None and self.max_completion_tokens is not None
        if both and self.max_tokens != self.max_completion_tokens:
            raise ValueError("max_tokens and max_completion_tokens disagree; send only one")
        if self.stream and self.audio is not None and self.audio.format not in ("pcm16", "wav"):
            raise ValueError(f"streamed audio is pcm16 or wav (a header, then PCM), not {self.audio.format}; set "
                             "audio.format, or do not stream")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ValueError("tool_choice needs 'tools' to choose from")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in {
                t.function.name for t in self.tools}:
            raise ValueError(f"tool_choice names {self.tool_choice.function.name!r}, which is not among 'tools'")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message continues the last message: send add_generation_prompt=false")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs the last message to be the assistant's")
        return self

    def _requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def _requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def message_dicts(self) -> list[dict[str, Any]]:
        return [m.to_dict() for m in self.messages]


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, value: Any) -> Any:
        """One clear message for every wrong shape, instead of one error per union member."""

        def token_ids(row: Any) -> bool:
            return isinstance(row, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in row)

        if isinstance(value, str):
            return value
        shape_ok = isinstance(value, list) and (
            all(isinstance(x, str) for x in value) or token_ids(value) or all(token_ids(x) for x in value)
        )
        if not shape_ok:
            raise ValueError(
                "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists"
            )
        if not value:
            raise ValueError("prompt must not be an empty list")
        if isinstance(value[0], str):
            return value
        for row in value if isinstance(value[0], list) else [value]:
            if not row:
                raise ValueError("a token-id prompt must not be empty")
            if min(row) < 0:
                raise ValueError("token ids must be >= 0")
        return value

    @model_validator(mode="after")
    def _unsupported(self) -> CompletionRequest:
        prompts = len(self.prompt_inputs())
        if prompts * self.n > MAX_CHOICES:
            raise ValueError(f"{prompts} prompts x n={self.n} would start {prompts * self.n} generations; at most "
                             f"{MAX_CHOICES} per request")
        if self.echo:
            raise ValueError("echo=true is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self

    def _requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def _requested_logprobs(self) -> int | None:
        return self.logprobs

    def prompt_inputs(self) -> list[dict[str, Any]]:
        """One OmniRequest input per prompt of the batch: {"prompt": str} or {"prompt_token_ids": [...]}."""
        p = self.prompt
        if isinstance(p, str):
            return [{"prompt": p}]
        if isinstance(p[0], int):
            return [{"prompt_token_ids": list(p)}]
        return [{"prompt": x} if isinstance(x, str) else {"prompt_token_ids": list(x)} for x in p]


# Every name a request body may carry (for "did you mean" suggestions).
REQUEST_FIELDS = frozenset({*ChatCompletionRequest.model_fields, *CompletionRequest.model_fields,
                            *VLLM_IGNORED_FIELDS, "extra_body"})


# ---------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = _optional()

    @classmethod
    def of(cls, prompt: int, completion: int, cached: int) -> Usage:
        return cls(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprobEntry] | None = None


class MessageAudio(BaseModel):
    id: str
    data: str  # base64 audio file (format chosen by the request)
    expires_at: int
    transcript: str


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    audio: MessageAudio | None = _optional()
    tool_calls: list[dict[str, Any]] | None = _optional()


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = _optional()


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaAudio(BaseModel):
    id: str | None = _optional()
    data: str | None = _optional()  # base64 pcm16 little-endian mono
    transcript: str | None = _optional()


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = _optional()
    content: str | None = _optional()
    audio: DeltaAudio | None = _optional()
    tool_calls: list[dict[str, Any]] | None = _optional()  # each with its `index` among the choice's calls


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = _optional()


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = _optional()


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = _optional()


class Completion(BaseModel):
    """Both the full response and each stream chunk (OpenAI uses one shape for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = _optional()


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "omnistage"
    max_model_len: int | None = _optional()
    output_modalities: list[str] | None = _optional()


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""

    error: ErrorInfo

    @classmethod
    def of(cls, message: str, type: str, param: str | None = None, code: str | None = None) -> ErrorResponse:
        return cls(error=ErrorInfo(message=message, type=type, param=param, code=code))
