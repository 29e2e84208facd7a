"""A local HTTP server for the media tests (only ever on 127.0.0.1)."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        """A client that hangs up mid-body (the size-limit tests' fetcher does, on purpose) is no error here."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class MediaServer:
    """Serves registered bytes at /files/NAME (with Content-Length) and /stream/NAME (chunked, no length);
    /slow sleeps before answering; /redirect/NAME answers 302 to `redirects[NAME]`; /trickle/NAME announces 1 MB
    and sends a byte every 0.1 s until the client goes (`trickling` counts those open); anything else is a 404.
    `requests` lists (path, Host header) of every request."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.files: dict[str, bytes] = {}
        self.redirects: dict[str, str] = {}
        self.requests: list[tuple[str, str | None]] = []
        self.trickling = 0
        files, redirects, server = self.files, self.redirects, self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # keep test output clean
                pass

            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                kind, _, name = self.path.lstrip("/").partition("/")
                server.requests.append((self.path, self.headers.get("Host")))
                if kind == "slow":
                    time.sleep(2.0)
                if kind == "redirect" and name in redirects:
                    self.send_response(302)
                    self.send_header("Location", redirects[name])
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if kind == "trickle":
                    self.send_response(200)
                    self.send_header("Content-Length", str(2**20))
                    self.end_headers()
                    server.trickling += 1
                    try:
                        for _ in range(2**20):
                            self.wfile.write(b"x")
                            self.wfile.flush()
                            time.sleep(0.1)
                    finally:
                        server.trickling -= 1
                    return
                if kind not in ("files", "stream") or name not in files:
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                data = files[name]
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                if kind == "files":
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for start in range(0, len(data), 4096):
                    chunk = data[start : start + 4096]
                    self.wfile.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
                self.wfile.write(b"0\r\n\r\n")

        self.httpd = _QuietServer((host, 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    def url(self, path: str, host: str | None = None) -> str:
        return f"http://{host or self.httpd.server_address[0]}:{self.port}/{path}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="session")
def media_server() -> Iterator[MediaServer]:
    server = MediaServer()
    yield server
    server.close()


@pytest.fixture(scope="session")
def other_server() -> Iterator[MediaServer]:
    """A second server, on another loopback address: what a redirect must never reach."""
    server = MediaServer("127.0.0.2")
    yield server
    server.close()
