"""OpenAI-compatible HTTP server over AsyncOmni.

Route handlers stay thin: FastAPI validates the body (protocol.py), serving.py turns it into generations
and renders their deltas, and this module does the HTTP edge: errors as OpenAI error bodies, API keys,
start-up and drain states, admission (429 beyond `max_queued_requests`), body size and time limits, SSE
framing, and aborting the generations of a client that leaves. Operating it: docs/serving.md.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypeVar

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

import omnistage
from omnistage.config.deploy import LimitsConfig
from omnistage.entrypoints.openai.metrics import router as metrics_router
from omnistage.entrypoints.openai.protocol import (
    REQUEST_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
    ModelCard,
    ModelList,
    close_match,
)
from omnistage.entrypoints.openai.serving import (
    ClientGone,
    Fanout,
    ModelNotFound,
    Release,
    TextOffsets,
    TokenTexts,
    chat_chunks,
    chat_logprobs,
    chat_requests,
    check_model,
    completion_chunks,
    completion_logprobs,
    completion_requests,
    render_chat,
    render_completion,
    run_admitted,
    unless_disconnected,
)
from omnistage.entrypoints.openai.ui import UI_PATHS
from omnistage.entrypoints.openai.ui import router as ui_router
from omnistage.errors import OmniError, RequestError
from omnistage.types import OmniOutput, OmniRequest

if TYPE_CHECKING:
    from omnistage.entrypoints.async_omni import AsyncOmni

__all__ = [
    "BackgroundServer",
    "ServerOptions",
    "attach_engine",
    "build_app",
    "run_server",
    "serve",
    "validation_message",
    # re-exported from serving.py for existing importers
    "TokenTexts",
    "chat_logprobs",
    "TextOffsets",
    "completion_logprobs",
    "ClientGone",
    "unless_disconnected",
]

log = logging.getLogger("omnistage.server")
Body = TypeVar("Body", ChatCompletionRequest, CompletionRequest)
Progress = Callable[[str], None]

INTERNAL_ERROR = "internal server error; the server log has the details"
RETRY_AFTER_S = {429: "1", 503: "5"}  # what a refused client is told to wait, by status
# answer without an API key: probes (load balancers, orchestrators) and the browser page's own files (it asks
# for the key itself and sends it with every API call)
OPEN_PATHS = ("/health", "/ping", *UI_PATHS)
STATE_PATHS = (*OPEN_PATHS, "/version", "/metrics")  # answer while loading and draining too


@dataclass
class ServerOptions:
    """The HTTP edge's settings: `omnistage serve`'s flags (docs/serving.md has each one's meaning)."""

    api_keys: Sequence[str] = ()
    served_model_names: Sequence[str] | None = None
    allowed_origins: Sequence[str] = ()
    enable_docs: bool = False
    metrics_without_auth: bool = False
    max_queued_requests: int | None = None  # None: the deploy config's limits.max_queued_requests
    max_connections: int = 2048
    body_timeout_s: float = 30.0
    shutdown_timeout_s: float = 30.0
    # /v1/videos jobs: where their records and videos are kept (None: video_jobs.default_jobs_dir()), how many
    # may be unfinished at once (beyond it 429), and when finished ones are removed (oldest first)
    video_jobs_dir: str | None = None
    max_video_jobs: int = 16
    video_jobs_max_bytes: int = 10 * 2**30
    video_jobs_max_age_s: float = 86400.0


# ---------------------------------------------------------------- errors


class Overloaded(OmniError):
    status = 429
    type = "rate_limit_exceeded"
    code = "rate_limit_exceeded"


class Unavailable(OmniError):
    status = 503
    type = "service_unavailable"


def error_response(
    status: int, message: str, type: str, param: str | None = None, code: str | None = None,
    close: bool = False,
) -> JSONResponse:
    """An OpenAI error body; 429 and 503 say when to retry, `close` ends the connection after it (a request
    body left unread)."""
    body = ErrorResponse.of(message, type, param, code).model_dump()
    headers = {"Retry-After": RETRY_AFTER_S[status]} if status in RETRY_AFTER_S else {}
    if close:
        headers["Connection"] = "close"
    return JSONResponse(body, status_code=status, headers=headers)


def _omni_response(exc: OmniError, close: bool = False) -> JSONResponse:
    return error_response(exc.status, exc.message, exc.type, exc.param, getattr(exc, "code", None), close)


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
            close = close_match(path, REQUEST_FIELDS) if path.isidentifier() else None
            items.append((path, f"unknown field '{path}'; " + (f"did you mean '{close}'?" if close else "remove it")))
        else:
            got = err.get("input")
            shown = "" if isinstance(got, dict | list) else f" (got {_short(got)})"
            items.append((path, f"{path}: {raw}{shown}"))
    # A union reports one error per member: keep the deepest ones and drop duplicates.
    kept = [(p, m) for p, m in items if not any(_is_under(q, p) for q, _ in items)]
    unique = list(dict.fromkeys(m for _, m in kept))
    message = "; ".join(unique[:3]) + ("; ..." if len(unique) > 3 else "")
    param = (kept[0][0] or None) if kept else None
    return message or "invalid request", param


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc.errors())
        return error_response(400, message, "invalid_request_error", param)

    @app.exception_handler(OmniError)
    async def _omni(_: Request, exc: OmniError) -> JSONResponse:
        return _omni_response(exc)

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
        # Never the exception's text: it may carry paths, shapes or other internals. Starlette re-raises
        # after answering, so uvicorn logs the traceback; the server keeps serving.
        return error_response(500, INTERNAL_ERROR, "internal_error")


# ---------------------------------------------------------------- the edge's state


class Edge:
    """What the server knows besides the engine: loading progress, draining, and admission. Admission counts
    generations (prompts x n choices) admitted and not finished; it lives on the event loop's thread, so it
    needs no lock."""

    def __init__(self, options: ServerOptions) -> None:
        self.options = options
        self.engine: AsyncOmni | None = None
        self.loading = "starting"
        self.draining = False
        self.limits = LimitsConfig()
        self.max_queued = options.max_queued_requests or self.limits.max_queued_requests
        self.in_flight = 0
        self.rejected: Counter[str] = Counter()  # by reason: overloaded, unavailable, loading, draining

    def progress(self, detail: str) -> None:
        if self.engine is None:  # restarts later report too: only start-up shows
            self.loading = detail
            log.info("%s", detail)

    def attach(self, engine: AsyncOmni) -> None:
        deploy = getattr(getattr(engine, "pipeline", None), "deploy", None)
        self.limits = deploy.limits if deploy is not None else LimitsConfig()
        self.max_queued = self.options.max_queued_requests or self.limits.max_queued_requests
        self.engine = engine  # last: from here on requests are served

    def refusal(self) -> tuple[str, Unavailable] | None:
        """Why no request can start now (loading, draining), if so."""
        if self.engine is None:
            return "loading", Unavailable(f"server is loading ({self.loading}); retry when GET /health answers 200")
        if self.draining:
            return "draining", Unavailable("server is shutting down; send the request to another replica")
        return None

    def admit(self, n: int) -> Callable[[], None]:
        """Admit `n` generations or raise: 503 while a stage is down, 429 over the limit. Returns their release
        (idempotent), to call when they have finished."""
        assert self.engine is not None
        ready, detail = self.engine.health()
        if not ready:
            self.rejected["unavailable"] += 1
            raise Unavailable(f"the model cannot serve right now ({detail}); retry shortly")
        if n > self.max_queued:
            raise RequestError(f"this request asks for {n} generations (prompts x n) but the server runs at most "
                               f"{self.max_queued} at once; send fewer prompts or a smaller n", "n")
        if self.in_flight + n > self.max_queued:
            self.rejected["overloaded"] += 1
            raise Overloaded(f"the server is at its limit of {self.max_queued} generations in flight "
                             f"({self.in_flight} now, this request needs {n}); retry shortly")
        self.in_flight += n
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released, self.in_flight = True, self.in_flight - n

        return release


# ---------------------------------------------------------------- middleware (plain ASGI: streaming and
# disconnect detection stay untouched)


def _path_in(path: str, paths: Sequence[str]) -> bool:
    return path in paths or path.rstrip("/") in paths


class BearerAuth:
    """Every route but OPEN_PATHS needs one of the API keys as `Authorization: Bearer <key>` (the scheme in
    any case). Every key is compared, each in constant time, so timing tells nothing about which matched."""

    def __init__(self, app: ASGIApp, api_keys: Sequence[str], open_paths: Sequence[str]) -> None:
        self.app, self.keys, self.open = app, [k.encode() for k in api_keys], tuple(open_paths)

    def authorized(self, header: bytes) -> bool:
        scheme, _, token = header.strip().partition(b" ")
        token = token.strip()
        matches = [hmac.compare_digest(token, key) for key in self.keys]  # all of them, no short cut
        return scheme.lower() == b"bearer" and any(matches)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not _path_in(scope["path"], self.open):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not self.authorized(given):
                reason = "missing" if not given else "invalid"
                message = f"{reason} API key: send the header 'Authorization: Bearer <api key>'"
                await error_response(401, message, "invalid_request_error", code="invalid_api_key")(
                    scope, receive, send)
                return
        await self.app(scope, receive, send)


class Gate:
    """While the model loads, and once a drain has begun, only STATE_PATHS answer; the rest get 503."""

    def __init__(self, app: ASGIApp, edge: Edge) -> None:
        self.app, self.edge = app, edge

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        refusal = self.edge.refusal() if scope["type"] == "http" else None
        if refusal is not None and not _path_in(scope["path"], STATE_PATHS):
            reason, exc = refusal
            self.edge.rejected[reason] += 1
            await _omni_response(exc)(scope, receive, send)
            return
        await self.app(scope, receive, send)


class RequestBody:
    """Reads the whole body before the app runs: over `limits.max_request_bytes` it is a 413 (by the declared
    length before reading anything, else as the chunks arrive), not complete within `body_timeout_s` a 408, and
    both close the connection, so a slow or huge sender holds nothing for long. The app then gets the body as
    one message; later receive() calls go to the client (to see it leave)."""

    def __init__(self, app: ASGIApp, edge: Edge) -> None:
        self.app, self.edge = app, edge

    def _too_large(self) -> RequestError:
        return RequestError(f"the request body is larger than the limit of {self.edge.limits.max_request_bytes} "
                            "bytes; send less (e.g. smaller or fewer media items, or URLs instead of inline data)",
                            status=413)

    async def _read(self, receive: Receive) -> bytes | OmniError | None:
        chunks, size, limit = [], 0, self.edge.limits.max_request_bytes
        try:
            async with asyncio.timeout(self.edge.options.body_timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return None
                    chunks.append(message.get("body", b""))
                    size += len(chunks[-1])
                    if size > limit:
                        return self._too_large()
                    if not message.get("more_body", False):
                        return b"".join(chunks)
        except TimeoutError:
            return RequestError(f"the request body did not arrive within {self.edge.options.body_timeout_s:g} s; "
                                "send it at once", status=408)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.edge.limits.max_request_bytes:
            await _omni_response(self._too_large(), close=True)(scope, receive, send)
            return
        body = await self._read(receive)
        if body is None:  # the client left
            return
        if isinstance(body, OmniError):
            await _omni_response(body, close=True)(scope, receive, send)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


class CatchAll:
    """An unexpected exception before the response has started becomes the generic 500 here, its traceback
    logged, rather than in Starlette's outermost handler, which re-raises it, so that uvicorn drops the
    connection (a client's pooled keep-alive connection with it). After the start it propagates: the response
    cannot be taken back, and uvicorn closing the connection is how the client learns it broke."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def watch(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception:
            if started or scope["type"] != "http":
                raise
            log.exception("unhandled error on %s %s", scope["method"], scope["path"])
            await error_response(500, INTERNAL_ERROR, "internal_error")(scope, receive, send)


# ---------------------------------------------------------------- server-sent events


def _sse_error(exc: Exception) -> str:
    """An in-band error event. An OmniError's message is meant for the caller; anything else is a bug, told
    apart only in the log."""
    if isinstance(exc, OmniError):
        body = ErrorResponse.of(exc.message, exc.type, exc.param)
        log.warning("stream failed (%s): %s", exc.status, exc.message)
    else:
        body = ErrorResponse.of(INTERNAL_ERROR, "internal_error")
        log.error("stream failed", exc_info=exc)
    return f"data: {body.model_dump_json()}\n\n"


class EventStream(StreamingResponse):
    """SSE response over a Fanout's chunks. Errors after the first byte go in-band as an OpenAI error
    event, the stream always ends with [DONE], and the generations are closed (and their admission
    released) however it ends, even if the client leaves before the body is first iterated (then the
    body's own cleanup would never run)."""

    def __init__(self, chunks: AsyncIterator[BaseModel], fan: Fanout, release: Callable[[], None]) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(self._body(chunks), media_type="text/event-stream", headers=headers)
        self.fan, self.release = fan, release

    async def _body(self, chunks: AsyncIterator[BaseModel]) -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield f"data: {chunk.model_dump_json()}\n\n"
        except Exception as exc:  # headers already sent
            yield _sse_error(exc)
        finally:
            await self.fan.aclose()
            self.release()
        yield "data: [DONE]\n\n"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.fan.aclose()
            self.release()


# ---------------------------------------------------------------- routes

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 once every stage is ready; 503 while loading (with the stage loading), draining, or a stage is down."""
    edge: Edge = request.app.state.edge
    if edge.engine is None:
        status, ready, detail = "loading", False, edge.loading
    elif edge.draining:
        status, ready, detail = "draining", False, "shutting down: finishing the requests in flight"
    else:
        ready, detail = edge.engine.health()
        status = "ok" if ready else "unavailable"
    return JSONResponse({"status": status, "detail": detail}, status_code=200 if ready else 503)


router.add_api_route("/ping", health, methods=["GET"], include_in_schema=False)  # vLLM's (SageMaker's) name


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": omnistage.__version__}


def _card(request: Request, name: str) -> ModelCard:
    engine = request.app.state.engine
    return ModelCard(id=name, max_model_len=engine.max_model_len, output_modalities=list(engine.output_modalities))


@router.get("/v1/models")
async def list_models(request: Request) -> ModelList:
    return ModelList(data=[_card(request, name) for name in request.app.state.model_names])


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> ModelCard:
    names = request.app.state.model_names
    if model_id not in names:
        raise ModelNotFound(f"model '{model_id}' does not exist; this server serves "
                            f"{', '.join(repr(n) for n in names)}", param="model")
    return _card(request, model_id)


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages through the model's chat template."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send either 'prompt' or 'messages'")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]


def _tokenizer(request: Request, model: str | None) -> Any:
    check_model(request.app.state.model_names, model)
    tokenizer = getattr(request.app.state.engine, "tokenizer", None)
    if tokenizer is None:
        raise RequestError("this model has no tokenizer to tokenize with")
    return tokenizer


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    tokenizer = _tokenizer(request, body.model)
    if body.prompt is not None:
        ids = await asyncio.to_thread(tokenizer.encode, body.prompt, add_special_tokens=body.add_special_tokens)
    elif tokenizer.chat_template is None:
        raise RequestError("this model has no chat template; tokenize a prompt instead", "messages")
    else:
        try:
            ids = await asyncio.to_thread(tokenizer.apply_chat_template, body.messages, tokenize=True,
                                          add_generation_prompt=body.add_generation_prompt, return_dict=False)
        except Exception as exc:  # template errors are the caller's messages' fault
            raise RequestError(f"could not apply the chat template to these messages: {exc}", "messages") from None
    ids = list(ids)
    return {"count": len(ids), "max_model_len": request.app.state.engine.max_model_len, "tokens": ids}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, str]:
    tokenizer = _tokenizer(request, body.model)
    bad = [t for t in body.tokens if not 0 <= t < len(tokenizer)]
    if bad:
        raise RequestError(f"token ids must be in [0, {len(tokenizer)}); got {bad[:5]}", "tokens")
    return {"prompt": await asyncio.to_thread(tokenizer.decode, body.tokens)}


async def _complete(
    request: Request,
    body: Body,
    id_prefix: str,
    to_requests: Callable[[AsyncOmni, Body, str], list[OmniRequest]],
    chunks: Callable[[Fanout, Body, str, str, TokenTexts], AsyncIterator[BaseModel]],
    render: Callable[[Body, str, str, list[OmniOutput], TokenTexts], BaseModel],
) -> Response:
    """Both endpoints: their generations (prompts x n) run through `run_admitted`, streamed as SSE chunks or
    collected into one rendered reply."""
    engine: AsyncOmni = request.app.state.engine
    texts: TokenTexts = request.app.state.token_texts
    model = check_model(request.app.state.model_names, body.model)
    rid = f"{id_prefix}-{uuid.uuid4().hex}"

    def stream(fan: Fanout, release: Release) -> Response:
        return EventStream(chunks(fan, body, rid, model, texts), fan, release)

    outputs = await run_admitted(request, to_requests(engine, body, rid), stream if body.stream else None)
    if isinstance(outputs, Response):
        return outputs
    return JSONResponse(render(body, rid, model, outputs, texts).model_dump())


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    return await _complete(request, body, "chatcmpl", chat_requests, chat_chunks, render_chat)


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request) -> Response:
    return await _complete(request, body, "cmpl", completion_requests, completion_chunks, render_completion)


def build_app(engine: AsyncOmni | None, api_key: str | None = None,
              served_model_names: Sequence[str] | None = None, options: ServerOptions | None = None) -> FastAPI:
    """The app; `engine` None: not loaded yet (attach it with `attach_engine`; until then the server answers
    503). `api_key` and `served_model_names` are shortcuts for the options' fields; served model names are the
    names clients may send as `model` (vLLM's --served-model-name), the first one reported when a request names
    none; default: the engine's `served_model_name`."""
    options = options or ServerOptions()
    if api_key or served_model_names:  # a copy: the caller's options stay as they were
        options = replace(options, api_keys=[*options.api_keys, *([api_key] if api_key else [])],
                          served_model_names=served_model_names or options.served_model_names)
    # The docs pages load their scripts from a CDN and describe every route: off unless asked for.
    docs = {"docs_url": "/docs", "redoc_url": "/redoc", "openapi_url": "/openapi.json"}
    app = FastAPI(title="omnistage", description="OpenAI-compatible API for any-to-any models",
                  version=omnistage.__version__,
                  **(docs if options.enable_docs else dict.fromkeys(docs)))  # type: ignore[arg-type]
    app.state.edge = Edge(options)
    app.state.engine = None
    _install_error_handlers(app)
    from omnistage.entrypoints.openai import audio, embeddings, images, speech  # (they import this module's helpers)
    from omnistage.entrypoints.openai.audio_generate import router as audio_generate_router
    from omnistage.entrypoints.openai.videos import router as videos_router

    app.include_router(images.chat_router)  # chat completions of an image model; matches only for one
    app.include_router(router)
    app.include_router(metrics_router)
    for extra in (audio.router, embeddings.router, images.router, speech.router, videos_router, audio_generate_router,
                  ui_router):
        app.include_router(extra)
    # add_middleware wraps: the last added runs first (CORS answers preflights before any key is asked for)
    app.add_middleware(CatchAll)
    app.add_middleware(RequestBody, edge=app.state.edge)
    app.add_middleware(Gate, edge=app.state.edge)
    if options.api_keys:
        open_paths = (*OPEN_PATHS, "/metrics") if options.metrics_without_auth else OPEN_PATHS
        app.add_middleware(BearerAuth, api_keys=list(options.api_keys), open_paths=open_paths)
    if options.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(options.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])
    if engine is not None:
        attach_engine(app, engine)
    return app


def attach_engine(app: FastAPI, engine: AsyncOmni) -> None:
    """The engine has loaded: serve it."""
    names = app.state.edge.options.served_model_names
    app.state.model_names = list(dict.fromkeys(names or [engine.served_model_name]))
    app.state.token_texts = TokenTexts(getattr(engine, "tokenizer", None))
    app.state.engine = engine
    app.state.edge.attach(engine)


# ---------------------------------------------------------------- running


def _http_protocol(head_timeout_s: float) -> type[H11Protocol]:
    class Protocol(H11Protocol):
        """uvicorn's h11 protocol plus a head timeout: a connection that has not sent a whole request head within
        `head_timeout_s` of opening, or of its last response, is closed (uvicorn itself times out only idle
        keep-alive connections after a response, never one that sent nothing or half a head)."""

        head_timer: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            if self.head_timer is not None:
                self.head_timer.cancel()
            self.head_timer = self.loop.call_later(head_timeout_s, self._head_timeout)

        def _head_timeout(self) -> None:
            if (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            if self.head_timer is not None:
                self.head_timer.cancel()
            super().connection_lost(exc)

    return Protocol


def _uvicorn_config(app: FastAPI, options: ServerOptions, log_level: str) -> uvicorn.Config:
    # limit_concurrency: beyond it uvicorn answers 503 itself, so open connections stay bounded
    return uvicorn.Config(app, log_level=log_level, lifespan="off", http=_http_protocol(options.body_timeout_s),
                          limit_concurrency=options.max_connections, timeout_keep_alive=5,
                          timeout_graceful_shutdown=5)


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a drain: the first SIGTERM (or Ctrl-C) stops admission (new requests get 503,
    /health too) and lets the generations in flight finish for up to `shutdown_timeout_s`; then uvicorn closes
    the connections and cancels what still runs, which aborts its generations. A second signal ends it at once.
    The signal is not re-raised afterwards (uvicorn would), so the caller still shuts the engine down."""

    def __init__(self, config: uvicorn.Config, edge: Edge) -> None:
        super().__init__(config)
        self.edge, self.drain_deadline = edge, None

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.drain_deadline is not None or self.edge.engine is None:  # again, or nothing to drain
            self.force_exit = self.drain_deadline is not None
            self.should_exit = True
            return
        self.edge.draining = True
        self.drain_deadline = time.monotonic() + self.edge.options.shutdown_timeout_s
        log.info("draining: %d generations in flight, %g s to finish", self.edge.in_flight,
                 self.edge.options.shutdown_timeout_s)

    async def on_tick(self, counter: int) -> bool:
        if self.drain_deadline is not None and not self.should_exit:
            if self.edge.in_flight == 0:
                self.should_exit = True
            elif time.monotonic() >= self.drain_deadline:
                log.warning("shutdown timeout: aborting %d generations still in flight", self.edge.in_flight)
                self.config.timeout_graceful_shutdown = 0  # cancel the requests at once
                self.should_exit = True
        return await super().on_tick(counter)


def serve(load: Callable[[Progress], AsyncOmni], sock: socket.socket, options: ServerOptions,
          log_level: str = "info") -> None:
    """Serve on `sock` (bound by the caller, so a busy port fails before anything loads) while `load` builds
    the engine in a thread, reporting its progress (/health answers 503 with it until the engine is ready).
    Returns once a signal has drained the server and the engine has shut down; raises what `load` raised."""
    app = build_app(None, options=options)
    edge: Edge = app.state.edge
    server = DrainingServer(_uvicorn_config(app, options, log_level), edge)
    result: list[Any] = []  # the engine, or what loading raised

    def load_engine() -> None:
        try:
            engine = load(edge.progress)
        except BaseException as exc:  # handed to the caller
            result.append(exc)
            server.should_exit = True
            return
        result.append(engine)
        attach_engine(app, engine)
        log.info("ready: serving %s", ", ".join(app.state.model_names))

    loader = threading.Thread(target=load_engine, name="omnistage-load", daemon=True)
    loader.start()
    try:
        server.run(sockets=[sock])
    finally:
        loader.join()  # a signal while loading: stop once it has loaded (a second one kills the process)
        sock.close()
        if result and not isinstance(result[0], BaseException):
            result[0].shutdown()
    if result and isinstance(result[0], BaseException):
        raise result[0]


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (0: any free port); OSError if it is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def run_server(
    engine: AsyncOmni,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    log_level: str = "info",
    served_model_names: Sequence[str] | None = None,
    options: ServerOptions | None = None,
) -> None:
    """Serve a loaded engine until a signal drains the server, then shut the engine down."""
    options = options or ServerOptions()
    options = replace(options, api_keys=[*options.api_keys, *([api_key] if api_key else [])],
                      served_model_names=served_model_names or options.served_model_names)
    serve(lambda _: engine, bind(host, port), options, log_level)


class BackgroundServer:
    """The real server in a daemon thread, on a socket bound up front (port 0 = any free port), for tests
    and the demo. Over a loaded `engine`, or, with `load`, one it loads in a thread while /health reports the
    progress. Does not shut the engine down: the caller owns it. `stop` does not drain."""

    def __init__(
        self,
        engine: AsyncOmni | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        log_level: str = "warning",
        served_model_names: Sequence[str] | None = None,
        options: ServerOptions | None = None,
        load: Callable[[Progress], AsyncOmni] | None = None,
    ) -> None:
        self.sock = bind(host, port)
        self.host, self.port = host, self.sock.getsockname()[1]
        self.app = build_app(engine, api_key, served_model_names, options)
        self.load = load
        config = _uvicorn_config(self.app, self.app.state.edge.options, log_level)
        config.timeout_graceful_shutdown = 3
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, name="omnistage-http", daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        self.thread.start()
        if self.load is not None:
            load, edge = self.load, self.app.state.edge
            threading.Thread(target=lambda: attach_engine(self.app, load(edge.progress)), daemon=True).start()
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
