"""The browser demo: one static page (ui/index.html, app.js, style.css) served by the API server itself at
GET /ui, chatting with the server's own OpenAI API (streamed text, streamed speech, media input). It loads
nothing from the internet, and its Content-Security-Policy lets it talk to this server only. docs/ui.md.

The page's files hold no secrets, so they are served without an API key (UI_PATHS go with the server's open
paths); the page sends the key the user types to the API routes as `Authorization: Bearer`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from importlib import resources
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, FastAPI
from fastapi.responses import RedirectResponse, Response
from starlette.exceptions import HTTPException

if TYPE_CHECKING:
    from omnistage.entrypoints.async_omni import AsyncOmni

__all__ = ["ASSETS", "UI_PATHS", "install_ui", "router", "serve_ui_demo", "ui_url"]

_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
          ".css": "text/css; charset=utf-8"}
ASSETS = ("index.html", "app.js", "style.css")  # every file the page has; nothing else under /ui is served
UI_PATHS = ("/ui", *(f"/ui/{name}" for name in ASSETS))  # the paths to serve without an API key

# Only this server: scripts and styles from /ui, requests to the API, media from the page's own blobs.
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; connect-src 'self'; "
       "img-src 'self' data: blob:; media-src 'self' data: blob:; object-src 'none'; base-uri 'none'; "
       "frame-ancestors 'none'")

router = APIRouter(include_in_schema=False)


def _asset(name: str) -> Response:
    if name not in ASSETS:
        raise HTTPException(404)
    body = resources.files("omnistage.entrypoints.openai").joinpath("ui", name).read_bytes()
    suffix = name[name.rindex("."):]
    headers = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff", "Content-Security-Policy": CSP}
    return Response(body, media_type=_TYPES[suffix], headers=headers)


@router.get("/ui")
async def ui_page() -> Response:
    return _asset("index.html")


@router.get("/ui/", response_model=None)
async def ui_slash() -> RedirectResponse:
    return RedirectResponse("/ui", status_code=308)


@router.get("/ui/{name}")
async def ui_asset(name: str) -> Response:
    return _asset(name)


def ui_url(base_url: str) -> str:
    """The demo page's address on a server at `base_url` (e.g. http://127.0.0.1:8000 -> http://127.0.0.1:8000/ui);
    a wildcard bind address becomes localhost, which browsers can open (and allow the microphone on)."""
    url = base_url.rstrip("/")
    for wildcard in ("//0.0.0.0", "//[::]"):
        url = url.replace(wildcard, "//localhost", 1)
    return url.removesuffix("/v1") + "/ui"


def install_ui(app: FastAPI) -> FastAPI:
    """Serve the page on an app from `build_app` that does not yet (a no-op once it does): the routes, and
    UI_PATHS added to the API-key middleware's open paths. Call it before the app serves its first request
    (Starlette builds the middleware stack then)."""
    if not any(getattr(route, "path", None) == "/ui" for route in app.routes):
        app.include_router(router)
    for middleware in app.user_middleware:
        paths = middleware.kwargs.get("open_paths")
        if paths is not None and "/ui" not in paths:
            middleware.kwargs["open_paths"] = (*paths, *UI_PATHS)
    return app


def serve_ui_demo(engine: AsyncOmni, host: str = "127.0.0.1", port: int = 0, out: Callable[[str], Any] = print,
                  stop: threading.Event | None = None) -> None:
    """`omnistage demo --ui`: serve `engine` (no API key) with the demo page, print the page's address, and keep
    serving until Ctrl-C (or `stop` is set). The caller shuts the engine down."""
    from omnistage.entrypoints.openai.server import BackgroundServer

    server = BackgroundServer(engine, host=host, port=port)
    install_ui(server.app)
    with server:
        out(f"demo page: {ui_url(server.url)}  (open it in a browser; Ctrl-C stops the server)")
        try:
            (stop or threading.Event()).wait()
        except KeyboardInterrupt:
            out("stopping")
