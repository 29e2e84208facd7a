"""Where a batch-1 decode step spends its time (Qwen2.5-7B architecture, random bf16, one H200).

Reports the GPU time of one graph replay, the host time of each part of `AREngine.step`, and the
top CUDA kernels of one eager decode step. Used to decide what to optimise next.

    python tools/profile/profile_decode.py --out profile.jsonl
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # the benchmarks these profile
import argparse
import json
import statistics
import time

import torch
from llm_throughput import build_engine, prompts, random_qwen2

from omnistage.sampling_params import SamplingParams
from omnistage.types import StageInput


def timed_method(obj, name: str, bucket: list[float]) -> None:
    original = getattr(obj, name)

    def wrapper(*args, **kwargs):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = original(*args, **kwargs)
        torch.cuda.synchronize()
        bucket.append(time.perf_counter() - t)
        return out

    setattr(obj, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = []

    def record(**row) -> None:
        print(json.dumps(row), flush=True)
        rows.append(row)

    model, config = random_qwen2(tiny=False)

    engine = build_engine(model, config, max_num_seqs=8, util=0.5)
    graph = engine.runner.graphs[1][0]
    for _ in range(5):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(50):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    record(part="graph_replay_batch1_ms", ms=round(start.elapsed_time(end) / 50, 3),
           note="padded rows attend to one token, so this is weights + small attention")

    parts: dict[str, list[float]] = {"schedule": [], "execute": [], "sample": [], "step": []}
    timed_method(engine.scheduler, "schedule", parts["schedule"])
    timed_method(engine.runner, "execute", parts["execute"])
    timed_method(engine, "sampler", parts["sample"])
    timed_method(engine, "step", parts["step"])
    params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    engine.add_request(StageInput("a", prompts(1, config.vocab_size)[0], params=params))
    while engine.has_work():
        engine.step()
    record(part="step_breakdown_ms", **{k: round(statistics.median(v[2:]) * 1e3, 3) for k, v in parts.items()})
    engine.shutdown()
    del engine

    eager = build_engine(model, config, max_num_seqs=8, enforce_eager=True, util=0.5)
    eager.add_request(StageInput("b", prompts(1, config.vocab_size)[0], params=params))
    for _ in range(4):
        eager.step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        eager.step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=15)
    print(table)
    record(part="eager_decode_top_kernels", table=table)
    if args.out:
        with open(args.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    with torch.inference_mode():
        main()
