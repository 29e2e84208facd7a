"""The fused MoE kernels (`omnistage.kernels.moe`; on CPU through Triton's interpreter) equal the per-expert torch
path; routing equals transformers' router; the kernels compile for Hopper. The MoE blocks built on them (against
transformers' blocks, full-size on a GPU): tests/families/qwen3_omni_moe/test_fused_moe.py."""

import pytest
import torch
import torch.nn.functional as F

import omnistage.kernels.moe as moe

pytest.importorskip("triton")
CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
SMALL = moe.Tiling(block_m=16, block_n=16, block_k=16)  # the interpreter is slow: small tiles, small shapes


@pytest.fixture
def force_triton(monkeypatch):
    """The Triton path whatever the device (CPU: the interpreter)."""
    monkeypatch.setattr(moe, "_use_triton", lambda x: True)


def _experts(e: int, hidden: int, inter: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(e, 2 * inter, hidden, generator=g) * hidden ** -0.5).to(DEVICE, dtype)
    down = (torch.randn(e, hidden, inter, generator=g) * inter ** -0.5).to(DEVICE, dtype)
    return gate_up, down


def _routing(t: int, e: int, k: int, dtype: torch.dtype, seed: int = 1, unused: int = 0):
    """Random routing; the last `unused` experts are never picked."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, e, generator=g)
    logits[:, e - unused :] = -1e4
    return moe.route(logits.to(DEVICE, dtype), k, normalize=True)


@pytest.mark.parametrize("tokens", [1, 5, 37])
@pytest.mark.parametrize("block_m", [4, 16])
def test_align_sorts_every_assignment_into_single_expert_blocks(tokens: int, block_m: int) -> None:
    e, k = 8, 3
    _, ids = _routing(tokens, e, k, torch.float32, unused=2)
    al = moe.align(ids, e, block_m)
    n = tokens * k
    assert al.slots.numel() == moe.max_slots(n, e, block_m) and al.slots.numel() % block_m == 0
    slots = al.slots.cpu()
    used = slots[slots < n]
    assert sorted(used.tolist()) == list(range(n))  # each assignment once
    assert (slots[slots >= n] == n).all()  # padding holds the sentinel
    flat, blocks = ids.reshape(-1).cpu(), al.block_expert.cpu()
    for b, expert in enumerate(blocks.tolist()):
        block = slots[b * block_m : (b + 1) * block_m]
        block = block[block < n]
        if expert == e:  # past the used blocks: empty
            assert len(block) == 0
            continue
        assert len(block) and (flat[block] == expert).all()
        assert block.tolist() == sorted(block.tolist())  # by token within an expert
    counts = torch.bincount(flat, minlength=e)
    assert blocks.tolist() == sorted(blocks.tolist())  # experts in order
    assert (blocks < e).sum() == ((counts + block_m - 1) // block_m).sum()  # each expert's run in whole blocks


def test_route_is_transformers_router() -> None:
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeTextConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeThinkerTextTopKRouter

    for normalize in (True, False):
        cfg = Qwen3OmniMoeTextConfig(hidden_size=32, num_experts=8, num_experts_per_tok=3, norm_topk_prob=normalize)
        router = Qwen3OmniMoeThinkerTextTopKRouter(cfg).to(DEVICE, torch.bfloat16)
        router.weight.data.normal_()
        x = torch.randn(11, 32, device=DEVICE).bfloat16()
        _, want_w, want_ids = router(x)
        got_w, got_ids = moe.route(F.linear(x, router.weight), 3, normalize)
        assert torch.equal(got_ids, want_ids) and torch.equal(got_w, want_w) and got_w.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,top_k", [(1, 1), (1, 3), (5, 2), (19, 3)])
def test_fused_experts_match_the_plain_path(force_triton, dtype: torch.dtype, tokens: int, top_k: int) -> None:
    """Token counts of 1 and off the block size, top-1 and top-k > 1, experts hit by no token (2 never routed to,
    more at a single token), ragged tiles (hidden 40, intermediate 24 in tiles of 16)."""
    e, hidden, inter = 8, 40, 24
    gate_up, down = _experts(e, hidden, inter, dtype)
    weights, ids = _routing(tokens, e, top_k, dtype, unused=2)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype)
    got = moe.fused_experts(x, gate_up, down, weights, ids, tiling=SMALL)
    want = moe.experts_reference(x, gate_up, down, weights, ids)
    assert got.shape == (tokens, hidden) and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # the same roundings; on a GPU the GEMMs' accumulation order differs
        torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2 * want.abs().max().item())


def test_a_token_does_not_depend_on_its_batch(force_triton) -> None:
    """Fixed tiles and order along K: token 0's result alone and among 12 others (sharing its experts' blocks) is
    the same bits."""
    gate_up, down = _experts(4, 32, 32, torch.float32)
    weights, ids = _routing(13, 4, 2, torch.float32)
    x = torch.randn(13, 32, device=DEVICE)
    alone = moe.fused_experts(x[:1], gate_up, down, weights[:1], ids[:1], tiling=SMALL)
    batch = moe.fused_experts(x, gate_up, down, weights, ids, tiling=SMALL)
    assert torch.equal(alone[0], batch[0])


def test_bad_shapes_are_refused(force_triton) -> None:
    gate_up, down = _experts(4, 32, 16, torch.float32)
    weights, ids = _routing(2, 4, 2, torch.float32)
    with pytest.raises(ValueError, match="do not fit"):
        moe.fused_experts(torch.randn(2, 32, device=DEVICE), gate_up[:, :20], down, weights, ids, tiling=SMALL)


def test_choose_tiling() -> None:
    # decode (one token, top-8 of 128): 16-slot blocks; thinker gate-up (8 blocks x 12 tiles of 64 < 132 SMs)
    # in 32-feature tiles, down (2048 features) in 64
    assert moe.choose_tiling(8, 128, 768, sms=132) == moe.Tiling(16, 32, 256)
    assert moe.choose_tiling(8, 128, 2048, sms=132) == moe.Tiling(16, 64, 128)
    # prefill of 2048 tokens: 128 assignments an expert, 64-slot blocks; float32 halves K per stage
    assert moe.choose_tiling(2048 * 8, 128, 768, sms=132) == moe.Tiling(64, 128, 64, num_warps=8)
    assert moe.choose_tiling(2048 * 8, 128, 768, elem_bytes=4, sms=132).block_k == 32


# Compiled for Hopper (sm_90) with Triton's own compiler, no GPU needed: what the interpreter does not check (types,
# layouts, shared memory) on the tiles the released thinker's layers take, bf16. In a subprocess: the interpreter
# (set for the tests) replaces the kernels.
_COMPILE = """
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import omnistage.kernels.moe as moe
ptrs = {"X", "W", "SLOTS", "BLOCK_EXPERT", "Y", "A", "ROUTE_W"}
for tokens in (1, 2048):
    for kernel, n in ((moe._gate_up_kernel, 768), (moe._down_kernel, 2048)):
        t = moe.choose_tiling(tokens * 8, 128, n, 2, 132)
        consts = {"TOP_K": 8, "PRECISION": "tf32", "WIDEN": False, "BLOCK_M": t.block_m, "BLOCK_N": t.block_n,
                  "BLOCK_K": t.block_k}
        sig = {a: ("*i32" if a in ("SLOTS", "BLOCK_EXPERT") else "*bf16") if a in ptrs else
               "constexpr" if a in consts else "i32" for a in kernel.arg_names}
        consts = {a: v for a, v in consts.items() if a in sig}
        triton.compile(ASTSource(kernel, sig, consts), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": t.num_warps, "num_stages": t.num_stages})
print("compiled")
"""


@pytest.mark.skipif(CUDA, reason="the GPU tests run the kernels themselves")
def test_kernels_compile_for_hopper() -> None:
    import os
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
