"""The token2wav DiT's matmuls at streamed-window sizes: cuBLAS (what the solver calls) against a Triton GEMM
swept over tile shapes.

A small window's solve is ~36 passes of 22 layers with four matmuls each, at a few hundred rows: run 23a's
profile put cuBLAS at ~6 µs a matmul (240 x 1024 x 1024-3072), ~2-3x what the weights' read and the FLOPs
need. This probe times each of a layer's matmuls (qkv, o, ff up with its tanh GELU, ff down; bias always) for
row counts of the windows a stream decodes, as a CUDA graph over 22 layers' distinct weights (a pass reads
every layer's weights once, so none stays in L2), and reports cuBLAS and the best Triton tiles. On an H200
(run 27a) cuBLAS won at every shape (the o matmul at 240 rows: 5.4 against 6.0 µs), so the solver keeps it.
`--split-k` sweeps a Triton GEMM that cuts K into slices, each program leaving fp32 partial sums (a consumer
such as the seam's norm kernel can sum them, as the talker's add+RMSNorm does), alone and followed by a kernel
that sums the slices (with bias, GELU): a small window's matmul is a few dozen tiles, each a K loop long.
`--tunableop N` times cuBLAS as the solver calls it against PyTorch's TunableOp choosing among N cuBLASLt
heuristic candidates, with and without an SM carveout; the GPU machine's torch 2.11 has no such candidates on
CUDA, so there TunableOp kept cuBLAS's default at every shape (run 29a).

    python benchmarks/dit_gemm.py --out dit_gemm.jsonl      # GPU
    python benchmarks/dit_gemm.py --split-k --out dit_splitk.jsonl
    python benchmarks/dit_gemm.py --tunableop 32 --rows "48,96,192" --out dit_tunable.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from recording import recorder

from omnistage.families.qwen2_5_omni.models import matmul_sm_carveout
from omnistage.kernels import pdl
from omnistage.kernels.exact_gemm import linear_kernel

LAYERS = 22
# rows = 2 (guided, unguided) x windows x frames; frames = 2 x (window codes + 12 of look-ahead)
ROWS = {"24 codes": 144, "48": 240, "96": 432, "192": 816, "48 x 8": 1920, "48 x 32": 7680}
MATMULS = {"qkv": (3072, 1024, False), "o": (1024, 1024, False), "ff_up": (2048, 1024, True),
           "ff_down": (1024, 2048, False)}


@dataclass(frozen=True)
class Tiles:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3

    def __str__(self) -> str:
        return f"{self.block_m}x{self.block_n}x{self.block_k}/w{self.num_warps}s{self.num_stages}"


@triton.jit
def _split_k_kernel(X, W, P, M, N, K, k_per_split, stride_xm, stride_wn, stride_ps, PRECISION: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One tile's fp32 partial product over one slice of K: P[split, rows, cols]."""
    pid, split = tl.program_id(0), tl.program_id(1)
    tiles_m = tl.cdiv(M, BLOCK_M)
    pid_m, pid_n = pid % tiles_m, pid // tiles_m
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    k_begin = split * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k_end
        x = tl.load(X + rows.to(tl.int64)[:, None] * stride_xm + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        w = tl.load(W + cols.to(tl.int64)[:, None] * stride_wn + ks[None, :], mask=col_ok[:, None] & k_ok[None, :],
                    other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    out = P + split * stride_ps + rows.to(tl.int64)[:, None] * N + cols[None, :]
    tl.store(out, acc, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _preloaded_split_kernel(X, W, P, M, N, K, stride_xm, stride_wn, stride_ps, PRECISION: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """A K slice of BLOCK_K as one tile: the weight tile is read before the PDL wait (weights are never written),
    the input after it; fp32 partials P[split, rows, cols]."""
    pid, split = tl.program_id(0), tl.program_id(1)
    tiles_m = tl.cdiv(M, BLOCK_M)
    pid_m, pid_n = pid % tiles_m, pid // tiles_m
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = split * BLOCK_K + tl.arange(0, BLOCK_K)
    row_ok, col_ok, k_ok = rows < M, cols < N, ks < K
    w = tl.load(W + cols.to(tl.int64)[:, None] * stride_wn + ks[None, :], mask=col_ok[:, None] & k_ok[None, :],
                other=0.0)
    pdl.wait_for_inputs(PDL)
    pdl.launch_next(PDL)
    x = tl.load(X + rows.to(tl.int64)[:, None] * stride_xm + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                other=0.0)
    acc = tl.dot(x, tl.trans(w), input_precision=PRECISION)
    out = P + split * stride_ps + rows.to(tl.int64)[:, None] * N + cols[None, :]
    tl.store(out, acc, mask=row_ok[:, None] & col_ok[None, :])


def preloaded_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, *, tiles: Tiles, pdl_on: bool
                     ) -> torch.Tensor:
    """x @ weight.T as fp32 partials over K slices of tiles.block_k, each program's weight tile read before the
    PDL wait (`pdl_on`: launched with PDL, so that read overlaps the previous kernel)."""
    (m, k), n, t = x.shape, weight.shape[0], tiles
    splits = triton.cdiv(k, t.block_k)
    parts = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n), splits)
    _preloaded_split_kernel[grid](x, weight, parts, m, n, k, x.stride(0), weight.stride(0), parts.stride(0),
                                  PRECISION="tf32", BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
                                  num_warps=t.num_warps, num_stages=1, PDL=pdl_on,
                                  **pdl.launch_options(pdl_on))
    return parts


@triton.jit
def _sum_slices_kernel(P, B, Y, M, N, stride_ps, SPLITS: tl.constexpr, GELU: tl.constexpr, BLOCK: tl.constexpr):
    """Y = sum over slices (in order) + bias, then tanh GELU: what a consumer of the partials would compute."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < M * N
    acc = tl.load(P + offs, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLITS):
        acc += tl.load(P + s * stride_ps + offs, mask=ok, other=0.0)
    acc += tl.load(B + offs % N, mask=ok, other=0.0).to(tl.float32)
    if GELU:
        u = 0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)
        acc = acc * tl.sigmoid(2.0 * u)
    tl.store(Y + offs, acc.to(Y.dtype.element_ty), mask=ok)


def split_k_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, *, gelu: bool, tiles: Tiles,
                   splits: int, reduce: bool) -> torch.Tensor:
    """x @ weight.T over `splits` slices of K: the fp32 partials [splits, M, N], or (`reduce`) summed with the
    bias (and GELU) into x's dtype by a second kernel."""
    (m, k), n, t = x.shape, weight.shape[0], tiles
    per = triton.cdiv(triton.cdiv(k, splits), t.block_k) * t.block_k
    parts = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n), splits)
    _split_k_kernel[grid](x, weight, parts, m, n, k, per, x.stride(0), weight.stride(0), parts.stride(0),
                          PRECISION="tf32", BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
                          num_warps=t.num_warps, num_stages=t.num_stages)
    if not reduce:
        return parts
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block = 2048
    _sum_slices_kernel[(triton.cdiv(m * n, block),)](parts, bias, y, m, n, parts.stride(0), SPLITS=splits,
                                                     GELU=gelu, BLOCK=block)
    return y


def split_k_tiles() -> list[tuple[Tiles, int]]:
    out = []
    for bm, bn, bk, splits in itertools.product((32, 64, 128), (64, 128), (64, 128), (1, 2, 4, 8)):
        if bm == 128 and bn == 128 and bk == 128:
            continue
        out.append((Tiles(bm, bn, bk, 4, 2 if bk == 128 else 3), splits))
    return out


def split_k(args: argparse.Namespace) -> None:
    """Per matmul and window: cuBLAS, then the best split-K tilings leaving partials, and summed by a kernel."""
    record = recorder(args.out)
    candidates = split_k_tiles()
    for name, n, k, gelu, label, m, weights, x in workload(args.rows):
        ref = cublas(x, *weights[0], gelu).float()
        base = graph_us(lambda x, w, b, gelu=gelu: cublas(x, w, b, gelu), weights, x)
        rows = {False: [], True: []}
        for t, splits in candidates:
            if splits > 1 and k // splits < t.block_k:
                continue
            for reduce in (False, True):
                fn = (lambda x, w, b, t=t, s=splits, r=reduce, g=gelu:
                      split_k_linear(x, w, b, gelu=g, tiles=t, splits=s, reduce=r))
                try:
                    out = fn(x, *weights[0])
                    if reduce:
                        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
                    else:
                        plain = out.sum(0) + weights[0][1].float()
                        err = 0.0 if gelu else ((plain - ref).abs().max() / ref.abs().max()).item()
                    us = graph_us(fn, weights, x)
                except Exception as e:  # a tiling the compiler refuses
                    print(f"# {name} {m} {t} s{splits}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    continue
                rows[reduce].append((us, t, splits, err))
        for reduce in (False, True):
            rows[reduce].sort(key=lambda r: r[0])
        preloaded = {False: [], True: []}  # PDL off / on: a chain of 22 such kernels
        for bm, bn, bk, warps in itertools.product((64, 128, 256), (32, 64, 128), (64, 128, 256), (4, 8)):
            if (bm + bn) * bk * 2 > 96 * 1024 or k // bk > 32:
                continue
            t = Tiles(bm, bn, bk, warps, 1)
            for pdl_on in (False, True):
                fn = lambda x, w, b, t=t, p=pdl_on: preloaded_linear(x, w, b, tiles=t, pdl_on=p)  # noqa: E731
                try:
                    plain = fn(x, *weights[0]).sum(0) + weights[0][1].float()
                    err = 0.0 if gelu else ((plain - ref).abs().max() / ref.abs().max()).item()
                    us = graph_us(fn, weights, x)
                except Exception as e:  # a tiling the compiler refuses
                    print(f"# {name} {m} {t} preloaded: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    continue
                preloaded[pdl_on].append((us, t, k // bk, err))
        for pdl_on in (False, True):
            preloaded[pdl_on].sort(key=lambda r: r[0])
        record(part="dit_gemm_split_k", matmul=name, window=label, m=m, n=n, k=k, cublas_us=round(base, 2),
               partials=[{"tiles": str(t), "splits": s, "us": round(us, 2), "rel_err": f"{e:.1e}"}
                         for us, t, s, e in rows[False][:4]],
               summed=[{"tiles": str(t), "splits": s, "us": round(us, 2), "rel_err": f"{e:.1e}"}
                       for us, t, s, e in rows[True][:4]],
               **{f"preloaded_pdl_{'on' if on else 'off'}": [
                   {"tiles": str(t), "splits": s, "us": round(us, 2), "rel_err": f"{e:.1e}"}
                   for us, t, s, e in preloaded[on][:4]] for on in (False, True)})
        print(f"{name:8s} {label:8s} m={m:5d} cuBLAS {base:6.2f} us  partials {rows[False][0][0]:6.2f} "
              f"({rows[False][0][1]} s{rows[False][0][2]})  summed {rows[True][0][0]:6.2f} "
              f"({rows[True][0][1]} s{rows[True][0][2]})  preloaded, PDL off {preloaded[False][0][0]:6.2f} "
              f"on {preloaded[True][0][0]:6.2f} ({preloaded[True][0][1]} s{preloaded[True][0][2]})", flush=True)


def triton_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, *, gelu: bool, tiles: Tiles
                  ) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [M, K] (then tanh GELU with `gelu`), as one Triton kernel."""
    (m, k), n, t = x.shape, weight.shape[0], tiles
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n),)
    linear_kernel[grid](x, weight, bias, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0), HAS_BIAS=True,
                        GELU=gelu, PRECISION="tf32", BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
                        num_warps=t.num_warps, num_stages=t.num_stages)
    return y


def cublas(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, gelu: bool) -> torch.Tensor:
    if gelu:
        return torch._addmm_activation(b, x, w.t(), use_gelu=True)
    return F.linear(x, w, b)


def graph_us(fn, weights, x: torch.Tensor, reps: int = 20) -> float:
    """µs per matmul: a graph of one matmul per layer's weights, replayed `reps` times."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for w, b in weights:
            fn(x, w, b)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for w, b in weights:
            fn(x, w, b)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / len(weights))
    return statistics.median(times)


def candidate_tiles() -> list[Tiles]:
    out = []
    for bm, bn, bk, warps, stages in itertools.product((64, 128), (64, 128, 256), (64, 128), (4, 8), (3, 4)):
        if bm * bk + bn * bk > 128 * 128 + 256 * 64 or (bn == 256 and warps == 4):
            continue  # shared memory per stage past 48 KB, or a 256-wide tile on 4 warps
        out.append(Tiles(bm, bn, bk, warps, stages))
    out += [Tiles(32, bn, bk, 4, 4) for bn in (64, 128) for bk in (64, 128)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--rows", default=",".join(ROWS), help="comma-separated keys of ROWS")
    ap.add_argument("--tunableop", type=int, default=0, metavar="N",
                    help="cuBLAS only: also time each matmul as PyTorch's TunableOp picks it among N cuBLASLt "
                         "heuristic candidates, with and without an SM carveout")
    ap.add_argument("--split-k", action="store_true", help="sweep split-K Triton GEMMs (partials, and summed)")
    args = ap.parse_args()
    if args.split_k:
        return split_k(args)
    if args.tunableop:
        return tunableop(args)
    record = recorder(args.out)
    tiles = candidate_tiles()
    for name, n, k, gelu, label, m, weights, x in workload(args.rows):
        ref = cublas(x, *weights[0], gelu).float()
        base = graph_us(lambda x, w, b, gelu=gelu: cublas(x, w, b, gelu), weights, x)
        results = []
        for t in tiles:
            try:
                out = triton_linear(x, *weights[0], gelu=gelu, tiles=t).float()
                err = ((out - ref).abs().max() / ref.abs().max()).item()
                us = graph_us(lambda x, w, b, t=t, gelu=gelu: triton_linear(x, w, b, gelu=gelu, tiles=t),
                              weights, x)
            except Exception as e:  # a tile shape the compiler refuses (shared memory, registers)
                print(f"# {name} {m} {t}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            results.append((us, t, err))
        results.sort(key=lambda r: r[0])
        record(part="dit_gemm", matmul=name, window=label, m=m, n=n, k=k, cublas_us=round(base, 2),
               best=[{"tiles": str(t), "us": round(us, 2), "rel_err": f"{err:.1e}"} for us, t, err in results[:4]])


def workload(rows: str):
    """(name, n, k, gelu, window label, m, 22 layers' weights, x) for each matmul and each window in `rows`."""
    torch.manual_seed(0)
    dev = torch.device("cuda")
    for name, (n, k, gelu) in MATMULS.items():
        weights = [(torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k ** -0.5,
                    torch.randn(n, device=dev, dtype=torch.bfloat16) * 0.1) for _ in range(LAYERS)]
        for label in rows.split(","):
            m = ROWS[label]
            yield name, n, k, gelu, label, m, weights, torch.randn(m, k, device=dev, dtype=torch.bfloat16)


def with_carveout(sms: int, fn):
    """`fn` with its cuBLAS calls (and their capture) leaving `sms` SMs free, as the solver's small batches do."""
    def run(*a):
        with matmul_sm_carveout(sms):
            return fn(*a)
    return run


def tunableop(args: argparse.Namespace) -> None:
    """cuBLAS as the solver calls it against the algorithm TunableOp picks (tuned eagerly, before capture)."""
    from torch.cuda import tunable
    record = recorder(args.out)
    has_lt = hasattr(tunable, "set_cublaslt_requested_algo_count")
    print(f"# torch {torch.__version__}, cuBLASLt candidates in TunableOp: {has_lt}", flush=True)
    for name, n, k, gelu, label, m, weights, x in workload(args.rows):
        fn = lambda x, w, b, gelu=gelu: cublas(x, w, b, gelu)  # noqa: E731
        ref = fn(x, *weights[0]).float()
        row = {"default_us": graph_us(fn, weights, x),
               "default_carveout32_us": graph_us(with_carveout(32, fn), weights, x)}
        tunable.enable(True)
        tunable.tuning_enable(True)
        if has_lt:
            tunable.set_cublaslt_requested_algo_count(args.tunableop)
        try:
            out = fn(x, *weights[0]).float()  # tunes this shape
            row["tuned_us"] = graph_us(fn, weights, x)
            row["tuned_carveout32_us"] = graph_us(with_carveout(32, fn), weights, x)
            row["tuned_rel_err"] = f"{((out - ref).abs().max() / ref.abs().max()).item():.1e}"
        finally:
            tunable.enable(False)
        record(part="dit_gemm_tunableop", matmul=name, window=label, m=m, n=n, k=k,
               **{key: round(v, 2) if isinstance(v, float) else v for key, v in row.items()})
    record(part="dit_gemm_tunableop", tuned=[list(map(str, r)) for r in tunable.get_results()])  # (op, shape, pick, ms)


if __name__ == "__main__":
    main()
