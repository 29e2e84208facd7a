"""POST /v1/audio/transcriptions and /v1/audio/translations over the real server on tiny Qwen2.5-Omni, with the
official client: the transcript is the thinker's reply to the family's instruction (the same text a chat completion
with that instruction and the audio gets), in every response format, whole and streamed; errors are OpenAI's 4xx."""

from __future__ import annotations

import base64
import io
import json
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from openai_helpers import wait_for

from omnistage.entrypoints.openai.audio import router as audio_router
from omnistage.entrypoints.openai.audio import subtitles
from omnistage.entrypoints.openai.server import BackgroundServer

pytest.importorskip("torchvision", reason="Qwen2.5-Omni's processor needs torchvision (installed by scripts/test)")

MAX_TOKENS = 6
MAX_MEDIA_BYTES = 100_000  # a 4 s 16 kHz wav (128 kB) is over it, a 1 s one is not


def wav_bytes(seconds: float = 1.0, rate: int = 16000, seed: int = 0) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    noise = np.random.default_rng(seed).normal(0, 0.05, t.shape)
    samples = np.clip(0.3 * np.sin(2 * np.pi * 220 * t) + noise, -1, 1)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((samples * 32767).astype("<i2").tobytes())
    return buf.getvalue()


def _serve(engine: Any, name: str) -> BackgroundServer:
    server = BackgroundServer(engine, served_model_names=[name])
    server.app.include_router(audio_router)  # what server.build_app does once the route is wired in
    return server.start()


@pytest.fixture(scope="module")
def omni(tiny_qwen2_5_omni: str) -> Iterator[tuple[Any, str]]:
    from omnistage.entrypoints.async_omni import AsyncOmni

    engine = AsyncOmni.from_model(tiny_qwen2_5_omni, {"stages": {"*": {"max_model_len": 512, "dtype": "float32"}},
                                                      "limits": {"max_media_bytes": MAX_MEDIA_BYTES}},
                                  served_model_name="omni")
    server = _serve(engine, "omni")
    yield engine, server.url
    server.stop()
    engine.shutdown()


@pytest.fixture(scope="module")
def client(omni: tuple[Any, str]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{omni[1]}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def wav(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("audio") / "speech.wav"
    path.write_bytes(wav_bytes())
    return path


def _chat_text(client: openai.OpenAI, engine: Any, wav: Path, task: str, **hook: Any) -> tuple[str, int]:
    """The reply of a chat completion with the same instruction (the family's hook) and the same audio, greedy."""
    messages = engine.pipeline.transcription_messages(None, task, **hook)
    for message in messages:
        if isinstance(message["content"], list):
            message["content"] = [
                {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav.read_bytes()).decode(),
                                                        "format": "wav"}}
                if part["type"] == "audio" else part for part in message["content"]
            ]
    out = client.chat.completions.create(model="omni", messages=messages, temperature=0, max_tokens=MAX_TOKENS)
    return out.choices[0].message.content or "", out.usage.completion_tokens


def test_transcript_is_the_models_reply(client: openai.OpenAI, omni: tuple[Any, str], wav: Path) -> None:
    with wav.open("rb") as f:
        out = client.audio.transcriptions.create(model="omni", file=f, extra_body={"max_tokens": MAX_TOKENS})
    expected, tokens = _chat_text(client, omni[0], wav, "transcribe")
    assert isinstance(out.text, str) and tokens == MAX_TOKENS  # random weights: the text may be spaces or empty
    assert out.text == expected
    assert out.usage.output_tokens == tokens


def test_language_and_prompt_are_in_the_instruction(client: openai.OpenAI, omni: tuple[Any, str],
                                                    wav: Path) -> None:
    messages = omni[0].pipeline.transcription_messages(None, "transcribe", "German", "Omnistage, Qwen")
    instruction = messages[-1]["content"][-1]["text"]
    assert "German" in instruction and "Omnistage, Qwen" in instruction
    assert messages[0]["role"] == "system"  # Qwen2.5-Omni's override
    with wav.open("rb") as f:
        out = client.audio.transcriptions.create(model="omni", file=f, language="de", prompt="Omnistage, Qwen",
                                                 extra_body={"max_tokens": MAX_TOKENS})
    assert out.text == _chat_text(client, omni[0], wav, "transcribe", language="German",
                                  prompt="Omnistage, Qwen")[0]


def test_response_formats(client: openai.OpenAI, wav: Path) -> None:
    def create(fmt: str) -> Any:
        with wav.open("rb") as f:
            return client.audio.transcriptions.create(model="omni", file=f, response_format=fmt,
                                                      extra_body={"max_tokens": MAX_TOKENS})

    text = create("json").text
    assert create("text") == text
    assert create("srt") == subtitles(text, 1.0, "srt")
    assert create("srt").startswith("1\n00:00:00,000 --> 00:00:01,000\n")
    assert create("vtt").startswith("WEBVTT\n\n00:00:00.000 --> 00:00:01.000\n")
    verbose = create("verbose_json")
    assert (verbose.task, verbose.language, verbose.duration, verbose.text) == ("transcribe", "unknown", 1.0, text)
    [segment] = verbose.segments
    assert (segment.start, segment.end, segment.text) == (0.0, 1.0, text)
    assert len(segment.tokens) == MAX_TOKENS or text == ""
    assert segment.avg_logprob <= 0.0


def test_streamed_transcript(client: openai.OpenAI, wav: Path) -> None:
    with wav.open("rb") as f:
        whole = client.audio.transcriptions.create(model="omni", file=f, extra_body={"max_tokens": MAX_TOKENS}).text
    with wav.open("rb") as f:
        events = list(client.audio.transcriptions.create(model="omni", file=f, stream=True,
                                                         extra_body={"max_tokens": MAX_TOKENS}))
    deltas = [e.delta for e in events if e.type == "transcript.text.delta"]
    done = [e for e in events if e.type == "transcript.text.done"]
    assert len(done) == 1 and events[-1] is done[0]
    assert "".join(deltas) == done[0].text == whole


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the client marks translations deprecated
def test_translation(client: openai.OpenAI, omni: tuple[Any, str], wav: Path) -> None:
    with wav.open("rb") as f:
        out = client.audio.translations.create(model="omni", file=f, extra_body={"max_tokens": MAX_TOKENS})
    assert out.text == _chat_text(client, omni[0], wav, "translate")[0]
    with wav.open("rb") as f:
        verbose = client.audio.translations.create(model="omni", file=f, response_format="verbose_json",
                                                   extra_body={"max_tokens": MAX_TOKENS})
    assert (verbose.task, verbose.language, verbose.text) == ("translate", "english", out.text)


def test_ignored_fields_are_accepted(client: openai.OpenAI, wav: Path) -> None:
    with wav.open("rb") as f:
        out = client.audio.transcriptions.create(model="omni", file=f, response_format="verbose_json",
                                                 timestamp_granularities=["segment"], chunking_strategy="auto",
                                                 extra_body={"max_tokens": MAX_TOKENS})
    assert isinstance(out.text, str)


def _error(exc: openai.APIStatusError) -> dict[str, Any]:
    return exc.response.json()["error"]


@pytest.mark.parametrize("temperature", [2.5, -0.1])
def test_temperature_out_of_range(client: openai.OpenAI, wav: Path, temperature: float) -> None:
    with wav.open("rb") as f, pytest.raises(openai.BadRequestError) as exc:
        client.audio.transcriptions.create(model="omni", file=f, temperature=temperature)
    error = _error(exc.value)
    assert error["param"] == "temperature" and "[0, 2]" in error["message"]


def _post(url: str, files: dict | None = None, data: dict | None = None, timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{url}/v1/audio/transcriptions", files=files, data=data, timeout=timeout)


@pytest.mark.parametrize(("data", "param"), [
    ({"temperature": "warm"}, "temperature"),
    ({"stream": "maybe"}, "stream"),
    ({"response_format": "docx"}, "response_format"),
    ({"response_format": "srt", "stream": "true"}, "stream"),
    ({"max_tokens": "0"}, "max_tokens"),
    ({"langauge": "en"}, "langauge"),
    ({"model": "whisper-9"}, "model"),
])
def test_bad_fields_are_400s_naming_the_field(omni: tuple[Any, str], data: dict, param: str) -> None:
    resp = _post(omni[1], files={"file": ("a.wav", wav_bytes(0.2))}, data=data)
    assert resp.status_code == (404 if param == "model" else 400), resp.text
    error = resp.json()["error"]
    assert error["param"] == param
    if param == "langauge":
        assert "did you mean 'language'?" in error["message"]


def test_not_audio_is_a_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.audio.transcriptions.create(model="omni", file=("notes.txt", b"these are not sounds " * 50))
    error = _error(exc.value)
    assert error["param"] == "file" and "could not decode the audio" in error["message"]


def test_missing_file_and_json_body_are_400s(omni: tuple[Any, str]) -> None:
    resp = _post(omni[1], files={"model": (None, "omni")})  # multipart without a file
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "file"
    resp = _post(omni[1], files={"file": (None, "not a file")})
    assert resp.status_code == 400 and "must be a file upload" in resp.json()["error"]["message"]
    resp = httpx.post(f"{omni[1]}/v1/audio/transcriptions", json={"model": "omni"}, timeout=60)
    assert resp.status_code == 400 and "multipart/form-data" in resp.json()["error"]["message"]


def test_file_over_the_media_limit_is_a_413(client: openai.OpenAI) -> None:
    with pytest.raises(openai.APIStatusError) as exc:
        client.audio.transcriptions.create(model="omni", file=("long.wav", wav_bytes(4.0)))
    assert exc.value.status_code == 413
    assert "limits.max_media_bytes" in _error(exc.value)["message"]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_model_that_does_not_hear_is_a_400(tiny_qwen2: str, wav: Path) -> None:
    from omnistage.entrypoints.async_omni import AsyncOmni

    engine = AsyncOmni.from_model(tiny_qwen2, {"stages": {"*": {"dtype": "float32"}}}, served_model_name="lm")
    server = _serve(engine, "lm")
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        for create in (client.audio.transcriptions.create, client.audio.translations.create):
            with wav.open("rb") as f, pytest.raises(openai.BadRequestError) as exc:
                create(model="lm", file=f)
            assert "this model does not take audio input" in _error(exc.value)["message"]
    finally:
        server.stop()
        engine.shutdown()


def test_streamed_events_are_openai_sse(omni: tuple[Any, str]) -> None:
    resp = _post(omni[1], files={"file": ("a.wav", wav_bytes(0.5))},
                 data={"stream": "true", "max_tokens": str(MAX_TOKENS)})
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    lines = [line[len("data: "):] for line in resp.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    last = json.loads(lines[-2])
    assert last["type"] == "transcript.text.done" and last["usage"]["output_tokens"] >= 1


def _spy(engine: Any, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """request id -> 'finished' or 'closed' (left before finishing)."""
    outcomes: dict[str, str] = {}
    real_generate = engine.generate

    async def generate(request: Any) -> Any:
        finished = False
        try:
            async for out in real_generate(request):
                finished = out.finished
                yield out
        finally:
            outcomes[request.request_id] = "finished" if finished else "closed"

    monkeypatch.setattr(engine, "generate", generate)
    return outcomes


def _running(engine: Any) -> int:
    return sum(s["num_running"] for s in engine.stats().values())


@pytest.mark.parametrize("stream", [False, True])
def test_client_leaving_aborts(omni: tuple[Any, str], monkeypatch: pytest.MonkeyPatch, stream: bool) -> None:
    engine, url = omni
    outcomes = _spy(engine, monkeypatch)
    files, data = {"file": ("a.wav", wav_bytes(0.5))}, {"max_tokens": "400", "stream": str(stream).lower()}
    if stream:
        with httpx.stream("POST", f"{url}/v1/audio/transcriptions", files=files, data=data, timeout=60) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    break
    else:
        with pytest.raises(httpx.ReadTimeout):
            _post(url, files=files, data=data, timeout=0.3)
    assert wait_for(lambda: len(outcomes) == 1 and _running(engine) == 0, 10.0), (outcomes, engine.stats())
    assert list(outcomes.values()) == ["closed"]


def test_audio_longer_than_the_context_is_a_400(omni: tuple[Any, str]) -> None:
    """20 s is about 500 audio tokens: with the instruction, more than the 512-token context."""
    resp = _post(omni[1], files={"file": ("long.wav", wav_bytes(20.0, rate=2000))})
    assert resp.status_code == 400, resp.text
    assert "context" in resp.json()["error"]["message"]
