"""16 concurrent CustomVoice requests (different voices, lengths, half streamed) through the real orchestrator:
each one's audio equals its run alone (no crosstalk between the batched codec rows), streamed chunks in order."""

from __future__ import annotations

import queue
from pathlib import Path

import numpy as np
import pytest

from omnistage.config.deploy import load_deploy_config
from omnistage.families.base import CheckpointInfo
from omnistage.families.qwen3_tts import Qwen3TTSFamily
from omnistage.runtime.launch import start_orchestrator
from omnistage.sampling_params import SamplingParams
from omnistage.testing.qwen3_tts import SPEAKERS, make_tiny_qwen3_tts
from omnistage.types import OmniOutput, OmniRequest

TEXTS = ["Hi.", "Hello there, how are you?", "The quick brown fox.", "One two three four five six."]
N = 16
# Codec windows small enough that every streamed request gets several chunks in the few frames made here;
# left context = all frames, so a streamed decode is exact up to batch-shape fp32 noise (see test_codec).
DEPLOY = {"stages": {"codec": {"options": {"first_window": 2, "window": 3, "left_context": 64}}}}


def _request(i: int) -> OmniRequest:
    voices = sorted(SPEAKERS)
    greedy = SamplingParams(temperature=0.0, repetition_penalty=1.05, max_tokens=4 + i % 5)
    return OmniRequest(request_id=f"r{i}", prompt=TEXTS[i % len(TEXTS)], output_modalities=("audio",),
                       stage_params={"talker": greedy},
                       options={"voice": voices[i % len(voices)], "subtalker_dosample": False,
                                "stream_audio": i % 2 == 1})


def _run(orchestrator, requests: list[OmniRequest]) -> dict[str, tuple[OmniOutput, list[np.ndarray]]]:
    done: queue.SimpleQueue[OmniOutput] = queue.SimpleQueue()
    results = {r.request_id: (OmniOutput(r.request_id), []) for r in requests}
    for r in requests:
        orchestrator.submit(r, done.put)
    remaining = len(requests)
    while remaining:
        out = done.get(timeout=60)
        merged, chunks = results[out.request_id]
        if out.audio is not None and len(out.audio):
            chunks.append(np.asarray(out.audio).copy())
        merged.merge(out)
        remaining -= out.finished
    return results


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen3_tts(tmp_path_factory.mktemp("qwen3_tts"))


def test_concurrent_requests_match_alone(checkpoint: Path) -> None:
    family = Qwen3TTSFamily()
    info = CheckpointInfo.read(checkpoint)
    config = load_deploy_config({"worker_backend": "inline", **DEPLOY}, base=family.default_deploy(info))
    orchestrator = start_orchestrator(family.pipeline(info, config))
    try:
        alone = {}
        for i in range(N):
            alone.update(_run(orchestrator, [_request(i)]))
        together = _run(orchestrator, [_request(i) for i in range(N)])
    finally:
        orchestrator.shutdown()
    # Streamed requests arrive in windows (how many per request depends on thread timing: frames that land
    # together with the final one decode with it, so only the total is asserted).
    assert sum(len(together[f"r{i}"][1]) for i in range(1, N, 2)) > N // 2
    for i in range(N):
        rid = f"r{i}"
        (a, _), (t, t_chunks) = alone[rid], together[rid]
        assert a.error is None and t.error is None
        assert np.abs(a.audio).max() > 1e-3
        # The chunks, in arrival order, concatenate to the merged audio: in order, none lost or duplicated.
        np.testing.assert_array_equal(np.concatenate(t_chunks), t.audio)
        if i % 2 == 0:
            assert len(t_chunks) == 1  # not streamed: one exact decode at the end
        # Codes are identical (greedy), so the audio equals the lone run up to batch-shape fp32 noise.
        assert t.audio.shape == a.audio.shape
        np.testing.assert_allclose(t.audio, a.audio, atol=5e-3, rtol=0)


def test_ignore_eos_makes_exactly_max_tokens_frames(checkpoint: Path) -> None:
    """With ignore_eos the talker never samples eos (no codec code), so it runs to max_tokens and every frame
    decodes: the audio is max_tokens frames long."""
    from omnistage.families.qwen3_tts.codec import load_codec_decoder

    family = Qwen3TTSFamily()
    info = CheckpointInfo.read(checkpoint)
    config = load_deploy_config({"worker_backend": "inline", **DEPLOY}, base=family.default_deploy(info))
    orchestrator = start_orchestrator(family.pipeline(info, config))
    frames = 150  # more than the tiny greedy talker makes before its eos
    params = SamplingParams(temperature=0.0, max_tokens=frames, ignore_eos=True)
    request = OmniRequest(request_id="long", prompt=TEXTS[0], output_modalities=("audio",),
                          stage_params={"talker": params}, options={"subtalker_dosample": False})
    try:
        out, _ = _run(orchestrator, [request])["long"]
    finally:
        orchestrator.shutdown()
    assert out.error is None
    assert len(out.audio) == frames * load_codec_decoder(checkpoint / "speech_tokenizer").upsample_factor
