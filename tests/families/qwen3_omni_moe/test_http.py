"""Qwen3-Omni over HTTP with the official client, the Qwen2.5-Omni family's API: text + speech answers (whole and
streamed PCM16 deltas), voices by name, `sampling_params_list` with one entry per stage, 4xx for bad input."""

from __future__ import annotations

import base64
import io
import wave

import numpy as np
import openai
import pytest

from omnistage.entrypoints.openai.server import BackgroundServer

from .reference import AUDIO_ATOL, tone

pytest.importorskip("torchvision", reason="Qwen3-Omni's processor needs torchvision")

SPEECH = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
FRAMES = 10  # the talker's max_tokens in the server's defaults
SAMPLES = FRAMES * 1920 - 555  # 1920 samples a frame, less the decoder blocks' trimmed tail


@pytest.fixture(scope="module")
def client(tiny_qwen3_omni: str):
    from omnistage.entrypoints.async_omni import AsyncOmni

    deploy = {"stages": {"*": {"max_model_len": 512, "dtype": "float32"},
                         "talker": {"default_sampling_params": {"max_tokens": FRAMES, "temperature": 0}},
                         "code2wav": {"options": {"first_window": 3, "window": 4, "left_context": 16}}}}
    engine = AsyncOmni.from_model(tiny_qwen3_omni, deploy, served_model_name="omni")
    with BackgroundServer(engine) as server:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    engine.shutdown()


def _speak(client: openai.OpenAI, voice: str, **kwargs) -> tuple[str, np.ndarray]:
    out = client.chat.completions.create(
        model="omni", messages=kwargs.pop("messages", [{"role": "user", "content": "Hi!"}]),
        modalities=["text", "audio"], audio={"voice": voice, "format": "wav"}, **{"extra_body": SPEECH, **kwargs})
    message = out.choices[0].message
    with wave.open(io.BytesIO(base64.b64decode(message.audio.data))) as w:
        assert w.getframerate() == 24000
        samples = np.frombuffer(w.readframes(w.getnframes()), dtype=np.int16)
    assert message.audio.transcript == message.content and message.content
    return message.content, samples


def test_text_and_audio_answer_in_each_voice(client: openai.OpenAI) -> None:
    text, ethan = _speak(client, "Ethan")
    same_text, chelsie = _speak(client, "chelsie")  # any case
    assert same_text == text and len(ethan) == len(chelsie) == SAMPLES
    assert not np.array_equal(ethan, chelsie)  # the speaker's codec id is in the talker's prompt
    assert np.abs(ethan).max() > 100
    with pytest.raises(openai.BadRequestError, match=r"unknown voice 'Nobody'; this model has \['Ethan', 'Chelsie'\]"):
        _speak(client, "Nobody")


def test_streamed_text_and_pcm16(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="omni", messages=[{"role": "user", "content": "Hi!"}], modalities=["text", "audio"],
        audio={"voice": "Ethan", "format": "pcm16"}, stream=True, extra_body=SPEECH)
    text, chunks = "", []
    for chunk in stream:
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is not None:
            text += delta.content or ""
            audio = getattr(delta, "audio", None) or (delta.model_extra or {}).get("audio")
            if audio and (audio["data"] if isinstance(audio, dict) else audio.data):
                chunks.append(base64.b64decode(audio["data"] if isinstance(audio, dict) else audio.data))
    whole_text, whole = _speak(client, "Ethan")
    assert text == whole_text
    assert len(chunks) > 1  # windows of 3, then 4 frames
    streamed = np.frombuffer(b"".join(chunks), dtype=np.int16).astype(np.int32)
    # PCM16 and WAV round apart (one step), plus the waveforms' own bound in PCM16 steps
    assert len(streamed) == len(whole) and np.abs(streamed - whole).max() <= 1 + AUDIO_ATOL * 32768


def test_per_stage_sampling_params_and_audio_input(client: openai.OpenAI) -> None:
    """One entry per stage (thinker, talker, code2wav), as clients of the Qwen2.5-Omni family send them; an
    input_audio part (WAV, base64) is heard."""
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(16000)
        w.writeframes((tone(0.5, 300.0) * 32767).astype(np.int16).tobytes())
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(buffer.getvalue()).decode(),
                                                   "format": "wav"}}
    messages = [{"role": "user", "content": [part, {"type": "text", "text": "What is this?"}]}]
    per_stage = [{"max_tokens": 4, "temperature": 0, "ignore_eos": True}, {"max_tokens": 6, "temperature": 0}, {}]
    out = client.chat.completions.create(model="omni", messages=messages, modalities=["text", "audio"],
                                         audio={"voice": "Ethan", "format": "pcm16"},
                                         extra_body={"sampling_params_list": per_stage})
    assert out.usage.completion_tokens == 4 and out.usage.prompt_tokens > 10
    assert len(base64.b64decode(out.choices[0].message.audio.data)) == (6 * 1920 - 555) * 2
    with pytest.raises(openai.BadRequestError, match="4 entries but this model has 3 stages"):
        client.chat.completions.create(model="omni", messages=messages,
                                       extra_body={"sampling_params_list": [{}, {}, {}, {}]})


def test_max_duration_bounds_speech(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="omni", messages=[{"role": "user", "content": "Hi!"}], modalities=["text", "audio"],
        audio={"voice": "ethan", "format": "pcm16", "max_duration_s": 0.5}, extra_body=SPEECH)
    assert len(base64.b64decode(out.choices[0].message.audio.data)) == (7 * 1920 - 555) * 2  # ceil(0.5 s x 12.5)


def test_speech_demo(tmp_path) -> None:
    """`omnistage demo --arch qwen3_omni_moe`: the tiny model served, text and streamed speech through the OpenAI
    client, the speech saved as a WAV."""
    import subprocess
    import sys

    out = tmp_path / "demo.wav"
    proc = subprocess.run([sys.executable, "-m", "omnistage", "demo", "--arch", "qwen3_omni_moe", "--max-tokens", "4",
                           "--audio-out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "first audio" in proc.stdout and f"wrote {out}" in proc.stdout
    with wave.open(str(out)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (24000, 1, 2)
        assert w.getnframes() == 4 * 25 // 2 * 1920 - 555  # the speech bound: 1 s per reply token, 12.5 frames a s
