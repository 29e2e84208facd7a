"""`FusedSparseMoe` (transformers' sparse MoE blocks on `omnistage.kernels.moe`) against transformers' blocks: on
CPU through Triton's interpreter, tiny; on a GPU the released thinker's full-size layer and a talker-shaped one
within bfloat16 tolerance, and a layer replayed in a CUDA graph (no host sync). And inside the real stages: the
tiny checkpoint loaded as users load it, every sparse MoE block of the thinker and the talker swapped, its kernels
forced, against transformers' `generate`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import omnistage.kernels.moe as moe
from omnistage import Omni
from omnistage.families.moe import FusedSparseMoe, fuse_moe

from .reference import run_hf
from .test_parity import DEPLOY, FRAMES, PARAMS, TEXT, THINKER_TOKENS, for_speech

pytest.importorskip("triton")
pytest.importorskip("torchvision", reason="Qwen3-Omni's processor needs torchvision")
CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")


@pytest.fixture
def force_triton(monkeypatch):
    """The kernels whatever the device (CPU: the interpreter)."""
    monkeypatch.setattr(moe, "available", lambda device: True)


def _block(kind: str, hidden: int, inter: int, experts: int, top_k: int, dtype: torch.dtype, seed: int = 0,
           impl: str = "eager"):
    """transformers' sparse MoE block of the thinker or the talker (with its shared expert), random weights, its
    experts run by `impl`: "eager" (the loop over the experts hit) or "grouped_mm" (`torch._grouped_mm`, what
    transformers picks by default when it loads a model)."""
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as m
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
        Qwen3OmniMoeTalkerTextConfig,
        Qwen3OmniMoeTextConfig,
    )

    common = dict(hidden_size=hidden, moe_intermediate_size=inter, num_experts=experts, num_experts_per_tok=top_k)
    with torch.device(DEVICE):  # full-size layers are made and filled on the GPU
        if kind == "thinker":
            cfg = Qwen3OmniMoeTextConfig(norm_topk_prob=True, **common)
            cfg._experts_implementation = impl
            block = m.Qwen3OmniMoeThinkerTextSparseMoeBlock(cfg)
        else:
            cfg = Qwen3OmniMoeTalkerTextConfig(norm_topk_prob=False, shared_expert_intermediate_size=2 * inter,
                                               **common)
            cfg._experts_implementation = impl
            block = m.Qwen3OmniMoeTalkerTextSparseMoeBlock(cfg)
    g = torch.Generator(DEVICE).manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():  # unit-scale activations: weights of std 1 / sqrt(fan-in)
            p.copy_(torch.randn(p.shape, generator=g, device=DEVICE) * p.shape[-1] ** -0.5)
    return block.to(dtype).eval().requires_grad_(False)


@pytest.mark.parametrize("kind", ["thinker", "talker"])
@pytest.mark.parametrize("tokens", [1, 6])
@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
def test_fused_block_matches_transformers_block(force_triton, kind: str, tokens: int, impl: str) -> None:
    block = _block(kind, 32, 16, 8, 3, torch.float32, impl=impl)
    x = torch.randn(1, tokens, 32, device=DEVICE)
    with torch.inference_mode():
        want = block(x)
        got = FusedSparseMoe(block)(x)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fuse_moe_swaps_the_sparse_blocks_only() -> None:
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeTextConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeThinkerTextModel

    cfg = Qwen3OmniMoeTextConfig(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_experts=4,
                                 num_experts_per_tok=2, num_hidden_layers=3, num_attention_heads=2,
                                 num_key_value_heads=1, head_dim=16, vocab_size=64, mlp_only_layers=[1])
    decoder = Qwen3OmniMoeThinkerTextModel(cfg)
    names = set(decoder.state_dict())
    assert fuse_moe(decoder, cfg) == 2
    assert [type(layer.mlp).__name__ for layer in decoder.layers] == [
        "FusedSparseMoe", "Qwen3OmniMoeThinkerTextMLP", "FusedSparseMoe"]
    assert set(decoder.state_dict()) == names  # the same tensors under the same names
    cfg.hidden_act = "gelu"
    assert fuse_moe(Qwen3OmniMoeThinkerTextModel(cfg), cfg) == 0  # the kernels compute SiLU experts only


# ---- on a GPU: full-size layers -------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not CUDA, reason="needs a GPU")
# The released Qwen3-Omni-30B-A3B thinker's text config: 128 experts, top-8 renormalized, hidden 2048,
# moe_intermediate 768. The talker-shaped layer: transformers' talker defaults (hidden 1024, 128 experts of 384,
# top-8, not renormalized) with a shared expert of 768.
FULL = {"thinker": (2048, 768, 128, 8), "talker": (1024, 384, 128, 8)}


def _bf16_errors(got: torch.Tensor, plain: torch.Tensor, exact: torch.Tensor) -> tuple[float, float, float]:
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
    return rel(got, plain), rel(got, exact), rel(plain, exact)


@gpu
@pytest.mark.parametrize("kind", ["thinker", "talker"])
@pytest.mark.parametrize("tokens", [1, 3, 100, 2048])
@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
def test_full_size_layer_matches_the_plain_path_in_bf16(kind: str, tokens: int, impl: str) -> None:
    """transformers' block (its expert loop, or its grouped_mm) against the fused block on the same bf16 weights
    and routing; both against the exact (float32) experts on that routing: the fused path is no less exact."""
    block = _block(kind, *FULL[kind], torch.bfloat16, impl=impl)
    x = torch.randn(1, tokens, FULL[kind][0], device=DEVICE).bfloat16()
    fused = FusedSparseMoe(block)
    with torch.inference_mode():
        plain, got = block(x), fused(x)
        rows = x[0]
        weights, ids = moe.route(F.linear(rows, block.gate.weight), block.gate.top_k, block.gate.norm_topk_prob)
        exact = moe.experts_reference(rows.float(), block.experts.gate_up_proj.float(),
                                      block.experts.down_proj.float(), weights.float(), ids)
        if kind == "talker":
            exact = exact + (torch.sigmoid(block.shared_expert_gate(rows)) * block.shared_expert(rows)).float()
    to_plain, to_exact, plain_to_exact = _bf16_errors(got[0], plain[0], exact)
    assert to_plain < 1.6e-2, (to_plain, to_exact, plain_to_exact)
    assert to_exact <= 1.5 * plain_to_exact + 1e-3, (to_plain, to_exact, plain_to_exact)


@gpu
def test_full_size_layer_replays_in_a_cuda_graph() -> None:
    """Routing, sorting and both GEMMs captured once and replayed on new tokens: no host sync, static shapes."""
    block = _block("thinker", *FULL["thinker"], torch.bfloat16)
    fused = FusedSparseMoe(block)
    x = torch.randn(1, 4, 2048, device=DEVICE).bfloat16()
    with torch.inference_mode():
        side = torch.cuda.Stream()  # warm-up (kernels compiled, workspaces allocated) outside the capture
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fused(x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fused(x)
        for seed in range(3):
            x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE))
            graph.replay()
            torch.testing.assert_close(out, fused(x), rtol=0, atol=0)




def test_fused_moe_stages_equal_transformers(tiny_qwen3_omni: str, force_triton, caught_codes: list[torch.Tensor],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"kernels": 0, "torch": 0}
    kernels, reference = moe.fused_experts, moe.experts_reference

    def counted_kernels(*args, **kwargs):
        calls["kernels"] += 1
        return kernels(*args, **kwargs)

    def counted_reference(*args, **kwargs):
        calls["torch"] += 1
        return reference(*args, **kwargs)

    monkeypatch.setattr(moe, "fused_experts", counted_kernels)
    monkeypatch.setattr(moe, "experts_reference", counted_reference)
    ref = run_hf(tiny_qwen3_omni, for_speech(TEXT), THINKER_TOKENS, FRAMES, "Chelsie")
    with Omni(tiny_qwen3_omni, DEPLOY) as omni:
        (spoken,) = omni.generate([TEXT], PARAMS, ("text", "audio"), voice="chelsie")
    assert spoken.error is None, spoken.error
    # every step of both stages through the kernels (3 thinker and 2 talker MoE layers a step), never torch's path
    assert calls["kernels"] >= 3 * THINKER_TOKENS + 2 * FRAMES and calls["torch"] == 0
    assert spoken.token_ids == ref.thinker_tokens
    assert torch.equal(torch.cat(caught_codes).T, ref.codes)
    torch.testing.assert_close(torch.from_numpy(spoken.audio), ref.wav, rtol=0, atol=1e-5)


def test_talker_experts_load_into_their_slices(tiny_qwen3_omni: str, tmp_path) -> None:
    """The released layout's per-expert tensors land in their slices of the fused ones; a checkpoint lacking one
    is refused, naming the tensor left unfilled."""
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file, save_file
    from transformers import Qwen3OmniMoeConfig

    from omnistage.errors import ConfigError
    from omnistage.families import hf
    from omnistage.families.qwen3_omni_moe import models

    path = Path(tiny_qwen3_omni)
    config = Qwen3OmniMoeConfig.from_pretrained(path)
    talker = models.load_talker(path, config.talker_config, config, torch.float32, torch.device("cpu")).talker
    state = {k: v for f in hf.safetensors_files(path) for k, v in load_file(f).items()}
    prefix = "talker.model.layers.1.mlp.experts.3."
    assert f"{prefix}up_proj.weight" in state  # the released layout
    inter = config.talker_config.text_config.moe_intermediate_size
    fused = talker.model.layers[1].mlp.experts
    assert torch.equal(fused.gate_up_proj[3, :inter], state[f"{prefix}gate_proj.weight"])
    assert torch.equal(fused.gate_up_proj[3, inter:], state[f"{prefix}up_proj.weight"])
    assert torch.equal(fused.down_proj[3], state[f"{prefix}down_proj.weight"])

    broken = tmp_path / "broken"
    shutil.copytree(path, broken, ignore=shutil.ignore_patterns("*.safetensors*"))
    save_file({k: v for k, v in state.items() if k != f"{prefix}up_proj.weight"}, str(broken / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"layers\.1\.mlp\.experts\.gate_up_proj"):
        models.load_talker(broken, config.talker_config, config, torch.float32, torch.device("cpu"))
