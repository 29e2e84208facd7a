"""CUDA graphs of the Qwen3-TTS talker change no output. GPU only.

The talker's decode and prompt steps replay graphs (which keep the final hidden states the code predictor reads and
take the per-step embedding additions), and so does its code predictor (`after_sample_graph`, one graph per batch
bucket); `enforce_eager` runs the same functions on the same static buffers from Python.
- Greedy: the same codes with graphs as with `enforce_eager`, batched and alone, and the same audio end to end.
- Sampled: graph replays draw the code predictor's noise from the default CUDA generator at the offsets eager calls
  would: with the same seeds the same codes as `enforce_eager`, run after run; the codes are valid and varied.
- A seeded request's steps run the eager hook (its own generator): its codes do not depend on its batch.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from omnistage.engine.ar.engine import AREngine, AREngineConfig
from omnistage.families.qwen3_tts.talker import TalkerLM, codec_prefix_ids, load_talker, talker_input, talker_params
from omnistage.testing.qwen3_tts import CODEBOOK, Q, make_tiny_qwen3_tts

from .test_family import _speak

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")

ITEMS = [("Hello there, how are you?", "Vivian"), ("A tiny test of speech.", "ryan"), ("The quick brown fox.", "eric")]
GREEDY = dict(do_sample=False, subtalker_dosample=False)
SAMPLED = dict(do_sample=True, temperature=0.9, top_k=50, subtalker_dosample=True, subtalker_temperature=1.2,
               subtalker_top_k=8, subtalker_top_p=0.9)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen3_tts(tmp_path_factory.mktemp("qwen3_tts"))


@pytest.fixture(scope="module")
def talker(checkpoint: Path) -> TalkerLM:
    return load_talker(checkpoint, device="cuda")


def _run(checkpoint: Path, talker: TalkerLM, items: list[tuple[str, str]], eager: bool, max_frames: int = 40,
         seed: list[int | None] | None = None, default_seed: int | None = None, **overrides
         ) -> tuple[list[torch.Tensor], dict[str, int]]:
    """The talker stage over `items` as one batch: each request's codes [frames, Q], and the engine's stats.
    `seed`: the requests' own seeds; `default_seed`: the default generators' seed, set once the engine is built
    (its captures and warm-ups draw too)."""
    config = json.loads((checkpoint / "config.json").read_text())
    tc, gen = config["talker_config"], json.loads((checkpoint / "generation_config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    engine = AREngine("talker", talker, AREngineConfig(max_model_len=256, num_kv_blocks=64, max_num_seqs=8,
                                                       enforce_eager=eager),
                      eos_token_ids=(tc["codec_eos_token_id"],))
    try:
        assert engine.runner.graphs and engine.runner.hook_graphs
        if default_seed is not None:
            torch.manual_seed(default_seed)
        for i, (text, speaker) in enumerate(items):
            ids = tokenizer(f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
            params = talker_params(tc, gen, max_frames, **overrides).with_overrides(seed=seed[i] if seed else None)
            engine.add_request(talker_input(f"r{i}", ids, codec_prefix_ids(tc, speaker), params, gen, **overrides))
        codes: dict[str, list[torch.Tensor]] = {f"r{i}": [] for i in range(len(items))}
        while engine.seqs:
            for out in engine.step():
                assert out.error is None, out.error
                if "codes" in out.tensors:
                    codes[out.request_id].append(out.tensors["codes"])
        return [torch.cat(codes[f"r{i}"]) for i in range(len(items))], engine.stats()
    finally:
        engine.shutdown()


def test_greedy_codes_equal_with_and_without_graphs(checkpoint: Path, talker: TalkerLM) -> None:
    (eager, eager_stats), (graphs, graph_stats) = (_run(checkpoint, talker, ITEMS, e, **GREEDY) for e in (True, False))
    for e, g in zip(eager, graphs, strict=True):
        assert e.shape[1] == Q and len(e) >= 2
        assert torch.equal(g, e)
    assert graph_stats["num_after_sample_graph_steps"] == eager_stats["num_after_sample_graph_steps"] > 0
    for item, batched in zip(ITEMS, graphs, strict=True):  # alone: other buckets, the same codes
        (alone,), stats = _run(checkpoint, talker, [item], False, **GREEDY)
        assert torch.equal(alone, batched)
        assert stats["num_prompt_graph_steps"] == 1  # a prompt alone in its step replays a prompt graph


def test_greedy_audio_equal_with_and_without_graphs(checkpoint: Path) -> None:
    outs = {}
    for eager in (True, False):
        # float32: which requests share a step depends on when they arrive, and in bfloat16 that alone may flip a
        # near-tied code of this random model
        outs[eager] = _speak(checkpoint, {"stages": {"talker": {"enforce_eager": eager, "dtype": "float32"}}})
    for e, g in zip(outs[True], outs[False], strict=True):
        assert e.error is None and g.error is None and np.abs(e.audio).max() > 1e-3
        np.testing.assert_array_equal(g.audio, e.audio)


def test_sampled_codes_with_graphs_are_eager_codes(checkpoint: Path, talker: TalkerLM) -> None:
    """c0 from the engine's sampler generator (its seed), the other codes from the default CUDA generator."""
    runs = {}
    for eager in (True, False, False):
        runs.setdefault(eager, []).append(_run(checkpoint, talker, ITEMS, eager, max_frames=16, default_seed=0,
                                               **SAMPLED)[0])
    for a, b, e in zip(*runs[False], runs[True][0], strict=True):
        assert torch.equal(a, b)  # deterministic under a fixed default seed
        assert torch.equal(a, e)  # graph replays draw what eager calls draw
    codes = torch.cat(runs[False][0])
    assert int(codes.min()) >= 0 and int(codes[:, 1:].max()) < CODEBOOK
    assert all(len(codes[:, k].unique()) >= 4 for k in range(1, Q))  # sampled: varied codes in every codebook
    other = _run(checkpoint, talker, ITEMS, False, max_frames=16, default_seed=1, **SAMPLED)[0]
    assert any(not torch.equal(o, a) for o, a in zip(other, runs[False][0], strict=True))  # the seed matters


def test_seeded_requests_take_the_eager_hook(checkpoint: Path, talker: TalkerLM) -> None:
    (alone,), stats = _run(checkpoint, talker, ITEMS[:1], False, max_frames=16, seed=[7], **SAMPLED)
    assert stats["num_after_sample_graph_steps"] == 0
    batched, _ = _run(checkpoint, talker, ITEMS, False, max_frames=16, seed=[7, None, None], **SAMPLED)
    assert torch.equal(batched[0], alone)
