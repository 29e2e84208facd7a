"""Linear layers for decode batches of a few rows (a "skinny" GEMM: M ≤ 16), on CUDA.

At batch 1 a decode step only streams weights, so a linear layer should run at the memory's bandwidth.
cuBLAS's kernels fall well short of it on the talker's shapes and a layer's output then went
through separate kernels (bias, SiLU-mul, split-K reduce). Here one Triton kernel reads a tile of weight
rows against all (≤ 16, zero-padded) input rows with `tl.dot`, and either

- finishes the rows: bias added, or SiLU(gate) * up for a fused gate-up weight (gate rows then up rows), or
- leaves fp32 partial sums over a slice of K ("split-K"), [splits, M, N]: for tall weights (K ≫ N) too
  few row tiles exist to fill the GPU, so K is cut instead and the consumer sums the slices in a fixed
  order — `add_rmsnorm` takes such partials, so the reduction costs no kernel of its own.

A row's result does not depend on how many other rows are in the batch (fixed tiles and order along K).
Elsewhere (CPU, or more rows) the same math runs through torch.

Under programmatic dependent launch (`omnistage.kernels.pdl`) a program lets the next kernel launch once its
K loop is done. Small weights (the talker's qkv and o) skip the loop: each program reads its whole slice of K
before the wait, while the previous kernel finishes (`_preload_tiling`). For larger K none of these pays,
so none is done: loading a K loop's first tile before the wait, a pipeline of register tiles started before
it, pulling weights into L2 ahead of a GEMM from earlier kernels or a side stream, weight tiles through TMA
descriptors, and (worst) fusing the add+RMSNorm that feeds a GEMM into its programs or the whole gated MLP
into one kernel (benchmarks/results/ has the comparisons).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F

from omnistage.kernels import pdl
from omnistage.kernels.fused import rotary_kv_write, silu_mul

try:
    from omnistage.kernels.fused import rotate_half_pair
except ImportError:  # no Triton
    rotate_half_pair = None

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is needed only on CUDA
    triton = None

MAX_ROWS = 16  # tl.dot's smallest M; larger decode batches go to cuBLAS
# Small weights are read whole, one tile per program, before the PDL wait (`_preload_tiling`), up to this many
# bytes a program (8 warps hold them in registers). PRELOAD = False: the K loop after the wait, as
# for larger weights (for comparisons).
PRELOAD = True
PRELOAD_MAX_BYTES = 65536


def _use_triton(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda and x.dim() == 2 and x.shape[0] <= MAX_ROWS


if triton is not None:

    @triton.jit
    def _skinny_gemm_kernel(X, W, B, Y, M, N, K, stride_xm, stride_wn, stride_ys, stride_ym, k_per_split,
                            COS, SIN, SLOTS, KC, VC, stride_c, stride_ct, stride_ch, q_heads, kv_heads,
                            HAS_BIAS: tl.constexpr, GATE_UP: tl.constexpr, PARTIAL: tl.constexpr,
                            PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, PRELOAD: tl.constexpr, ROTARY: tl.constexpr,
                            HEAD_DIM: tl.constexpr, PDL: tl.constexpr):
        pid_n, split = tl.program_id(0), tl.program_id(1)
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.arange(0, BLOCK_M)
        row_ok, m_ok = rows < N, m < M
        if ROTARY:  # row 2p / 2p + 1 of the tile: the first / second half's feature of rotary pair p
            pair, half = rows // 2, HEAD_DIM // 2
            w_index = pair // half * HEAD_DIM + pair % half + rows % 2 * half
        else:
            w_index = rows
        w_rows = W + w_index.to(tl.int64)[:, None] * stride_wn
        k_begin = split * k_per_split
        k_end = tl.minimum(k_begin + k_per_split, K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if GATE_UP:  # up's rows sit N rows below gate's
            acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if PRELOAD:  # the program's whole slice of K is one tile, read before the wait (weights are never written)
            ks = k_begin + tl.arange(0, BLOCK_K)
            k_ok = ks < k_end
            w = tl.load(w_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            pdl.wait_for_inputs(PDL)
            x = tl.load(X + m[:, None] * stride_xm + ks[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        else:
            pdl.wait_for_inputs(PDL)
            for k0 in range(k_begin, k_end, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                k_ok = ks < k_end
                x = tl.load(X + m[:, None] * stride_xm + ks[None, :], mask=m_ok[:, None] & k_ok[None, :],
                            other=0.0)
                w_ok = row_ok[:, None] & k_ok[None, :]
                w = tl.load(w_rows + ks[None, :], mask=w_ok, other=0.0)
                acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
                if GATE_UP:
                    w_up = tl.load(w_rows + N * stride_wn + ks[None, :], mask=w_ok, other=0.0)
                    acc_up = tl.dot(x, tl.trans(w_up), acc_up, input_precision=PRECISION)
        pdl.launch_next(PDL)
        if ROTARY:
            if HAS_BIAS:
                acc += tl.load(B + w_index, mask=row_ok, other=0.0).to(tl.float32)[None, :]
            _rotary_kv_epilogue(acc, Y, COS, SIN, SLOTS, KC, VC, m, M, pid_n, N, stride_ym, stride_c, stride_ct,
                                stride_ch, q_heads, kv_heads, X.dtype.element_ty, BLOCK_M, BLOCK_N, HEAD_DIM)
            return
        out = Y + split * stride_ys + m[:, None] * stride_ym + rows[None, :]
        ok = m_ok[:, None] & row_ok[None, :]
        if PARTIAL:  # a bias rides on the first slice's partials
            if HAS_BIAS:
                acc += tl.load(B + rows, mask=row_ok & (split == 0), other=0.0).to(tl.float32)[None, :]
            tl.store(out, acc, mask=ok)
        else:
            dtype = X.dtype.element_ty  # rounded to the activations' dtype, then stored as Y's (maybe float32)
            if HAS_BIAS:
                acc += tl.load(B + rows, mask=row_ok, other=0.0).to(tl.float32)[None, :]
            if GATE_UP:  # rounded where F.silu(gate(x)) * up(x) rounds
                gate = acc.to(dtype).to(tl.float32)
                act = (gate / (1.0 + tl.exp(-gate))).to(dtype)
                tl.store(out, (act * acc_up.to(dtype)).to(Y.dtype.element_ty), mask=ok)
            else:
                tl.store(out, acc.to(dtype).to(Y.dtype.element_ty), mask=ok)


    @triton.jit
    def _rotary_kv_epilogue(acc, Q, COS, SIN, SLOTS, KC, VC, m, M, pid_n, N, stride_qm, stride_c, stride_ct,
                            stride_ch, q_heads, kv_heads, dtype: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
        """A q/k/v tile of rotary pairs (see ROTARY) finished as `fused.rotary_kv_write` would: rounded to the
        activations' dtype, q and k rotated (in float32, rounded again), q stored at Q [M, q_heads * HEAD_DIM],
        k and v at each row's cache slot."""
        half = HEAD_DIM // 2
        x1, x2 = tl.split(tl.reshape(acc.to(dtype).to(tl.float32), [BLOCK_M, BLOCK_N // 2, 2]))
        pair = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        head, d = pair // half, pair % half
        m_ok = (m < M)[:, None]
        pair_ok = (pair < N // 2)[None, :]
        table = m[:, None] * stride_c + d[None, :]
        cos1 = tl.load(COS + table, mask=m_ok, other=0.0).to(tl.float32)
        cos2 = tl.load(COS + table + half, mask=m_ok, other=0.0).to(tl.float32)
        sin1 = tl.load(SIN + table, mask=m_ok, other=0.0).to(tl.float32)
        sin2 = tl.load(SIN + table + half, mask=m_ok, other=0.0).to(tl.float32)
        is_v = (head >= q_heads + kv_heads)[None, :]
        r1, r2 = rotate_half_pair(x1, x2, cos1, cos2, sin1, sin2)
        y1, y2 = tl.where(is_v, x1, r1).to(dtype), tl.where(is_v, x2, r2).to(dtype)
        is_q = (head < q_heads)[None, :]
        q = Q + m[:, None] * stride_qm + (head * HEAD_DIM + d)[None, :]
        tl.store(q, y1.to(Q.dtype.element_ty), mask=m_ok & pair_ok & is_q)
        tl.store(q + half, y2.to(Q.dtype.element_ty), mask=m_ok & pair_ok & is_q)
        slot = tl.load(SLOTS + m, mask=m < M, other=0).to(tl.int64)
        kv_head = tl.where(is_v, head[None, :] - q_heads - kv_heads, head[None, :] - q_heads)
        cache = slot[:, None] * stride_ct + kv_head * stride_ch + d[None, :]
        is_k = ~is_q & ~is_v & m_ok & pair_ok
        tl.store(KC + cache, y1.to(KC.dtype.element_ty), mask=is_k)
        tl.store(KC + cache + half, y2.to(KC.dtype.element_ty), mask=is_k)
        is_v &= m_ok & pair_ok
        tl.store(VC + cache, y1.to(VC.dtype.element_ty), mask=is_v)
        tl.store(VC + cache + half, y2.to(VC.dtype.element_ty), mask=is_v)


@dataclass(frozen=True)
class Tiling:
    block_n: int
    block_k: int
    splits: int
    num_warps: int = 4
    num_stages: int = 4
    preload: bool = False  # one K tile per program (block_k covers its slice), read before the PDL wait


@cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # Triton's interpreter (tests on CPU): a small GPU, so tiny shapes still split K


def choose_tiling(n: int, k: int, sms: int, gate_up: bool = False, elem_bytes: int = 2,
                  splittable: bool = True) -> Tiling:
    """Tiles from a sweep (benchmarks/kernel_bench.py skinny-gemm --sweep, bf16, one row): 32 weight rows per
    program (64 where 32 would leave a second, nearly empty wave), 32 KB of weights per pipeline stage (8 KB
    per matrix for gate-up's two, and for K < 2048, whose few steps pipeline better short), and K split in
    powers of two while the programs still fit one per SM with every slice at least two steps long. No more
    programs than SMs: a program's stages in flight already keep the memory busy, and programs sized for 2 or
    4 per SM lose, alone and beside token2wav (the talker's down projection too, where they help it alone but
    not in the pipeline). Small weights are read whole instead (`_preload_tiling`). `splittable`: the result
    may come back as split-K partials (the caller sums them; no rotary epilogue); otherwise a split's slices
    would be joined into one.
    From shapes and SM count only, so a CUDA graph captured once stays valid."""
    if PRELOAD and not gate_up:
        preloaded = _preload_tiling(n, k, sms, elem_bytes, splittable)
        if preloaded is not None:
            return preloaded
    block_n = 32
    if not gate_up and sms < triton.cdiv(n, block_n) < 2 * sms:
        block_n = 64  # the thinker's qkv: 144 tiles of 32 on 132 SMs
    stage_bytes = 8192 if gate_up or k < 2048 else 32768  # of each weight matrix read
    block_k = stage_bytes // (block_n * elem_bytes)
    row_tiles, k_steps = triton.cdiv(n, block_n), triton.cdiv(k, block_k)
    splits = 1
    while row_tiles * splits * 2 <= sms and k_steps >= 4 * splits:
        splits *= 2
    return Tiling(block_n, block_k, splits, num_warps=4, num_stages=3 if gate_up else 4)


def _preload_tiling(n: int, k: int, sms: int, elem_bytes: int, splittable: bool) -> Tiling | None:
    """A tiling whose programs each read their whole slice of K in one tile before the PDL wait, so a small
    weight streams while the previous kernel finishes, or None where that does not fit: all row tiles in one
    wave and at most PRELOAD_MAX_BYTES a program. 16 rows a program, K split while the programs still fit the
    GPU; 32 rows (twice the splits) where a split weight's slices of 16 rows would be longer than 512. This
    suits the talker's qkv (2560 x 896, 32 rows, whole K) and o (896 x 1536, 32 rows, 4 slices of 384). A
    weight with more row tiles than one wave (the talker's codec head, 528 tiles of 16) keeps the K loop:
    tiles past the first wave gain nothing from reading early."""
    for block_n in (16, 32):
        tiles = triton.cdiv(n, block_n)
        if tiles > sms:
            continue
        splits = 1
        while splittable and tiles * splits * 2 <= sms and k >= 512 * splits:
            splits *= 2
        block_k = triton.next_power_of_2(triton.cdiv(k, splits))
        if block_n * block_k * elem_bytes > PRELOAD_MAX_BYTES or (splittable and block_n == 16 and block_k > 512):
            continue
        return Tiling(block_n, block_k, splits, num_warps=_preload_warps(block_n, block_k, elem_bytes),
                      num_stages=1, preload=True)
    return None


def _preload_warps(block_n: int, block_k: int, elem_bytes: int) -> int:
    """Warps for a preloaded tile: 8 past 32 KB, so its weights stay in registers."""
    return 8 if block_n * block_k * elem_bytes > 32768 else 4


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, n: int, gate_up: bool,
            partial: bool, tiling: Tiling | None, out_dtype: torch.dtype | None = None,
            rotary: _Rotary | None = None) -> torch.Tensor:
    m, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        raise ValueError("skinny_gemm: the weight's rows must be contiguous")
    t = tiling or choose_tiling(n, k, _sm_count(x.device), gate_up, x.element_size(),
                                splittable=partial and rotary is None)
    if t.preload and gate_up:
        raise ValueError("skinny_gemm: no preloaded tiles for gate-up weights")
    splits = t.splits if partial else 1
    block_k, num_warps = t.block_k, t.num_warps
    if t.preload and block_k * splits < k:  # fewer slices than the tiling's (a bias, say): a wider tile
        block_k = triton.next_power_of_2(triton.cdiv(k, splits))
        num_warps = max(num_warps, _preload_warps(t.block_n, block_k, x.element_size()))
    k_per_split = triton.cdiv(triton.cdiv(k, block_k), splits) * block_k
    splits = triton.cdiv(k, k_per_split)  # no empty slices
    partial = splits > 1
    if partial:
        y = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    elif rotary is not None:  # q only: k and v go to the cache
        y = torch.empty(m, rotary.q_heads * rotary.head_dim, dtype=x.dtype, device=x.device)
    else:
        y = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    r = rotary or _NO_ROTARY
    _skinny_gemm_kernel[(triton.cdiv(n, t.block_n), splits)](
        x, weight, bias if bias is not None else weight, y, m, n, k, x.stride(0), weight.stride(0),
        m * n if partial else 0, y.stride(-2), k_per_split,
        *(r.args or (weight,) * 5), *r.strides, r.q_heads, r.kv_heads,
        HAS_BIAS=bias is not None, GATE_UP=gate_up, PARTIAL=partial, PRELOAD=t.preload,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=MAX_ROWS, BLOCK_N=t.block_n, BLOCK_K=block_k, ROTARY=rotary is not None, HEAD_DIM=r.head_dim,
        num_warps=num_warps, num_stages=t.num_stages, **pdl.kernel_args(x.device),
    )
    return y


@dataclass(frozen=True)
class _Rotary:
    """What the rotary epilogue needs: tables and slots per row, the caches, the head layout."""
    args: tuple[torch.Tensor, ...] | None  # cos, sin [M, head_dim], slots [M], k_cache, v_cache [slots, KVH, D]
    strides: tuple[int, int, int]  # of the tables' rows, of the caches' slots and heads
    q_heads: int
    kv_heads: int
    head_dim: int


_NO_ROTARY = _Rotary(None, (0, 0, 0), 0, 0, 2)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, partial: bool = False,
           tiling: Tiling | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [M, K]. With `partial`, the result may come back as fp32 partial sums
    [splits, M, N] (the bias in the first) to be summed (in order) by the consumer; `add_rmsnorm` accepts them."""
    if not _use_triton(x):
        return F.linear(x, weight, bias)
    return _launch(x, weight, bias, weight.shape[0], False, partial, tiling)


def linear_to_float(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                    tiling: Tiling | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias).float() (an LM head's logits: rounded to x's dtype, handed on as float32),
    with no separate conversion kernel."""
    if not _use_triton(x):
        return F.linear(x, weight, bias).float()
    return _launch(x, weight, bias, weight.shape[0], False, False, tiling, out_dtype=torch.float32)


def gate_up_silu(x: torch.Tensor, gate_up_weight: torch.Tensor, tiling: Tiling | None = None) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T) for a weight of gate rows stacked over up rows, [2I, K] -> [M, I]."""
    n = gate_up_weight.shape[0] // 2
    if not _use_triton(x):
        return silu_mul(F.linear(x, gate_up_weight))
    return _launch(x, gate_up_weight, None, n, True, False, tiling)


def qkv_rotary_kv_write(x: torch.Tensor, qkv_weight: torch.Tensor, qkv_bias: torch.Tensor | None, head_dim: int,
                        q_heads: int, kv_heads: int, cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor,
                        k_cache: torch.Tensor, v_cache: torch.Tensor, *, tiling: Tiling | None = None
                        ) -> torch.Tensor:
    """A fused q/k/v projection ([q; k; v] rows), then `fused.rotary_kv_write`: on CUDA one kernel, whose
    programs each take rows in rotary pairs (feature i of a head with feature i + head_dim / 2, read from the
    weight where they are) and finish them rotated, q to the result and k and v straight to their cache slots.
    x [M, K], cos/sin [M, head_dim], slot_mapping [M], caches [slots, kv_heads, head_dim]. Returns q
    [M, q_heads, head_dim], rotated, rounded where the linear layer and `rotary_kv_write` round."""
    n = qkv_weight.shape[0]
    if n != (q_heads + 2 * kv_heads) * head_dim:
        raise ValueError(f"skinny_gemm: a [q; k; v] weight of {q_heads}+2x{kv_heads} heads of {head_dim} has "
                         f"{(q_heads + 2 * kv_heads) * head_dim} rows, not {n}")
    if not _use_triton(x) or head_dim % 2 or cos.stride(-1) != 1 or sin.stride() != cos.stride():
        q, k, v = F.linear(x, qkv_weight, qkv_bias).split([q_heads * head_dim, kv_heads * head_dim,
                                                           kv_heads * head_dim], dim=-1)
        m = x.shape[0]
        return rotary_kv_write(q.view(m, q_heads, head_dim), k.view(m, kv_heads, head_dim),
                               v.view(m, kv_heads, head_dim), cos, sin, k_cache, v_cache, slot_mapping)
    rotary = _Rotary((cos, sin, slot_mapping, k_cache, v_cache), (cos.stride(0), k_cache.stride(0), k_cache.stride(1)),
                     q_heads, kv_heads, head_dim)
    return _launch(x, qkv_weight, qkv_bias, n, False, False, tiling, rotary=rotary).view(-1, q_heads, head_dim)
