"""Media through the real HTTP server on the tiny Qwen2.5-Omni: URLs are fetched before admission, so a text
request is not held up by slow media URLs; a client that leaves stops its fetches; internal URLs are refused with
the uniform message; too many parts is a 413."""

from __future__ import annotations

import asyncio
import base64
import io
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

for _module in ("torchvision", "soundfile", "soxr", "av", "PIL"):
    pytest.importorskip(_module, reason="needs the omni extra (pip install 'omnistage[omni]')")

from omnistage.entrypoints.openai.server import BackgroundServer  # noqa: E402
from omnistage.media import RemotePolicy  # noqa: E402
from omnistage.testing.media_files import Image, png_bytes  # noqa: E402


@pytest.fixture(scope="module")
def served(tiny_qwen2_5_omni: str) -> Iterator[tuple[Any, str]]:
    from omnistage.entrypoints.async_omni import AsyncOmni

    engine = AsyncOmni.from_model(tiny_qwen2_5_omni, {"stages": {"*": {"max_model_len": 512, "dtype": "float32"}},
                                                      "limits": {"max_media_parts": 8}}, served_model_name="omni")
    try:
        with BackgroundServer(engine) as server:
            yield engine, server.url
    finally:
        engine.shutdown()


def chat(content: Any) -> dict:
    return {"model": "omni", "messages": [{"role": "user", "content": content}], "max_tokens": 3, "temperature": 0}


def image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


async def _until(condition, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.05)


async def test_text_is_not_held_up_by_slow_media(served, media_server, monkeypatch) -> None:
    engine, url = served
    monkeypatch.setattr(engine, "media_policy", RemotePolicy(allow_internal=frozenset({"127.0.0.1"}),
                                                             fetch_timeout_s=60))
    media_server.files["pic.png"] = png_bytes(Image.new("RGB", (56, 56), (128, 128, 128)))
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        ok = await client.post("/v1/chat/completions", json=chat([image(media_server.url("files/pic.png")),
                                                                 {"type": "text", "text": "What is this?"}]))
        assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] > 20  # fetched, decoded, answered
        slow = [asyncio.ensure_future(client.post("/v1/chat/completions", json=chat([
            image(media_server.url(f"trickle/{i}")), {"type": "text", "text": "and this?"}]))) for i in range(8)]
        await _until(lambda: media_server.trickling == 8, 30)
        start = time.monotonic()
        text = await client.post("/v1/chat/completions", json=chat("Hi"))
        assert text.status_code == 200 and time.monotonic() - start < 10
        assert media_server.trickling == 8 and not any(t.done() for t in slow)  # still fetching
        for task in slow:  # the clients leave: their fetches stop long before their deadline
            task.cancel()
        await asyncio.gather(*slow, return_exceptions=True)
    await _until(lambda: media_server.trickling == 0, 10)


def test_internal_urls_are_refused(served, media_server) -> None:
    """With the deploy config's policy (the default), loopback in any spelling, and the server itself."""
    engine, url = served
    assert engine.media_policy is None
    media_server.files["pic.png"] = png_bytes(Image.new("RGB", (8, 8)))
    server_port = int(url.rsplit(":", 1)[1])
    before = len(media_server.requests)
    for target in (media_server.url("files/pic.png"), media_server.url("files/pic.png", "0x7f000001"),
                   media_server.url("files/pic.png", "[::1]"), f"http://localhost:{server_port}/metrics",
                   "http://169.254.169.254/latest/meta-data/"):
        response = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                              json=chat([{"type": "text", "text": "see"}, image(target)]))
        assert response.status_code == 400, target
        assert response.json()["error"]["message"] == "could not fetch the media at messages[0].content[1]"
    assert len(media_server.requests) == before


def test_too_many_media_parts(served) -> None:
    _, url = served
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buffer, format="PNG")
    inline = image("data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode())
    response = httpx.post(f"{url}/v1/chat/completions", json=chat([inline] * 9), timeout=60)
    assert response.status_code == 413
    assert "messages[0].content[8]" in response.json()["error"]["message"]
    assert "limits.max_media_parts" in response.json()["error"]["message"]
