"""Fused Triton ops equal their torch definitions (on CPU through Triton's interpreter)."""

import pytest
import torch

import omnistage.kernels.fused as fused

pytest.importorskip("triton")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def force_triton(monkeypatch):
    monkeypatch.setattr(fused, "_use_triton", lambda x: True)


def test_add_rmsnorm(force_triton) -> None:
    x, r = torch.randn(5, 48, device=DEVICE), torch.randn(5, 48, device=DEVICE)
    w = torch.randn(48, device=DEVICE)
    summed = x + r
    expected = w * (summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-6))
    out, res = fused.add_rmsnorm(x, r, w, 1e-6)
    torch.testing.assert_close(res, summed)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    out, res = fused.add_rmsnorm(x, None, w, 1e-6)
    assert res is x
    torch.testing.assert_close(out, w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)), rtol=1e-5, atol=1e-5)


def test_rotary_and_silu_mul(force_triton) -> None:
    q, k = torch.randn(3, 4, 16, device=DEVICE), torch.randn(3, 2, 16, device=DEVICE)
    angles = torch.randn(3, 8, device=DEVICE)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)

    def rotate(x):
        x1, x2 = x.chunk(2, -1)
        return torch.cat((-x2, x1), -1)

    eq, ek = q * cos[:, None] + rotate(q) * sin[:, None], k * cos[:, None] + rotate(k) * sin[:, None]
    gq, gk = fused.apply_rotary(q.clone(), k.clone(), cos, sin)
    torch.testing.assert_close(gq, eq, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gk, ek, rtol=1e-5, atol=1e-5)
    gu = torch.randn(4, 2 * 1500, device=DEVICE)
    torch.testing.assert_close(fused.silu_mul(gu), torch.nn.functional.silu(gu[:, :1500]) * gu[:, 1500:])


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("use_triton", [True, False])
def test_rotary_kv_write(monkeypatch, use_triton: bool, cache_dtype: torch.dtype) -> None:
    """Equals apply_rotary + paged_attention's two index_copy_ writes, on q/k/v as strided views of one qkv
    output (as the fused decoder passes them), with the cast to a cache dtype other than k's."""
    monkeypatch.setattr(fused, "_use_triton", lambda x: use_triton)
    tokens, heads, kv_heads, dim, slots = 5, 4, 2, 16, 24
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, device=DEVICE)
    q, k, v = (x.view(tokens, -1, dim) for x in qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1))
    angles = torch.randn(tokens, dim // 2, device=DEVICE)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    slot_mapping = torch.randperm(slots, device=DEVICE)[:tokens]
    # caches padded past head_dim: their head stride differs from k's, so each tensor's own strides must be used
    k_cache, v_cache = (torch.randn(slots, kv_heads, dim + 8, device=DEVICE).to(cache_dtype)[..., :dim]
                        for _ in range(2))
    expected_k, expected_v = k_cache.clone(), v_cache.clone()

    def rotate(x):
        x1, x2 = x.chunk(2, -1)
        return torch.cat((-x2, x1), -1)

    expected_q = q * cos[:, None] + rotate(q) * sin[:, None]
    expected_k.index_copy_(0, slot_mapping, (k * cos[:, None] + rotate(k) * sin[:, None]).to(cache_dtype))
    expected_v.index_copy_(0, slot_mapping, v.to(cache_dtype))
    got_q = fused.rotary_kv_write(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
    torch.testing.assert_close(got_q, expected_q, rtol=1e-5, atol=1e-5)
    if use_triton:
        assert got_q.data_ptr() == qkv.data_ptr()  # rotated in place
    torch.testing.assert_close(k_cache, expected_k, rtol=1e-5, atol=1e-5)  # other slots untouched too
    torch.testing.assert_close(v_cache, expected_v, rtol=0, atol=0)


@pytest.mark.parametrize("with_update", [True, False])
def test_residual_norm_modulate(force_triton, with_update: bool) -> None:
    h, update = torch.randn(6, 40, device=DEVICE), torch.randn(6, 40, device=DEVICE)
    gate, shift, scale = (torch.randn(40, device=DEVICE) for _ in range(3))
    expected_h = h + gate * update if with_update else h
    normed = (expected_h - expected_h.mean(-1, keepdim=True)) / torch.sqrt(
        expected_h.var(-1, unbiased=False, keepdim=True) + 1e-6)
    got_h, got_x = fused.residual_norm_modulate(h, update if with_update else None, gate if with_update else None,
                                                shift, scale, 1e-6)
    torch.testing.assert_close(got_h, expected_h, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_x, normed * scale + shift, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GELU epilogue is cuBLASLt's (CUDA only)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_gelu_epilogue_is_the_tanh_gelu(dtype: torch.dtype) -> None:
    """The DiT's GELU is the tanh form: the fused matmul must be it (nearer to it than to the exact erf form,
    which differs by up to ~5e-4 where pre-activations are near +-2)."""
    torch.manual_seed(0)
    x, w, b = (torch.randn(*shape, device="cuda", dtype=dtype) for shape in ((300, 256), (512, 256), (512,)))
    x = x * 0.15  # pre-activations of a few units, where the two forms differ most
    pre = torch.nn.functional.linear(x.double(), w.double(), b.double())
    got = fused.linear_gelu_tanh(x, w, b).double()
    tanh_err = (got - torch.nn.functional.gelu(pre, approximate="tanh")).abs().max().item()
    if dtype == torch.bfloat16:
        assert tanh_err < 0.05  # bfloat16 rounding of values up to ~8
    else:
        erf_err = (got - torch.nn.functional.gelu(pre)).abs().max().item()
        assert tanh_err < 1e-4 and tanh_err < erf_err / 4, (tanh_err, erf_err)
