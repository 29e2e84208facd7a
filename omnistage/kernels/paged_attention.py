"""Paged attention in Triton: one kernel for prefill chunks (with cached prefixes) and decodes, plus a
split-K ("flash-decoding") path for small decode batches.

Each program of the main kernel owns one sequence, one tile of its new query tokens and one KV head.
The query heads that share that KV head (GQA) are folded into the tile's rows, so a decode step (one
token) still fills a tensor-core tile, and every K/V block is read once per group instead of once per
query head. K/V are gathered page by page through the block table; softmax is computed online.

At small decode batches that grid is only batch * kv_heads programs, each walking its whole context
serially: at batch 1 a handful of SMs work while the rest idle. Decode steps with too few programs to
fill the GPU instead split each sequence's keys over SPLITS programs, which write partial (max, sum,
unnormalised output) in float32; a second small kernel merges the partials. SPLITS and the grid depend
only on shapes (batch, heads, block-table width) and the SM count, never on the context lengths, so
the launch is the same on every CUDA-graph replay; each program derives its key range at run time.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from omnistage.kernels import pdl


@triton.jit
def _attend_keys(
    q, q_pos, acc, m_i, l_i,  # q: [BLOCK_M, BLOCK_D]; the running softmax state, updated and returned
    K, V, block_tables, seq, kv_head, ctx_len, start_pos, end_pos, scale, window,
    stride_kt, stride_kh, stride_bt,
    BLOCK_N: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Online softmax of q's rows over keys [start_pos, end_pos) of one sequence (start_pos a multiple
    of BLOCK_N), gathered page by page through its block table."""
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    cols = tl.arange(0, BLOCK_N)
    for start in range(start_pos, end_pos, BLOCK_N):
        key_pos = start + cols
        key_ok = key_pos < ctx_len
        kv_off = _kv_offsets(block_tables, seq, kv_head, key_pos, key_ok, stride_kt, stride_kh, stride_bt, PAGE,
                             dims)
        kv_ok = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(K + kv_off, mask=kv_ok, other=0.0)
        v = tl.load(V + kv_off, mask=kv_ok, other=0.0)
        acc, m_i, l_i = _attend_block(q, q_pos, acc, m_i, l_i, k, v, key_pos, key_ok, scale, window, PRECISION)
    return acc, m_i, l_i


@triton.jit
def _kv_offsets(block_tables, seq, kv_head, key_pos, key_ok, stride_kt, stride_kh, stride_bt, PAGE: tl.constexpr,
                dims):
    """[keys, dims] offsets of keys at `key_pos` of one sequence and KV head in the paged cache."""
    page = tl.load(block_tables + seq * stride_bt + key_pos // PAGE, mask=key_ok, other=0)
    slot = page.to(tl.int64) * PAGE + key_pos % PAGE  # int64: large caches overflow int32 offsets
    return slot[:, None] * stride_kt + kv_head * stride_kh + dims[None, :]


@triton.jit
def _attend_block(q, q_pos, acc, m_i, l_i, k, v, key_pos, key_ok, scale, window, PRECISION: tl.constexpr):
    """One block of keys k, values v (at key_pos; key_ok: real keys) into the running softmax state."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    visible = key_ok[None, :] & (key_pos[None, :] <= q_pos[:, None])
    if window > 0:
        visible &= (q_pos[:, None] - key_pos[None, :]) < window
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _paged_attention_kernel(
    Q, K, V, Out,  # Q/Out: [T, H, D]; K/V: [slots, KVH, D]
    block_tables, seq_lens, cu_q,  # [B, max_blocks] int32, [B] int32 or int64, [B + 1] int32
    scale, window,  # window <= 0: no sliding window
    stride_qt, stride_qh, stride_kt, stride_kh, stride_ot, stride_oh, stride_bt,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_Q: tl.constexpr,  # query tokens per tile
    BLOCK_M: tl.constexpr,  # next power of two >= BLOCK_Q * GROUP
    BLOCK_N: tl.constexpr,  # keys per iteration
    PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # next power of two >= HEAD_DIM
    PRECISION: tl.constexpr,  # tl.dot's input precision: "ieee" keeps float32 exact, else "tf32"
    PDL: tl.constexpr,  # launched with programmatic dependent launch (omnistage.kernels.pdl)
):
    pdl.wait_for_inputs(PDL)
    pdl.launch_next(PDL)
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

    last_pos = tl.minimum(ctx_len, ctx_len - q_len + (tile + 1) * BLOCK_Q)  # keys past it are masked for all rows
    first_pos = 0
    if window > 0:
        first_pos = tl.maximum(0, (ctx_len - q_len + tile * BLOCK_Q - window + 1) // BLOCK_N * BLOCK_N)
    acc, m_i, l_i = _attend_keys(
        q, q_pos, tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32), tl.full([BLOCK_M], -1.0e30, dtype=tl.float32),
        tl.zeros([BLOCK_M], dtype=tl.float32), K, V, block_tables, seq, kv_head, ctx_len, first_pos, last_pos,
        scale, window, stride_kt, stride_kh, stride_bt, BLOCK_N, PAGE, HEAD_DIM, BLOCK_D, PRECISION,
    )
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # rows past the query length hold no keys
    o_ptrs = Out + (q_start + token).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit
def _decode_split_kernel(
    Q, K, V, Acc, Max, Sum,  # Q: [T, H, D]; Acc: [B, H, SPLITS, D] f32; Max/Sum: [B, H, SPLITS] f32
    block_tables, seq_lens, cu_q, scale, window, splits,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_bt,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    """One decode token's GROUP query heads against one of `splits` equal, BLOCK_N-aligned slices of
    its visible keys. A slice past the context leaves the neutral partial (sum 0, max -1e30, acc 0).

    The slice's first block of keys and values is read before the PDL wait, all but the newest key: the
    kernel before this one (the QKV GEMM with the rotary, or the rotary's cache write) stores that one; the
    step's metadata and older keys were written by kernels finished before this one launched
    (omnistage/kernels/pdl.py)."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(cu_q + seq)
    if tl.load(cu_q + seq + 1) == q_start:
        return
    ctx_len = tl.load(seq_lens + seq).to(tl.int32)
    lo = 0  # first key any query may see, rounded down to a BLOCK_N boundary
    if window > 0:
        lo = tl.maximum(0, ctx_len - window) // BLOCK_N * BLOCK_N
    per_split = tl.cdiv(tl.cdiv(ctx_len - lo, splits), BLOCK_N) * BLOCK_N
    start = lo + split * per_split
    end = tl.minimum(start + per_split, ctx_len)

    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    key_pos = start + tl.arange(0, BLOCK_N)
    key_ok = key_pos < end
    kv_off = _kv_offsets(block_tables, seq, kv_head, key_pos, key_ok, stride_kt, stride_kh, stride_bt, PAGE, dims)
    older = (key_ok & (key_pos < ctx_len - 1))[:, None] & dim_ok[None, :]
    k = tl.load(K + kv_off, mask=older, other=0.0)
    v = tl.load(V + kv_off, mask=older, other=0.0)
    pdl.wait_for_inputs(PDL)
    newest = (key_ok & (key_pos == ctx_len - 1))[:, None] & dim_ok[None, :]
    k = tl.where(newest, tl.load(K + kv_off, mask=newest, other=0.0), k)
    v = tl.where(newest, tl.load(V + kv_off, mask=newest, other=0.0), v)

    rows = tl.arange(0, BLOCK_M)
    head = kv_head * GROUP + rows
    row_ok = rows < GROUP
    q = tl.load(Q + q_start.to(tl.int64) * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    q_pos = tl.zeros([BLOCK_M], dtype=tl.int32) + ctx_len - 1
    acc, m_i, l_i = _attend_block(
        q, q_pos, tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32), tl.full([BLOCK_M], -1.0e30, dtype=tl.float32),
        tl.zeros([BLOCK_M], dtype=tl.float32), k, v, key_pos, key_ok, scale, window, PRECISION)
    acc, m_i, l_i = _attend_keys(
        q, q_pos, acc, m_i, l_i, K, V, block_tables, seq, kv_head, ctx_len, start + BLOCK_N, end,
        scale, window, stride_kt, stride_kh, stride_bt, BLOCK_N, PAGE, HEAD_DIM, BLOCK_D, PRECISION,
    )
    pdl.launch_next(PDL)
    part = (seq * GROUP * tl.num_programs(1) + head).to(tl.int64) * splits + split  # [B, H, SPLITS] index
    tl.store(Max + part, m_i, mask=row_ok)
    tl.store(Sum + part, l_i, mask=row_ok)
    tl.store(Acc + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit
def _decode_combine_kernel(
    Acc, Max, Sum, Out, cu_q, splits, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr,
):
    """Merge one (sequence, query head)'s partials: rescale each by exp(max - overall max), then divide."""
    pdl.wait_for_inputs(PDL)
    pdl.launch_next(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(cu_q + seq)
    if tl.load(cu_q + seq + 1) == q_start:
        return
    s = tl.arange(0, BLOCK_S)
    s_ok = s < splits
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    part = (seq * tl.num_programs(1) + head).to(tl.int64) * splits + s
    m = tl.load(Max + part, mask=s_ok, other=-1.0e30)
    weight = tl.exp(m - tl.max(m, axis=0))  # an empty split's -1e30 weighs 0 (its sum and acc are 0 anyway)
    total = tl.sum(tl.load(Sum + part, mask=s_ok, other=0.0) * weight, axis=0)
    acc = tl.load(Acc + part[:, None] * HEAD_DIM + dims[None, :], mask=s_ok[:, None] & dim_ok[None, :], other=0.0)
    out = tl.sum(acc * weight[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(Out + q_start.to(tl.int64) * stride_ot + head * stride_oh + dims, out.to(Out.dtype.element_ty),
             mask=dim_ok)


MAX_SPLITS = 32  # at most this many programs per sequence's keys (benchmarks compare other caps)


@functools.cache
def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached: queried once); 1 elsewhere, which disables
    split-K unless asked for explicitly."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def decode_splits(batch: int, kv_heads: int, max_blocks: int, page_size: int, block_n: int, sm_count: int) -> int:
    """How many programs share each decode sequence's keys: the largest power of two that keeps the
    grid within ~4 programs per SM (4 * SMs // (batch * kv_heads)), at most MAX_SPLITS (32), and no more than the
    BLOCK_N chunks the block table can hold. 1 means the grid already fills the GPU: the single-pass
    kernel runs. Only shapes go in, so a CUDA graph's launch suits every replay. With 132 SMs and 4 KV
    heads that is 32, 16, 8, 4, 2 and 1 splits at batch 1, 8, 16, 32, 64 and 128, at or near the best
    power-of-two count at 256 to 2048 keys (benchmarks/kernel_bench.py decode-attention --splits); once the grid fills
    the GPU, splitting only adds the reduction."""
    wanted = max(1, 4 * sm_count // (batch * kv_heads))
    return max(1, min(1 << (wanted.bit_length() - 1), MAX_SPLITS, triton.cdiv(max_blocks * page_size, block_n)))


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
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attention of the packed step's queries over their sequences' paged contexts. Decode-only steps
    (max_query_len 1) take the split-K path when `decode_splits` asks for more than one split;
    `num_splits` overrides that choice (1: always the single-pass kernel), for tests and benchmarks."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    block_q = 1 if max_query_len == 1 else max(1, 64 // group)
    block_m = max(16, triton.next_power_of_2(block_q * group))
    block_n = max(page_size, 64 if max_query_len > 1 else 32)
    block_d = triton.next_power_of_2(head_dim)
    out = torch.empty_like(query)
    # Triton's float32 dots default to TF32; a float32 model gets float32 attention unless torch's matmuls
    # are allowed TF32 too.
    exact = query.dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32
    precision = "ieee" if exact else "tf32"
    batch = block_tables.shape[0]
    window = sliding_window or 0
    launch = pdl.kernel_args(query.device)
    if max_query_len == 1:
        splits = num_splits or decode_splits(
            batch, num_kv_heads, block_tables.shape[1], page_size, block_n, _sm_count(query.device))
        if splits > 1:
            acc = torch.empty(batch, num_heads, splits, head_dim, dtype=torch.float32, device=query.device)
            row_max = torch.empty(batch, num_heads, splits, dtype=torch.float32, device=query.device)
            row_sum = torch.empty_like(row_max)
            _decode_split_kernel[(batch, num_kv_heads, splits)](
                query, k_cache, v_cache, acc, row_max, row_sum, block_tables, seq_lens, cu_seqlens_q,
                scale, window, splits,
                query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1), block_tables.stride(0),
                GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, PAGE=page_size, HEAD_DIM=head_dim,
                BLOCK_D=block_d, PRECISION=precision, **launch,
            )
            _decode_combine_kernel[(batch, num_heads)](
                acc, row_max, row_sum, out, cu_seqlens_q, splits, out.stride(0), out.stride(1),
                HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(splits), **launch,
            )
            return out
    grid = (batch, triton.cdiv(max_query_len, block_q), num_kv_heads)
    _paged_attention_kernel[grid](
        query, k_cache, v_cache, out, block_tables, seq_lens, cu_seqlens_q,
        scale, window,
        query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0),
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n, PAGE=page_size,
        HEAD_DIM=head_dim, BLOCK_D=block_d, PRECISION=precision, **launch,
    )
    return out
