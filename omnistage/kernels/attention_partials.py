"""Split decode attention's partial results, and their merge.

At small decode batches each sequence's keys are split over several programs ("flash-decoding",
engine/ar/triton_attention.py); each leaves a partial (max, sum, unnormalised output) per query head.
Merging them is a kernel of its own, `merge()`, or happens inside the consumer: the O projection's skinny GEMM
merges the heads of its slice of K as it loads its input (`merged_tile`), one kernel fewer per layer. Both merge
with the same arithmetic in the same order, so they give the same bits.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from omnistage.kernels import pdl

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is needed only on CUDA
    triton = None

# OMNISTAGE_MERGE_IN_GEMM=0: always merge in a kernel of its own (for comparisons)
MERGE_IN_GEMM = os.environ.get("OMNISTAGE_MERGE_IN_GEMM", "1") != "0"


@dataclass
class SplitPartials:
    """One decode token per sequence (token t is sequence t), `splits` partials per (sequence, query head):
    acc [T, H, splits, D] float32, row_max and row_sum [T, H, splits]. `dtype`: the merged output's."""

    acc: torch.Tensor
    row_max: torch.Tensor
    row_sum: torch.Tensor
    dtype: torch.dtype

    @property
    def num_tokens(self) -> int:
        return self.acc.shape[0]

    @property
    def splits(self) -> int:
        return self.acc.shape[2]

    @property
    def head_dim(self) -> int:
        return self.acc.shape[3]

    def merge(self) -> torch.Tensor:
        """The attention output [T, H * D] in `dtype`."""
        t, heads, splits, d = self.acc.shape
        out = torch.empty(t, heads * d, dtype=self.dtype, device=self.acc.device)
        _merge_kernel[(t, heads)](self.acc, self.row_max, self.row_sum, out, heads, out.stride(0), SPLITS=splits,
                                  HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d), **pdl.kernel_args(out.device))
        return out


if triton is not None:

    @triton.jit
    def merged_head(Acc, Max, Sum, part, dims, valid, SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr):
        """One (token, head)'s output [len(dims)], its partials at index `part` on (invalid: zeros). Each split
        weighs exp(its max - the largest max); unrolled, so every load is issued before any arithmetic, and
        summed in split order (an empty split, max -1e30 and sum 0, weighs nothing)."""
        ok = valid & (dims < HEAD_DIM)
        top = -1.0e30
        for s in tl.static_range(SPLITS):
            top = tl.maximum(top, tl.load(Max + part + s, mask=valid, other=-1.0e30))
        total = 0.0
        acc = tl.zeros(dims.shape, tl.float32)
        for s in tl.static_range(SPLITS):
            weight = tl.exp(tl.load(Max + part + s, mask=valid, other=-1.0e30) - top)
            total += tl.load(Sum + part + s, mask=valid, other=0.0) * weight
            acc += tl.load(Acc + (part + s) * HEAD_DIM + dims, mask=ok, other=0.0) * weight
        return acc / tl.where(total > 0, total, 1.0)

    @triton.jit
    def merged_tile(Acc, Max, Sum, k0, K, rows, heads, SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_K: tl.constexpr):
        """Columns k0 .. k0 + BLOCK_K of the merged output [T, H * D] (k0 a multiple of HEAD_DIM, BLOCK_K of
        HEAD_DIM, columns past K zero) for tokens 0 .. rows - 1 (at most 16): a float32 [16, BLOCK_K] tile
        whose other rows are 0 (a skinny GEMM's input tile)."""
        HEADS: tl.constexpr = BLOCK_K // HEAD_DIM
        m = tl.arange(0, 16)[:, None, None]
        slot = tl.arange(0, HEADS)[None, :, None]
        dims = tl.arange(0, HEAD_DIM)
        x = tl.zeros([16, HEADS, HEAD_DIM], dtype=tl.float32)
        for j in tl.static_range(HEADS):
            head = k0 // HEAD_DIM + j
            for r in range(0, rows):
                row = merged_head(Acc, Max, Sum, (r * heads + head).to(tl.int64) * SPLITS, dims,
                                  head * HEAD_DIM < K, SPLITS, HEAD_DIM)
                x = tl.where((m == r) & (slot == j), row[None, None, :], x)
        return tl.reshape(x, [16, BLOCK_K])

    @triton.jit
    def _merge_kernel(Acc, Max, Sum, Out, heads, stride_ot, SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr,
                      BLOCK_D: tl.constexpr, PDL: tl.constexpr):
        """One (token, query head)'s partials merged (`merged_head`)."""
        pdl.wait_for_inputs(PDL)
        pdl.launch_next(PDL)
        token, head = tl.program_id(0), tl.program_id(1)
        dims = tl.arange(0, BLOCK_D)
        out = merged_head(Acc, Max, Sum, (token * heads + head).to(tl.int64) * SPLITS, dims, True, SPLITS,
                          HEAD_DIM)
        tl.store(Out + token.to(tl.int64) * stride_ot + head * HEAD_DIM + dims, out.to(Out.dtype.element_ty),
                 mask=dims < HEAD_DIM)
