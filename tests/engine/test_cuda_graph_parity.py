"""CUDA graphs change no greedy token: a bfloat16 Qwen2 decoding 8 prompts gives the same 64 tokens each with
graphs as with `enforce_eager` (whose steps run the graphs' functions eagerly, at the same padded shapes).
GPU only; bfloat16 random weights make near-ties common, so a numerics difference shows up as a token."""

from __future__ import annotations

import pytest
import torch

from omnistage.engine.ar.engine import AREngine, AREngineConfig
from omnistage.families.causal_lm import causal_lm_model
from omnistage.families.hf import ATTN_IMPL
from omnistage.sampling_params import SamplingParams
from omnistage.types import StageInput

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


def _tokens(model, config, eager: bool, prompts: list[list[int]], steps: int) -> list[list[int]]:
    cfg = AREngineConfig(max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=8192, kv_cache_memory_gb=1.0,
                         enforce_eager=eager)
    engine = AREngine("lm", causal_lm_model(model, config), cfg, tokenizer=None, eos_token_ids=())
    params = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True)
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    for i, ids in enumerate(prompts):
        engine.add_request(StageInput(str(i), ids, params=params))
    while engine.has_work():
        for o in engine.step():
            out[o.request_id] += o.token_ids
    engine.shutdown()
    return [out[str(i)] for i in range(len(prompts))]


def test_graph_and_eager_decode_give_the_same_greedy_tokens() -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(hidden_size=1024, intermediate_size=2816, num_hidden_layers=6, num_attention_heads=16,
                         num_key_value_heads=4, vocab_size=32000, max_position_embeddings=4096)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16).eval()
    model.set_attn_implementation(ATTN_IMPL)
    g = torch.Generator().manual_seed(3)
    prompts = torch.randint(10, config.vocab_size - 10, (8, 128), generator=g).tolist()
    graphs = _tokens(model, config, False, prompts, 64)
    eager = _tokens(model, config, True, prompts, 64)
    same = sum(a == b for a, b in zip(graphs, eager, strict=True))
    assert same == len(prompts), f"{same} of {len(prompts)} sequences identical"
    # a lone request (graph bucket 1, more decode-attention splits) and a batch of 5 (padded to bucket 8)
    for subset in (prompts[:1], prompts[:5]):
        assert _tokens(model, config, False, subset, 32) == _tokens(model, config, True, subset, 32)
