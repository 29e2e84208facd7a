"""Server paths that need a scripted engine: stage failures, crashes, request shaping, abort accounting."""

from __future__ import annotations

import base64
import io
import time
import wave

import httpx
import openai
import pytest
from openai_helpers import (
    AUDIO_CHUNK,
    CHAT,
    CHAT_FAIL,
    Served,
    assert_openai_error,
    assert_still_serving,
    sse_events,
    wait_for,
)


def test_stage_error_non_stream_is_5xx(fake_served: Served) -> None:
    with fake_served.http() as http:
        resp = http.post("/v1/chat/completions", json={"messages": CHAT_FAIL, "max_tokens": 8})
    err = assert_openai_error(resp, 500, "boom")
    assert err["type"] == "stage_error"
    assert_still_serving(fake_served)


def test_stage_error_non_stream_aborts_the_other_choices(fake_served: Served) -> None:
    """One prompt of a batch fails after two tokens: the answer is an error at once, and the other prompt's
    generation (50 tokens to go) is aborted rather than run to its end for nothing."""
    engine = fake_served.engine
    engine.aborted.clear()
    body = {"prompt": ["please FAIL", "a long answer"], "max_tokens": 50}
    with fake_served.http() as http:
        assert_openai_error(http.post("/v1/completions", json=body), 500, "boom")
    other = [r.request_id for r in engine.requests if r.prompt == "a long answer"][-1]
    assert other in engine.aborted
    assert wait_for(lambda: other not in engine.running, timeout=5)
    assert_still_serving(fake_served)


def test_stage_error_mid_stream_is_in_band(fake_served: Served) -> None:
    body = {"messages": CHAT_FAIL, "max_tokens": 8, "stream": True}
    with fake_served.http() as http, http.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        events = sse_events(resp)
    assert '"error"' in events[-2] and "boom" in events[-2] and events[-1] == "[DONE]"
    with pytest.raises(openai.APIError, match="boom"):
        list(fake_served.client().chat.completions.create(model=fake_served.model, messages=CHAT_FAIL, stream=True))
    assert_still_serving(fake_served)


def test_unexpected_exception_is_500(fake_served: Served) -> None:
    body = {"messages": [{"role": "user", "content": "RAISE"}], "max_tokens": 2}
    with fake_served.http() as http:
        err = assert_openai_error(http.post("/v1/chat/completions", json=body), 500, "internal server error")
    assert err["type"] == "internal_error" and "scripted crash" not in err["message"]  # internals stay in the log
    assert_still_serving(fake_served)


def test_request_shaping(fake_served: Served) -> None:
    """What the engine sees: fan-out ids, per-choice seeds, max_tokens None when unsent, developer->system."""
    engine = fake_served.engine
    engine.requests.clear()
    fake_served.client().chat.completions.create(
        model=fake_served.model,
        messages=[{"role": "developer", "content": "be brief"}, *CHAT],
        n=3,
        seed=11,
        temperature=0.5,
        stop="zz",
    )
    reqs = sorted(engine.requests, key=lambda r: r.request_id)
    assert len({r.request_id for r in reqs}) == 3 and all(r.request_id[-2:] in ("-0", "-1", "-2") for r in reqs)
    params = [r.stage_params["*"] for r in reqs]
    assert [p.seed for p in params] == [11, 12, 13]
    assert all(p.max_tokens is None and p.temperature == 0.5 and p.stop == ["zz"] for p in params)
    assert reqs[0].messages[0] == {"role": "system", "content": "be brief"}
    assert reqs[0].output_modalities == ("text",)


def test_stop_string(fake_served: Served) -> None:
    out = fake_served.client().chat.completions.create(model=fake_served.model, messages=CHAT, stop=["w3"])
    assert out.choices[0].message.content == " w0 w1 w2 " and out.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_stream_disconnect_aborts(fake_served: Served, endpoint: str) -> None:
    engine = fake_served.engine
    engine.delay = 0.05  # 64 tokens take ~3 s; we leave after two
    try:
        path, body = (
            ("/v1/chat/completions", {"messages": CHAT, "stream": True})
            if endpoint == "chat"
            else ("/v1/completions", {"prompt": "x", "max_tokens": 60, "stream": True})
        )
        with fake_served.http() as http, http.stream("POST", path, json=body) as resp:
            lines = resp.iter_lines()
            next(line for line in lines if "w1" in line)
            assert engine.running
        start = time.monotonic()
        assert wait_for(lambda: not engine.running, 2.0)
        assert time.monotonic() - start < 1.0
    finally:
        engine.delay = 0.002


def test_non_stream_disconnect_aborts(fake_served: Served) -> None:
    engine = fake_served.engine
    engine.delay = 0.05
    try:
        with pytest.raises(httpx.ReadTimeout), fake_served.http() as http:
            http.post("/v1/chat/completions", json={"messages": CHAT, "n": 2}, timeout=0.3)
        assert wait_for(lambda: not engine.running, 2.0)
    finally:
        engine.delay = 0.002
    assert_still_serving(fake_served)


def test_health_503_when_not_ready(fake_served: Served) -> None:
    fake_served.engine.ready = False
    try:
        resp = httpx.get(f"{fake_served.url}/health")
        assert resp.status_code == 503 and resp.json()["status"] == "unavailable"
    finally:
        fake_served.engine.ready = True


def test_audio_output(fake_served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    """Spoken output: a WAV in message.audio (non-stream), base64 pcm16 chunks in delta.audio (stream)."""
    monkeypatch.setattr(fake_served.engine, "output_modalities", ("text", "audio"))
    client = fake_served.client()
    kwargs = dict(model=fake_served.model, messages=CHAT, max_tokens=4, modalities=["text", "audio"])
    out = client.chat.completions.create(**kwargs, audio={"voice": "alloy", "format": "wav"})
    audio = out.choices[0].message.audio
    with wave.open(io.BytesIO(base64.b64decode(audio.data))) as wav:
        assert (wav.getframerate(), wav.getnchannels(), wav.getnframes()) == (16000, 1, 4 * AUDIO_CHUNK)
    assert audio.transcript == out.choices[0].message.content == " w0 w1 w2 w3"
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    pcm = b"".join(base64.b64decode(c.choices[0].delta.audio.data) for c in chunks if c.choices[0].delta.audio)
    assert len(pcm) == 2 * 4 * AUDIO_CHUNK
    assert fake_served.engine.requests[-1].output_modalities == ("text", "audio")
    # Text-only requests stay text-only.
    plain = client.chat.completions.create(model=fake_served.model, messages=CHAT, max_tokens=2)
    assert plain.choices[0].message.audio is None
