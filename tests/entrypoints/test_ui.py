"""The browser demo (GET /ui) in a real headless Chromium, driven by Playwright, against the real server on tiny
checkpoints: a streamed text chat turn, streamed speech played through Web Audio and kept as a replayable WAV,
and a wrong API key's error shown. Screenshots go to the test's tmp_path and to /tmp/ui-screenshots/."""

from __future__ import annotations

import io
import json
import re
import shutil
import threading
import time
import wave
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from openai_helpers import API_KEY

from omnistage.entrypoints.openai.server import BackgroundServer
from omnistage.entrypoints.openai.ui import ASSETS, install_ui, serve_ui_demo, ui_url

CHROMIUM = "/usr/bin/chromium"
SHOTS = Path("/tmp/ui-screenshots")
AUTH = {"Authorization": f"Bearer {API_KEY}"}
GREEDY = '{"temperature": 0, "ignore_eos": true}'


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as exc:
        pytest.skip(f"playwright is not installed ({exc}); pip install playwright")
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no Chromium at {CHROMIUM}; apt-get install chromium")
    with sync_playwright() as p:
        try:
            browser = p.chromium.launch(executable_path=CHROMIUM,
                                        args=["--no-sandbox", "--autoplay-policy=no-user-gesture-required",
                                              # a fake microphone (a beep), allowed without asking
                                              "--use-fake-device-for-media-stream", "--use-fake-ui-for-media-stream"])
        except Exception as exc:  # noqa: BLE001 - any launch failure is an environment problem
            pytest.skip(f"could not launch Chromium at {CHROMIUM}: {exc}")
        yield browser
        browser.close()


@contextmanager
def _served(engine: Any) -> Iterator[BackgroundServer]:
    """The real server, API key required, serving the page (install_ui: a no-op once build_app does it)."""
    server = BackgroundServer(engine, api_key=API_KEY)
    install_ui(server.app)
    with server:
        yield server


@contextmanager
def _page(browser: Any, server: BackgroundServer, key: str | None = API_KEY) -> Iterator[Any]:
    """The demo page, its API key typed in (then stored by the page); fails the test on any page error."""
    context = browser.new_context()
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(ui_url(server.url))
    if key is not None:
        page.fill("#api-key", key)
        page.dispatch_event("#api-key", "change")
    try:
        yield page
    finally:
        context.close()
    assert not errors, errors


def _shot(page: Any, tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    page.screenshot(path=str(path), full_page=True)
    SHOTS.mkdir(parents=True, exist_ok=True)
    shutil.copy(path, SHOTS / name)


def _chat(page: Any, prompt: str, max_tokens: int, extra: str = GREEDY, timeout_ms: float = 120_000) -> Any:
    """Send one chat turn from the page and wait for it to end; returns the answer's element."""
    page.fill("#max-tokens", str(max_tokens))
    page.evaluate("document.querySelector('details').open = true")
    page.fill("#extra", extra)
    page.fill("#prompt", prompt)
    page.click("#send")
    page.wait_for_selector("body[data-state=idle] .msg.assistant .meta", timeout=timeout_ms)
    return page.query_selector(".msg.assistant")


def test_page_and_assets_need_no_key_and_nothing_else_is_served(real_engine: Any) -> None:
    with _served(real_engine) as server:
        for name in ("", *ASSETS):
            res = httpx.get(f"{server.url}/ui/{name}".removesuffix("/"))
            assert res.status_code == 200, (name, res.text)
            assert "connect-src 'self'" in res.headers["content-security-policy"]
        html = httpx.get(f"{server.url}/ui").text
        assert "http://" not in html and "https://" not in html  # nothing from the internet
        assert httpx.get(f"{server.url}/ui/../server.py").status_code in (401, 404)
        assert httpx.get(f"{server.url}/v1/models").status_code == 401  # the API still needs the key
    assert ui_url("http://0.0.0.0:8000/") == "http://localhost:8000/ui"
    assert ui_url("http://127.0.0.1:9/v1") == "http://127.0.0.1:9/ui"


def test_demo_serves_the_page_until_stopped(real_engine: Any) -> None:
    """`omnistage demo --ui`'s loop: prints the page's address, serves it (no key), stops when told."""
    lines: list[str] = []
    stop = threading.Event()
    thread = threading.Thread(target=serve_ui_demo, args=(real_engine,), kwargs={"out": lines.append, "stop": stop})
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not lines and time.monotonic() < deadline:
            time.sleep(0.05)
        url = re.search(r"http://\S+/ui", lines[0]).group(0)
        assert httpx.get(url).status_code == 200
        assert httpx.get(url.removesuffix("/ui") + "/v1/models").json()["data"][0]["id"] == "tiny-qwen2"
    finally:
        stop.set()
        thread.join(30)
    assert not thread.is_alive()


def test_streamed_text_chat(browser: Any, real_engine: Any, tmp_path: Path) -> None:
    with _served(real_engine) as server, _page(browser, server) as page:
        page.wait_for_selector("#model option[value='tiny-qwen2']", state="attached")
        assert page.is_disabled("#speak")  # a text-only model
        answer = _chat(page, "Tell me about the river.", max_tokens=8)
        _shot(page, tmp_path, "ui-text-chat.png")
        text = answer.query_selector(".text").text_content()
        expected = httpx.post(f"{server.url}/v1/chat/completions", headers=AUTH,
                              json={"model": "tiny-qwen2", "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                                    "messages": [{"role": "user", "content": "Tell me about the river."}]},
                              timeout=120).json()["choices"][0]["message"]["content"]
        assert text and text == expected
        assert int(answer.get_attribute("data-deltas")) > 1  # it came in pieces, shown as they arrived
        assert page.is_hidden("#error")
        assert "8 tokens" in answer.query_selector(".meta").text_content()
        # the tabs say what the server has: a 404 from the endpoint means "not available"
        for tab, path in (("images", "/v1/images/generations"), ("videos", "/v1/videos"),
                          ("speech", "/v1/audio/speech")):
            status = httpx.post(f"{server.url}{path}", headers=AUTH, json={}).status_code
            page.click(f"#tabs button[data-tab={tab}]")
            shown = page.text_content(f"#tab-{tab}")
            assert ("Not available" in shown) == (status in (404, 405)), (tab, status, shown)
        _shot(page, tmp_path, "ui-images-tab.png")
        # the key was stored: a reload lists the models without typing it again
        page.reload()
        page.wait_for_selector("#model option[value='tiny-qwen2']", state="attached")
        assert page.input_value("#api-key") == API_KEY


@pytest.fixture(scope="module")
def omni_engine(tiny_qwen2_5_omni: str) -> Iterator[Any]:
    pytest.importorskip("torchvision", reason="Qwen2.5-Omni's processor needs torchvision (installed by scripts/test)")
    from omnistage.entrypoints.async_omni import AsyncOmni

    engine = AsyncOmni.from_model(tiny_qwen2_5_omni, {"stages": {"*": {"max_model_len": 512, "dtype": "float32"},
                                                                 "talker": {"default_sampling_params": {
                                                                     "max_tokens": 12, "temperature": 0}}}},
                                  served_model_name="omni")
    yield engine
    engine.shutdown()


def test_streamed_speech_plays_and_replays(browser: Any, omni_engine: Any, tmp_path: Path) -> None:
    with _served(omni_engine) as server, _page(browser, server) as page:
        page.wait_for_selector("#model option[value='omni']", state="attached")
        assert page.is_checked("#speak")  # the model outputs audio: speech is asked for by default
        answer = _chat(page, "Hi!", max_tokens=6)
        assert answer.query_selector(".text").text_content()
        assert page.is_hidden("#error")
        # Web Audio scheduled the streamed chunks as they came
        assert int(page.get_attribute("body", "data-audio-chunks")) > 0
        audio = answer.query_selector("audio")
        assert audio is not None and audio.get_attribute("src").startswith("blob:")
        duration = audio.evaluate("""async (a) => {
            if (a.readyState < 1) await new Promise((ok, fail) => {
                a.addEventListener("loadedmetadata", ok, {once: true});
                a.addEventListener("error", () => fail(new Error("audio error " + a.error.code)), {once: true});
            });
            await a.play();  // it can play: the WAV decodes
            return a.duration;
        }""")
        assert duration == pytest.approx(12 * 2 * 240 / 24000, abs=1e-3)  # 12 codes, 2 mel frames each
        _shot(page, tmp_path, "ui-speech-chat.png")


def test_image_audio_file_and_microphone_inputs(browser: Any, omni_engine: Any, tmp_path: Path) -> None:
    """An image and a WAV file attached, a recording from the (fake) microphone: sent as image_url and
    input_audio parts, the recording re-encoded as WAV, and the omni model answers."""
    from PIL import Image

    Image.fromarray(np.full((56, 56, 3), 128, dtype=np.uint8)).save(tmp_path / "grey.png")
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(16000)
        w.writeframes((np.sin(np.arange(8000) * 0.2) * 8000).astype(np.int16).tobytes())
    (tmp_path / "tone.wav").write_bytes(buffer.getvalue())
    with _served(omni_engine) as server, _page(browser, server) as page:
        page.wait_for_selector("#model option[value='omni']", state="attached")
        page.set_input_files("#files", [str(tmp_path / "grey.png"), str(tmp_path / "tone.wav")])
        page.click("#record")
        page.wait_for_selector("#record.recording")
        page.wait_for_timeout(700)
        page.click("#record")
        page.locator("#attachments .chip").nth(2).wait_for()  # (wait_for_function would eval: the CSP forbids it)
        assert "recording.wav" in page.text_content("#attachments")
        with page.expect_request("**/v1/chat/completions") as sent:
            answer = _chat(page, "What do you see and hear?", max_tokens=4)
        assert page.is_hidden("#error"), page.text_content("#error")
        assert answer.query_selector(".text").text_content()
        parts = json.loads(sent.value.post_data)["messages"][-1]["content"]
        assert [p["type"] for p in parts] == ["image_url", "input_audio", "input_audio", "text"]
        assert parts[0]["image_url"]["url"].startswith("data:image/png;base64,")
        assert [p["input_audio"]["format"] for p in parts[1:3]] == ["wav", "wav"]
        assert page.query_selector(".msg.user img") is not None
        assert not page.query_selector_all("#attachments .chip")  # sent: cleared
        _shot(page, tmp_path, "ui-media-input.png")
        # a second turn sends the history, media included
        with page.expect_request("**/v1/chat/completions") as sent:
            page.fill("#prompt", "And now?")
            page.click("#send")
            page.locator(".msg.assistant .meta").nth(1).wait_for(timeout=120_000)
        assert page.is_hidden("#error"), page.text_content("#error")
        assert [m["role"] for m in json.loads(sent.value.post_data)["messages"]] == ["user", "assistant", "user"]


def test_wrong_api_key_shows_the_error(browser: Any, real_engine: Any, tmp_path: Path) -> None:
    with _served(real_engine) as server, _page(browser, server, key="not-the-key") as page:
        page.wait_for_selector("#error:has-text('invalid API key')")
        assert page.text_content("#error").startswith("Could not list the models: 401: invalid API key")
        page.fill("#prompt", "Hello?")
        page.click("#send")
        page.wait_for_selector("body[data-state=idle] .msg.assistant.failed .meta")
        shown = page.text_content("#error")
        assert shown.startswith("401: invalid API key") and "Authorization: Bearer" in shown
        _shot(page, tmp_path, "ui-wrong-key.png")
