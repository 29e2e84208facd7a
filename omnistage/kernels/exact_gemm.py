"""float32 linear layers on tensor cores, as exact as float32 on CUDA cores ("3xTF32"), on CUDA.

Strict float32 matmuls (torch's default: no TF32) run on CUDA cores at a fraction of the tensor cores' rate, so
a float32 model's large matmuls are compute-bound there. TF32 tensor cores are fast but keep 10 bits of each
operand's mantissa. Here each float32 operand is split into its TF32 rounding and the TF32 rounding of what
that leaves out, and three tensor-core products (high x high, high x low, low x high; low x low falls below
float32's resolution) accumulate in float32: Triton's `tl.dot(..., input_precision="tf32x3")`.

On token2wav's DiT matmuls this comes out closer to a float64 product than cuBLAS's strict float32, and
faster; plain TF32 is faster again, for those who accept its rounding (benchmarks/results/ has the figures).

`exact_linear` is used where torch would run strict float32 on CUDA (float32 input, TF32 matmuls not allowed);
`ENABLED = False` keeps cuBLAS there (benchmarks compare). Tiles are fixed by the shape (no autotuning:
kernels are captured into CUDA graphs), and a row's result does not depend on the other rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from omnistage.kernels.fused import linear_gelu_tanh

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is needed only on CUDA
    triton = None

ENABLED = True  # False keeps cuBLAS there (benchmarks compare with it)


def exact_applies(x: torch.Tensor) -> bool:
    """Whether torch would multiply `x` in strict float32 on CUDA cores, where `exact_linear` is faster."""
    return (ENABLED and triton is not None and x.is_cuda and x.dtype == torch.float32
            and not torch.backends.cuda.matmul.allow_tf32)


def exact_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 gelu: bool = False) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T + bias [N] in float32 on 3xTF32 tensor cores; `gelu`: then GELU's tanh form
    (as F.gelu(..., approximate="tanh"))."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    (m, k), n = x.shape, weight.shape[0]
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    y = torch.empty(m, n, dtype=torch.float32, device=x.device)
    block_m, block_n, block_k, warps, stages = _tiles(m, n)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    linear_kernel[grid](x, weight, bias if bias is not None else weight, y, m, n, k, x.stride(0), weight.stride(0),
                        y.stride(0), HAS_BIAS=bias is not None, GELU=gelu, PRECISION="tf32x3", BLOCK_M=block_m,
                        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages)
    return y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, gelu: bool = False) -> torch.Tensor:
    """A linear layer (GELU's tanh form after it with `gelu`): `exact_linear` where it applies, else torch's
    (`linear_gelu_tanh` with `gelu`)."""
    if x.dim() == 2 and exact_applies(x):
        return exact_linear(x, weight, bias, gelu)
    return linear_gelu_tanh(x, weight, bias) if gelu else F.linear(x, weight, bias)


def _tiles(m: int, n: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) by shape, from a sweep of token2wav's DiT matmuls: narrow
    tiles where few rows and columns would leave SMs idle, wider ones for large batches."""
    if m <= 256 and n <= 1024:
        return 32, 64, 32, 4, 4
    if m <= 1024:
        return 64, 64, 64, 4, 3
    return 128, 64, 32, 4, 3


if triton is not None:

    @triton.jit
    def linear_kernel(X, W, B, Y, M, N, K, stride_xm, stride_wn, stride_ym, HAS_BIAS: tl.constexpr,
                      GELU: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):
        """Y = X @ W.T (+ B) (then GELU's tanh form), one output tile a program, accumulated in float32 with
        `tl.dot`'s `input_precision` PRECISION."""
        # consecutive programs take consecutive row tiles of one column tile: they share its weights in L2
        pid = tl.program_id(0)
        tiles_m = tl.cdiv(M, BLOCK_M)
        pid_m, pid_n = pid % tiles_m, pid // tiles_m
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        row_ok, col_ok = rows < M, cols < N
        x_ptrs = X + rows.to(tl.int64)[:, None] * stride_xm + ks[None, :]
        w_ptrs = W + cols.to(tl.int64)[:, None] * stride_wn + ks[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + ks) < K
            x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if HAS_BIAS:
            acc += tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if GELU:  # 0.5 z (1 + tanh(u)) = z sigmoid(2u), u = sqrt(2 / pi) (z + 0.044715 z^3)
            u = 0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)
            acc = acc * tl.sigmoid(2.0 * u)
        out = Y + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :]
        tl.store(out, acc.to(Y.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
