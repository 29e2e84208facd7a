"""Programmatic dependent launch changes when kernels start, never what they compute: a decode layer's kernel
chain, captured in a CUDA graph with PDL, gives the same bits as the same chain run eagerly without it, and an
engine decodes the same tokens either way. Off on CPU and when forced off."""

import pytest
import torch

from omnistage import Omni, SamplingParams
from omnistage.kernels import pdl

pytest.importorskip("triton")
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
needs_pdl = pytest.mark.skipif(not HOPPER, reason="programmatic dependent launch needs a Hopper or newer GPU")


@pytest.fixture
def restore_pdl():
    yield
    pdl.set_enabled(True)


def test_off_on_cpu_and_when_forced_off(restore_pdl) -> None:
    assert not pdl.enabled(torch.device("cpu"))
    assert pdl.launch_options(False) == {}
    assert pdl.launch_options(True) == {"launch_pdl": True}
    pdl.set_enabled(False)
    assert not pdl.enabled(torch.device("cuda", 0))


def _layer_chain(hidden: torch.Tensor, layers: list[dict], k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: dict) -> torch.Tensor:
    """What the fused decoder launches for a decode step, layer after layer (skinny GEMMs, split-K partials
    summed in add+RMSNorm, rotary with the KV write, split-K decode attention)."""
    from omnistage.kernels import skinny_gemm as skinny
    from omnistage.kernels.fused import add_rmsnorm, rotary_kv_write
    from omnistage.kernels.paged_attention import paged_attention_triton

    residual, tokens = None, hidden.shape[0]
    for p in layers:
        x, residual = add_rmsnorm(hidden, residual, p["norm"], 1e-6)
        qkv = skinny.linear(x, p["qkv"], p["qkv_b"])
        q, k, v = qkv.split([512, 128, 128], dim=-1)
        q = rotary_kv_write(q.view(tokens, 4, 128), k.view(tokens, 1, 128), v.view(tokens, 1, 128), meta["cos"],
                            meta["sin"], k_cache, v_cache, meta["slots"])
        o = paged_attention_triton(q, k_cache, v_cache, meta["tables"], meta["lens"], meta["cu_q"], 1, 16, 0.088)
        hidden = skinny.linear(o.reshape(tokens, -1), p["o"], partial=True)
        x, residual = add_rmsnorm(hidden, residual, p["norm"], 1e-6)
        hidden = skinny.linear(skinny.gate_up_silu(x, p["gate_up"]), p["down"], partial=True)
    return add_rmsnorm(hidden, residual, layers[0]["norm"], 1e-6)[0]


@needs_pdl
def test_graphed_chain_with_pdl_equals_eager_chain_without(restore_pdl) -> None:
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=dev) * 0.05).to(dt)

    width, inter, context = 512, 8192, 700  # big gate-up/down weights: a kernel that read early would see junk
    layers = [{"norm": 1 + rand(width), "qkv": rand(768, width), "qkv_b": rand(768), "o": rand(width, 512),
               "gate_up": rand(2 * inter, width), "down": rand(width, inter)} for _ in range(6)]
    k_cache, v_cache = rand(48 * 16, 1, 128), rand(48 * 16, 1, 128)
    meta = {"cos": torch.cos(rand(1, 128).float()).to(dt), "sin": torch.sin(rand(1, 128).float()).to(dt),
            "slots": torch.tensor([context - 1], device=dev), "tables": torch.arange(48, device=dev)[None].int(),
            "lens": torch.tensor([context], device=dev), "cu_q": torch.tensor([0, 1], device=dev).int()}
    hidden = rand(1, width)

    pdl.set_enabled(False)
    want = _layer_chain(hidden, layers, k_cache.clone(), v_cache.clone(), meta)
    pdl.set_enabled(True)
    assert pdl.enabled(dev)
    kc, vc = k_cache.clone(), v_cache.clone()
    _layer_chain(hidden, layers, kc, vc, meta)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _layer_chain(hidden, layers, kc, vc, meta)
    for _ in range(20):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)


@needs_pdl
def test_engine_decodes_the_same_tokens_with_and_without_pdl(tiny_qwen2: str, restore_pdl) -> None:
    prompts = ["a b c", "the quick brown fox jumps", "1 2 3 4 5 6 7 8"]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    runs = []
    for on in (False, True):
        pdl.set_enabled(on)
        deploy = {"worker_backend": "inline", "stages": {"lm": {"max_model_len": 128}}}  # inline: the switch reaches it
        with Omni(tiny_qwen2, deploy) as omni:
            runs.append([o.token_ids for o in omni.generate(prompts, params)])
    assert runs[0] == runs[1] and all(len(ids) == 24 for ids in runs[0])
