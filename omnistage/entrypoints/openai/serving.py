"""Between the OpenAI wire format and the engine: a validated request becomes one OmniRequest per choice,
those run together as a Fanout, and their deltas become a response or a stream of chunks.

Nothing here knows a particular model, and of HTTP only a route's request lifecycle (`run_admitted`: admission,
client disconnects, 499). The server never tokenizes; the one thing borrowed from the engine is
`engine.tokenizer` (entry-stage HF tokenizer or None), to spell token ids in logprobs.
"""

from __future__ import annotations

import asyncio
import base64
import codecs
import itertools
import json
import logging
import re
import struct
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, fields
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from omnistage.entrypoints.openai.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChoiceLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    DeltaAudio,
    MessageAudio,
    TokenLogprobEntry,
    TopLogprob,
    Usage,
    close_match,
    drop_ignored,
    seeded_copies,
)
from omnistage.entrypoints.openai.tool_parsers import StreamedToolCalls, tool_calls_of
from omnistage.errors import RequestError, StageError
from omnistage.media import encode_audio
from omnistage.sampling_params import VLLM_CHECKED_FIELDS, VLLM_IGNORED_FIELDS, InvalidParams, SamplingParams
from omnistage.types import OmniOutput, OmniRequest, TokenLogprob

if TYPE_CHECKING:
    from omnistage.entrypoints.async_omni import AsyncOmni

log = logging.getLogger("omnistage.server")
T = TypeVar("T")
Release = Callable[[], None]  # gives back what the HTTP edge admitted (idempotent)


class ModelNotFound(RequestError):
    status = 404
    code = "model_not_found"


# ---------------------------------------------------------------- request -> OmniRequests


M = TypeVar("M", bound=BaseModel)


def with_extra_body(data: dict[str, Any]) -> dict[str, Any]:
    """`data` with its `extra_body` (an object, or its JSON text from a form) merged in; its keys win."""
    extra = data.get("extra_body")
    if isinstance(extra, str):
        try:
            extra = json.loads(extra)
        except ValueError:
            raise RequestError("extra_body must be a JSON object", "extra_body") from None
    if extra is not None and not isinstance(extra, dict):
        raise RequestError("extra_body must be an object", "extra_body")
    return {**data, **(extra or {})}


def validated(model: type[M], data: dict[str, Any]) -> M:
    """`model` validated from `data`; a wrong type or value is a 400 naming the field."""
    from omnistage.entrypoints.openai.server import validation_message  # server.py includes this module

    try:
        return model.model_validate(data)
    except ValidationError as exc:
        message, param = validation_message(exc.errors())
        raise RequestError(message, param) from None


def check_model(names: Sequence[str], model: str | None) -> str:
    """The name the response reports: the one asked for, or the first served name when none is given (a
    missing or empty `model` is accepted, as vLLM does); any other name is OpenAI's 404 model_not_found."""
    if not model:
        return names[0]
    if model not in names:
        served = ", ".join(repr(n) for n in names)
        raise ModelNotFound(f"model '{model}' does not exist; this server serves {served}", param="model")
    return model


def output_modalities(engine: AsyncOmni, requested: list[str] | None) -> tuple[str, ...]:
    """The requested modalities, checked against the model's; by default text, if the model has it."""
    available = tuple(engine.output_modalities)
    if not requested:
        return ("text",) if "text" in available else available
    missing = [m for m in requested if m not in available]
    if missing:
        raise RequestError(
            f"modalities {missing} are not available: this model produces {list(available)}",
            param="modalities",
        )
    return tuple(dict.fromkeys(requested))


def stage_vocab_size(engine: AsyncOmni, stage: str) -> int | None:
    """The vocabulary of `stage` ('*': the entry stage) as its engine reported it; None where unknown (no AR
    stage, or an engine without an orchestrator)."""
    orchestrator = getattr(engine, "orchestrator", None)
    return orchestrator.vocab_size(stage) if orchestrator is not None else None


def _choice_params(engine: AsyncOmni, body: ChatCompletionRequest | CompletionRequest) -> list[SamplingParams]:
    params = body.to_sampling_params(engine.default_sampling_params())
    if (vocab := stage_vocab_size(engine, "*")) is not None:
        try:
            params.check_token_ids(vocab)
        except InvalidParams as exc:
            raise exc.at("") from None
    return seeded_copies(params, body.n)


def _fan_out(rid: str, inputs: list[dict[str, Any]], params: list[SamplingParams], **shared: Any) -> list[OmniRequest]:
    """One OmniRequest per (input, choice), in the response's choice order; a lone one keeps `rid` as its id."""
    pairs = list(itertools.product(inputs, params))
    return [
        OmniRequest(request_id=rid if len(pairs) == 1 else f"{rid}-{i}", stage_params={"*": p}, **inp, **shared)
        for i, (inp, p) in enumerate(pairs)
    ]


def _apply_stage_params(engine: AsyncOmni, body: ChatCompletionRequest | CompletionRequest,
                        requests: list[OmniRequest]) -> list[OmniRequest]:
    """`sampling_params_list` over each request's params; a seeded entry gets seed, seed+1, ... per choice."""
    if not body.sampling_params_list:
        return requests
    per_stage = stage_sampling_params(engine, body.sampling_params_list)
    for i, request in enumerate(requests):
        choice = i % body.n
        request.stage_params.update({stage: p.with_seed_offset(choice) for stage, p in per_stage.items()})
    return requests


def chat_requests(engine: AsyncOmni, body: ChatCompletionRequest, rid: str) -> list[OmniRequest]:
    params = _choice_params(engine, body)
    modalities = output_modalities(engine, body.modalities)
    options = body.template_options()
    if body.audio:
        options.update(voice=body.audio.voice, audio_format=body.audio.format, max_duration_s=body.audio.max_duration_s)
    if body.stream and "audio" in modalities:  # a streamed reply's audio is decoded as it comes (TTS codecs)
        options["stream_audio"] = True
    requests = _fan_out(rid, [{"messages": body.message_dicts()}], params, output_modalities=modalities,
                        options=options)
    return _apply_stage_params(engine, body, requests)


def pipeline_stages(engine: AsyncOmni) -> list[tuple[str, bool]]:
    """(stage name, is autoregressive) in pipeline order."""
    pipeline = getattr(engine, "pipeline", None)
    if pipeline is not None:
        return [(s.name, s.kind == "ar") for s in pipeline.stages]
    return [(name, True) for name in getattr(engine, "ar_stages", None) or ["*"]]


def _stage_defaults(engine: AsyncOmni, stage: str) -> SamplingParams:
    pipeline = getattr(engine, "pipeline", None)
    if pipeline is None or stage == "*":
        return engine.default_sampling_params()
    return pipeline.stage_config(stage).sampling_params()


_ENTRY_FIELDS = frozenset({f.name for f in fields(SamplingParams)})
_ENTRY_VOCABULARY = _ENTRY_FIELDS | VLLM_IGNORED_FIELDS | VLLM_CHECKED_FIELDS


def entry_params(entry: Any, defaults: SamplingParams, where: str, stage: str = "",
                 vocab_size: int | None = None) -> SamplingParams:
    """One `sampling_params_list` entry (omnistage's SamplingParams fields or a whole vLLM SamplingParams dict)
    over the stage's defaults; a null value keeps the default. Checked as strictly as SamplingParams itself, and
    its token ids against the stage's vocabulary where known; errors name the field by its path (`where`)."""
    note = f"; this entry is for stage {stage!r}" if stage and stage != "*" else ""
    if not isinstance(entry, dict):
        raise RequestError(f"{where} must be an object of sampling fields{note}", where)
    unknown = sorted(set(entry) - _ENTRY_VOCABULARY)
    if unknown:
        close = close_match(unknown[0], _ENTRY_VOCABULARY - {n for n in _ENTRY_VOCABULARY if n.startswith("_")})
        hint = f"; did you mean {close!r}?" if close else ""
        raise RequestError(f"{where}: unknown field {unknown[0]!r}{hint}", f"{where}.{unknown[0]}")
    entry = drop_ignored(entry, where)
    for name in ("n", "best_of"):
        value = entry.pop(name, None)
        if value is not None and (type(value) is not int or value != 1):
            raise RequestError(f"{where}.{name}: n and best_of are per request, not per stage; set 'n' on the "
                               "request", f"{where}.{name}")
    guided = entry.pop("guided_decoding", None)
    if guided is not None and entry.get("structured_outputs") is None:
        entry["structured_outputs"] = guided  # older vLLM's name for it
    for name in ("bad_words",):
        if entry.pop(name, None):
            raise RequestError(f"{where}.{name} is not supported; remove it", f"{where}.{name}")
    try:
        params = defaults.with_overrides(**entry)
        if vocab_size is not None:
            params.check_token_ids(vocab_size)
        return params
    except InvalidParams as exc:
        raise exc.at(where, note) from None


def stage_sampling_params(engine: AsyncOmni, entries: list[Any]) -> dict[str, SamplingParams]:
    """`sampling_params_list` -> params by stage name: one entry per stage in pipeline order (an entry for a
    non-AR stage, e.g. token2wav, carries at least its seed); fewer leave the later stages at their deploy
    defaults; a single entry applies to every AR stage."""
    stages = pipeline_stages(engine)
    names = ", ".join(name for name, _ in stages)
    if len(entries) > len(stages):
        raise RequestError(f"sampling_params_list has {len(entries)} entries but this model has {len(stages)} "
                           f"stages ({names}); give at most {len(stages)}, one per stage in pipeline order",
                           "sampling_params_list")
    if len(entries) == 1:
        targets = [name for name, ar in stages if ar] or [stages[0][0]]
        return {name: entry_params(entries[0], _stage_defaults(engine, name), "sampling_params_list[0]", name,
                                   stage_vocab_size(engine, name)) for name in targets}
    return {name: entry_params(entry, _stage_defaults(engine, name), f"sampling_params_list[{i}]", name,
                               stage_vocab_size(engine, name))
            for i, ((name, _), entry) in enumerate(zip(stages, entries, strict=False))}


def completion_requests(engine: AsyncOmni, body: CompletionRequest, rid: str) -> list[OmniRequest]:
    params = _choice_params(engine, body)
    output_modalities(engine, ["text"])  # completions answer in text: refuse a model that has none
    return _apply_stage_params(engine, body, _fan_out(rid, body.prompt_inputs(), params))


# ---------------------------------------------------------------- running generations


def raise_if_failed(out: OmniOutput) -> None:
    if out.error:
        raise StageError(out.error, status=out.error_status)


class Fanout:
    """The generations behind one HTTP request (n choices x prompts): started together, read as one
    merged stream of (choice index, delta), and always closed together, which aborts unfinished ones."""

    def __init__(self, engine: AsyncOmni, requests: list[OmniRequest]) -> None:
        self.engine, self.requests = engine, requests
        self.gens: list[AsyncIterator[OmniOutput]] = []
        self.pending: dict[asyncio.Future[OmniOutput], int] = {}  # next delta of each live generation
        self.done: set[int] = set()
        self.closed = False

    def _pull(self, i: int) -> None:
        self.pending[asyncio.ensure_future(anext(self.gens[i]))] = i

    async def start(self) -> None:
        """Wait for every generation's first delta, so validation errors (RequestError) and early stage
        failures surface as HTTP errors before any byte of the response is sent."""
        try:
            for i, req in enumerate(self.requests):
                self.gens.append(self.engine.generate(req))
                self._pull(i)
            await asyncio.wait(list(self.pending))
            for task in self.pending:
                exc = task.exception()
                if exc is None:
                    raise_if_failed(task.result())
                elif not isinstance(exc, StopAsyncIteration):
                    raise exc
        except BaseException:
            await self.aclose()
            raise

    async def events(self) -> AsyncIterator[tuple[int, OmniOutput]]:
        """(choice index, delta) as they arrive, simultaneous ones in index order; closes the fan-out at the end."""
        try:
            while self.pending:
                ready, _ = await asyncio.wait(list(self.pending), return_when=asyncio.FIRST_COMPLETED)
                for task in sorted(ready, key=self.pending.__getitem__):
                    i = self.pending.pop(task)
                    try:
                        out = task.result()
                    except StopAsyncIteration:
                        self.done.add(i)
                        continue
                    if out.finished:
                        self.done.add(i)
                    else:
                        self._pull(i)
                    yield i, out
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        """Idempotent; shielded so it completes even inside a cancelled (disconnected) request."""
        if self.closed:
            return
        self.closed = True
        with anyio.CancelScope(shield=True):
            for task in self.pending:
                task.cancel()
            await asyncio.gather(*self.pending, return_exceptions=True)
            self.pending.clear()
            for gen in self.gens:
                try:
                    await gen.aclose()
                except Exception:
                    log.debug("closing a generation failed", exc_info=True)
            for i, req in enumerate(self.requests[: len(self.gens)]):
                if i not in self.done:
                    try:
                        await self.engine.abort(req.request_id)
                    except Exception:
                        log.debug("abort(%s) failed", req.request_id, exc_info=True)


async def collect(fan: Fanout) -> list[OmniOutput]:
    """Each generation's deltas merged into one output. The first failure raises at once and aborts the
    other generations: the response is an error whatever they would have produced."""
    merged = [OmniOutput(request_id=r.request_id) for r in fan.requests]
    try:
        async for i, out in fan.events():
            raise_if_failed(out)
            merged[i].merge(out)
    finally:
        await fan.aclose()
    return merged


# ---------------------------------------------------------------- a route's generations, admitted to released


class ClientGone(Exception):
    """The HTTP client disconnected before its response was ready."""


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run `work`, cancelling it (which aborts its generations) if the client goes away first."""
    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientGone
    finally:
        for t in (task, watch):
            t.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(task, watch, return_exceptions=True)


async def run_admitted(
    request: Request,
    requests: list[OmniRequest],
    stream: Callable[[Fanout, Release], Response] | None = None,
) -> list[OmniOutput] | Response:
    """A route's generations from admission to release: admit them at the HTTP edge (its 429 / 503 raise), start
    them on the app's engine (a RequestError or an early stage failure raises, before any byte is sent), then
    hand them to `stream` for the response it builds, or collect each one's merged output (a failure raises).
    A client that leaves before that is answered 499 (an empty body).

    Invariant: every admitted request is released exactly once, and a disconnect aborts what has not finished in
    every stage: here while starting or collecting; once handed over, the response `stream` returns owns the
    fan-out and the release, and closes and calls them however it ends (as server.EventStream does)."""
    release = request.app.state.edge.admit(len(requests))
    fan = Fanout(request.app.state.engine, requests)
    handed_over = False
    try:
        await unless_disconnected(request, fan.start())
        if stream is not None:
            response = stream(fan, release)
            handed_over = True
            return response
        return await unless_disconnected(request, collect(fan))
    except ClientGone:
        log.info("client left; aborted %s", ", ".join(r.request_id for r in requests))
        return Response(status_code=499)
    finally:
        if not handed_over:
            await fan.aclose()  # idempotent: starting and collecting already close it however they end
            release()


# ---------------------------------------------------------------- token spelling for logprobs


def _byte_level_alphabet() -> dict[str, int]:
    """Inverse of the GPT-2 byte-level alphabet: printable Latin-1 bytes stand for themselves and the
    other bytes were moved, in order, to code points from 256 up."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in keep}
    moved = [b for b in range(256) if b not in set(keep)]
    table.update({chr(256 + i): b for i, b in enumerate(moved)})
    return table


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte fallback


class TokenTexts:
    """token id -> (text, utf-8 bytes), cached. Bytes are exact for byte-level BPE and byte-fallback
    tokens, so a client can rebuild characters split across tokens."""

    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self.alphabet = _byte_level_alphabet() if "ByteLevel" in repr(decoder) else None
        self.cache: dict[int, tuple[str, list[int] | None]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int] | None]:
        if token_id not in self.cache:
            self.cache[token_id] = self._spell(token_id)
        return self.cache[token_id]

    def _spell(self, token_id: int) -> tuple[str, list[int] | None]:
        if self.tokenizer is None:
            return f"token_id:{token_id}", None
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            text = self.tokenizer.decode([token_id])
            return text, list(text.encode())
        if self.alphabet is not None and all(c in self.alphabet for c in piece):
            raw = bytes(self.alphabet[c] for c in piece)
        elif match := _BYTE_TOKEN.fullmatch(piece):
            raw = bytes([int(match.group(1), 16)])
        else:
            raw = piece.replace("\u2581", " ").encode()  # SentencePiece's word-boundary mark
        return raw.decode("utf-8", errors="replace"), list(raw)


def _finite(logprob: float) -> float:
    """JSON has no -inf; masked tokens get a very negative finite value instead."""
    return max(float(logprob), -9999.0)


def _spelled(texts: TokenTexts, token_id: int, logprob: float) -> dict[str, Any]:
    text, raw = texts(token_id)
    return {"token": text, "logprob": _finite(logprob), "bytes": raw}


def chat_logprobs(logprobs: list[TokenLogprob] | None, texts: TokenTexts) -> ChoiceLogprobs | None:
    if logprobs is None:
        return None
    entries = [
        TokenLogprobEntry(
            **_spelled(texts, lp.token_id, lp.logprob),
            top_logprobs=[TopLogprob(**_spelled(texts, t, p)) for t, p in lp.top],
        )
        for lp in logprobs
    ]
    return ChoiceLogprobs(content=entries)


class TextOffsets:
    """Where each token of a choice starts in its text, in characters: the text's UTF-8 bytes are decoded
    as tokens come, so a character split over several byte tokens counts once (they all start at it)."""

    def __init__(self, start: int = 0) -> None:
        self.chars = start
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, text: str, raw: list[int] | None) -> int:
        """The offset of a token spelled `text` (utf-8 bytes `raw`), then moves past it."""
        offset = self.chars
        self.chars += len(self.decoder.decode(bytes(raw) if raw is not None else text.encode()))
        return offset


def completion_logprobs(
    logprobs: list[TokenLogprob] | None, texts: TokenTexts, offsets: TextOffsets
) -> CompletionLogprobs | None:
    """Completions-format logprobs for a delta; `offsets` carries the choice's position between deltas."""
    if logprobs is None:
        return None
    out = CompletionLogprobs()
    for lp in logprobs:
        text, raw = texts(lp.token_id)
        out.tokens.append(text)
        out.token_logprobs.append(_finite(lp.logprob))
        out.top_logprobs.append({texts(t)[0]: _finite(p) for t, p in lp.top})
        out.text_offset.append(offsets.add(text, raw))
    return out


# ---------------------------------------------------------------- audio


def streaming_wav_header(rate: int, channels: int = 1) -> bytes:
    """A 16-bit PCM WAV header whose sizes say "unknown" (0xFFFFFFFF), as streamed WAV players expect."""
    unknown = 0xFFFFFFFF
    return (b"RIFF" + struct.pack("<I", unknown) + b"WAVEfmt " + struct.pack("<IHHIIHH", 16, 1, channels, rate,
                                                                            rate * channels * 2, channels * 2, 16)
            + b"data" + struct.pack("<I", unknown))


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _audio_id() -> str:
    return f"audio-{uuid.uuid4().hex}"


def _message_audio(out: OmniOutput, fmt: str) -> MessageAudio | None:
    if out.audio is None or not out.sample_rate:
        return None
    data = encode_audio(out.audio, out.sample_rate, fmt)
    return MessageAudio(id=_audio_id(), data=_b64(data), expires_at=int(time.time()) + 3600, transcript=out.text)


# ---------------------------------------------------------------- usage


@dataclass
class Counts:
    """A streamed choice's token counts so far (a delta reports 0 for a count it does not know)."""

    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0

    def update(self, out: OmniOutput) -> None:
        self.num_prompt_tokens = out.num_prompt_tokens or self.num_prompt_tokens
        self.num_cached_tokens = out.num_cached_tokens or self.num_cached_tokens
        self.num_output_tokens = out.num_output_tokens or self.num_output_tokens


def usage_of(counts: Sequence[Counts | OmniOutput], group: int) -> Usage:
    """Choices come in groups of `group` sharing one prompt (n fan-out): each prompt counts once."""
    firsts = counts[::group]
    return Usage.of(
        prompt=sum(c.num_prompt_tokens for c in firsts),
        completion=sum(c.num_output_tokens for c in counts),
        cached=sum(c.num_cached_tokens for c in firsts),
    )


# ---------------------------------------------------------------- responses


async def _chunks(
    fan: Fanout,
    body: ChatCompletionRequest | CompletionRequest,
    chunk: Callable[..., BaseModel],
    choice: Callable[[int, OmniOutput], BaseModel | None],
) -> AsyncIterator[BaseModel]:
    """The streaming loop of both endpoints: a chunk per delta worth sending (`choice` returns None for
    the others), then the usage chunk if asked for. A failed generation raises."""
    counts = [Counts() for _ in fan.requests]
    async for i, out in fan.events():
        raise_if_failed(out)
        counts[i].update(out)
        if (c := choice(i, out)) is not None:
            yield chunk(choices=[c])
    if body.include_usage:
        yield chunk(choices=[], usage=usage_of(counts, body.n))


def _reply(body: ChatCompletionRequest, out: OmniOutput) -> tuple[str | None, list[dict] | None, str | None]:
    """A whole reply's (content, tool calls, finish reason), its calls read as the request's tool mode says."""
    content, calls = tool_calls_of(out.text, body.tool_mode)
    if not calls:
        return content, None, out.finish_reason
    return content or None, [c.to_dict() for c in calls], "tool_calls"


def render_chat(
    body: ChatCompletionRequest, rid: str, model: str, outputs: list[OmniOutput], texts: TokenTexts
) -> ChatCompletion:
    fmt = body.audio.format if body.audio else "wav"
    choices = []
    for i, out in enumerate(outputs):
        content, calls, reason = _reply(body, out)
        choices.append(ChatChoice(
            index=i,
            message=AssistantMessage(content=content, audio=_message_audio(out, fmt), tool_calls=calls),
            logprobs=chat_logprobs(out.logprobs, texts) if body.logprobs else None,
            finish_reason=reason,
            token_ids=out.token_ids if body.return_token_ids else None,
        ))
    return ChatCompletion(id=rid, model=model, choices=choices, usage=usage_of(outputs, body.n))


async def chat_chunks(
    fan: Fanout, body: ChatCompletionRequest, rid: str, model: str, texts: TokenTexts
) -> AsyncIterator[BaseModel]:
    """Each choice opens with an assistant-role chunk; audio comes as base64 pcm16 pieces."""
    chunk = partial(ChatCompletionChunk, id=rid, created=int(time.time()), model=model)
    audio_ids = [_audio_id() for _ in fan.requests]
    tools = [StreamedToolCalls(body.tool_mode) for _ in fan.requests]
    wav_header = [body.audio is not None and body.audio.format == "wav" for _ in fan.requests]

    def choice(i: int, out: OmniOutput) -> ChatChunkChoice | None:
        audio = None
        if out.audio is not None and out.audio.size:
            pcm = encode_audio(out.audio, out.sample_rate, "pcm16")
            if wav_header[i]:  # streamed wav: a header of unknown length opens the first piece
                pcm, wav_header[i] = streaming_wav_header(out.sample_rate) + pcm, False
            audio = DeltaAudio(id=audio_ids[i], data=_b64(pcm))
        content, calls = tools[i].feed(out.text, out.finished)
        if not (content or calls or out.token_ids or audio or out.finished):
            return None
        reason = ("tool_calls" if tools[i].num_calls else out.finish_reason) if out.finished else None
        return ChatChunkChoice(
            index=i,
            delta=ChatDelta(content=content or None, audio=audio, tool_calls=calls or None),
            logprobs=chat_logprobs(out.logprobs, texts) if body.logprobs else None,
            finish_reason=reason,
            token_ids=out.token_ids if body.return_token_ids else None,
        )

    for i in range(len(fan.requests)):
        yield chunk(choices=[ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))])
    async for c in _chunks(fan, body, chunk, choice):
        yield c


def _completion_choice(
    body: CompletionRequest, texts: TokenTexts, i: int, out: OmniOutput, offsets: TextOffsets | None = None
) -> CompletionChoice:
    """A whole choice or a streamed piece of one (the same shape); `offsets`: where the choice's earlier
    pieces left its text positions."""
    logprobs = None
    if body.logprobs is not None:
        logprobs = completion_logprobs(out.logprobs, texts, offsets or TextOffsets())
    return CompletionChoice(
        index=i,
        text=out.text,
        logprobs=logprobs,
        finish_reason=out.finish_reason if out.finished else None,
        token_ids=out.token_ids if body.return_token_ids else None,
    )


def render_completion(
    body: CompletionRequest, rid: str, model: str, outputs: list[OmniOutput], texts: TokenTexts
) -> Completion:
    choices = [_completion_choice(body, texts, i, out) for i, out in enumerate(outputs)]
    return Completion(id=rid, model=model, choices=choices, usage=usage_of(outputs, body.n))


async def completion_chunks(
    fan: Fanout, body: CompletionRequest, rid: str, model: str, texts: TokenTexts
) -> AsyncIterator[BaseModel]:
    chunk = partial(Completion, id=rid, created=int(time.time()), model=model)
    offsets = [TextOffsets() for _ in fan.requests]

    def choice(i: int, out: OmniOutput) -> CompletionChoice | None:
        if not (out.text or out.token_ids or out.finished):
            return None
        return _completion_choice(body, texts, i, out, offsets[i])

    async for c in _chunks(fan, body, chunk, choice):
        yield c
