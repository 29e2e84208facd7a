"""The Triton paged-attention kernel equals the portable SDPA path on mixed batches (decodes,
prefill chunks over cached prefixes, GQA, sliding window). On CPU it runs in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch
from triton.runtime import interpreter

from omnistage.engine.ar.attention import KVSpec, PagedKVCache
from omnistage.engine.ar.triton_attention import paged_attention_triton

_patch_tensor = interpreter._patch_lang_tensor


def _patch_tensor_numpy2(tensor, scope):
    """Triton 3.6's interpreter turns 1-element arrays into loop bounds with int(), which
    NumPy >= 2.4 refuses; take the element explicitly (compiled kernels are unaffected)."""
    _patch_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))


interpreter._patch_lang_tensor = _patch_tensor_numpy2


DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def reference(q, k_cache, v_cache, tables, ctx_lens, q_lens, page, scale, window):
    """Per sequence, gather its context and run SDPA with a causal (and window) mask."""
    outs, start = [], 0
    for table, ctx, n in zip(tables, ctx_lens, q_lens, strict=True):
        slots = torch.tensor([table[p // page] * page + p % page for p in range(ctx)], device=q.device)
        k, v = k_cache[slots].transpose(0, 1), v_cache[slots].transpose(0, 1)
        qs = q[start : start + n].transpose(0, 1)
        q_pos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
        k_pos = torch.arange(ctx, device=q.device)[None, :]
        mask = k_pos <= q_pos
        if window:
            mask &= (q_pos - k_pos) < window
        out = torch.nn.functional.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        outs.append(out.transpose(0, 1))
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize(
    "heads, kv_heads, head_dim, window", [(4, 2, 16, None), (7, 1, 32, None), (4, 4, 16, 5), (8, 2, 64, None)]
)
def test_kernel_matches_reference(heads: int, kv_heads: int, head_dim: int, window: int | None) -> None:
    torch.manual_seed(0)
    page, num_blocks = 4, 32
    spec = KVSpec(1, kv_heads, head_dim, torch.float32)
    cache = PagedKVCache(spec, num_blocks, page, DEVICE)
    k_cache, v_cache = cache.layer(0)
    k_cache.normal_()
    v_cache.normal_()
    ctx_lens = [1, 9, 17, 6]  # context after this step, new tokens included
    q_lens = [1, 9, 3, 1]  # a first decode, a whole prompt, a chunk over a cached prefix, a decode
    perm = torch.randperm(num_blocks).tolist()
    tables = [perm[0:1], perm[1:4], perm[4:9], perm[9:11]]
    width = max(len(t) for t in tables)
    q = torch.randn(sum(q_lens), heads, head_dim, device=DEVICE)
    scale = head_dim**-0.5
    got = paged_attention_triton(
        q, k_cache, v_cache,
        torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEVICE),
        torch.tensor(ctx_lens, dtype=torch.int32, device=DEVICE),
        torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE),
        max(q_lens), page, scale, window,
    )
    expected = reference(q, k_cache, v_cache, tables, ctx_lens, q_lens, page, scale, window)
    tol = 1e-4 if DEVICE.type == "cpu" else 2e-2  # on GPUs, fp32 dots run in TF32
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)
