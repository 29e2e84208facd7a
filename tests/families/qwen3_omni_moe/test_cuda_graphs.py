"""CUDA graphs of the Qwen3-Omni MoE stages change no output. GPU only.

With the fused MoE kernels (no host sync) the thinker's and the talker's decoders are graph-safe, and the talker's
code predictor replays its graph form per decode bucket (`after_sample_graph`). Greedy runs of two requests
together, graphs against `enforce_eager` (the same functions on the same buffers from Python): the same text
tokens, all codebooks' codes and the waveform within code2wav's GPU bound; `test_parity` compares the graphed
stages with transformers on the same GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import omnistage.families.qwen3_omni_moe as family
from omnistage import Omni

from .reference import AUDIO_ATOL
from .test_parity import MULTI_TURN, PARAMS, TEXT

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
EDGE = family.talker_to_code2wav  # the real edge, wrapped afresh by each run's spy


def _run(path: str, eager: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[list, dict[str, list], dict]:
    codes: dict[str, list] = {}
    edge = EDGE

    def spy(pipeline, request, out):
        if "codes" in out.tensors:
            codes.setdefault(out.request_id, []).append(out.tensors["codes"])
        return edge(pipeline, request, out)

    monkeypatch.setattr(family, "talker_to_code2wav", spy)
    deploy = {"async_chunk": False, "stages": {"*": {"max_model_len": 512, "dtype": "float32",
                                                     "enforce_eager": eager}}}
    with Omni(path, deploy) as omni:
        outs = omni.generate([TEXT, MULTI_TURN], PARAMS, ("text", "audio"), voice="chelsie")
        stats = omni.stats()
    return outs, codes, stats


def test_graphs_keep_tokens_codes_and_audio(tiny_qwen3_omni: str, monkeypatch: pytest.MonkeyPatch) -> None:
    eager, eager_codes, _ = _run(tiny_qwen3_omni, True, monkeypatch)
    graphs, graph_codes, stats = _run(tiny_qwen3_omni, False, monkeypatch)
    assert stats["talker"]["num_after_sample_graph_steps"] > 0
    assert sorted(eager_codes) == sorted(graph_codes) and len(graph_codes) == 2
    for e, g in zip(eager, graphs, strict=True):
        assert e.error is None and g.error is None, (e.error, g.error)
        assert g.token_ids == e.token_ids
        np.testing.assert_allclose(g.audio, e.audio, rtol=0, atol=AUDIO_ATOL)
    for rid in eager_codes:
        assert torch.equal(torch.cat(graph_codes[rid]), torch.cat(eager_codes[rid]))
