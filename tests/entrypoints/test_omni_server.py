"""Qwen2.5-Omni over HTTP with the official client: text + speech answers (whole and streamed),
media input as OpenAI parts, and clear 4xx errors for what cannot be served."""

from __future__ import annotations

import base64
import io
import wave

import numpy as np
import openai
import pytest

from omnistage.entrypoints.openai.server import BackgroundServer

pytest.importorskip("torchvision", reason="Qwen2.5-Omni's processor needs torchvision (installed by scripts/test)")

SPEECH = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def client(tiny_qwen2_5_omni: str):
    from omnistage.entrypoints.async_omni import AsyncOmni

    engine = AsyncOmni.from_model(tiny_qwen2_5_omni, {"stages": {"*": {"max_model_len": 512, "dtype": "float32"},
                                                                 "talker": {"default_sampling_params": {
                                                                     "max_tokens": 12, "temperature": 0}}}},
                                  served_model_name="omni")
    with BackgroundServer(engine) as server:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    engine.shutdown()


def _wav_samples(data: str) -> tuple[int, np.ndarray]:
    with wave.open(io.BytesIO(base64.b64decode(data))) as w:
        return w.getframerate(), np.frombuffer(w.readframes(w.getnframes()), dtype=np.int16)


def test_text_and_audio_answer(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="omni", messages=[{"role": "user", "content": "Hi!"}], modalities=["text", "audio"],
        audio={"voice": "Chelsie", "format": "wav"}, extra_body=SPEECH,
    )
    message = out.choices[0].message
    rate, samples = _wav_samples(message.audio.data)
    assert rate == 24000 and len(samples) == 12 * 2 * 240  # 12 codes, 2 mel frames each, 240 samples per frame
    assert message.audio.transcript == message.content and message.content is not None


def test_finish_reason_speaks_of_the_text(client: openai.OpenAI) -> None:
    """max_tokens cut the text: "length", though the speech stages end with their own "stop" after it."""
    kwargs = dict(model="omni", messages=[{"role": "user", "content": "Hi!"}], modalities=["text", "audio"],
                  audio={"voice": "Chelsie", "format": "pcm16"}, extra_body=SPEECH)
    assert client.chat.completions.create(**kwargs).choices[0].finish_reason == "length"
    reasons = [c.choices[0].finish_reason for c in client.chat.completions.create(**kwargs, stream=True)
               if c.choices and c.choices[0].finish_reason]
    assert reasons == ["length"]


def test_n_choices_each_speak(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="omni", messages=[{"role": "user", "content": "Hi!"}], modalities=["text", "audio"], n=2,
        audio={"voice": "Ethan", "format": "wav"}, extra_body=SPEECH,
    )
    first, second = (_wav_samples(c.message.audio.data)[1] for c in out.choices)
    assert len(first) == len(second) == 12 * 2 * 240
    assert np.array_equal(first, second)  # greedy, same voice and seed: the same speech, decoded twice


def test_streamed_audio_chunks(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="omni", messages=[{"role": "user", "content": "Hi!"}], modalities=["text", "audio"],
        audio={"voice": "Ethan", "format": "pcm16"}, stream=True, extra_body=SPEECH,
    )
    text, pcm = "", b""
    for chunk in stream:
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is not None:
            text += delta.content or ""
            audio = getattr(delta, "audio", None) or (delta.model_extra or {}).get("audio")
            if audio:
                pcm += base64.b64decode(audio["data"] if isinstance(audio, dict) else audio.data)
    assert len(pcm) == 12 * 2 * 240 * 2  # int16 samples


def test_compressed_audio_formats(client: openai.OpenAI) -> None:
    import soundfile as sf

    for fmt in ("flac", "mp3"):
        out = client.chat.completions.create(
            model="omni", messages=[{"role": "user", "content": "Hi!"}], modalities=["text", "audio"],
            audio={"voice": "Chelsie", "format": fmt}, extra_body=SPEECH,
        )
        samples, rate = sf.read(io.BytesIO(base64.b64decode(out.choices[0].message.audio.data)))
        assert rate == 24000 and abs(len(samples) - 12 * 2 * 240) <= 2000  # mp3 frames pad a little


def test_per_stage_sampling_params(client: openai.OpenAI) -> None:
    per_stage = [{"max_tokens": 4, "temperature": 0, "ignore_eos": True}, {"max_tokens": 6, "temperature": 0}]
    out = client.chat.completions.create(
        model="omni", messages=[{"role": "user", "content": "Hi!"}], modalities=["text", "audio"],
        audio={"voice": "Ethan", "format": "pcm16"}, extra_body={"sampling_params_list": per_stage},
    )
    assert out.usage.completion_tokens == 4
    assert len(base64.b64decode(out.choices[0].message.audio.data)) == 6 * 2 * 240 * 2
    for bad, message in (([{}, {}, {}, {}], "4 entries but this model has 3 stages"),
                         ([{"temprature": 0}], "did you mean 'temperature'"),
                         ([{}, {"frobnicate": 1}], r"unknown field 'frobnicate'(?!; did)"),
                         ([{"n": 2}], "set 'n' on the request")):
        with pytest.raises(openai.BadRequestError, match=message):
            client.chat.completions.create(model="omni", messages=[{"role": "user", "content": "Hi"}],
                                           extra_body={"sampling_params_list": bad})


def _vllm_params(**kw: object) -> dict:
    """A vLLM SamplingParams as vLLM-Omni clients send it: every field, most at vLLM's defaults."""
    params = {
        "n": 1, "best_of": None, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
        "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "seed": None, "stop": [], "stop_token_ids": [],
        "bad_words": [], "ignore_eos": False, "max_tokens": 16, "min_tokens": 0, "logprobs": None,
        "prompt_logprobs": None, "detokenize": True, "skip_special_tokens": True,
        "spaces_between_special_tokens": True, "logits_processors": None, "include_stop_str_in_output": False,
        "truncate_prompt_tokens": None, "output_kind": 0, "guided_decoding": None, "structured_outputs": None,
        "logit_bias": None, "allowed_token_ids": None, "extra_args": None, "skip_clone": False,
    }
    return {**params, **kw}


def test_vllm_omni_sampling_params_list(client: openai.OpenAI) -> None:
    """One whole vLLM SamplingParams dict per stage (thinker, talker, token2wav), as vLLM-Omni sends them; the
    token2wav entry's sampling fields are accepted (it reads its seed)."""
    per_stage = [_vllm_params(temperature=0.0, max_tokens=5, ignore_eos=True, seed=7),
                 _vllm_params(temperature=0.0, max_tokens=8, seed=7, detokenize=False),
                 _vllm_params(seed=3)]
    kwargs = dict(model="omni", messages=[{"role": "user", "content": "Hi!"}], modalities=["text", "audio"],
                  audio={"voice": "Ethan", "format": "pcm16"}, extra_body={"sampling_params_list": per_stage})
    out = client.chat.completions.create(**kwargs)
    assert out.usage.completion_tokens == 5 and out.choices[0].message.content
    assert len(base64.b64decode(out.choices[0].message.audio.data)) == 8 * 2 * 240 * 2
    # two entries: token2wav keeps its defaults
    two = client.chat.completions.create(**{**kwargs, "extra_body": {"sampling_params_list": per_stage[:2]}})
    assert two.choices[0].message.content == out.choices[0].message.content


def test_image_part_and_errors(client: openai.OpenAI) -> None:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(np.full((56, 56, 3), 128, dtype=np.uint8)).save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    out = client.chat.completions.create(
        model="omni", extra_body=SPEECH,
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                               {"type": "text", "text": "What is this?"}]}],
    )
    assert out.choices[0].message.content is not None and out.usage.prompt_tokens > 20
    with pytest.raises(openai.BadRequestError, match="unknown voice 'Nobody'"):
        client.chat.completions.create(model="omni", messages=[{"role": "user", "content": "Hi"}],
                                       modalities=["text", "audio"], audio={"voice": "Nobody", "format": "wav"})
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\].content\[0\]: could not decode the image"):
        client.chat.completions.create(model="omni", messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}}]}])
    ok = client.chat.completions.create(model="omni", messages=[{"role": "user", "content": "Still there?"}],
                                        extra_body=SPEECH)
    assert ok.choices[0].finish_reason == "length"


def test_oversized_requests_and_media_get_413(tiny_qwen2_5_omni: str) -> None:
    from omnistage.entrypoints.async_omni import AsyncOmni

    deploy = {"stages": {"*": {"max_model_len": 512}}, "limits": {"max_request_bytes": 4096, "max_media_bytes": 2048}}
    engine = AsyncOmni.from_model(tiny_qwen2_5_omni, deploy, served_model_name="omni")
    big_image = "data:image/png;base64," + base64.b64encode(b"\0" * 2600).decode()  # 2.6 KB of media, < 4 KB body
    try:
        with BackgroundServer(engine) as server:
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
            with pytest.raises(openai.APIStatusError, match="larger than the limit of 4096 bytes") as body_err:
                client.chat.completions.create(model="omni", messages=[{"role": "user", "content": "x" * 5000}])
            with pytest.raises(openai.APIStatusError, match="larger than the limit of 2048 bytes") as media_err:
                client.chat.completions.create(model="omni", messages=[{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": big_image}}]}])
            assert body_err.value.status_code == media_err.value.status_code == 413
            ok = client.chat.completions.create(model="omni", messages=[{"role": "user", "content": "Hi"}],
                                                extra_body=SPEECH)
            assert ok.choices[0].message.content is not None
    finally:
        engine.shutdown()


def test_speech_demo_streams_text_and_writes_the_audio(tmp_path, tiny_qwen2_5_omni: str) -> None:
    """`omnistage demo --arch qwen2_5_omni`: the tiny omni model served, asked through the OpenAI client for
    text and streamed speech (the talker sampling hot from random weights), the speech saved as a WAV."""
    import subprocess
    import sys

    out = tmp_path / "demo.wav"
    proc = subprocess.run([sys.executable, "-m", "omnistage", "demo", "--arch", "qwen2_5_omni", "--audio-out",
                           str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "first audio" in proc.stdout and f"wrote {out}" in proc.stdout
    with wave.open(str(out)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (24000, 1, 2)
        assert w.getnframes() > 0


def test_streamed_wav_opens_with_a_header_and_compressed_streams_are_refused(client: openai.OpenAI) -> None:
    """Streamed audio is never silently switched: wav is a streaming header then PCM; mp3/flac/opus are a 400."""
    stream = client.chat.completions.create(
        model="omni", messages=[{"role": "user", "content": "Hi!"}], modalities=["text", "audio"],
        audio={"voice": "Ethan", "format": "wav"}, stream=True, extra_body=SPEECH,
    )
    data = b""
    for chunk in stream:
        delta = chunk.choices[0].delta if chunk.choices else None
        audio = delta and (getattr(delta, "audio", None) or (delta.model_extra or {}).get("audio"))
        if audio:
            data += base64.b64decode(audio["data"] if isinstance(audio, dict) else audio.data)
    assert data[:4] == b"RIFF" and data[8:16] == b"WAVEfmt " and data[36:40] == b"data"
    assert len(data) == 44 + 12 * 2 * 240 * 2
    with pytest.raises(openai.BadRequestError, match="streamed audio is pcm16 or wav"):
        client.chat.completions.create(
            model="omni", messages=[{"role": "user", "content": "Hi!"}], modalities=["text", "audio"],
            audio={"voice": "Ethan", "format": "mp3"}, stream=True, extra_body=SPEECH)


def test_max_duration_bounds_speech_over_http(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="omni", messages=[{"role": "user", "content": "Hi!"}], modalities=["text", "audio"],
        audio={"voice": "ethan", "format": "pcm16", "max_duration_s": 0.1}, extra_body=SPEECH,
    )
    assert len(base64.b64decode(out.choices[0].message.audio.data)) == 5 * 2 * 240 * 2  # 0.1 s: 5 codes
