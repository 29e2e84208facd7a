"""Paged attention in Triton: one kernel for prefill chunks (with cached prefixes) and decodes.

Each program owns one sequence, one tile of its new query tokens and one KV head. The query
heads that share that KV head (GQA) are folded into the tile's rows, so a decode step (one token)
still fills a tensor-core tile, and every K/V block is read once per group instead of once per
query head. K/V are gathered page by page through the block table; softmax is computed online.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_attention_kernel(
    Q, K, V, Out,  # Q/Out: [T, H, D]; K/V: [slots, KVH, D]
    block_tables, seq_lens, cu_q,  # [B, max_blocks] int32, [B] int32, [B + 1] int32
    scale, window,  # window <= 0: no sliding window
    stride_qt, stride_qh, stride_kt, stride_kh, stride_ot, stride_oh, stride_bt,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_Q: tl.constexpr,  # query tokens per tile
    BLOCK_M: tl.constexpr,  # next power of two >= BLOCK_Q * GROUP
    BLOCK_N: tl.constexpr,  # keys per iteration (a multiple of PAGE)
    PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # next power of two >= HEAD_DIM
    PRECISION: tl.constexpr,  # tl.dot's input precision: "ieee" keeps float32 exact, else "tf32"
):
    seq = tl.program_id(0)
    tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(cu_q + seq)
    q_len = tl.load(cu_q + seq + 1) - q_start
    if tile * BLOCK_Q >= q_len:
        return
    ctx_len = tl.load(seq_lens + seq).to(tl.int32)  # int32 or int64 lengths (graphs keep them int64)

    rows = tl.arange(0, BLOCK_M)
    token = tile * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (token < q_len)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q_ptrs = Q + (q_start + token).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    q_pos = ctx_len - q_len + token  # absolute position of each row's token

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    last_pos = tl.minimum(ctx_len, ctx_len - q_len + (tile + 1) * BLOCK_Q)  # keys past it are masked for all rows
    first_pos = 0
    if window > 0:
        first_pos = tl.maximum(0, (ctx_len - q_len + tile * BLOCK_Q - window + 1) // BLOCK_N * BLOCK_N)
    cols = tl.arange(0, BLOCK_N)
    for start in range(first_pos, last_pos, BLOCK_N):
        key_pos = start + cols
        key_ok = key_pos < ctx_len
        page = tl.load(block_tables + seq * stride_bt + key_pos // PAGE, mask=key_ok, other=0)
        slot = page.to(tl.int64) * PAGE + key_pos % PAGE  # int64: large caches overflow int32 offsets
        kv_off = slot[:, None] * stride_kt + kv_head * stride_kh + dims[None, :]
        k = tl.load(K + kv_off, mask=key_ok[:, None] & dim_ok[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        visible = key_ok[None, :] & (key_pos[None, :] <= q_pos[:, None])
        if window > 0:
            visible &= (q_pos[:, None] - key_pos[None, :]) < window
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(V + kv_off, mask=key_ok[:, None] & dim_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # rows past the query length hold no keys
    o_ptrs = Out + (q_start + token).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def paged_attention_triton(
    query: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [slots, KVH, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    max_query_len: int,
    page_size: int,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    block_q = 1 if max_query_len == 1 else max(1, 64 // group)
    block_m = max(16, triton.next_power_of_2(block_q * group))
    block_n = max(page_size, 64 if max_query_len > 1 else 32)
    out = torch.empty_like(query)
    # Triton's float32 dots default to TF32; a float32 model gets float32 attention unless torch's matmuls
    # are allowed TF32 too.
    exact = query.dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32
    grid = (block_tables.shape[0], triton.cdiv(max_query_len, block_q), num_kv_heads)
    _paged_attention_kernel[grid](
        query, k_cache, v_cache, out, block_tables, seq_lens, cu_seqlens_q,
        scale, sliding_window or 0,
        query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0),
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n, PAGE=page_size,
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        PRECISION="ieee" if exact else "tf32",
    )
    return out
