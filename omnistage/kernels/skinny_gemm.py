"""Linear layers for decode batches of a few rows (a "skinny" GEMM: M ≤ 16), on CUDA.

At batch 1 a decode step only streams weights, so a linear layer should run at the memory's bandwidth.
cuBLAS's kernels reached ~60% of it on the talker's shapes (H200 profile) and a layer's output then went
through separate kernels (bias, SiLU-mul, split-K reduce). Here one Triton kernel reads a tile of weight
rows against all (≤ 16, zero-padded) input rows with `tl.dot`, and either

- finishes the rows: bias added, or SiLU(gate) * up for a fused gate-up weight (gate rows then up rows), or
- leaves fp32 partial sums over a slice of K ("split-K"), [splits, M, N]: for tall weights (K ≫ N) too
  few row tiles exist to fill the GPU, so K is cut instead and the consumer sums the slices in a fixed
  order — `add_rmsnorm` takes such partials, so the reduction costs no kernel of its own.

`normed_linear` goes one step further: the add+RMSNorm that feeds a GEMM (a decoder layer's QKV or gate-up)
runs in the GEMM's own programs. Each computes its rows' 1/rms from the whole (tiny) rows, then normalises each
x tile as it loads it; the first program stores the residual stream. The add+RMSNorm kernel and its link in
the chain are gone (`OMNISTAGE_NORM_IN_GEMM=0` keeps them).

A row's result does not depend on how many other rows are in the batch (fixed tiles and order along K).
Elsewhere (CPU, or more rows) the same math runs through torch.

Under programmatic dependent launch (`omnistage.kernels.pdl`) a program lets the next kernel launch once its
K loop is done. (Loading the first weight tile before the wait was slower on an H200: the talker's code 1.343
vs 1.301 ms, run 15c; so was pulling weights into L2 ahead of a GEMM, from earlier kernels or a side stream,
run 17.)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F

from omnistage.kernels import pdl
from omnistage.kernels.fused import add_rmsnorm, silu_mul

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is needed only on CUDA
    triton = None

MAX_ROWS = 16  # tl.dot's smallest M; larger decode batches go to cuBLAS
NORM_IN_GEMM = os.environ.get("OMNISTAGE_NORM_IN_GEMM", "1") != "0"  # normed_linear's fusion (0: add_rmsnorm first)


def _use_triton(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda and x.dim() == 2 and x.shape[0] <= MAX_ROWS


if triton is not None:

    @triton.jit
    def _summed(X, R, offs, ok, stride_xp, DTYPE: tl.constexpr, PARTS: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
        """add_rmsnorm's input at `offs`: a linear's partial sums added in order and rounded (PARTS > 1), plus the
        residual, rounded: the same operations in the same order as `fused._add_rmsnorm_kernel`."""
        x = tl.load(X + offs, mask=ok, other=0.0)
        if PARTS > 1:
            for p in tl.static_range(1, PARTS):
                x += tl.load(X + p * stride_xp + offs, mask=ok, other=0.0)
            x = x.to(DTYPE)
        if HAS_RESIDUAL:
            x = (x + tl.load(R + offs, mask=ok, other=0.0)).to(DTYPE)
        return x

    @triton.jit
    def _skinny_gemm_kernel(X, W, B, Y, M, N, K, stride_xm, stride_wn, stride_ys, stride_ym, k_per_split,
                            R, NW, RES_OUT, stride_xp, eps,
                            HAS_BIAS: tl.constexpr, GATE_UP: tl.constexpr, PARTIAL: tl.constexpr,
                            NORM: tl.constexpr, PARTS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                            STORE_SUM: tl.constexpr, BLOCK_NORM: tl.constexpr,
                            PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        pid_n, split = tl.program_id(0), tl.program_id(1)
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.arange(0, BLOCK_M)
        row_ok, m_ok = rows < N, m < M
        w_rows = W + rows.to(tl.int64)[:, None] * stride_wn
        k_begin = split * k_per_split
        k_end = tl.minimum(k_begin + k_per_split, K)
        pdl.wait_for_inputs(PDL)
        if NORM:  # x = rmsnorm(X (+ R)) * NW: each row's 1/rms first (its whole row at once), then tiles below
            DTYPE: tl.constexpr = NW.dtype.element_ty
            cols = tl.arange(0, BLOCK_NORM)
            rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
            for row in range(0, M):
                summed = _summed(X, R, row * stride_xm + cols, cols < K, stride_xp, DTYPE, PARTS, HAS_RESIDUAL)
                if STORE_SUM:  # the residual stream for the next layer, stored once
                    tl.store(RES_OUT + row * stride_xm + cols, summed, mask=(cols < K) & (pid_n + split == 0))
                xf = summed.to(tl.float32)
                rstd = tl.where(m == row, tl.rsqrt(tl.sum(xf * xf, axis=0) / K + eps), rstd)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if GATE_UP:  # up's rows sit N rows below gate's
            acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(k_begin, k_end, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < k_end
            x_ok = m_ok[:, None] & k_ok[None, :]
            if NORM:
                xf = _summed(X, R, m[:, None] * stride_xm + ks[None, :], x_ok, stride_xp, DTYPE, PARTS,
                             HAS_RESIDUAL).to(tl.float32)
                nw = tl.load(NW + ks, mask=k_ok, other=0.0)
                x = nw[None, :] * (xf * rstd[:, None]).to(DTYPE)
            else:
                x = tl.load(X + m[:, None] * stride_xm + ks[None, :], mask=x_ok, other=0.0)
            w_ok = row_ok[:, None] & k_ok[None, :]
            w = tl.load(w_rows + ks[None, :], mask=w_ok, other=0.0)
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
            if GATE_UP:
                w_up = tl.load(w_rows + N * stride_wn + ks[None, :], mask=w_ok, other=0.0)
                acc_up = tl.dot(x, tl.trans(w_up), acc_up, input_precision=PRECISION)
        pdl.launch_next(PDL)
        out = Y + split * stride_ys + m[:, None] * stride_ym + rows[None, :]
        ok = m_ok[:, None] & row_ok[None, :]
        if PARTIAL:
            tl.store(out, acc, mask=ok)
        else:
            # rounded to the activations' dtype, then stored as Y's (maybe float32)
            dtype = NW.dtype.element_ty if NORM else X.dtype.element_ty
            if HAS_BIAS:
                acc += tl.load(B + rows, mask=row_ok, other=0.0).to(tl.float32)[None, :]
            if GATE_UP:  # rounded where F.silu(gate(x)) * up(x) rounds
                gate = acc.to(dtype).to(tl.float32)
                act = (gate / (1.0 + tl.exp(-gate))).to(dtype)
                tl.store(out, (act * acc_up.to(dtype)).to(Y.dtype.element_ty), mask=ok)
            else:
                tl.store(out, acc.to(dtype).to(Y.dtype.element_ty), mask=ok)


@dataclass(frozen=True)
class Tiling:
    block_n: int
    block_k: int
    splits: int
    num_warps: int = 4
    num_stages: int = 4


@cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # Triton's interpreter (tests on CPU): a small GPU, so tiny shapes still split K


def choose_tiling(n: int, k: int, sms: int, gate_up: bool = False, elem_bytes: int = 2) -> Tiling:
    """Tiles from a sweep on an H200 (benchmarks/skinny_gemm.py --sweep, bf16, one row): 32 weight rows per
    program (64 where 32 would leave a second, nearly empty wave), 32 KB of weights per pipeline stage (8 KB
    per matrix for gate-up's two, and for K < 2048, whose few steps pipeline better short), and K split in
    powers of two while the programs still fit one per SM with every slice at least two steps long. More
    programs than SMs was slower on every split shape: a program's stages in flight keep the memory busy.
    From shapes and SM count only, so a CUDA graph captured once stays valid."""
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


@dataclass(frozen=True)
class Norm:
    """An add+RMSNorm in front of a GEMM (`fused.add_rmsnorm`'s work, done in the GEMM's programs): the GEMM's
    input is rmsnorm(x + residual) * weight, where x may be a linear's fp32 partial sums [splits, M, K]."""
    residual: torch.Tensor | None
    weight: torch.Tensor
    eps: float


def _norm_args(x: torch.Tensor, norm: Norm | None, m: int, k: int) -> tuple[tuple, dict, torch.Tensor | None]:
    """The kernel's norm arguments and constexprs, and the residual stream it stores (None: x itself is it)."""
    if norm is None:
        return (x, x, x, 0, 0.0), dict(NORM=False, PARTS=1, HAS_RESIDUAL=False, STORE_SUM=False, BLOCK_NORM=1), None
    parts = x.shape[0] if x.dim() == 3 else 1
    store_sum = norm.residual is not None or parts > 1
    summed = torch.empty(m, k, dtype=norm.weight.dtype, device=x.device) if store_sum else None
    residual = norm.residual if norm.residual is not None else x
    args = (residual, norm.weight, summed if store_sum else x, m * k if parts > 1 else 0, norm.eps)
    return args, dict(NORM=True, PARTS=parts, HAS_RESIDUAL=norm.residual is not None, STORE_SUM=store_sum,
                      BLOCK_NORM=triton.next_power_of_2(k)), summed


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, n: int, gate_up: bool,
            partial: bool, tiling: Tiling | None, out_dtype: torch.dtype | None = None,
            norm: Norm | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    m, k = x.shape[-2:]
    if x.stride(-1) != 1 or norm is not None:
        x = x.contiguous()  # the norm reads x, the residual and its output with one row stride
    if weight.stride(1) != 1:
        raise ValueError("skinny_gemm: the weight's rows must be contiguous")
    norm_args, norm_consts, summed = _norm_args(x, norm, m, k)
    t = tiling or choose_tiling(n, k, _sm_count(x.device), gate_up, weight.element_size())
    splits = t.splits if partial else 1
    k_per_split = triton.cdiv(triton.cdiv(k, t.block_k), splits) * t.block_k
    splits = triton.cdiv(k, k_per_split)  # no empty slices
    partial = splits > 1
    dtype = norm.weight.dtype if norm is not None else x.dtype
    if partial:
        y = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    else:
        y = torch.empty(m, n, dtype=out_dtype or dtype, device=x.device)
    _skinny_gemm_kernel[(triton.cdiv(n, t.block_n), splits)](
        x, weight, bias if bias is not None else weight, y, m, n, k, x.stride(-2), weight.stride(0),
        m * n if partial else 0, n, k_per_split, *norm_args,
        HAS_BIAS=bias is not None, GATE_UP=gate_up, PARTIAL=partial, **norm_consts,
        PRECISION="ieee" if dtype == torch.float32 else "tf32",
        BLOCK_M=MAX_ROWS, BLOCK_N=t.block_n, BLOCK_K=t.block_k, num_warps=t.num_warps, num_stages=t.num_stages,
        **pdl.kernel_args(x.device),
    )
    return y, summed


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, partial: bool = False,
           tiling: Tiling | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [M, K]. With `partial`, the result may come back as fp32 partial sums
    [splits, M, N] to be summed (in order) by the consumer; `add_rmsnorm` accepts them."""
    if not _use_triton(x):
        return F.linear(x, weight, bias)
    return _launch(x, weight, bias, weight.shape[0], False, partial and bias is None, tiling)[0]


def linear_to_float(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                    tiling: Tiling | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias).float() (an LM head's logits: rounded to x's dtype, handed on as float32),
    with no separate conversion kernel."""
    if not _use_triton(x):
        return F.linear(x, weight, bias).float()
    return _launch(x, weight, bias, weight.shape[0], False, False, tiling, out_dtype=torch.float32)[0]


def gate_up_silu(x: torch.Tensor, gate_up_weight: torch.Tensor, tiling: Tiling | None = None) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T) for a weight of gate rows stacked over up rows, [2I, K] -> [M, I]."""
    n = gate_up_weight.shape[0] // 2
    if not _use_triton(x):
        return silu_mul(F.linear(x, gate_up_weight))
    return _launch(x, gate_up_weight, None, n, True, False, tiling)[0]


def normed_linear(x: torch.Tensor, norm: Norm, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  gate_up: bool = False, tiling: Tiling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(normed, weight, bias) or gate_up_silu(normed, weight), summed) where (normed, summed) =
    add_rmsnorm(x, norm.residual, norm.weight, norm.eps): on CUDA the norm runs inside the GEMM's programs
    (each computes its rows' 1/rms and normalises its tiles; the first stores the residual stream), so it costs
    no kernel of its own. x [M, K] or a linear's partial sums [splits, M, K]."""
    rows = x[0] if x.dim() == 3 else x
    same_dtype = (norm.residual is None or norm.residual.dtype == norm.weight.dtype) and (
        x.dim() == 3 or x.dtype == norm.weight.dtype)
    if not (NORM_IN_GEMM and _use_triton(rows) and same_dtype):
        normed, summed = add_rmsnorm(x, norm.residual, norm.weight, norm.eps)
        y = gate_up_silu(normed, weight, tiling) if gate_up else linear(normed, weight, bias, tiling=tiling)
        return y, summed
    n = weight.shape[0] // 2 if gate_up else weight.shape[0]
    y, summed = _launch(x, weight, bias, n, gate_up, False, tiling, norm=norm)
    return y, summed if summed is not None else x
