"""A plain Triton GEMM with a bias (and optionally tanh GELU) epilogue, for matmuls of a few hundred to a few
thousand rows: the token2wav DiT's layers at streamed-window sizes, where cuBLAS's choice of tiles left most
SMs idle (run 23a: ~6 µs a matmul at 240 x 1024 x 1024-3072).

Output rows do not depend on other rows (fixed tiles, fixed order along K). Off CUDA the same math runs
through torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is needed only on CUDA
    triton = None


def _use_triton(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda and x.dim() == 2


@dataclass(frozen=True)
class Tiles:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3

    @staticmethod
    def for_shape(m: int, n: int, k: int) -> Tiles:
        """64 x 128 tiles in 64-wide steps of K: at 240 rows and N 1024-3072, 64-192 programs."""
        return Tiles(64, 128, 64, 4, 3)

    def __str__(self) -> str:
        return f"{self.block_m}x{self.block_n}x{self.block_k}/w{self.num_warps}s{self.num_stages}"


if triton is not None:

    @triton.jit
    def _dense_gemm_kernel(X, W, B, Y, M, N, K, stride_xm, stride_wn, stride_ym, GELU: tl.constexpr,
                           PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # consecutive programs take consecutive row tiles of one column tile: they share its weight in L2
        pid = tl.program_id(0)
        tiles_m = tl.cdiv(M, BLOCK_M)
        pid_m, pid_n = pid % tiles_m, pid // tiles_m
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        x_ptrs = X + rows.to(tl.int64)[:, None] * stride_xm + ks[None, :]
        w_ptrs = W + cols.to(tl.int64)[:, None] * stride_wn + ks[None, :]
        row_ok, col_ok = rows < M, cols < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + ks) < K
            x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        acc += tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if GELU:  # tanh form: 0.5 z (1 + tanh(u)), tanh(u) = 2 sigmoid(2u) - 1
            u = 0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)
            acc = acc * tl.sigmoid(2.0 * u)
        out = Y + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :]
        tl.store(out, acc.to(Y.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, *, gelu: bool = False,
           tiles: Tiles | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [M, K] (then tanh GELU with `gelu`), as one Triton kernel on CUDA."""
    if not _use_triton(x):
        y = F.linear(x, weight, bias)
        return F.gelu(y, approximate="tanh") if gelu else y
    m, k = x.shape
    n = weight.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        raise ValueError("dense_gemm: the weight's rows must be contiguous")
    t = tiles or Tiles.for_shape(m, n, k)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n),)
    _dense_gemm_kernel[grid](x, weight, bias, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0), GELU=gelu,
                             PRECISION="ieee" if x.dtype == torch.float32 else "tf32", BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, num_warps=t.num_warps,
                             num_stages=t.num_stages)
    return y
