"""POST /v1/audio/speech over the real server on a tiny Qwen3-TTS CustomVoice checkpoint, greedy (talker temperature
0, code predictor greedy): the official client and raw HTTP, every response format decoded back with PyAV, the
streams against the one-shot file, speed and sample_rate, and each bad input as an OpenAI 4xx."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from openai_helpers import assert_openai_error, wait_for

from omnistage.entrypoints.openai.server import BackgroundServer
from omnistage.testing.qwen3_tts import make_tiny_qwen3_tts

av = pytest.importorskip("av")

FRAMES = 12
RATE = 24000
GREEDY = {"max_new_tokens": FRAMES, "subtalker_dosample": False}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, str]]:
    from omnistage.entrypoints.async_omni import AsyncOmni

    ckpt = make_tiny_qwen3_tts(tmp_path_factory.mktemp("tts"), "custom_voice")
    generation = json.loads((ckpt / "generation_config.json").read_text())
    generation["subtalker_dosample"] = False  # greedy code predictor for every route (chat has no field for it)
    (ckpt / "generation_config.json").write_text(json.dumps(generation))
    engine = AsyncOmni.from_model(str(ckpt), {"stages": {"talker": {"default_sampling_params": {"temperature": 0.0}},
                                                         "*": {"dtype": "float32"}},
                                              "limits": {"max_speech_input_chars": 200}}, served_model_name="tts")
    server = BackgroundServer(engine, served_model_names=["tts"]).start()
    yield engine, server.url
    server.stop()
    engine.shutdown()


@pytest.fixture(scope="module")
def http(served: tuple[Any, str]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=served[1], timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def client(served: tuple[Any, str]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served[1]}/v1", api_key="unused", max_retries=0)


def decode(data: bytes) -> tuple[np.ndarray, int]:
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        rate = stream.rate
        pieces = [f.to_ndarray().astype(np.float32).reshape(f.to_ndarray().shape[0], -1)[0] for f in
                  container.decode(stream)]
    samples = np.concatenate(pieces)
    if samples.dtype != np.float32 or np.abs(samples).max() > 1.5:
        samples = samples / 32768.0
    return samples, rate


def assert_close_stream(streamed: np.ndarray, one_shot: np.ndarray) -> None:
    """The streamed audio is decoded in windows, the one-shot file once over all frames: the same frames, so the
    same length, and samples that may differ only where a window's left context falls short (none does at these
    few frames, where the streams measure equal to the file's)."""
    assert streamed.size == one_shot.size
    diff = np.abs(streamed - one_shot)
    assert diff.mean() < 1e-3 and diff.max() < 0.05, (diff.mean(), diff.max())


def pcm(data: bytes) -> np.ndarray:
    return np.frombuffer(data, "<i2").astype(np.float32) / 32768.0


def speak(http: httpx.Client, **fields: Any) -> httpx.Response:
    body = {"model": "tts", "input": "Hello there.", "voice": "vivian", **GREEDY, **fields}
    return http.post("/v1/audio/speech", json=body)


@pytest.fixture(scope="module")
def one_shot(http: httpx.Client) -> np.ndarray:
    resp = speak(http, response_format="wav")
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"] == "audio/wav"
    samples, rate = decode(resp.content)
    assert rate == RATE and samples.size > 0
    assert int(resp.headers["x-usage-output-frames"]) > 0
    assert float(resp.headers["x-usage-audio-seconds"]) == pytest.approx(samples.size / RATE, abs=1e-3)
    assert resp.headers["x-usage-input-characters"] == str(len("Hello there."))
    return samples


def test_wav_equals_async_omni(served: tuple[Any, str], one_shot: np.ndarray) -> None:
    import asyncio

    from omnistage.sampling_params import SamplingParams
    from omnistage.types import OmniRequest

    engine = served[0]
    params = engine.pipeline.stage_config("talker").sampling_params().with_overrides(max_tokens=FRAMES)

    async def run() -> np.ndarray:
        req = OmniRequest(request_id="direct", prompt="Hello there.", output_modalities=("audio",),
                          stage_params={"talker": params}, options={"voice": "vivian", "subtalker_dosample": False,
                                                                    "stream_audio": False})
        pieces = [o.audio for o in [x async for x in engine.generate(req)] if o.audio is not None]
        return np.concatenate(pieces)

    assert isinstance(params, SamplingParams)
    direct = asyncio.run_coroutine_threadsafe(run(), engine.loop).result(60) if hasattr(engine, "loop") else \
        asyncio.run(run())
    assert direct.size == one_shot.size
    assert np.abs(direct - one_shot).max() < 2 / 32768 + 1e-6  # the wav is 16-bit


def test_chat_audio_equals_speech(http: httpx.Client, one_shot: np.ndarray) -> None:
    body = {"model": "tts", "messages": [{"role": "user", "content": "Hello there."}], "modalities": ["audio"],
            "audio": {"voice": "vivian", "format": "wav"}, "max_tokens": FRAMES}
    resp = http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    samples, rate = decode(base64.b64decode(resp.json()["choices"][0]["message"]["audio"]["data"]))
    assert rate == RATE
    np.testing.assert_allclose(samples, one_shot, atol=3 / 32768)


@pytest.mark.parametrize("fmt", ["pcm", "flac", "mp3", "opus", "aac"])
def test_formats(http: httpx.Client, one_shot: np.ndarray, fmt: str) -> None:
    resp = speak(http, response_format=fmt)
    assert resp.status_code == 200, resp.text
    if fmt == "pcm":
        assert resp.headers["content-type"] == "audio/pcm"
        np.testing.assert_allclose(pcm(resp.content), one_shot, atol=3 / 32768)
        return
    samples, rate = decode(resp.content)
    assert samples.size > 0
    if fmt == "flac":
        assert rate == RATE
        np.testing.assert_allclose(samples, one_shot, atol=3 / 32768)
    else:  # lossy: the length is about the wav's (codec padding aside)
        assert abs(samples.size / rate - one_shot.size / RATE) < 0.1


def test_openai_client(client: openai.OpenAI, one_shot: np.ndarray) -> None:
    out = client.audio.speech.create(model="tts", input="Hello there.", voice="vivian", response_format="wav",
                                     extra_body=GREEDY)
    samples, _ = decode(out.content)
    np.testing.assert_allclose(samples, one_shot, atol=3 / 32768)
    with client.audio.speech.with_streaming_response.create(
            model="tts", input="Hello there.", voice="vivian", response_format="pcm",
            extra_body={**GREEDY, "stream": True, "stream_format": "audio"}) as resp:
        data = b"".join(resp.iter_bytes())
    assert_close_stream(pcm(data), one_shot)


def test_sse_stream(http: httpx.Client, one_shot: np.ndarray) -> None:
    body = {"model": "tts", "input": "Hello there.", "voice": "vivian", **GREEDY, "response_format": "pcm",
            "stream": True, "stream_format": "sse"}
    with http.stream("POST", "/v1/audio/speech", json=body) as resp:
        assert resp.status_code == 200
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: ")]
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert deltas and events[-1]["type"] == "speech.audio.done"
    audio = pcm(b"".join(base64.b64decode(e["audio"]) for e in deltas))
    assert_close_stream(audio, one_shot)
    assert events[-1]["usage"]["audio_seconds"] == pytest.approx(audio.size / RATE, abs=1e-3)


def test_wav_stream_has_header(http: httpx.Client) -> None:
    with http.stream("POST", "/v1/audio/speech", json={"input": "Hi.", **GREEDY, "response_format": "wav",
                                                       "stream": True}) as resp:
        data = resp.read()
    assert data[:4] == b"RIFF" and len(data) > 44


def test_speed_and_sample_rate(http: httpx.Client, one_shot: np.ndarray) -> None:
    fast, rate = decode(speak(http, response_format="wav", speed=2.0).content)
    assert rate == RATE and abs(fast.size / one_shot.size - 0.5) < 0.1
    low, rate = decode(speak(http, response_format="wav", sample_rate=16000).content)
    assert rate == 16000 and abs(low.size / 16000 - one_shot.size / RATE) < 0.01


def test_vllm_omni_fields(http: httpx.Client, one_shot: np.ndarray) -> None:
    resp = http.post("/v1/audio/speech", json={"input": "Hello there.", "response_format": "wav",
                                               "extra_body": {"speaker": "Vivian", "task_type": "CustomVoice",
                                                              "language": "English", "seed": 3, **GREEDY},
                                               "some_client_field": 1})
    assert resp.status_code == 200, resp.text
    samples, _ = decode(resp.content)
    assert samples.size > 0
    short = speak(http, response_format="wav", max_new_tokens=3)
    assert int(short.headers["x-usage-output-frames"]) <= 3


@pytest.mark.parametrize(("fields", "status", "words"), [
    ({"voice": "nobody"}, 400, ("unknown voice", "vivian")),
    ({"input": ""}, 400, ("empty",)),
    ({"input": "a" * 201}, 400, ("200",)),
    ({"response_format": "ogg"}, 400, ("response_format", "wav")),
    ({"speed": 5}, 400, ("speed",)),
    ({"response_format": "mp3", "stream": True}, 400, ("pcm", "wav")),
    ({"task_type": "Base"}, 400, ("CustomVoice",)),
    ({"ref_audio": "AAAA"}, 400, ("does not clone",)),
    ({"language": "klingon"}, 400, ("english",)),
    ({"model": "other"}, 404, ("does not exist",)),
])
def test_bad_input(http: httpx.Client, fields: dict, status: int, words: tuple[str, ...]) -> None:
    assert_openai_error(speak(http, **fields), status, *words)


def test_not_a_tts_model(tiny_qwen2: str, tmp_path: Path) -> None:
    from omnistage.entrypoints.async_omni import AsyncOmni

    engine = AsyncOmni.from_model(tiny_qwen2, {"stages": {"*": {"max_model_len": 64, "dtype": "float32"}}},
                                  served_model_name="lm")
    try:
        with BackgroundServer(engine, served_model_names=["lm"]) as server:
            resp = httpx.post(f"{server.url}/v1/audio/speech", json={"input": "hi"}, timeout=30)
            assert_openai_error(resp, 400, "not a text-to-speech model")
    finally:
        engine.shutdown()


def _running(engine: Any) -> int:
    return sum(s.get("num_running", 0) + s.get("outstanding", 0) for s in engine.stats().values())


def test_disconnect_aborts(served: tuple[Any, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The client leaves mid-request (streamed, then whole): no stage holds the request afterwards, and the whole
    one was closed before it finished."""
    engine, url = served
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
    body = {"input": "A longer sentence to say, and then some more words.", "voice": "ryan",
            "max_new_tokens": 1000, "response_format": "pcm", "stream": True}
    with httpx.Client(base_url=url, timeout=30) as http, http.stream("POST", "/v1/audio/speech", json=body) as resp:
        assert resp.status_code == 200
    assert wait_for(lambda: len(outcomes) == 1 and _running(engine) == 0, 10.0), engine.stats()
    with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=url) as http:
        http.post("/v1/audio/speech", json={**body, "stream": False}, timeout=0.02)
    assert wait_for(lambda: len(outcomes) == 2 and _running(engine) == 0, 10.0), engine.stats()
    # the tiny talker may finish the streamed one before the client's close lands; the whole one it cannot
    assert list(outcomes.values())[1] == "closed", outcomes
