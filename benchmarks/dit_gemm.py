"""The token2wav DiT's matmuls at streamed-window sizes: cuBLAS (what the solver calls) against a Triton GEMM
swept over tile shapes.

A small window's solve is ~36 passes of 22 layers with four matmuls each, at a few hundred rows: run 23a's
profile put cuBLAS at ~6 µs a matmul (240 x 1024 x 1024-3072), ~2-3x what the weights' read and the FLOPs
need. This probe times each of a layer's matmuls (qkv, o, ff up with its tanh GELU, ff down; bias always) for
row counts of the windows a stream decodes, as a CUDA graph over 22 layers' distinct weights (a pass reads
every layer's weights once, so none stays in L2), and reports cuBLAS and the best Triton tiles.

    python benchmarks/dit_gemm.py --out dit_gemm.jsonl      # GPU
"""

from __future__ import annotations

import argparse
import itertools
import statistics

import torch
import torch.nn.functional as F
from recording import recorder

from omnistage.kernels.dense_gemm import Tiles, linear as triton_linear

LAYERS = 22
# rows = 2 (guided, unguided) x windows x frames; frames = 2 x (window codes + 12 of look-ahead)
ROWS = {"24 codes": 144, "48": 240, "96": 432, "192": 816, "48 x 8": 1920, "48 x 32": 7680}
MATMULS = {"qkv": (3072, 1024, False), "o": (1024, 1024, False), "ff_up": (2048, 1024, True),
           "ff_down": (1024, 2048, False)}


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
    args = ap.parse_args()
    record = recorder(args.out)
    torch.manual_seed(0)
    dev = torch.device("cuda")
    tiles = candidate_tiles()
    for name, (n, k, gelu) in MATMULS.items():
        weights = [(torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k ** -0.5,
                    torch.randn(n, device=dev, dtype=torch.bfloat16) * 0.1) for _ in range(LAYERS)]
        for label in args.rows.split(","):
            m = ROWS[label]
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
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
            default = Tiles.for_shape(m, n, k)
            default_us = next((us for us, t, _ in results if t == default), None)
            record(part="dit_gemm", matmul=name, window=label, m=m, n=n, k=k, cublas_us=round(base, 2),
                   default_tiles=str(default), default_us=default_us and round(default_us, 2),
                   best=[{"tiles": str(t), "us": round(us, 2), "rel_err": f"{err:.1e}"} for us, t, err in results[:4]])


if __name__ == "__main__":
    main()
