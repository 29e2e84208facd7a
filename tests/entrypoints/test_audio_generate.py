"""POST /v1/audio/generate on a real server over tiny Stable Audio Open: the clip equals diffusers'
StableAudioPipeline for the same prompt, clip, steps and seed (within the 16-bit step, STEP); it comes at the model's
sample rate, channels and the asked duration in every response format; concurrent requests each keep their own
clip; bad input is a 400 in OpenAI's error format naming the field; a model that makes no audio clips is refused;
and `omnistage demo --arch stable_audio` writes a clip."""

from __future__ import annotations

import concurrent.futures
import io
import subprocess
import sys

import httpx
import numpy as np
import pytest
import soundfile as sf
import torch

pytest.importorskip("diffusers")

from openai_helpers import API_KEY, assert_openai_error  # noqa: E402

from omnistage.entrypoints.openai.audio_generate import available_formats  # noqa: E402
from omnistage.entrypoints.openai.server import BackgroundServer  # noqa: E402
from omnistage.testing.stable_audio import SAMPLE_RATE, tiny_stable_audio  # noqa: E402

STEP = 1.5 / 32768  # 16-bit quantization (libsndfile scales by 32768) plus the parity tolerance
BODY = {"model": "sao", "input": "a dog barking in the rain", "audio_length": 0.5, "num_inference_steps": 4,
        "seed": 7, "guidance_scale": 4.0, "negative_prompt": "low quality"}


@pytest.fixture(scope="module")
def path() -> str:
    return str(tiny_stable_audio())


@pytest.fixture(scope="module")
def http(path: str):
    from omnistage.entrypoints.async_omni import AsyncOmni

    # float32 on the CPU, as the diffusers reference runs
    engine = AsyncOmni.from_model(path, {"stages": {"*": {"dtype": "float32", "devices": "cpu"}}},
                                  served_model_name="sao")
    with BackgroundServer(engine) as server, httpx.Client(base_url=server.url, timeout=120) as client:
        yield client
    engine.shutdown()


@pytest.fixture(scope="module")
def reference(path: str):
    from diffusers import StableAudioPipeline

    pipe = StableAudioPipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def diffusers_clip(ref, body: dict) -> np.ndarray:
    """diffusers' clip as the server writes it: clipped to [-1, 1], [samples, channels]."""
    start = body.get("audio_start", 0.0)
    audio = ref(body["input"], negative_prompt=body.get("negative_prompt"), audio_start_in_s=start,
                audio_end_in_s=start + body["audio_length"], num_inference_steps=body["num_inference_steps"],
                guidance_scale=body["guidance_scale"], generator=torch.Generator("cpu").manual_seed(body["seed"]),
                output_type="np").audios[0].T
    return np.clip(audio, -1, 1)


def read_wav(data: bytes) -> tuple[np.ndarray, int]:
    return sf.read(io.BytesIO(data), dtype="float32", always_2d=True)


def test_wav_is_diffusers_clip(http, reference) -> None:
    resp = http.post("/v1/audio/generate", json=BODY)
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"] == "audio/wav"
    samples, rate = read_wav(resp.content)
    assert rate == SAMPLE_RATE and samples.shape == (int(0.5 * SAMPLE_RATE), 2)
    want = diffusers_clip(reference, BODY)
    assert np.abs(samples - want).max() <= STEP
    assert np.abs(samples[:, 0] - samples[:, 1]).max() > 0.1  # two channels, not one written twice
    # usage: the prompt's T5 tokens, the denoising steps and the clip's seconds
    tokens = len(reference.tokenizer(BODY["input"]).input_ids)
    assert resp.headers["x-usage-input-tokens"] == str(tokens)
    assert resp.headers["x-usage-denoising-steps"] == "4" and resp.headers["x-usage-audio-seconds"] == "0.5"
    # another seed is another clip: the comparison above can fail
    other = http.post("/v1/audio/generate", json={**BODY, "seed": 8})
    assert np.abs(read_wav(other.content)[0] - want).max() > 0.1


def test_start_and_defaults(http, reference) -> None:
    """audio_start conditions the clip and cuts it from that second of the window, as diffusers does; with no
    length the clip runs to the end of the model's window (1 s on the tiny checkpoint)."""
    body = {**BODY, "audio_start": 0.25, "audio_length": 0.6, "extra_body": {"seed": 3}}
    resp = http.post("/v1/audio/generate", json=body)
    samples, _ = read_wav(resp.content)
    assert samples.shape == (int(0.85 * SAMPLE_RATE) - int(0.25 * SAMPLE_RATE), 2)
    assert np.abs(samples - diffusers_clip(reference, {**body, "seed": 3})).max() <= STEP
    resp = http.post("/v1/audio/generate", json={"input": "rain", "num_inference_steps": 2, "response_format": "pcm"})
    assert resp.status_code == 200, resp.text
    assert len(resp.content) == SAMPLE_RATE * 2 * 2  # 1 s of 16-bit stereo
    assert resp.headers["x-usage-audio-seconds"] == "1.0"


@pytest.mark.parametrize("fmt", ["wav", "flac", "mp3", "opus", "aac", "pcm"])
def test_formats(http, fmt) -> None:
    if fmt not in available_formats():
        pytest.skip(f"{fmt} is not encodable here")
    resp = http.post("/v1/audio/generate", json={**BODY, "response_format": fmt.upper() if fmt == "mp3" else fmt})
    assert resp.status_code == 200, resp.text
    types = {"wav": "audio/wav", "flac": "audio/flac", "mp3": "audio/mpeg", "opus": "audio/ogg", "aac": "audio/aac",
             "pcm": "audio/pcm"}
    assert resp.headers["content-type"] == types[fmt]
    frames = int(0.5 * SAMPLE_RATE)
    if fmt == "pcm":  # headerless 16-bit little-endian, channels interleaved
        samples = np.frombuffer(resp.content, "<i2").reshape(-1, 2)
        assert samples.shape == (frames, 2)
        wav = read_wav(http.post("/v1/audio/generate", json=BODY).content)[0]
        assert np.abs(samples / 32767 - wav).max() <= STEP  # pcm scales by 32767, libsndfile by 32768
        return
    import av

    with av.open(io.BytesIO(resp.content)) as container:
        stream = container.streams.audio[0]
        decoded = np.concatenate([f.to_ndarray().reshape(stream.channels, -1) for f in container.decode(stream)],
                                 axis=1)
        assert stream.channels == 2
        rate = stream.codec_context.sample_rate
    assert rate == (48000 if fmt == "opus" else SAMPLE_RATE)  # Opus decoders always output 48 kHz
    # lossless formats keep every sample; lossy codecs pad to their frames (and may add their priming)
    if fmt in ("wav", "flac"):
        assert decoded.shape[1] == frames
    else:
        assert 0.5 <= decoded.shape[1] / rate <= 0.5 + 0.35


def test_concurrent_requests_keep_their_own_clip(http, reference) -> None:
    """Requests of one length share forwards, another length queues; each clip is diffusers' for its own body."""
    bodies = [{**BODY, "seed": 11}, {**BODY, "seed": 12, "guidance_scale": 1.0}, {**BODY, "seed": 13,
                                                                                "audio_length": 0.3}]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        replies = list(pool.map(lambda b: http.post("/v1/audio/generate", json=b), bodies))
    for body, resp in zip(bodies, replies, strict=True):
        assert resp.status_code == 200, resp.text
        assert np.abs(read_wav(resp.content)[0] - diffusers_clip(reference, body)).max() <= STEP


@pytest.mark.parametrize(("change", "param", "words"), [
    ({"audio_length": 1.5}, "audio_length", "at most 1 s"),
    ({"audio_start": 0.75}, "audio_length", "at most 1 s"),
    ({"audio_start": 50.0}, "audio_start", "audio_start must be in [0, 10]"),
    ({"audio_length": 0}, "audio_length", "greater than 0"),
    ({"audio_start": -1}, "audio_start", "greater than or equal to 0"),
    ({"num_inference_steps": 0}, "num_inference_steps", "greater than or equal to 1"),
    ({"guidance_scale": "high"}, "guidance_scale", "guidance_scale"),
    ({"seed": -3}, "seed", "seed"),
    ({"response_format": "ogg"}, "response_format", "use one of: wav, flac"),
    ({"input": "  "}, "input", "'input' is empty"),
    ({"input": None}, "input", "input"),
])
def test_bad_values_are_400_naming_the_field(http, change, param, words) -> None:
    resp = http.post("/v1/audio/generate", json={**BODY, **change})
    err = assert_openai_error(resp, 400, words)
    assert err["param"] == param, err


def test_malformed_bodies_and_unknown_model(http) -> None:
    assert_openai_error(http.post("/v1/audio/generate", content=b"{not json"), 400, "not valid JSON")
    assert_openai_error(http.post("/v1/audio/generate", json=[1]), 400, "JSON object")
    assert assert_openai_error(http.post("/v1/audio/generate", json={"model": "sao"}), 400, "input")["param"] == "input"
    assert_openai_error(http.post("/v1/audio/generate", json={**BODY, "model": "other"}), 404, "does not exist")
    # unknown fields are ignored (clients send their own)
    assert http.post("/v1/audio/generate", json={**BODY, "num_inference_steps": 1, "voice": "x"}).status_code == 200


def test_a_model_that_makes_no_clips_is_refused(fake_served) -> None:
    resp = httpx.post(f"{fake_served.server.url}/v1/audio/generate", json={"input": "rain"},
                      headers={"Authorization": f"Bearer {API_KEY}"})
    err = assert_openai_error(resp, 400, "does not generate audio from a prompt")
    assert err["param"] == "model"


def test_demo_arch_writes_a_clip(tmp_path) -> None:
    out = tmp_path / "clip.wav"
    proc = subprocess.run([sys.executable, "-m", "omnistage", "demo", "--arch", "stable_audio", "--audio-out",
                           str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"wrote {out}" in proc.stdout
    info = sf.info(str(out))
    assert (info.samplerate, info.channels, info.frames) == (SAMPLE_RATE, 2, SAMPLE_RATE)


def test_stereo_encoding_keeps_channels_and_mono_stays_mono() -> None:
    """The encoders write [samples, channels] as channels (resampled per channel where the format needs another
    rate); 1-D input stays mono."""
    from omnistage.media.audio import encode_audio, resample

    t = np.arange(22050) / 22050
    stereo = np.stack([np.sin(2 * np.pi * 440 * t), 0.5 * np.sin(2 * np.pi * 660 * t)], axis=1).astype(np.float32)
    up = resample(stereo, 22050, 48000)
    assert up.shape == (48000, 2)
    np.testing.assert_allclose(up[:, 1], resample(stereo[:, 1], 22050, 48000), atol=1e-6)
    info = sf.info(io.BytesIO(encode_audio(stereo, 22050, "opus")))  # 22.05 kHz is no Opus rate: 48 kHz
    assert (info.channels, info.samplerate) == (2, 48000)
    wav, rate = read_wav(encode_audio(stereo, 22050, "wav"))
    assert rate == 22050 and np.abs(wav - stereo).max() <= STEP
    assert sf.info(io.BytesIO(encode_audio(stereo[:, 0], 22050, "flac"))).channels == 1
    assert len(encode_audio(stereo, 22050, "pcm16")) == 22050 * 2 * 2
