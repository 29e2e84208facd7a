"""The HTTP server's edge over real HTTP: ops routes, tokenize, auth, CORS, docs pages, admission (429/503),
body size and time limits, and error bodies without internals. FakeEngine servers are started per test with
the options under test; tokenize runs on the real tiny engine."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest
from openai_helpers import API_KEY, CHAT, FakeEngine, Served, assert_openai_error, sse_events, wait_for

import omnistage
from omnistage.config.deploy import LimitsConfig
from omnistage.entrypoints.openai.server import INTERNAL_ERROR, BackgroundServer, ServerOptions
from omnistage.types import OmniOutput, OmniRequest

AUTH = {"Authorization": f"Bearer {API_KEY}"}


@contextmanager
def server(engine: Any = None, **options: Any) -> Iterator[BackgroundServer]:
    with BackgroundServer(engine or FakeEngine(), options=ServerOptions(**options)) as srv:
        yield srv


def metric(url: str, name: str, headers: dict[str, str] | None = None) -> float:
    text = httpx.get(f"{url}/metrics", headers=headers or {}).text
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


# ---------------------------------------------------------------- routes


def test_ping_version_and_model_card(fake_served: Served) -> None:
    assert httpx.get(f"{fake_served.url}/ping").status_code == 200
    with fake_served.http() as http:
        assert http.get("/version").json() == {"version": omnistage.__version__}
        card = http.get(f"/v1/models/{fake_served.model}").json()
        assert card["id"] == fake_served.model and card["object"] == "model" and card["max_model_len"] == 64
        assert fake_served.client().models.retrieve(fake_served.model).id == fake_served.model
        err = assert_openai_error(http.get("/v1/models/gpt-4o"), 404, "'gpt-4o' does not exist")
        assert err["code"] == "model_not_found"


def test_tokenize_and_detokenize(real_served: Served) -> None:
    tokenizer = real_served.engine.tokenizer
    with real_served.http() as http:
        out = http.post("/tokenize", json={"model": real_served.model, "prompt": "Hello river"}).json()
        assert out == {"count": len(out["tokens"]), "max_model_len": real_served.engine.max_model_len,
                       "tokens": tokenizer.encode("Hello river")}
        chat = http.post("/tokenize", json={"messages": CHAT, "add_generation_prompt": True}).json()
        assert chat["tokens"] == list(tokenizer.apply_chat_template(CHAT, add_generation_prompt=True,
                                                                    tokenize=True, return_dict=False))
        bare = http.post("/tokenize", json={"messages": CHAT, "add_generation_prompt": False}).json()
        assert bare["count"] < chat["count"]
        assert http.post("/detokenize", json={"tokens": out["tokens"]}).json() == {
            "prompt": tokenizer.decode(out["tokens"])}
        assert_openai_error(http.post("/detokenize", json={"tokens": [1, len(tokenizer)]}), 400, "token ids")
        assert_openai_error(http.post("/detokenize", json={"tokens": [-1]}), 400, "token ids")
        assert_openai_error(http.post("/tokenize", json={"prompt": "x", "messages": CHAT}), 400, "either")
        assert_openai_error(http.post("/tokenize", json={"model": "other", "prompt": "x"}), 404)


def test_docs_pages_off_by_default_and_behind_the_key() -> None:
    with server() as srv:
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert httpx.get(srv.url + path).status_code == 404
    with server(api_keys=[API_KEY], enable_docs=True) as srv:
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert httpx.get(srv.url + path).status_code == 401
            assert httpx.get(srv.url + path, headers=AUTH).status_code == 200
        assert "/v1/chat/completions" in httpx.get(srv.url + "/openapi.json", headers=AUTH).json()["paths"]


def test_cors() -> None:
    origin = "https://app.example"
    preflight = {"Origin": origin, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    with server(api_keys=[API_KEY], allowed_origins=[origin]) as srv:
        resp = httpx.options(f"{srv.url}/v1/chat/completions", headers=preflight)  # browsers send no key here
        assert resp.status_code == 200 and resp.headers["access-control-allow-origin"] == origin
        resp = httpx.get(f"{srv.url}/v1/models", headers={**AUTH, "Origin": origin})
        assert resp.status_code == 200 and resp.headers["access-control-allow-origin"] == origin
        denied = httpx.options(f"{srv.url}/v1/chat/completions", headers={**preflight, "Origin": "https://evil"})
        assert "access-control-allow-origin" not in denied.headers
    with server() as srv:  # no --allowed-origins: no CORS headers at all
        resp = httpx.get(f"{srv.url}/v1/models", headers={"Origin": origin})
        assert "access-control-allow-origin" not in resp.headers


# ---------------------------------------------------------------- auth


def test_every_route_but_health_and_ping_needs_a_key() -> None:
    keys = ["first-key", "second-key"]
    with server(api_keys=keys) as srv:
        for path in ("/health", "/ping"):
            assert httpx.get(srv.url + path).status_code == 200
        for method, path in (("GET", "/version"), ("GET", "/metrics"), ("GET", "/v1/models"),
                             ("POST", "/tokenize"), ("POST", "/detokenize"), ("POST", "/v1/completions"),
                             ("GET", "/nope")):
            assert_openai_error(httpx.request(method, srv.url + path), 401, "missing API key")
        for header in ("Bearer first-key", "bearer second-key", "BEARER  second-key"):
            assert httpx.get(f"{srv.url}/v1/models", headers={"Authorization": header}).status_code == 200, header
        for header in ("Bearer third-key", "Basic first-key", "first-key", "Bearer first-key2", "Bearer"):
            resp = httpx.get(f"{srv.url}/v1/models", headers={"Authorization": header})
            assert_openai_error(resp, 401, "invalid API key")
            assert "first-key" not in resp.text
    with server(api_keys=keys, metrics_without_auth=True) as srv:
        assert httpx.get(f"{srv.url}/metrics").status_code == 200
        assert httpx.get(f"{srv.url}/v1/models").status_code == 401


# ---------------------------------------------------------------- admission


def test_admission_counts_prompts_times_n_and_answers_429() -> None:
    engine = FakeEngine(delay=0.05)
    with server(engine, max_queued_requests=4) as srv, httpx.Client(base_url=srv.url, timeout=30) as http:
        assert metric(srv.url, "omnistage_server_max_queued_requests") == 4
        body = {"prompt": ["a", "b"], "n": 2, "max_tokens": 30, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as stream:  # 2 prompts x n 2 = 4 generations
            assert stream.status_code == 200
            assert metric(srv.url, "omnistage_server_requests_admitted") == 4
            busy = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2})
            err = assert_openai_error(busy, 429, "limit of 4", "retry")
            assert busy.headers["retry-after"] == "1" and err["code"] == "rate_limit_exceeded"
            with pytest.raises(openai.RateLimitError):
                openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0).completions.create(
                    model="fake-model", prompt="x", max_tokens=2)
            assert sse_events(stream)[-1] == "[DONE]"
        assert wait_for(lambda: metric(srv.url, "omnistage_server_requests_admitted") == 0, 5)
        assert metric(srv.url, 'omnistage_server_requests_refused_total{reason="overloaded"}') == 2
        too_big = http.post("/v1/completions", json={"prompt": ["a", "b", "c"], "n": 2, "max_tokens": 2})
        assert_openai_error(too_big, 400, "6 generations", "at most 4")
        ok = http.post("/v1/completions", json={"prompt": ["a", "b"], "n": 2, "max_tokens": 2})
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 4
        assert metric(srv.url, "omnistage_server_requests_admitted") == 0


def test_stage_down_is_503_with_retry_after() -> None:
    engine = FakeEngine()
    with server(engine) as srv:
        engine.ready = False
        resp = httpx.post(f"{srv.url}/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2})
        assert_openai_error(resp, 503, "cannot serve right now", "stopped")
        assert resp.headers["retry-after"] == "5"
        assert metric(srv.url, 'omnistage_server_requests_refused_total{reason="unavailable"}') == 1


# ---------------------------------------------------------------- size and time limits


def _limited_engine(max_request_bytes: int) -> FakeEngine:
    engine = FakeEngine()
    engine.pipeline = SimpleNamespace(deploy=SimpleNamespace(limits=LimitsConfig(max_request_bytes=max_request_bytes)))
    return engine


def test_chunked_body_over_the_limit_is_413() -> None:
    with server(_limited_engine(4096)) as srv:
        def chunks() -> Iterator[bytes]:
            yield b'{"prompt": "'
            for _ in range(10):
                yield b"x" * 1000
            yield b'"}'

        resp = httpx.post(f"{srv.url}/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
        assert_openai_error(resp, 413, "larger than the limit of 4096 bytes")
        declared = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x" * 5000})
        assert_openai_error(declared, 413)
        assert httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def _raw(port: int, data: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(data)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def test_slow_senders_are_cut_off() -> None:
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    with server(body_timeout_s=0.5) as srv:
        start = time.monotonic()
        bodies = [_raw(srv.port, head + b'{"prompt": ') for _ in range(50)]  # bodies that never finish
        heads = [_raw(srv.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n") for _ in range(20)]
        silent = [_raw(srv.port, b"") for _ in range(20)]
        replies = [_read_all(s) for s in bodies]
        assert all(r.startswith(b"HTTP/1.1 408 ") and b"did not arrive within 0.5 s" in r for r in replies), replies[0]
        assert all(_read_all(s) == b"" for s in heads + silent)  # closed without an answer
        assert time.monotonic() - start < 5
        for s in bodies + heads + silent:
            s.close()
        ok = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert ok.status_code == 200


# ---------------------------------------------------------------- errors never carry internals


class LeakyEngine(FakeEngine):
    """Crashes with internals in the message: before the first delta ("RAISE"), or after it (mid-stream)."""

    async def generate(self, request: OmniRequest) -> AsyncIterator[OmniOutput]:
        if "RAISE" in str(request.messages):
            raise RuntimeError("secret /srv/weights/model.bin shape (3, 4)")
        yield OmniOutput(request.request_id, text=" w0", token_ids=[100], num_prompt_tokens=3, num_output_tokens=1)
        await asyncio.sleep(0)
        raise KeyError("secret /srv/weights/model.bin")


def test_unexpected_errors_say_nothing_of_internals(caplog: pytest.LogCaptureFixture) -> None:
    with server(LeakyEngine()) as srv, httpx.Client(base_url=srv.url, timeout=30) as http:
        resp = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "RAISE"}]})
        err = assert_openai_error(resp, 500)
        assert err["message"] == INTERNAL_ERROR and err["type"] == "internal_error"
        assert "secret" not in resp.text and "RuntimeError" not in resp.text
        with http.stream("POST", "/v1/chat/completions", json={"messages": CHAT, "stream": True}) as stream:
            events = sse_events(stream)
        error = json.loads(events[-2])["error"]
        assert error["message"] == INTERNAL_ERROR and events[-1] == "[DONE]"
        assert not any("secret" in e or "KeyError" in e for e in events)
    assert any("secret" in str(r.exc_info) for r in caplog.records if r.exc_info), "the log keeps the details"


def test_loading_state_refuses_requests() -> None:
    """A server whose engine is still loading: /health shows the progress, other routes 503 (full start-up
    flow in test_startup.py)."""
    release = threading.Event()

    def load(progress: Any) -> FakeEngine:
        progress("loading stage 'talker' (2 of 3)")
        release.wait(10)
        return FakeEngine()

    with BackgroundServer(load=load, options=ServerOptions(api_keys=[API_KEY])) as srv:
        assert wait_for(lambda: "talker" in httpx.get(f"{srv.url}/health").text, 5)
        health = httpx.get(f"{srv.url}/health")
        assert health.status_code == 503
        assert health.json() == {"status": "loading", "detail": "loading stage 'talker' (2 of 3)"}
        assert httpx.get(f"{srv.url}/ping").status_code == 503
        assert httpx.get(f"{srv.url}/version", headers=AUTH).status_code == 200
        assert httpx.get(f"{srv.url}/v1/models").status_code == 401  # the key is checked first
        resp = httpx.post(f"{srv.url}/v1/chat/completions", json={"messages": CHAT}, headers=AUTH)
        assert_openai_error(resp, 503, "server is loading", "talker")
        assert resp.headers["retry-after"] == "5"
        release.set()
        assert wait_for(lambda: httpx.get(f"{srv.url}/health").status_code == 200, 5)
        assert httpx.get(f"{srv.url}/v1/models", headers=AUTH).json()["data"][0]["id"] == "fake-model"
