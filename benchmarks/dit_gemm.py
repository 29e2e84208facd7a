"""The token2wav DiT's matmuls at streamed-window sizes: cuBLAS (what the solver calls) against a Triton GEMM
swept over tile shapes.

A small window's solve is ~36 passes of 22 layers with four matmuls each, at a few hundred rows: run 23a's
profile put cuBLAS at ~6 µs a matmul (240 x 1024 x 1024-3072), ~2-3x what the weights' read and the FLOPs
need. This probe times each of a layer's matmuls (qkv, o, ff up with its tanh GELU, ff down; bias always) for
row counts of the windows a stream decodes, as a CUDA graph over 22 layers' distinct weights (a pass reads
every layer's weights once, so none stays in L2), and reports cuBLAS and the best Triton tiles. On an H200
(run 27a) cuBLAS won at every shape (the o matmul at 240 rows: 5.4 against 6.0 µs), so the solver keeps it.
`--tunableop N` times cuBLAS as the solver calls it against PyTorch's TunableOp choosing among N cuBLASLt
heuristic candidates, with and without an SM carveout; the GPU machine's torch 2.11 has no such candidates on
CUDA, so there TunableOp kept cuBLAS's default at every shape (run 29a).

    python benchmarks/dit_gemm.py --out dit_gemm.jsonl      # GPU
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


def triton_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, *, gelu: bool, tiles: Tiles
                  ) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [M, K] (then tanh GELU with `gelu`), as one Triton kernel."""
    (m, k), n, t = x.shape, weight.shape[0], tiles
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n),)
    _dense_gemm_kernel[grid](x, weight, bias, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0), GELU=gelu,
                             PRECISION="tf32", BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
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
    args = ap.parse_args()
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
