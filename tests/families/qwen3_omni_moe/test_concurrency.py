"""8 concurrent speech requests with different voices, prompts and lengths batch inside every stage (thinker and
talker steps, code predictor passes, code2wav windows): each equals its output alone. Half of them sample (seeded:
the talker's first codebook and the code predictor's draws continue the request's own generator)."""

from __future__ import annotations

import queue

import numpy as np

from omnistage import Omni, SamplingParams
from omnistage.types import OmniOutput, OmniRequest

from .reference import AUDIO_ATOL

TOPICS = ("rivers", "mountains", "the sea", "bread", "music", "trains", "snow", "books")


def _requests() -> list[OmniRequest]:
    requests = []
    for i, topic in enumerate(TOPICS):
        talker = dict(temperature=0.9, top_k=50, seed=100 + i) if i % 2 else dict(temperature=0)
        params = {"thinker": SamplingParams(max_tokens=3 + i % 4, temperature=0, ignore_eos=True),
                  "talker": SamplingParams(max_tokens=6 + 3 * i, ignore_eos=True, **talker)}
        messages = [{"role": "user", "content": f"Tell me about {topic}."}]
        requests.append(OmniRequest(request_id=f"r{i}", messages=messages, stage_params=params,
                                    output_modalities=("text", "audio"),
                                    options={"voice": ("Ethan", "Chelsie")[i // 2 % 2]}))
    return requests


def _run(omni: Omni, requests: list[OmniRequest]) -> dict[str, OmniOutput]:
    done: queue.SimpleQueue[OmniOutput] = queue.SimpleQueue()
    results = {r.request_id: OmniOutput(r.request_id) for r in requests}
    for r in requests:
        omni.orchestrator.submit(r, done.put)
    remaining = len(requests)
    while remaining:
        out = done.get(timeout=300)
        results[out.request_id].merge(out)
        remaining -= out.finished
    return results


def test_concurrent_requests_equal_each_alone(tiny_qwen3_omni: str) -> None:
    deploy = {"async_chunk": True, "stages": {"*": {"max_model_len": 512, "dtype": "float32"},
                                              "code2wav": {"options": {"first_window": 3, "window": 5}}}}
    with Omni(tiny_qwen3_omni, deploy) as omni:
        alone = {r.request_id: _run(omni, [r])[r.request_id] for r in _requests()}
        together = _run(omni, _requests())
        reseeded = _requests()[1]
        reseeded.stage_params["talker"] = reseeded.stage_params["talker"].with_overrides(seed=999)
        other_seed = _run(omni, [reseeded])["r1"]
    for i, rid in enumerate(alone):
        a, b = alone[rid], together[rid]
        assert a.error is None and b.error is None, (a.error, b.error)
        assert len(a.token_ids) == 3 + i % 4 and b.token_ids == a.token_ids
        # 1920 samples a frame, less the tail the decoder blocks' trims drop (rates 8, 5, 4, 3)
        assert a.audio.shape == ((6 + 3 * i) * 1920 - (((8 * 5 + 5) * 4 + 4) * 3 + 3),)
        np.testing.assert_allclose(b.audio, a.audio, rtol=0, atol=AUDIO_ATOL)
    assert other_seed.audio.shape == alone["r1"].audio.shape
    assert not np.allclose(other_seed.audio, alone["r1"].audio, atol=1e-3)  # the sampled requests do draw
