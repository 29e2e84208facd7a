"""A decode layer's gated MLP at batch ≤ 16, each path timed with the add+RMSNorm that consumes its output:

- `two_kernels`: skinny_gemm's gate-up (+SiLU-mul) then down (split-K partials), as the fused decoder ran it;
- `one_kernel`: skinny_gemm.gated_mlp (both in one kernel, down's shares summed by integer atomics);
- `cublas`: torch's linears and silu_mul.

Released Qwen2.5-Omni talker and thinker sizes. Weights are cycled over enough copies to exceed the L2 cache and
each measurement is a CUDA graph of 24 calls replayed (benchmarks/graph_timing.py). `--sweep` also times a grid
of `MlpTiling`s at M=1.

    python benchmarks/gated_mlp.py --out mlp.jsonl              # GPU
    python benchmarks/gated_mlp.py --sweep --only talker --out mlp.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
from graph_timing import time_graph

from omnistage.kernels import skinny_gemm as skinny
from omnistage.kernels.fused import add_rmsnorm, silu_mul

SHAPES = {"talker": (896, 18944), "thinker": (3584, 18944)}  # hidden, intermediate
CALLS = 24


def make_op(path: str, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, acc: torch.Tensor,
            residual: torch.Tensor, norm_w: torch.Tensor, tiling: skinny.MlpTiling | None):
    if path == "cublas":
        return lambda: add_rmsnorm(F.linear(silu_mul(F.linear(x, gate_up)), down), residual, norm_w, 1e-6)
    if path == "two_kernels":
        return lambda: add_rmsnorm(skinny.linear(skinny.gate_up_silu(x, gate_up), down, partial=True), residual,
                                   norm_w, 1e-6)
    return lambda: add_rmsnorm(skinny.gated_mlp(x, gate_up, down, acc, tiling), residual, norm_w, 1e-6)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--only", default="talker,thinker")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    out = open(args.out, "a") if args.out else None

    def emit(row: dict) -> None:
        print(json.dumps(row), flush=True)
        if out:
            out.write(json.dumps(row) + "\n")
            out.flush()

    for model in args.only.split(","):
        run_model(model, args, emit)
        torch.cuda.empty_cache()


def run_model(model: str, args: argparse.Namespace, emit) -> None:
    dev = torch.device("cuda")
    hidden, inter = SHAPES[model]
    size = 3 * hidden * inter * 2
    copies = min(CALLS, max(2, -(-300_000_000 // size)))
    weights = [(torch.randn(2 * inter, hidden, device=dev, dtype=torch.bfloat16) * 0.02,
                torch.randn(hidden, inter, device=dev, dtype=torch.bfloat16) * 0.02) for _ in range(copies)]
    acc = torch.zeros(skinny.MAX_ROWS, hidden, dtype=torch.int64, device=dev)
    norm_w = torch.ones(hidden, device=dev, dtype=torch.bfloat16)

    def timed(path: str, m: int, tiling: skinny.MlpTiling | None = None) -> float:
        x = torch.randn(m, hidden, device=dev, dtype=torch.bfloat16)
        residual = torch.randn(m, hidden, device=dev, dtype=torch.bfloat16)
        return time_graph([make_op(path, x, *weights[i % copies], acc, residual, norm_w, tiling)
                           for i in range(CALLS)])

    best = None
    if args.sweep:
        results = []
        for sl, bk, bn, warps, stages in itertools.product((64, 128, 256), (64, 128), (64, 128), (4, 8), (2, 3)):
            t = skinny.MlpTiling(sl, bk, bn, warps, stages)
            try:
                us = timed("one_kernel", 1, t)
            except Exception as exc:  # past the shared memory, say
                emit({"model": model, "tiling": t.__dict__, "error": str(exc)[:120]})
                continue
            results.append((us, t))
            emit({"model": model, "rows": 1, "tiling": t.__dict__, "us": round(us, 2), "sweep": True})
        results.sort(key=lambda r: r[0])
        best = results[0][1]
        emit({"model": model, "summary": "sweep", "best": [(round(us, 2), t.__dict__) for us, t in results[:6]]})
    for m in (int(r) for r in args.rows.split(",")):
        row = {"model": model, "rows": m, "weight_mb": round(size / 1e6, 1)}
        for path in ("cublas", "two_kernels", "one_kernel"):
            row[f"{path}_us"] = round(timed(path, m), 2)
        if best is not None:
            row["best"], row["best_us"] = best.__dict__, round(timed("one_kernel", m, best), 2)
        x = torch.randn(m, hidden, device=dev, dtype=torch.bfloat16)
        residual = torch.randn(m, hidden, device=dev, dtype=torch.bfloat16)
        want = make_op("cublas", x, *weights[0], acc, residual, norm_w, None)()[1].float()
        got = make_op("one_kernel", x, *weights[0], acc, residual, norm_w, best)()[1].float()
        row["rel_err"] = round(((got - want).abs().max() / want.abs().max()).item(), 5)
        row["tb_s"] = round(size / row["one_kernel_us"] / 1e6, 2)
        emit(row)


if __name__ == "__main__":
    main()
