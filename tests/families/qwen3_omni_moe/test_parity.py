"""Qwen3-Omni through omnistage's three stages against transformers' `generate` on the tiny checkpoint, greedy:
the same thinker tokens, the same talker codes (every codebook), the same waveform (float32 on both sides, so
within 1e-5: the convolutions' summation order is the only difference). Text only, and image + audio input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from omnistage import Omni, SamplingParams
from omnistage.families.qwen2_5_omni import SPEECH_SYSTEM_PROMPT

from .reference import run_hf, tone

pytest.importorskip("torchvision", reason="Qwen3-Omni's processor needs torchvision")

THINKER_TOKENS, FRAMES = 8, 12
DEPLOY = {"async_chunk": False, "stages": {"*": {"max_model_len": 512, "dtype": "float32"}}}
PARAMS = {"thinker": SamplingParams(max_tokens=THINKER_TOKENS, temperature=0, ignore_eos=True),
          "talker": SamplingParams(max_tokens=FRAMES, temperature=0, repetition_penalty=1.05, ignore_eos=True)}
TEXT = [{"role": "system", "content": [{"type": "text", "text": "You are a helpful assistant."}]},
        {"role": "user", "content": [{"type": "text", "text": "Say something nice about rivers."}]}]


def _image() -> Image.Image:
    pixels = np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


# The talker's prompt takes every user turn and leaves out the system turn and earlier assistant turns.
MULTI_TURN = [*TEXT, {"role": "assistant", "content": "Rivers are lovely."},
              {"role": "user", "content": [{"type": "text", "text": "And lakes?"}]}]
IMAGE_AUDIO = [{"role": "user", "content": [{"type": "image", "image": _image()},
                                            {"type": "audio", "audio": tone(1.0, 440.0)},
                                            {"type": "text", "text": "What do you see and hear?"}]}]


def for_speech(messages: list[dict]) -> list[dict]:
    """The messages as a speech request reaches the thinker: under the speech system prompt unless they have one."""
    if messages[0]["role"] == "system":
        return messages
    return [{"role": "system", "content": [{"type": "text", "text": SPEECH_SYSTEM_PROMPT}]}, *messages]


@pytest.mark.parametrize("messages, async_chunk", [(TEXT, False), (TEXT, True), (MULTI_TURN, True),
                                                   (IMAGE_AUDIO, False), (IMAGE_AUDIO, True)],
                         ids=["text", "text-streamed-handoff", "multi-turn", "image+audio",
                              "image+audio-streamed-handoff"])
def test_tokens_codes_and_waveform_equal_transformers(tiny_qwen3_omni: str, messages, async_chunk: bool,
                                                      caught_codes) -> None:
    """Streamed handoff (`async_chunk`): the talker opens on the thinker's first reply token and takes each later
    reply row as the thinker computes it."""
    ref = run_hf(tiny_qwen3_omni, for_speech(messages), THINKER_TOKENS, FRAMES, "Chelsie")
    assert ref.codes.shape == (4, FRAMES)
    with Omni(tiny_qwen3_omni, {**DEPLOY, "async_chunk": async_chunk}) as omni:
        (spoken,) = omni.generate([messages], PARAMS, ("text", "audio"), voice="chelsie")
    assert spoken.error is None, spoken.error
    assert spoken.token_ids == ref.thinker_tokens
    assert torch.equal(torch.cat(caught_codes).T, ref.codes)
    assert spoken.sample_rate == 24000 and spoken.audio.shape == ref.wav.shape
    torch.testing.assert_close(torch.from_numpy(spoken.audio), ref.wav, rtol=0, atol=1e-5)
    assert np.abs(spoken.audio).max() > 0.01  # audible: the comparison is not of silence


def test_text_only_never_runs_the_talker(tiny_qwen3_omni: str, caught_codes) -> None:
    ref = run_hf(tiny_qwen3_omni, TEXT, THINKER_TOKENS, FRAMES, "Ethan")
    with Omni(tiny_qwen3_omni, DEPLOY) as omni:
        (text_only,) = omni.generate([TEXT], PARAMS["thinker"])
        stats = omni.stats()
    assert text_only.error is None and text_only.audio is None
    assert text_only.token_ids == ref.thinker_tokens
    assert caught_codes == []
    assert stats["talker"]["num_output_tokens"] == 0 and stats["code2wav"]["num_steps"] == 0


def test_video_with_its_audio_track_equals_transformers(tiny_qwen3_omni: str, caught_codes) -> None:
    """A video part (data URL) with `use_audio_in_video`: frames and sound interleaved in M-RoPE time; speech."""
    import base64

    from omnistage.media import load_part

    pytest.importorskip("av")  # PyAV makes and decodes the video
    from omnistage.testing.media_files import make_video

    part = {"type": "video_url", "video_url": {
        "url": "data:video/mp4;base64," + base64.b64encode(make_video(frames=20, fps=10, size=(64, 64))).decode()}}
    question = {"type": "text", "text": "What happens?"}
    video = load_part(part, use_audio_in_video=True).value  # what omnistage decodes, fed to both sides
    media = {"videos": [video.frames], "audio": [video.audio], "fps": video.fps, "load_audio_from_video": True,
             "audio_from_video_indices": [0]}
    ref = run_hf(tiny_qwen3_omni, for_speech([{"role": "user", "content": [{"type": "video"}, question]}]),
                 THINKER_TOKENS, FRAMES, "Ethan", media=media, use_audio_in_video=True)
    with Omni(tiny_qwen3_omni, {**DEPLOY, "async_chunk": True}) as omni:
        (got,) = omni.generate([[{"role": "user", "content": [part, question]}]], PARAMS, ("text", "audio"),
                               use_audio_in_video=True)
    assert got.error is None, got.error
    assert got.token_ids == ref.thinker_tokens
    assert torch.equal(torch.cat(caught_codes).T, ref.codes)
    torch.testing.assert_close(torch.from_numpy(got.audio), ref.wav, rtol=0, atol=1e-5)
