"""POST /v1/chat/completions on a real server over tiny FLUX.1-dev: the last user message is the prompt, the
generation fields come SDK-merged or in a literal `extra_body`, the reply's content is image_url parts whose
bytes equal the images API's and the Python API's; `stream` sends one progress chunk per step, then the images."""

from __future__ import annotations

import base64
import json

import httpx
import openai
import pytest

pytest.importorskip("diffusers")

from omnistage.entrypoints.openai.server import BackgroundServer  # noqa: E402

GEN = {"size": "32x48", "num_inference_steps": 3, "seed": 7, "guidance_scale": 3.5}
PREFIX = "data:image/png;base64,"


def _png(size: tuple[int, int] = (8, 8)) -> str:
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", size, (200, 30, 30)).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture(scope="module")
def served():
    from omnistage.entrypoints.async_omni import AsyncOmni
    from omnistage.testing.flux import tiny_flux

    engine = AsyncOmni.from_model(str(tiny_flux("dev")), {"stages": {"*": {"dtype": "float32", "devices": "cpu"}}},
                                  served_model_name="flux")
    with BackgroundServer(engine) as server:
        yield engine, server
    engine.shutdown()


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served[1].url}/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def http(served):
    with httpx.Client(base_url=served[1].url, timeout=60) as c:
        yield c


def _urls(content: list) -> list[str]:
    assert all(part["type"] == "image_url" for part in content)
    urls = [part["image_url"]["url"] for part in content]
    assert all(url.startswith(PREFIX) for url in urls)
    return [url.removeprefix(PREFIX) for url in urls]


def test_chat_returns_image_url_content_equal_to_the_images_api(client: openai.OpenAI, served) -> None:
    from test_images import python_api

    reply = client.chat.completions.create(
        model="flux", messages=[{"role": "system", "content": "ignored"}, {"role": "user", "content": "a red fox"}],
        temperature=0.7, max_tokens=10, extra_body={**GEN, "num_outputs_per_prompt": 2})
    images = _urls(reply.choices[0].message.content)
    assert len(images) == 2 and reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens == 3
    gen = client.images.generate(model="flux", prompt="a red fox", n=2, size="32x48",
                                 extra_body={k: v for k, v in GEN.items() if k != "size"})
    assert images == [item.b64_json for item in gen.data]
    assert images == python_api(served[0], "a red fox", width=32, height=48, num_inference_steps=3, seed=7,
                                guidance_scale=3.5, n=2)


def test_literal_extra_body_and_text_parts(http: httpx.Client, client: openai.OpenAI) -> None:
    want = _urls(client.chat.completions.create(model="flux", messages=[{"role": "user", "content": "a red fox"}],
                                                extra_body=GEN).choices[0].message.content)
    body = {"model": "flux", "seed": 1, "response_format": {"type": "text"}, "extra_body": GEN,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "a red"}, {"type": "text",
                                                                                         "text": "fox"}]}]}
    resp = http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    assert _urls(resp.json()["choices"][0]["message"]["content"]) == want


def _events(resp: httpx.Response) -> list[dict]:
    lines = [line.removeprefix("data: ") for line in resp.text.split("\n\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_stream_sends_progress_then_images(http: httpx.Client, client: openai.OpenAI) -> None:
    want = _urls(client.chat.completions.create(model="flux", messages=[{"role": "user", "content": "a red fox"}],
                                                extra_body=GEN).choices[0].message.content)
    body = {"model": "flux", "stream": True, "messages": [{"role": "user", "content": "a red fox"}], **GEN}
    with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        resp.read()
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    events = _events(resp)
    assert all(e["object"] == "chat.completion.chunk" and e["id"] == events[0]["id"] for e in events)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    steps = [e["progress"] for e in events[1:-1]]
    assert steps == [{"step": i, "total": 3} for i in range(1, len(steps) + 1)] and len(steps) >= 2
    assert all(e["choices"][0]["delta"] == {} for e in events[1:-1])
    last = events[-1]
    assert last["choices"][0]["finish_reason"] == "stop" and last["progress"] == {"step": 3, "total": 3}
    assert _urls(last["choices"][0]["delta"]["content"]) == want


def test_stream_with_the_openai_client(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(model="flux", messages=[{"role": "user", "content": "a fox"}],
                                                 stream=True, extra_body=GEN))
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert base64.b64decode(_urls(chunks[-1].choices[0].delta.content)[0]).startswith(b"\x89PNG")


@pytest.mark.parametrize("body, words", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "assistant", "content": "hi"}]}, "user message"),
    ({"messages": [{"role": "user", "content": "x"}], "n": "2"}, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "size": "33x48"}, "multiple"),
    ({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "aGVsbG8="}}]}]},
     "decode"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"},
                                                {"type": "image_url", "image_url": {"url": _png()}}]}]},
     "input images"),
])
def test_bad_chat_requests_are_400(http: httpx.Client, body: dict, words: str) -> None:
    resp = http.post("/v1/chat/completions", json={"model": "flux", **body})
    assert resp.status_code == 400, resp.text
    assert words in resp.json()["error"]["message"]
