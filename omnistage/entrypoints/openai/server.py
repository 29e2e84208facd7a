"""OpenAI-compatible HTTP server over AsyncOmni.

Route handlers stay thin: FastAPI validates the body (protocol.py), serving.py turns it into generations
and renders their deltas, and this module does the HTTP: errors as OpenAI error bodies, the API key, SSE
framing, and aborting the generations of a client that leaves.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

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
    Fanout,
    TextOffsets,
    TokenTexts,
    chat_chunks,
    chat_logprobs,
    chat_requests,
    check_model,
    collect,
    completion_chunks,
    completion_logprobs,
    completion_requests,
    render_chat,
    render_completion,
)
from omnistage.errors import OmniError, RequestError
from omnistage.types import OmniOutput, OmniRequest

if TYPE_CHECKING:
    from omnistage.entrypoints.async_omni import AsyncOmni

__all__ = [
    "BackgroundServer",
    "build_app",
    "run_server",
    "validation_message",
    # re-exported from serving.py for existing importers
    "TokenTexts",
    "chat_logprobs",
    "TextOffsets",
    "completion_logprobs",
]

log = logging.getLogger("omnistage.server")
T = TypeVar("T")
Body = TypeVar("Body", ChatCompletionRequest, CompletionRequest)


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


# ---------------------------------------------------------------- auth


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


class BodyLimit:
    """Refuse request bodies over the deploy config's `limits.max_request_bytes` with a 413, by the
    declared length before reading anything, else while the body streams in."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    def _too_large(self) -> OmniError:
        return RequestError(f"the request body is larger than the limit of {self.max_bytes} bytes; send less "
                            "(e.g. smaller or fewer media items, or URLs instead of inline data)", status=413)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            exc = self._too_large()
            await error_response(exc.status, exc.message, exc.type)(scope, receive, send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise self._too_large()
            return message

        await self.app(scope, counted, send)


# ---------------------------------------------------------------- client disconnects


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


# ---------------------------------------------------------------- server-sent events


def _sse_error(exc: Exception) -> str:
    status = getattr(exc, "status", 500)
    kind = getattr(exc, "type", "internal_error")
    body = ErrorResponse.of(getattr(exc, "message", str(exc)), kind, getattr(exc, "param", None))
    log.warning("stream failed (%s): %s", status, exc)
    return f"data: {body.model_dump_json()}\n\n"


class EventStream(StreamingResponse):
    """SSE response over a Fanout's chunks. Errors after the first byte go in-band as an OpenAI error
    event, the stream always ends with [DONE], and the generations are closed however it ends, even if
    the client leaves before the body is first iterated (then the body's own cleanup would never run)."""

    def __init__(self, chunks: AsyncIterator[BaseModel], fan: Fanout) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(self._body(chunks), media_type="text/event-stream", headers=headers)
        self.fan = fan

    async def _body(self, chunks: AsyncIterator[BaseModel]) -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield f"data: {chunk.model_dump_json()}\n\n"
        except Exception as exc:  # headers already sent
            yield _sse_error(exc)
        finally:
            await self.fan.aclose()
        yield "data: [DONE]\n\n"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.fan.aclose()


# ---------------------------------------------------------------- routes

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    ready, detail = request.app.state.engine.health()
    return JSONResponse(
        {"status": "ok" if ready else "unavailable", "detail": detail}, status_code=200 if ready else 503
    )


@router.get("/v1/models")
async def list_models(request: Request) -> ModelList:
    engine = request.app.state.engine
    cards = [
        ModelCard(id=name, max_model_len=engine.max_model_len, output_modalities=list(engine.output_modalities))
        for name in request.app.state.model_names
    ]
    return ModelList(data=cards)


async def _complete(
    request: Request,
    body: Body,
    id_prefix: str,
    to_requests: Callable[[AsyncOmni, Body, str], list[OmniRequest]],
    chunks: Callable[[Fanout, Body, str, str, TokenTexts], AsyncIterator[BaseModel]],
    render: Callable[[Body, str, str, list[OmniOutput], TokenTexts], BaseModel],
) -> Response:
    """Both endpoints: start the generations, then stream or collect them, aborting if the client leaves."""
    engine: AsyncOmni = request.app.state.engine
    texts: TokenTexts = request.app.state.token_texts
    model = check_model(request.app.state.model_names, body.model)
    rid = f"{id_prefix}-{uuid.uuid4().hex}"
    fan = Fanout(engine, to_requests(engine, body, rid))
    try:
        await unless_disconnected(request, fan.start())
        if body.stream:
            return EventStream(chunks(fan, body, rid, model, texts), fan)
        outputs = await unless_disconnected(request, collect(fan))
    except ClientGone:
        log.info("client left; aborted %s", [r.request_id for r in fan.requests])
        return Response(status_code=499)
    return JSONResponse(render(body, rid, model, outputs, texts).model_dump())


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    return await _complete(request, body, "chatcmpl", chat_requests, chat_chunks, render_chat)


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request) -> Response:
    return await _complete(request, body, "cmpl", completion_requests, completion_chunks, render_completion)


def build_app(engine: AsyncOmni, api_key: str | None = None,
              served_model_names: Sequence[str] | None = None) -> FastAPI:
    """`served_model_names`: the names clients may send as `model` (vLLM's --served-model-name), the first
    one reported when a request names none; default: the engine's `served_model_name`."""
    app = FastAPI(title="omnistage", description="OpenAI-compatible API for any-to-any models")
    app.state.engine = engine
    app.state.model_names = list(dict.fromkeys(served_model_names or [engine.served_model_name]))
    app.state.token_texts = TokenTexts(getattr(engine, "tokenizer", None))
    _install_error_handlers(app)
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)
    deploy = getattr(getattr(engine, "pipeline", None), "deploy", None)
    app.add_middleware(BodyLimit, max_bytes=(deploy.limits if deploy else LimitsConfig()).max_request_bytes)
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
    served_model_names: Sequence[str] | None = None,
) -> None:
    """Serve until interrupted (Ctrl-C / SIGTERM), then shut the engine down."""
    try:
        app = build_app(engine, api_key, served_model_names)
        uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
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
        served_model_names: Sequence[str] | None = None,
    ) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = host, self.sock.getsockname()[1]
        config = uvicorn.Config(
            build_app(engine, api_key, served_model_names), log_level=log_level, lifespan="off",
            timeout_graceful_shutdown=3,
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
