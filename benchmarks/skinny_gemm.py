"""Skinny GEMMs (decode batches of ≤ 16 rows): omnistage's Triton kernels vs cuBLAS, per linear layer of the
Qwen2.5-Omni talker and thinker, each timed with the op that consumes its output (as the fused decoder runs
them): qkv (+bias), o (+add+RMSNorm), gate-up (+SiLU-mul), down (+add+RMSNorm); and the talker's input
projection (+bias) and both LM heads (logits handed on as float32).

Weights are cycled over enough copies to exceed the L2 cache (a decode step never finds a layer's weights
there), and each measurement is a CUDA graph of 24 calls replayed, as a decode step runs. `--sweep` times
every tiling of a grid at M=1 and reports the best beside the built-in choice (`choose_tiling`). `--pdl on,off`
times the Triton kernels with and without programmatic dependent launch (omnistage/kernels/pdl.py). For K up to
`--preload-max-k` the sweep adds tilings that read a program's whole slice of K before the PDL wait
(`--preload-only`: only those); OMNISTAGE_SKINNY_PRELOAD=0 makes the built-in choice the K loop again.

    python benchmarks/skinny_gemm.py --out skinny.jsonl            # GPU: built-in choice vs cuBLAS, M=1,2,4,8,16
    python benchmarks/skinny_gemm.py --sweep --out sweep.jsonl     # GPU: also the tiling grid at M=1
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
import triton
from graph_timing import time_graph

from omnistage.kernels import pdl
from omnistage.kernels import skinny_gemm as skinny
from omnistage.kernels.fused import add_rmsnorm, silu_mul

# (model, op, N, K, bias): the released sizes
SHAPES = [
    ("talker", "qkv", 2560, 896, True), ("talker", "o", 896, 1536, False),  # 12 heads, 4 KV heads of 128
    ("talker", "gate_up", 2 * 18944, 896, False), ("talker", "down", 896, 18944, False),
    ("thinker", "qkv", 4608, 3584, True), ("thinker", "o", 3584, 3584, False),
    ("thinker", "gate_up", 2 * 18944, 3584, False), ("thinker", "down", 3584, 18944, False),
    ("talker", "input_proj", 896, 3584, True), ("talker", "head", 8448, 896, False),
    ("thinker", "head", 152064, 3584, False),
]
CALLS = 24


def make_op(op: str, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, norm_w: torch.Tensor,
            residual: torch.Tensor, tiling: skinny.Tiling | None):
    """The layer op and its consumer; tiling None = cuBLAS (torch) path."""
    if op == "head":  # logits handed on as float32
        if tiling is None:
            return lambda: F.linear(x, w).float()
        return lambda: skinny.linear_to_float(x, w, tiling=tiling)
    if op in ("qkv", "input_proj"):
        if tiling is None:
            return lambda: F.linear(x, w, b)
        return lambda: skinny.linear(x, w, b, tiling=tiling)
    if op == "gate_up":
        if tiling is None:
            return lambda: silu_mul(F.linear(x, w))
        return lambda: skinny.gate_up_silu(x, w, tiling=tiling)
    if tiling is None:
        return lambda: add_rmsnorm(F.linear(x, w), residual, norm_w, 1e-6)
    return lambda: add_rmsnorm(skinny.linear(x, w, partial=True, tiling=tiling), residual, norm_w, 1e-6)


def op_inputs(op: str, n: int, k: int, bias: bool, m: int, dev: torch.device) -> tuple:
    """(x, bias, norm weight, residual) for `m` rows of a layer op with an [n, k] weight."""
    width = n // 2 if op == "gate_up" else n
    return (torch.randn(m, k, device=dev, dtype=torch.bfloat16),
            torch.randn(n, device=dev, dtype=torch.bfloat16) if bias else None,
            torch.ones(width, device=dev, dtype=torch.bfloat16),
            torch.randn(m, width, device=dev, dtype=torch.bfloat16))


def time_op(op: str, n: int, k: int, bias: bool, m: int, tiling: skinny.Tiling | None, weights: list) -> float:
    """Microseconds per call: a graph of CALLS calls over distinct weight copies, replayed."""
    x, b, norm_w, residual = op_inputs(op, n, k, bias, m, weights[0].device)
    return time_graph([make_op(op, x, weights[i % len(weights)], b, norm_w, residual, tiling) for i in range(CALLS)])


def check(op: str, n: int, k: int, bias: bool, m: int, tiling: skinny.Tiling | None, w: torch.Tensor) -> float:
    """Largest difference from cuBLAS's result, relative to its largest magnitude (bf16: ~1e-2 expected)."""
    x, b, norm_w, residual = op_inputs(op, n, k, bias, m, w.device)
    want = make_op(op, x, w, b, norm_w, residual, None)()
    got = make_op(op, x, w, b, norm_w, residual, tiling)()
    want, got = (want[0], got[0]) if isinstance(want, tuple) else (want, got)
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--only", default="", help="comma list of model.op to run, e.g. talker.down")
    ints = lambda text: [int(v) for v in text.split(",")]  # noqa: E731
    ap.add_argument("--warps", type=ints, default=[4, 8], help="num_warps values the sweep tries, e.g. 4,8")
    ap.add_argument("--stages", type=ints, default=[3, 4], help="num_stages values the sweep tries, e.g. 3,4")
    ap.add_argument("--preload-only", action="store_true", help="sweep only preloaded tilings where K allows them")
    ap.add_argument("--preload-max-k", type=int, default=2048, help="sweep preloaded tilings for K up to this")
    ap.add_argument("--block-n", type=ints, default=[16, 32, 64], help="block_n values the sweep tries")
    ap.add_argument("--pdl", default="on", help="programmatic dependent launch: on, off or on,off (each timed)")
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    out = open(args.out, "a") if args.out else None

    def emit(row: dict) -> None:
        row |= {"device": torch.cuda.get_device_name(dev)}
        print(json.dumps(row), flush=True)
        if out:
            out.write(json.dumps(row) + "\n")
            out.flush()

    for model, op, n, k, bias in SHAPES:
        if args.only and f"{model}.{op}" not in args.only.split(","):
            continue
        size = n * k * 2
        copies = max(2, -(-200_000_000 // size))
        weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(min(copies, CALLS))]
        chosen = skinny.choose_tiling(n // 2 if op == "gate_up" else n, k, sms, gate_up=op == "gate_up",
                                      splittable=op in ("o", "down"))  # the others keep whole rows
        best = None
        if args.sweep:
            splits = (1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 32) if op in ("o", "down") else (1,)
            results = []
            grid = [skinny.Tiling(bn, bk, s, warps, stages) for bn, bk, warps, stages, s in itertools.product(
                args.block_n, (128, 256, 512), args.warps, args.stages, splits) if s == 1 or k // (bk * s) >= 1]
            if k <= args.preload_max_k and op != "gate_up":  # whole slices read before the wait
                grid = [t for t in grid if not args.preload_only] + [
                    skinny.Tiling(bn, max(16, triton.next_power_of_2(-(-k // s))), s, warps, 1, preload=True)
                    for bn, s, warps in itertools.product((16, 32, 64), (1, 2, 4), args.warps)]
            for t in grid:
                try:
                    us = time_op(op, n, k, bias, 1, t, weights)
                except Exception as exc:  # a tiling past the shared memory, say
                    emit({"model": model, "op": op, "rows": 1, "tiling": t.__dict__, "error": str(exc)[:120]})
                    continue
                results.append((us, t))
                emit({"model": model, "op": op, "rows": 1, "tiling": t.__dict__, "us": round(us, 2), "sweep": True})
            results.sort(key=lambda r: r[0])
            best = results[0][1]
            top = [(round(us, 2), t.__dict__) for us, t in results[:5]]
            emit({"model": model, "op": op, "summary": "sweep", "best": top})
        for m, mode in itertools.product((int(r) for r in args.rows.split(",")), args.pdl.split(",")):
            pdl.set_enabled(mode == "on")
            row = {"model": model, "op": op, "n": n, "k": k, "rows": m, "weight_mb": round(size / 1e6, 1),
                   "pdl": pdl.enabled(dev)}
            row["cublas_us"] = round(time_op(op, n, k, bias, m, None, weights), 2)
            row["chosen"] = chosen.__dict__
            row["chosen_us"] = round(time_op(op, n, k, bias, m, chosen, weights), 2)
            row["chosen_rel_err"] = round(check(op, n, k, bias, m, chosen, weights[0]), 5)
            if best is not None:
                row["best"] = best.__dict__
                row["best_us"] = round(time_op(op, n, k, bias, m, best, weights), 2)
                row["best_rel_err"] = round(check(op, n, k, bias, m, best, weights[0]), 5)
            row["chosen_tb_s"] = round(size / row["chosen_us"] / 1e6, 2)
            row["cublas_tb_s"] = round(size / row["cublas_us"] / 1e6, 2)
            emit(row)
        del weights
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
