"""code2wav's windowed streaming against the one-shot decode of the same frames (transformers' Code2Wav module,
loaded from the tiny checkpoint): the same length always; the same samples once `left_context` covers the
decoder's receptive field (its sliding-window transformer's layers x (window - 1) frames plus the convolutions'
few: 16 frames on the tiny checkpoint); a deviation shrinking with the context below it."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import Qwen3OmniMoeConfig

from omnistage import Omni, SamplingParams
from omnistage.families.qwen3_omni_moe import models
from omnistage.types import OmniOutput, OmniRequest, StageInput

from .reference import AUDIO_ATOL

FRAMES = 60


@pytest.fixture(scope="module")
def code2wav(tiny_qwen3_omni: str) -> torch.nn.Module:
    path = Path(tiny_qwen3_omni)
    return models.load_code2wav(path, Qwen3OmniMoeConfig.from_pretrained(path).code2wav_config, torch.device("cpu"))


def _codes() -> torch.Tensor:
    return torch.randint(0, 64, (FRAMES, 4), generator=torch.Generator().manual_seed(1))


def _decode(stage: models.Code2Wav, codes: torch.Tensor, stream: bool, arrive: int) -> list[torch.Tensor]:
    """The stage's audio chunks for frames arriving `arrive` at a time, as the engine would call it."""
    inp = StageInput("r", [], params={"stream": stream}, tensors={"codes": codes[:0]}, final=False)
    chunks = []
    for start in range(0, len(codes), arrive):
        inp.tensors["codes"], inp.final = codes[: start + arrive], start + arrive >= len(codes)
        while stage.ready(inp):
            ((out, finished),) = stage.generate([inp])
            chunks.append(out["audio"])
            if finished:
                return chunks
    raise AssertionError("the request never finished")


def test_windows_match_the_one_shot_decode_with_enough_context(code2wav) -> None:
    codes = _codes()
    with torch.inference_mode():
        one_shot = code2wav(codes.T[None])[0, 0]
    whole = _decode(models.Code2Wav(code2wav, torch.device("cpu")), codes, stream=False, arrive=7)
    assert len(whole) == 1 and torch.equal(whole[0], one_shot)  # the utterance at its end: one decode
    errors = []
    for context in (2, 4, 8, 16, 25):
        stage = models.Code2Wav(code2wav, torch.device("cpu"), first_window=3, window=5, left_context=context)
        chunks = _decode(stage, codes, stream=True, arrive=2)
        assert len(chunks) == 1 + -(-(FRAMES - 3) // 5)  # the first window, then whole windows
        streamed = torch.cat(chunks)
        assert streamed.shape == one_shot.shape
        errors.append(float((streamed - one_shot).norm() / one_shot.norm()))
    assert errors == sorted(errors, reverse=True)  # more context, less deviation
    assert errors[1] < 1e-2  # 4 frames of context: already within 1% (RMS)
    assert errors[-2] < 1e-5 and errors[-1] < 1e-5  # the receptive field covered: the same samples


def test_batched_windows_equal_each_alone(code2wav) -> None:
    """Requests of different lengths decode in one padded batch: each equals its own decode."""
    stage = models.Code2Wav(code2wav, torch.device("cpu"))
    lengths = (5, 17, 40)
    codes = [_codes()[:n] for n in lengths]
    inputs = [StageInput(f"r{i}", [], params={"stream": False}, tensors={"codes": c}, final=True)
              for i, c in enumerate(codes)]
    batched = stage.generate(inputs)
    for c, (out, finished) in zip(codes, batched, strict=True):
        with torch.inference_mode():
            alone = code2wav(c.T[None])[0, 0]
        assert finished and out["audio"].shape == alone.shape
        torch.testing.assert_close(out["audio"], alone, rtol=0, atol=1e-6)


def test_streamed_speech_through_the_server_stages(tiny_qwen3_omni: str) -> None:
    """Audio leaves in windows as the talker speaks (several audio deltas), and with the receptive field covered
    the stream is the one-shot decode."""
    params = {"thinker": SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
              "talker": SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)}
    messages = [{"role": "user", "content": "Tell me about rivers."}]
    base = {"async_chunk": True, "stages": {"*": {"max_model_len": 512, "dtype": "float32"}}}
    with Omni(tiny_qwen3_omni, base) as omni:
        (whole,) = omni.generate([messages], params, ("text", "audio"))
    streamed = {**base, "stages": {**base["stages"], "code2wav": {"options": {
        "first_window": 3, "window": 5, "left_context": 16}}}}
    deltas: list[OmniOutput] = []
    done = threading.Event()
    with Omni(tiny_qwen3_omni, streamed) as omni:
        request = OmniRequest(request_id="s", messages=messages, stage_params=params,
                              output_modalities=("text", "audio"))

        def collect(out: OmniOutput) -> None:
            deltas.append(out)
            if out.finished:
                done.set()

        omni.orchestrator.submit(request, collect)
        assert done.wait(120)
    audio = [d.audio for d in deltas if d.audio is not None and len(d.audio)]
    # a window of 3 frames, then windows of 5: as many deltas when code2wav keeps up with the talker, fewer (larger
    # spans) when the talker runs ahead of it
    assert 2 <= len(audio) <= 1 + -(-(20 - 3) // 5)
    assert whole.error is None and all(d.error is None for d in deltas)
    np.testing.assert_allclose(np.concatenate(audio), whole.audio, rtol=0, atol=AUDIO_ATOL)
