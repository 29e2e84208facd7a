"""CUDA graphs change no output: the thinker's decode graphs (which also keep the hidden states the
talker needs), the talker's (which take its per-step embedding additions) and token2wav's captured
flow-matching solves give the same text, codes and audio as eager execution. GPU only."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omnistage import Omni, SamplingParams

pytest.importorskip("torchvision", reason="Qwen2.5-Omni's processor needs torchvision (installed by scripts/test)")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


def test_cuda_graphs_keep_text_and_speech_unchanged(tiny_qwen2_5_omni: str) -> None:
    prompts = [[{"role": "user", "content": f"Tell me about rivers, part {i}."}] for i in range(4)]
    params = [{"thinker": SamplingParams(max_tokens=6 + 3 * i, temperature=0, ignore_eos=True),
               "talker": SamplingParams(max_tokens=30 + 7 * i, temperature=0, repetition_penalty=1.05,
                                        ignore_eos=True)} for i in range(4)]
    results = {}
    for eager in (True, False):
        deploy = {"async_chunk": True, "worker_backend": "inline",
                  "stages": {"*": {"max_model_len": 512, "kv_cache_memory_gb": 0.25, "enforce_eager": eager},
                             "token2wav": {"options": {"window": 8, "left": 8, "right": 4, "vocoder_context": 8}}}}
        with Omni(tiny_qwen2_5_omni, deploy) as omni:
            results[eager] = [omni.generate([p], ps, ("text", "audio"), voice=v)[0]
                              for p, ps, v in zip(prompts, params, ["Chelsie", "Ethan"] * 2, strict=True)]
            together = omni.generate(prompts[:2], params[0], ("text", "audio"))  # a batch of two in every stage
            results[eager] += together
    for eager_out, graph_out in zip(results[True], results[False], strict=True):
        assert eager_out.error is None and graph_out.error is None
        assert graph_out.token_ids == eager_out.token_ids
        assert graph_out.audio.shape == eager_out.audio.shape and eager_out.audio.size > 0
        np.testing.assert_allclose(graph_out.audio, eager_out.audio, rtol=0, atol=1e-5)
