"""Summarise a torch profiler chrome trace (e.g. from `omni_qwen2_5.py --profile DIR`) per host thread and per
GPU stream: busy time and the names that take it. Traces of whole serving waves run to hundreds of MB; this
prints a page.

    python benchmarks/trace_summary.py DIR/wave-c1.json [--top 15]
"""

from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict


def summarise(path: str, top: int) -> None:
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    span = (max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)) / 1e3
    print(f"{path}: {len(events)} events over {span:.0f} ms")
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    host = [e for e in events if e.get("cat") in ("cpu_op", "cuda_runtime", "cuda_driver", "python_function")]
    by_stream: dict[tuple, list] = defaultdict(list)
    for e in gpu:
        by_stream[(e.get("pid"), e.get("tid"))].append(e)
    for key, evs in sorted(by_stream.items(), key=lambda kv: -sum(e["dur"] for e in kv[1])):
        names = Counter()
        for e in evs:
            names[e["name"][:90]] += e["dur"]
        busy = sum(e["dur"] for e in evs) / 1e3
        print(f"\nGPU stream {key}: {len(evs)} kernels/copies, busy {busy:.0f} ms ({100 * busy / span:.0f}%)")
        for name, dur in names.most_common(top):
            print(f"  {dur / 1e3:9.1f} ms  {name}")
    by_thread: dict[tuple, list] = defaultdict(list)
    for e in host:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    for key, evs in sorted(by_thread.items(), key=lambda kv: -len(kv[1])):
        runtime, ops = Counter(), Counter()
        for e in evs:
            (runtime if e.get("cat") in ("cuda_runtime", "cuda_driver") else ops)[e["name"][:90]] += e["dur"]
        top_level = _top_level(evs)
        print(f"\nhost thread {key}: {len(evs)} events, top-level busy {top_level / 1e3:.0f} ms")
        print("  CUDA runtime calls:")
        for name, dur in runtime.most_common(8):
            print(f"  {dur / 1e3:9.1f} ms  {name}")
        print("  ops (inclusive):")
        for name, dur in ops.most_common(top):
            print(f"  {dur / 1e3:9.1f} ms  {name}")


def _top_level(events: list[dict]) -> float:
    """Time covered by events not nested in another of the same thread."""
    covered, end = 0.0, float("-inf")
    for e in sorted(events, key=lambda e: e["ts"]):
        if e["ts"] >= end:
            covered += e["dur"]
            end = e["ts"] + e["dur"]
        elif e["ts"] + e["dur"] > end:
            covered += e["ts"] + e["dur"] - end
            end = e["ts"] + e["dur"]
    return covered


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    summarise(args.trace, args.top)
