"""Decode attention alone: the single-pass paged kernel vs the split-K path, microseconds per call.

Each case captures a CUDA graph of many decode-attention calls (batch sequences, one new token each, bf16
cache with 16-token pages), cycling over `--layers` distinct caches so that, as in a real step, a layer's
keys are mostly not still in L2, and times its replays with CUDA events. Prints (and with --out appends)
one JSON line per case: both timings, the split count the launcher picks, and the largest difference
between the two outputs; with --splits, also the time at each of those forced split counts (how
`decode_splits`'s rule was checked).

    python benchmarks/decode_attention.py --out decode_attention.jsonl   # GPU only
    python benchmarks/decode_attention.py --batches 1,8,16,32,64,128 --splits 2,4,8,16,32
"""

from __future__ import annotations

import argparse

import torch
import triton
from graph_timing import time_graph
from recording import recorder

from omnistage.kernels.paged_attention import _sm_count, decode_splits, paged_attention_triton

PAGE = 16


def run_case(batch: int, heads: int, kv_heads: int, head_dim: int, context: int, args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    dev, pages = torch.device("cuda"), triton.cdiv(context, PAGE)
    kv = torch.randn(2, args.layers, batch * pages * PAGE, kv_heads, head_dim, dtype=torch.bfloat16, device=dev)
    width = triton.cdiv(args.max_model_len, PAGE)  # the graph buffers' block-table width
    tables = torch.zeros(batch, width, dtype=torch.int32, device=dev)
    tables[:, :pages] = torch.randperm(batch * pages, device=dev).view(batch, pages).int()
    seq_lens = torch.full((batch,), context, dtype=torch.long, device=dev)
    cu_q = torch.arange(batch + 1, dtype=torch.int32, device=dev)
    q = torch.randn(batch, heads, head_dim, dtype=torch.bfloat16, device=dev)
    layer = [0]

    def call(splits: int | None) -> torch.Tensor:
        k, v = kv[0, layer[0]], kv[1, layer[0]]
        layer[0] = (layer[0] + 1) % args.layers
        return paged_attention_triton(q, k, v, tables, seq_lens, cu_q, 1, PAGE, head_dim**-0.5, num_splits=splits)

    single_us = time_graph([lambda: call(1)] * args.calls, args.replays)
    split_us = time_graph([lambda: call(None)] * args.calls, args.replays)
    forced = {f"splits{n}_us": round(time_graph([lambda n=n: call(n)] * args.calls, args.replays), 2)
              for n in map(int, filter(None, args.splits.split(",")))}
    layer[0] = 0
    single = call(1)
    layer[0] = 0
    split = call(None)
    return dict(
        batch=batch, heads=heads, kv_heads=kv_heads, head_dim=head_dim, context=context,
        splits=decode_splits(batch, kv_heads, width, PAGE, 32, _sm_count(dev)),
        single_us=round(single_us, 2), split_us=round(split_us, 2),
        max_abs_diff=(single.float() - split.float()).abs().max().item(), **forced,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--contexts", default="256,700,2048")
    parser.add_argument("--shapes", default="12/4/128,28/4/128", help="heads/kv_heads/head_dim, comma-separated")
    parser.add_argument("--splits", default="", help="also time these forced split counts, comma-separated")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--max-model-len", type=int, default=32768)
    parser.add_argument("--calls", type=int, default=240, help="calls per captured graph")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--out", help="append the JSON lines to this file")
    args = parser.parse_args()
    record = recorder(args.out)
    for shape in args.shapes.split(","):
        heads, kv_heads, head_dim = map(int, shape.split("/"))
        for batch in map(int, args.batches.split(",")):
            for context in map(int, args.contexts.split(",")):
                record(bench="decode_attention", **run_case(batch, heads, kv_heads, head_dim, context, args))


if __name__ == "__main__":
    main()
