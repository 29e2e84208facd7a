"""The skinny-GEMM kernels equal torch's linear layers (on CPU through Triton's interpreter), and a decoder
run through them decodes the same tokens as transformers."""

import pytest
import torch
import torch.nn.functional as F

import omnistage.kernels.fused as fused
import omnistage.kernels.skinny_gemm as skinny

pytest.importorskip("triton")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def force_triton(monkeypatch):
    """The Triton path whatever the device (CPU: the interpreter); batches past MAX_ROWS still go to torch."""
    monkeypatch.setattr(skinny, "_use_triton", lambda x: x.dim() == 2 and x.shape[0] <= skinny.MAX_ROWS)
    monkeypatch.setattr(fused, "_use_triton", lambda x: True)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear(force_triton, rows: int, with_bias: bool) -> None:
    x, w = torch.randn(rows, 200, device=DEVICE), torch.randn(72, 200, device=DEVICE)  # ragged tiles both ways
    b = torch.randn(72, device=DEVICE) if with_bias else None
    got = skinny.linear(x, w, b, tiling=skinny.Tiling(block_n=32, block_k=64, splits=1))
    assert got.shape == (rows, 72) and got.dtype == x.dtype
    _close(got, F.linear(x, w, b))


def test_split_k_partials_and_their_sum_in_add_rmsnorm(force_triton) -> None:
    x, w = torch.randn(2, 300, device=DEVICE), torch.randn(40, 300, device=DEVICE)
    parts = skinny.linear(x, w, partial=True, tiling=skinny.Tiling(block_n=16, block_k=32, splits=4))
    assert parts.shape == (4, 2, 40) and parts.dtype == torch.float32  # K=300: 10 steps of 32, 3 per slice
    _close(fused.sum_partials(parts, x.dtype), F.linear(x, w))
    residual, norm_w = torch.randn(2, 40, device=DEVICE), torch.randn(40, device=DEVICE)
    out, summed = fused.add_rmsnorm(parts, residual, norm_w, 1e-6)
    want_out, want_summed = fused.add_rmsnorm(F.linear(x, w), residual, norm_w, 1e-6)
    _close(summed, want_summed)
    _close(out, want_out)
    # no residual: the summed partials themselves are the residual
    out, summed = fused.add_rmsnorm(parts, None, norm_w, 1e-6)
    _close(summed, F.linear(x, w))
    _close(out, fused.add_rmsnorm(F.linear(x, w), None, norm_w, 1e-6)[0])
    # a bias rides on the first slice: the partials still sum to the linear layer, and add_rmsnorm takes them
    b = torch.randn(40, device=DEVICE)
    parts = skinny.linear(x, w, b, partial=True, tiling=skinny.Tiling(block_n=16, block_k=32, splits=4))
    assert parts.shape == (4, 2, 40)
    assert torch.equal(parts[1:], skinny.linear(x, w, partial=True, tiling=skinny.Tiling(16, 32, 4))[1:])
    _close(fused.sum_partials(parts, x.dtype), F.linear(x, w, b))
    _close(fused.add_rmsnorm(parts, None, norm_w, 1e-6)[0], fused.add_rmsnorm(F.linear(x, w, b), None, norm_w, 1e-6)[0])


def test_one_slice_is_not_partial(force_triton) -> None:
    """Too short a K to split: the finished [M, N] result in x's dtype, which add_rmsnorm takes as well."""
    x, w = torch.randn(2, 64, device=DEVICE), torch.randn(40, 64, device=DEVICE)
    got = skinny.linear(x, w, partial=True, tiling=skinny.Tiling(block_n=16, block_k=64, splits=8))
    assert got.shape == (2, 40) and got.dtype == x.dtype
    _close(got, F.linear(x, w))


def test_gate_up_silu(force_triton) -> None:
    x, w = torch.randn(3, 96, device=DEVICE), torch.randn(2 * 50, 96, device=DEVICE)
    got = skinny.gate_up_silu(x, w, tiling=skinny.Tiling(block_n=16, block_k=32, splits=1))
    gate_up = F.linear(x, w)
    _close(got, F.silu(gate_up[:, :50]) * gate_up[:, 50:])


def test_a_row_does_not_depend_on_its_batch(force_triton) -> None:
    """Fixed tiles and order along K: row 0 alone and row 0 among 11 others are the same bits."""
    x, w = torch.randn(12, 256, device=DEVICE), torch.randn(64, 256, device=DEVICE)
    tiling = skinny.Tiling(block_n=32, block_k=64, splits=2)
    assert torch.equal(skinny.linear(x[:1], w, partial=True, tiling=tiling)[:, 0],
                       skinny.linear(x, w, partial=True, tiling=tiling)[:, 0])


def test_choose_tiling(monkeypatch) -> None:
    # what the sweep found best on an H200 (132 SMs), bf16
    assert skinny.choose_tiling(896, 18944, sms=132) == skinny.Tiling(32, 512, 4, 4, 4)  # talker down: split K
    assert skinny.choose_tiling(3584, 18944, sms=132).splits == 1  # thinker down: 112 row tiles already
    assert skinny.choose_tiling(18944, 896, sms=132, gate_up=True) == skinny.Tiling(32, 128, 1, 4, 3)
    # small weights read whole before the PDL wait. Qwen2-0.5B's shapes: 16 rows a program, o in 2 slices of K,
    # qkv (a bias: whole rows) in one
    assert skinny.choose_tiling(896, 896, sms=132) == skinny.Tiling(16, 512, 2, 4, 1, preload=True)
    assert skinny.choose_tiling(1152, 896, sms=132, splittable=False) == skinny.Tiling(16, 1024, 1, 4, 1, preload=True)
    # the released talker's: o (K 1536) in 4 slices of 32 rows, qkv's 160 tiles of 16 are past one wave: 32 rows
    assert skinny.choose_tiling(896, 1536, sms=132) == skinny.Tiling(32, 512, 4, 4, 1, preload=True)
    assert skinny.choose_tiling(2560, 896, sms=132, splittable=False) == skinny.Tiling(32, 1024, 1, 8, 1, preload=True)
    assert not skinny.choose_tiling(8448, 896, sms=132).preload  # the codec head: more tiles than SMs
    assert not skinny.choose_tiling(3584, 3584, sms=132).preload  # the thinker's o: 256 KB a program
    # float32 (the GPU tests' tiny models): the same bytes per stage, so shared memory still suffices
    assert skinny.choose_tiling(896, 18944, sms=132, elem_bytes=4).block_k == 256
    monkeypatch.setattr(skinny, "PRELOAD", False)
    assert skinny.choose_tiling(896, 896, sms=132) == skinny.Tiling(32, 128, 2, 4, 4)


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("partial", [False, True])
def test_preloaded_tiles(force_triton, rows: int, partial: bool) -> None:
    """One tile per program's slice of K, read before the wait: the same result as the K loop; a bias (on the
    first slice's partials, or finished rows over the whole K in one wider tile); and a row still does not
    depend on its batch."""
    x, w = torch.randn(rows, 200, device=DEVICE), torch.randn(72, 200, device=DEVICE)
    tiling = skinny.Tiling(block_n=32, block_k=128, splits=2, num_stages=1, preload=True)
    got = fused.sum_partials(skinny.linear(x, w, partial=partial, tiling=tiling), x.dtype)
    _close(got, F.linear(x, w))
    b = torch.randn(72, device=DEVICE)
    _close(fused.sum_partials(skinny.linear(x, w, b, partial=partial, tiling=tiling), x.dtype), F.linear(x, w, b))
    assert torch.equal(skinny.linear(x[:1], w, partial=True, tiling=tiling)[..., 0, :],
                       skinny.linear(x, w, partial=True, tiling=tiling)[..., 0, :])
    with pytest.raises(ValueError, match="gate-up"):
        skinny.gate_up_silu(x, torch.randn(2 * 36, 200, device=DEVICE), tiling=tiling)


# bfloat16 only on a GPU: Triton's interpreter computes bfloat16 dots wrongly
@pytest.mark.parametrize("dtype", [torch.float32] + [torch.bfloat16] * torch.cuda.is_available())
def test_linear_to_float_rounds_like_the_head_then_float(force_triton, dtype: torch.dtype) -> None:
    """An LM head's logits: rounded to the activations' dtype (as `lm_head(x)` rounds) and stored as float32."""
    x, w = torch.randn(3, 96, device=DEVICE).to(dtype), torch.randn(50, 96, device=DEVICE).to(dtype)
    got = skinny.linear_to_float(x, w)
    assert got.dtype == torch.float32 and got.shape == (3, 50)
    want = F.linear(x, w).float()
    assert torch.equal(got.to(dtype).float(), got)  # exactly representable in the activations' dtype
    torch.testing.assert_close(got, want, rtol=1e-2 if dtype == torch.bfloat16 else 1e-4, atol=1e-2)


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("tiling", [skinny.Tiling(block_n=32, block_k=32, splits=1),
                                    skinny.Tiling(block_n=16, block_k=64, splits=1, num_stages=1, preload=True)],
                         ids=["k_loop", "preloaded"])
def test_qkv_with_rotary_and_cache_write(force_triton, rows: int, with_bias: bool, tiling: skinny.Tiling) -> None:
    """The q/k/v projection finished in its own kernel (rows taken in rotary pairs, q rotated into the result,
    k rotated and v stored at each row's cache slot) equals the linear layer then `rotary_kv_write`: q and
    both caches, untouched slots included. 3 q heads and 1 KV head of 16 (80 rows: the last tile is short)."""
    q_heads, kv_heads, d = 3, 1, 16
    x = torch.randn(rows, 64, device=DEVICE)
    w = torch.randn((q_heads + 2 * kv_heads) * d, 64, device=DEVICE)
    b = torch.randn(w.shape[0], device=DEVICE) if with_bias else None
    angles = torch.randn(rows, d // 2, device=DEVICE).repeat(1, 2)
    cos, sin = torch.cos(angles), torch.sin(angles)
    slots = torch.randperm(40, device=DEVICE)[:rows]
    k_cache, v_cache = torch.randn(40, kv_heads, d, device=DEVICE), torch.randn(40, kv_heads, d, device=DEVICE)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    q, k, v = F.linear(x, w, b).split([q_heads * d, kv_heads * d, kv_heads * d], dim=-1)
    want_q = fused.rotary_kv_write(q.reshape(rows, q_heads, d), k.reshape(rows, kv_heads, d),
                                   v.reshape(rows, kv_heads, d), cos, sin, want_k, want_v, slots)
    got_q = skinny.qkv_rotary_kv_write(x, w, b, d, q_heads, kv_heads, cos, sin, slots, k_cache, v_cache,
                                       tiling=tiling)
    assert got_q.shape == (rows, q_heads, d)
    _close(got_q, want_q)
    _close(k_cache, want_k)
    _close(v_cache, want_v)
    with pytest.raises(ValueError, match="rows"):
        skinny.qkv_rotary_kv_write(x, w[:-1], None, d, q_heads, kv_heads, cos, sin, slots, k_cache, v_cache)
