"""The qwen3_tts family end to end (inline stages on the CPU): request -> talker -> codec -> audio, one-shot and
streamed in windows, against the codec decode of the reference package's greedy codes."""

from __future__ import annotations

import queue
from pathlib import Path

import numpy as np
import pytest
import torch

from omnistage.config.deploy import load_deploy_config
from omnistage.families.base import CheckpointInfo
from omnistage.families.qwen3_tts import SAMPLE_RATE, Qwen3TTSFamily
from omnistage.families.qwen3_tts.codec import load_codec_decoder
from omnistage.runtime.launch import start_orchestrator
from omnistage.sampling_params import SamplingParams
from omnistage.testing.qwen3_tts import make_tiny_qwen3_tts
from omnistage.types import OmniOutput, OmniRequest

from . import reference

ITEMS = [("Hello there, how are you?", "Vivian"), ("The quick brown fox.", "eric")]
FRAMES = 20


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen3_tts(tmp_path_factory.mktemp("qwen3_tts"))


@pytest.fixture(scope="module")
def expected_audio(checkpoint: Path) -> list[np.ndarray]:
    reference.require_reference_venv()
    codes, _ = reference.generate(checkpoint, [{"text": t, "speaker": s} for t, s in ITEMS],
                                  max_new_tokens=FRAMES + 1, do_sample=False, subtalker_dosample=False)
    decoder = load_codec_decoder(checkpoint / "speech_tokenizer")
    return [decoder.decode(torch.from_numpy(c).T[None])[0].numpy() for c in codes]


def _speak(checkpoint: Path, deploy: dict, items: list[tuple] = ITEMS, stream: bool = False) -> list[OmniOutput]:
    family = Qwen3TTSFamily()
    info = CheckpointInfo.read(checkpoint)
    assert family.matches(info)
    config = load_deploy_config({"worker_backend": "inline", **deploy}, base=family.default_deploy(info))
    orchestrator = start_orchestrator(family.pipeline(info, config))
    greedy = SamplingParams(temperature=0.0, repetition_penalty=1.05, max_tokens=FRAMES)
    options = {"subtalker_dosample": False, "stream_audio": stream}
    done: queue.SimpleQueue[OmniOutput] = queue.SimpleQueue()
    results = {}
    try:
        for i, (text, voice, *instruct) in enumerate(items):
            request = OmniRequest(request_id=f"r{i}", prompt=text, output_modalities=("audio",),
                                  stage_params={"talker": greedy},
                                  options={"voice": voice, "instruct": instruct[0] if instruct else None, **options})
            results[request.request_id] = OmniOutput(request.request_id)
            orchestrator.submit(request, done.put)
        remaining, chunks = len(items), {rid: 0 for rid in results}
        while remaining:
            out = done.get(timeout=120)
            chunks[out.request_id] += out.audio is not None and len(out.audio) > 0
            results[out.request_id].merge(out)
            remaining -= out.finished
    finally:
        orchestrator.shutdown()
    outs = [results[f"r{i}"] for i in range(len(items))]
    for out in outs:
        out.num_chunks = chunks[out.request_id]  # type: ignore[attr-defined]
    return outs


def test_speech_matches_reference_codes_decoded(checkpoint: Path, expected_audio: list[np.ndarray]) -> None:
    for out, ref in zip(_speak(checkpoint, {}), expected_audio, strict=True):
        assert out.error is None and out.sample_rate == SAMPLE_RATE and np.abs(ref).max() > 1e-3
        # The two requests share the codec's forward or not as their frames' timing falls, and the batch shape's
        # fp32 noise is amplified by this random decoder (test_codec's batched bound); the codes are exact.
        np.testing.assert_allclose(out.audio, ref, atol=5e-3, rtol=0)


def test_streamed_windows_with_full_context_match(checkpoint: Path, expected_audio: list[np.ndarray]) -> None:
    deploy = {"stages": {"codec": {"options": {"first_window": 2, "window": 4, "left_context": FRAMES}}}}
    for out, ref in zip(_speak(checkpoint, deploy, stream=True), expected_audio, strict=True):
        assert out.error is None and out.num_chunks > 1  # type: ignore[attr-defined]
        # full left context: one-shot up to the batch-shape fp32 noise of the random decoder (see test_codec)
        np.testing.assert_allclose(out.audio, ref, atol=5e-3, rtol=0)


def test_voice_design_speaks_its_instruction(tmp_path: Path) -> None:
    """A VoiceDesign checkpoint takes `instruct`: its audio is the codec decode of the package's codes for it."""
    checkpoint = make_tiny_qwen3_tts(tmp_path / "design", variant="voice_design")
    reference.require_reference_venv()
    text, instruct = ITEMS[0][0], "A deep calm voice, slow."
    (codes,), _ = reference.generate(checkpoint, [{"text": text, "instruct": instruct}], max_new_tokens=FRAMES + 1,
                                     do_sample=False, subtalker_dosample=False)
    ref = load_codec_decoder(checkpoint / "speech_tokenizer").decode(torch.from_numpy(codes).T[None])[0].numpy()
    (out,) = _speak(checkpoint, {}, [(text, None, instruct)])
    assert out.error is None
    np.testing.assert_allclose(out.audio, ref, atol=1e-5, rtol=0)
