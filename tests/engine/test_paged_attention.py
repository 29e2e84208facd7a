"""The Triton paged-attention kernels equal the portable SDPA path: the single-pass kernel on mixed batches
(decodes, prefill chunks over cached prefixes, GQA, sliding window), the split-K path on decode-only batches.
On CPU they run in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch
from triton.runtime import interpreter

from omnistage.engine.ar.attention import KVSpec, PagedKVCache
from omnistage.kernels import paged_attention as triton_attention
from omnistage.kernels.paged_attention import decode_splits, paged_attention_triton

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


class _GridSpy:
    """Stands in for a kernel: records each launch's grid, then launches."""

    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


def _decode_inputs(heads: int, kv_heads: int, head_dim: int, ctx_lens: list[int], page: int = 4):
    """A decode-only step: one new token per sequence, contexts on shuffled pages of a fresh cache."""
    torch.manual_seed(0)
    needed = [-(-ctx // page) for ctx in ctx_lens]
    num_blocks = sum(needed) + 2
    cache = PagedKVCache(KVSpec(1, kv_heads, head_dim, torch.float32), num_blocks, page, DEVICE)
    k_cache, v_cache = cache.layer(0)
    k_cache.normal_()
    v_cache.normal_()
    perm, tables = torch.randperm(num_blocks).tolist(), []
    for n in needed:
        tables.append(perm[:n])
        perm = perm[n:]
    width = max(needed) + 1  # a spare column, as the graph buffers' fixed width leaves
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(ctx_lens), heads, head_dim, device=DEVICE)
    cu_q = torch.arange(len(ctx_lens) + 1, dtype=torch.int32, device=DEVICE)
    return q, k_cache, v_cache, tables, block_tables, cu_q


@pytest.mark.parametrize(
    "heads, kv_heads, head_dim, window, ctx_lens, splits, lens_dtype",
    [
        (4, 2, 16, None, [101], 4, torch.int32),  # batch 1: every split holds keys, the last a partial page
        (4, 2, 16, None, [1, 37, 70, 101, 6], 4, torch.int64),  # a first decode; short contexts leave splits empty
        (7, 1, 32, None, [45, 3, 64], 3, torch.int32),  # GQA group of 7, a split count that is no power of two
        (4, 4, 16, 40, [101, 20, 77], 4, torch.int64),  # sliding window: splits cover only the visible keys
        (8, 2, 64, 5, [101, 9], 2, torch.int32),  # a window shorter than one BLOCK_N, far from key 0
        # slices of several blocks: the newest key in a later block, or in the first (read after the wait)
        (4, 2, 16, None, [300, 161, 129, 33], 2, torch.int32),
    ],
)
def test_split_decode_matches_reference(
    monkeypatch: pytest.MonkeyPatch, heads: int, kv_heads: int, head_dim: int, window: int | None,
    ctx_lens: list[int], splits: int, lens_dtype: torch.dtype,
) -> None:
    """The split-K decode path (forced to `splits` programs per sequence) equals SDPA and the single-pass kernel."""
    spy = _GridSpy(triton_attention._decode_split_kernel)
    monkeypatch.setattr(triton_attention, "_decode_split_kernel", spy)
    page = 4
    q, k_cache, v_cache, tables, block_tables, cu_q = _decode_inputs(heads, kv_heads, head_dim, ctx_lens, page)
    seq_lens = torch.tensor(ctx_lens, dtype=lens_dtype, device=DEVICE)
    scale = head_dim**-0.5
    run = lambda n: paged_attention_triton(  # noqa: E731
        q, k_cache, v_cache, block_tables, seq_lens, cu_q, 1, page, scale, window, num_splits=n)
    got, single = run(splits), run(1)
    assert spy.grids == [(len(ctx_lens), kv_heads, splits)]  # the split path ran, once
    expected = reference(q, k_cache, v_cache, tables, ctx_lens, [1] * len(ctx_lens), page, scale, window)
    tol = 1e-4 if DEVICE.type == "cpu" else 2e-2
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)
    torch.testing.assert_close(got, single, rtol=tol, atol=tol)


def test_decode_splits_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """The largest power of two keeping ~4 programs per SM, capped at 32 and by the table's BLOCK_N chunks;
    none once the grid fills the GPU. Only shapes go in: a graph replays the same launch for any lengths."""
    h200 = [decode_splits(batch, 4, 2048, 16, 32, 132) for batch in (1, 8, 16, 32, 64, 128, 256)]
    assert h200 == [32, 16, 8, 4, 2, 1, 1]
    assert decode_splits(1, 4, 5, 16, 32, 132) == 3  # 80 keys at most: three chunks of 32
    assert decode_splits(1, 4, 2048, 16, 32, 1) == 1  # no SM count (CPU): single pass
    monkeypatch.setattr(triton_attention, "MAX_SPLITS", 8)
    assert [decode_splits(batch, 4, 2048, 16, 32, 132) for batch in (1, 8, 16, 32)] == [8, 8, 8, 4]
