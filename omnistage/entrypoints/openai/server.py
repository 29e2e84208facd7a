"""OpenAI-compatible HTTP server over AsyncOmni.

Handlers stay thin: validate (protocol.py), turn the request into OmniRequests, read the engine's delta
outputs, render them. The server never tokenizes and knows nothing of a particular model; the one thing it
borrows from the engine is `engine.tokenizer` (entry-stage HF tokenizer or None), to spell token ids in
logprobs. Every failure becomes an OpenAI error body, and a client that leaves aborts its generations.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import inspect
import io
import logging
import re
import socket
import threading
import time
import uuid
import wave
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import torch
import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from omnistage.engine.types import TokenLogprob
from omnistage.entrypoints.openai.metrics import router as metrics_router
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
    ErrorResponse,
    MessageAudio,
    ModelCard,
    ModelList,
    TokenLogprobEntry,
    TopLogprob,
    Usage,
    seeded_copies,
)
from omnistage.errors import OmniError, RequestError, StageError
from omnistage.runtime.messages import OmniOutput, OmniRequest

if TYPE_CHECKING:
    from omnistage.entrypoints.async_omni import AsyncOmni

log = logging.getLogger("omnistage.server")
T = TypeVar("T")


class ModelNotFound(RequestError):
    status = 404
    code = "model_not_found"


class ClientGone(Exception):
    """The HTTP client disconnected before its response was ready."""


# ---------------------------------------------------------------- errors


def error_response(
    status: int, message: str, type: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    body = ErrorResponse.of(message, type, param, code).model_dump()
    return JSONResponse(body, status_code=status)


_UNION_TAGS = {"str", "int", "float", "bool", "none", "dict", "list"}


def _loc_path(loc: Sequence[Any]) -> str:
    """('body', 'messages', 0, 'role') -> 'messages[0].role', dropping pydantic's union-member tags."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part != "body" and "[" not in part and part not in _UNION_TAGS:
            path += f".{part}" if path else part
    return path


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_under(path: str, parent: str) -> bool:
    return bool(parent) and path.startswith((parent + ".", parent + "["))


def validation_message(errors: Sequence[dict[str, Any]]) -> tuple[str, str | None]:
    """Pydantic errors -> one readable sentence that says what to fix, plus the offending parameter."""
    items: list[tuple[str, str]] = []
    for err in errors:
        path, kind, raw = _loc_path(err.get("loc", ())), err.get("type", ""), str(err.get("msg", "invalid"))
        if kind == "json_invalid":
            detail = (err.get("ctx") or {}).get("error", "")
            return f"request body is not valid JSON ({detail}); send a JSON object", None
        if kind == "value_error":  # our own validators already name the field and the fix
            items.append((path, raw.removeprefix("Value error, ")))
        elif not path:
            items.append(("", "request body must be a JSON object"))
        elif kind == "missing":
            items.append((path, f"'{path}' is required"))
        elif kind == "extra_forbidden":
            items.append((path, f"unknown field '{path}'; remove it"))
        else:
            got = err.get("input")
            shown = "" if isinstance(got, dict | list) else f" (got {_short(got)})"
            items.append((path, f"{path}: {raw}{shown}"))
    # A union reports one error per member: keep the deepest ones and drop duplicates.
    kept = [(p, m) for p, m in items if not any(_is_under(q, p) for q, _ in items)]
    unique = list(dict.fromkeys(m for _, m in kept))
    message = "; ".join(unique[:3]) + ("; ..." if len(unique) > 3 else "")
    return message or "invalid request", (kept[0][0] or None) if kept else None


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc.errors())
        return error_response(400, message, "invalid_request_error", param)

    @app.exception_handler(OmniError)
    async def _omni(_: Request, exc: OmniError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.type, exc.param, getattr(exc, "code", None))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}; see GET /v1/models, POST /v1/chat/completions"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        return error_response(
            exc.status_code, message, "invalid_request_error" if exc.status_code < 500 else "internal_error"
        )

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        # Starlette re-raises after answering, so uvicorn logs the traceback; the server keeps serving.
        return error_response(500, f"internal server error ({type(exc).__name__}: {exc})", "internal_error")


class BearerAuth:
    """Pure ASGI guard for /v1/*: plain ASGI, so streaming and disconnect detection are untouched."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                reason = "missing" if not given else "invalid"
                message = f"{reason} API key: send the header 'Authorization: Bearer <api key>'"
                response = error_response(401, message, "invalid_request_error", code="invalid_api_key")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


# ---------------------------------------------------------------- token spelling for logprobs


def _byte_level_alphabet() -> dict[str, int]:
    """Inverse of the GPT-2 byte-level alphabet: printable Latin-1 bytes stand for themselves and the
    other bytes were moved, in order, to code points from 256 up."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in keep}
    moved = [b for b in range(256) if b not in set(keep)]
    table.update({chr(256 + i): b for i, b in enumerate(moved)})
    return table


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


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
            raw = piece.replace("\u2581", " ").encode()
        return raw.decode("utf-8", errors="replace"), list(raw)


def _finite(logprob: float) -> float:
    """JSON has no -inf; masked tokens get a very negative finite value instead."""
    return max(float(logprob), -9999.0)


def chat_logprobs(logprobs: list[TokenLogprob] | None, texts: TokenTexts) -> ChoiceLogprobs | None:
    if logprobs is None:
        return None

    def top(token_id: int, logprob: float) -> TopLogprob:
        text, raw = texts(token_id)
        return TopLogprob(token=text, logprob=_finite(logprob), bytes=raw)

    entries = [
        TokenLogprobEntry(**top(lp.token_id, lp.logprob).model_dump(), top_logprobs=[top(t, p) for t, p in lp.top])
        for lp in logprobs
    ]
    return ChoiceLogprobs(content=entries)


def completion_logprobs(
    logprobs: list[TokenLogprob] | None, texts: TokenTexts, offset: int
) -> tuple[CompletionLogprobs | None, int]:
    """Completions-format logprobs for a delta; `offset` is the choice's text length so far."""
    if logprobs is None:
        return None, offset
    out = CompletionLogprobs()
    for lp in logprobs:
        text = texts(lp.token_id)[0]
        out.tokens.append(text)
        out.token_logprobs.append(_finite(lp.logprob))
        out.top_logprobs.append({texts(t)[0]: _finite(p) for t, p in lp.top})
        out.text_offset.append(offset)
        offset += len(text)
    return out, offset


# ---------------------------------------------------------------- audio


def _pcm16(samples: torch.Tensor) -> bytes:
    """Mono float samples in [-1, 1] -> 16-bit little-endian PCM."""
    return (samples.detach().float().clamp(-1, 1) * 32767).round().to(torch.int16).cpu().numpy().tobytes()


def _wav(samples: torch.Tensor, rate: int) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes(_pcm16(samples))
    return buf.getvalue()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# ---------------------------------------------------------------- running generations


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


class Fanout:
    """The generations behind one HTTP request (n choices x prompts): started together, read as one
    merged stream of (choice index, delta), and always closed together, which aborts unfinished ones."""

    def __init__(self, engine: AsyncOmni, requests: list[OmniRequest]) -> None:
        self.engine, self.requests = engine, requests
        self.gens: list[Any] = []
        self.pending: dict[asyncio.Future, int] = {}
        self.done: set[int] = set()
        self.closed = False

    def _pull(self, i: int) -> None:
        self.pending[asyncio.ensure_future(anext(self.gens[i]))] = i

    async def start(self) -> None:
        """Wait for every generation's first delta, so validation errors (RequestError) and early stage
        failures surface as HTTP errors before any byte of the response is sent."""
        try:
            for i, req in enumerate(self.requests):
                self.gens.append(await _maybe_await(self.engine.generate(req)))
                self._pull(i)
            await asyncio.wait(list(self.pending))
            for task in self.pending:
                exc = task.exception()
                if exc is not None and not isinstance(exc, StopAsyncIteration):
                    raise exc
                out = None if exc is not None else task.result()
                if out is not None and out.error:
                    raise StageError(out.error, status=out.error_status)
        except BaseException:
            await self.aclose()
            raise

    async def events(self) -> AsyncIterator[tuple[int, OmniOutput]]:
        try:
            while self.pending:
                ready, _ = await asyncio.wait(list(self.pending), return_when=asyncio.FIRST_COMPLETED)
                for task in sorted(ready, key=self.pending.__getitem__):
                    i = self.pending.pop(task)
                    try:
                        out: OmniOutput = task.result()
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
            for i, req in enumerate(self.requests):
                if i not in self.done and i < len(self.gens):
                    try:
                        await _maybe_await(self.engine.abort(req.request_id))
                    except Exception:
                        log.debug("abort(%s) failed", req.request_id, exc_info=True)


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


async def collect(fan: Fanout) -> list[OmniOutput]:
    merged = [OmniOutput(request_id=r.request_id) for r in fan.requests]
    async for i, out in fan.events():
        merged[i].merge(out)
    return merged


def _raise_failed(outputs: list[OmniOutput]) -> None:
    for out in outputs:
        if out.error:
            raise StageError(out.error, status=out.error_status)


@dataclass
class Counts:
    """Cumulative usage counters of one choice, updated from its deltas."""

    prompt: int = 0
    cached: int = 0
    output: int = 0

    def update(self, out: OmniOutput) -> None:
        self.prompt = out.num_prompt_tokens or self.prompt
        self.cached = out.num_cached_tokens or self.cached
        self.output = out.num_output_tokens or self.output


def usage_of(counts: Sequence[Counts], group: int) -> Usage:
    """Choices come in groups of `group` sharing one prompt (n fan-out): each prompt counts once."""
    firsts = counts[::group]
    return Usage.of(sum(c.prompt for c in firsts), sum(c.output for c in counts), sum(c.cached for c in firsts))


def _counts(outputs: Sequence[OmniOutput]) -> list[Counts]:
    counts = [Counts() for _ in outputs]
    for c, out in zip(counts, outputs, strict=True):
        c.update(out)
    return counts


def _sse(model: BaseModel) -> str:
    return f"data: {model.model_dump_json()}\n\n"


def _sse_error(exc: Exception) -> str:
    status = getattr(exc, "status", 500)
    kind = getattr(exc, "type", "internal_error")
    body = ErrorResponse.of(getattr(exc, "message", str(exc)), kind, getattr(exc, "param", None))
    log.warning("stream failed (%s): %s", status, exc)
    return f"data: {body.model_dump_json()}\n\n"


_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class EventStream(StreamingResponse):
    """SSE response that closes its generations however it ends, even if the client leaves before
    the body is first iterated (then the body generator's own cleanup would never run)."""

    def __init__(self, events: AsyncIterator[str], fan: Fanout) -> None:
        super().__init__(_sse_body(events, fan), media_type="text/event-stream", headers=_SSE_HEADERS)
        self.fan = fan

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.fan.aclose()


async def _sse_body(events: AsyncIterator[str], fan: Fanout) -> AsyncIterator[str]:
    """Errors after the first byte go in-band as an OpenAI error event; the stream always ends [DONE]."""
    try:
        async for event in events:
            yield event
    except Exception as exc:  # headers already sent
        yield _sse_error(exc)
    finally:
        await fan.aclose()
    yield "data: [DONE]\n\n"


# ---------------------------------------------------------------- request -> OmniRequests


def _engine(request: Request) -> AsyncOmni:
    return request.app.state.engine


def _texts(request: Request) -> TokenTexts:
    return request.app.state.token_texts


def check_model(engine: AsyncOmni, model: str | None) -> str:
    served = engine.served_model_name
    if model is not None and model != served:
        raise ModelNotFound(f"model '{model}' does not exist; this server serves '{served}'", param="model")
    return served


def _modalities(engine: AsyncOmni, requested: list[str] | None) -> tuple[str, ...]:
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


def _ids(base: str, count: int) -> list[str]:
    return [base] if count == 1 else [f"{base}-{i}" for i in range(count)]


def chat_requests(engine: AsyncOmni, body: ChatCompletionRequest, rid: str) -> list[OmniRequest]:
    params = body.to_sampling_params(engine.default_sampling_params())
    modalities = _modalities(engine, body.modalities)
    options = {"voice": body.audio.voice, "audio_format": body.audio.format} if body.audio else {}
    return [
        OmniRequest(
            request_id=req_id,
            messages=body.message_dicts(),
            output_modalities=modalities,
            stage_params={"*": p},
            options=dict(options),
        )
        for req_id, p in zip(_ids(rid, body.n), seeded_copies(params, body.n), strict=True)
    ]


def completion_requests(engine: AsyncOmni, body: CompletionRequest, rid: str) -> list[OmniRequest]:
    params = body.to_sampling_params(engine.default_sampling_params())
    _modalities(engine, ["text"])
    inputs = body.prompt_inputs()
    ids = _ids(rid, len(inputs) * body.n)
    per_choice = seeded_copies(params, body.n)
    return [
        OmniRequest(request_id=ids[k * body.n + j], stage_params={"*": per_choice[j]}, **inp)
        for k, inp in enumerate(inputs)
        for j in range(body.n)
    ]


# ---------------------------------------------------------------- rendering


def _message_audio(out: OmniOutput, fmt: str) -> MessageAudio | None:
    if out.audio is None or not out.sample_rate:
        return None
    data = _wav(out.audio, out.sample_rate) if fmt == "wav" else _pcm16(out.audio)
    return MessageAudio(
        id=f"audio-{uuid.uuid4().hex}",
        data=_b64(data),
        expires_at=int(time.time()) + 3600,
        transcript=out.text,
    )


def render_chat(
    body: ChatCompletionRequest, rid: str, model: str, outputs: list[OmniOutput], texts: TokenTexts
) -> ChatCompletion:
    fmt = body.audio.format if body.audio else "wav"
    choices = [
        ChatChoice(
            index=i,
            message=AssistantMessage(content=out.text, audio=_message_audio(out, fmt)),
            logprobs=chat_logprobs(out.logprobs, texts) if body.logprobs else None,
            finish_reason=out.finish_reason,
            token_ids=out.token_ids if body.return_token_ids else None,
        )
        for i, out in enumerate(outputs)
    ]
    return ChatCompletion(id=rid, model=model, choices=choices, usage=usage_of(_counts(outputs), body.n))


async def chat_events(
    fan: Fanout, body: ChatCompletionRequest, rid: str, model: str, texts: TokenTexts
) -> AsyncIterator[str]:
    created = int(time.time())
    counts = [Counts() for _ in fan.requests]
    audio_ids = [f"audio-{uuid.uuid4().hex}" for _ in fan.requests]

    def chunk(i: int, delta: ChatDelta, **kw: Any) -> str:
        choice = ChatChunkChoice(index=i, delta=delta, **kw)
        return _sse(ChatCompletionChunk(id=rid, created=created, model=model, choices=[choice]))

    for i in range(len(fan.requests)):
        yield chunk(i, ChatDelta(role="assistant", content=""))
    async for i, out in fan.events():
        if out.error:
            raise StageError(out.error, status=out.error_status)
        counts[i].update(out)
        audio = None
        if out.audio is not None and out.audio.numel():
            audio = DeltaAudio(id=audio_ids[i], data=_b64(_pcm16(out.audio)))
        if out.text or out.token_ids or audio or out.finished:
            yield chunk(
                i,
                ChatDelta(content=out.text or None, audio=audio),
                logprobs=chat_logprobs(out.logprobs, texts) if body.logprobs else None,
                finish_reason=out.finish_reason if out.finished else None,
                token_ids=out.token_ids if body.return_token_ids else None,
            )
    if body.include_usage:
        yield _sse(
            ChatCompletionChunk(id=rid, created=created, model=model, choices=[], usage=usage_of(counts, body.n))
        )


def render_completion(
    body: CompletionRequest, rid: str, model: str, outputs: list[OmniOutput], texts: TokenTexts
) -> Completion:
    choices = [
        CompletionChoice(
            index=i,
            text=out.text,
            logprobs=completion_logprobs(out.logprobs, texts, 0)[0] if body.logprobs is not None else None,
            finish_reason=out.finish_reason,
            token_ids=out.token_ids if body.return_token_ids else None,
        )
        for i, out in enumerate(outputs)
    ]
    return Completion(id=rid, model=model, choices=choices, usage=usage_of(_counts(outputs), body.n))


async def completion_events(
    fan: Fanout, body: CompletionRequest, rid: str, model: str, texts: TokenTexts
) -> AsyncIterator[str]:
    created = int(time.time())
    counts = [Counts() for _ in fan.requests]
    offsets = [0] * len(fan.requests)
    async for i, out in fan.events():
        if out.error:
            raise StageError(out.error, status=out.error_status)
        counts[i].update(out)
        if not (out.text or out.token_ids or out.finished):
            continue
        logprobs = None
        if body.logprobs is not None:
            logprobs, offsets[i] = completion_logprobs(out.logprobs, texts, offsets[i])
        choice = CompletionChoice(
            index=i,
            text=out.text,
            logprobs=logprobs,
            finish_reason=out.finish_reason if out.finished else None,
            token_ids=out.token_ids if body.return_token_ids else None,
        )
        yield _sse(Completion(id=rid, created=created, model=model, choices=[choice]))
    if body.include_usage:
        yield _sse(Completion(id=rid, created=created, model=model, choices=[], usage=usage_of(counts, body.n)))


# ---------------------------------------------------------------- routes

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    ready, detail = _engine(request).health()
    return JSONResponse(
        {"status": "ok" if ready else "unavailable", "detail": detail}, status_code=200 if ready else 503
    )


@router.get("/v1/models")
async def list_models(request: Request) -> ModelList:
    engine = _engine(request)
    card = ModelCard(
        id=engine.served_model_name,
        max_model_len=engine.max_model_len,
        output_modalities=list(engine.output_modalities),
    )
    return ModelList(data=[card])


async def _respond(
    request: Request,
    fan: Fanout,
    stream: bool,
    events: Callable[[], AsyncIterator[str]],
    render: Callable[[list[OmniOutput]], BaseModel],
) -> Response:
    """Shared tail of both endpoints: start, then stream or collect, aborting if the client leaves."""
    try:
        await unless_disconnected(request, fan.start())
        if stream:
            return EventStream(events(), fan)
        outputs = await unless_disconnected(request, collect(fan))
    except ClientGone:
        log.info("client left; aborted %s", [r.request_id for r in fan.requests])
        return Response(status_code=499)
    _raise_failed(outputs)
    return JSONResponse(render(outputs).model_dump())


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    engine = _engine(request)
    model = check_model(engine, body.model)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    fan = Fanout(engine, chat_requests(engine, body, rid))
    texts = _texts(request)
    return await _respond(
        request,
        fan,
        body.stream,
        lambda: chat_events(fan, body, rid, model, texts),
        lambda outs: render_chat(body, rid, model, outs, texts),
    )


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request) -> Response:
    engine = _engine(request)
    model = check_model(engine, body.model)
    rid = f"cmpl-{uuid.uuid4().hex}"
    fan = Fanout(engine, completion_requests(engine, body, rid))
    texts = _texts(request)
    return await _respond(
        request,
        fan,
        body.stream,
        lambda: completion_events(fan, body, rid, model, texts),
        lambda outs: render_completion(body, rid, model, outs, texts),
    )


def build_app(engine: AsyncOmni, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="omnistage", description="OpenAI-compatible API for any-to-any models")
    app.state.engine = engine
    app.state.token_texts = TokenTexts(getattr(engine, "tokenizer", None))
    _install_error_handlers(app)
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)
    app.include_router(router)
    app.include_router(metrics_router)
    return app


# ---------------------------------------------------------------- running


def run_server(
    engine: AsyncOmni,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    log_level: str = "info",
) -> None:
    """Serve until interrupted (Ctrl-C / SIGTERM), then shut the engine down."""
    try:
        uvicorn.run(build_app(engine, api_key), host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    finally:
        engine.shutdown()


class BackgroundServer:
    """The real server in a daemon thread, on a socket bound up front (port 0 = any free port), for tests
    and the demo. Does not shut the engine down: the caller owns it."""

    def __init__(
        self,
        engine: AsyncOmni,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        log_level: str = "warning",
    ) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = host, self.sock.getsockname()[1]
        config = uvicorn.Config(
            build_app(engine, api_key), log_level=log_level, lifespan="off", timeout_graceful_shutdown=3
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, name="omnistage-http", daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"HTTP server did not start on {self.url}")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
