"""The fused draw kernel (omnistage/kernels/draw.py) at a codec head's vocabulary: microseconds per draw for a few
rows, by which filters run and by the program's width. Each measurement is a CUDA graph of 24 draws replayed
(benchmarks/graph_timing.py), the history recorded as in a decode step.

    python benchmarks/draw_kernel.py --out draw.jsonl       # GPU
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
from graph_timing import time_graph

from omnistage.engine.ar.sampler import Sampler, SampleRow, TokenHistory
from omnistage.kernels import draw as fused_draw
from omnistage.sampling_params import SamplingParams

# the Qwen2.5-Omni talker's sampling, then without top-p, then temperature alone
SETTINGS = {
    "talker": SamplingParams(temperature=0.9, top_k=40, top_p=0.8, repetition_penalty=1.05),
    "top_k_only": SamplingParams(temperature=0.9, top_k=40, repetition_penalty=1.05),
    "temperature_only": SamplingParams(temperature=0.9, repetition_penalty=1.05),
}


def time_draw(params: SamplingParams, rows: int, vocab: int, num_warps: int | None) -> float:
    dev = torch.device("cuda")
    history = TokenHistory(rows + 1, vocab, dev)
    sampler = Sampler(seed=0)
    cols = sampler.columns([SampleRow(params, [1, 2, 3], [4, 5], None, ()) for _ in range(rows)], vocab, dev)
    logits = 3 * torch.randn(rows, vocab, device=dev)
    slots = torch.arange(rows, device=dev)
    noise = torch.empty_like(logits).exponential_()

    def one() -> torch.Tensor:
        return fused_draw.draw(logits, noise, cols.temperature, cols.greedy, cols.top_k, cols.top_p, cols.min_p,
                               cols.repetition, cols.frequency, cols.presence, cols.ban, history.seen,
                               history.counts, slots, record=True, num_warps=num_warps)

    return time_graph([one] * 24)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=8448)
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--warps", default="0,4,8,16,32", help="program widths to time (0: the built-in choice)")
    ap.add_argument("--out")
    args = ap.parse_args()
    out = open(args.out, "a") if args.out else None
    for (name, params), rows, warps in itertools.product(SETTINGS.items(), map(int, args.rows.split(",")),
                                                         map(int, args.warps.split(","))):
        row = {"settings": name, "rows": rows, "vocab": args.vocab, "num_warps": warps or "built-in",
               "us": round(time_draw(params, rows, args.vocab, warps or None), 2),
               "device": torch.cuda.get_device_name()}
        print(json.dumps(row), flush=True)
        if out:
            out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
