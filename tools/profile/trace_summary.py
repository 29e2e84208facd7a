"""Summarise a torch profiler chrome trace (e.g. from `omni_qwen2_5.py --profile DIR`) per host thread and per
GPU stream: busy time and the names that take it. Traces of whole serving waves run to hundreds of MB; this
prints a page.

    python tools/profile/trace_summary.py DIR/wave-c1.json [--top 15]
    python tools/profile/trace_summary.py DIR/wave-c1.json --gaps 20   # each stream's idle gaps over 20 µs, per 100 ms
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


def stream_gaps(path: str, threshold_us: float, bucket_ms: float = 100.0) -> None:
    """Per GPU stream, per `bucket_ms` of the trace: how busy the stream was and its idle gaps longer than
    `threshold_us` (between one kernel's end, or the latest end before it, and the next kernel's start). A
    stream that waits for the host shows gaps where its work is otherwise back to back."""
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and "dur" in e
                  and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    origin = min(e["ts"] for e in events)
    by_stream: dict[tuple, list] = defaultdict(list)
    for e in events:
        by_stream[(e.get("pid"), e.get("tid"))].append(e)
    for key, evs in sorted(by_stream.items(), key=lambda kv: -len(kv[1])):
        evs.sort(key=lambda e: e["ts"])
        print(f"\nGPU stream {key}: {len(evs)} kernels; per {bucket_ms:.0f} ms: busy ms, gaps > {threshold_us:.0f} "
              f"µs (count, ms)")
        busy: dict[int, float] = defaultdict(float)
        gaps: dict[int, list[float]] = defaultdict(list)
        end = evs[0]["ts"]
        for e in evs:
            bucket = int((e["ts"] - origin) / (bucket_ms * 1e3))
            if e["ts"] - end > threshold_us:
                gaps[bucket].append(e["ts"] - end)
            busy[bucket] += max(0.0, e["ts"] + e["dur"] - max(e["ts"], end))  # overlapping spans counted once
            end = max(end, e["ts"] + e["dur"])
        for bucket in sorted(busy):
            g = gaps.get(bucket, [])
            print(f"  {bucket * bucket_ms:7.0f} ms  busy {busy[bucket] / 1e3:6.1f}  gaps {len(g):4d} "
                  f"{sum(g) / 1e3:6.2f} ms  (largest {max(g, default=0) / 1e3:.2f})")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--gaps", type=float, metavar="US", help="instead: each stream's idle gaps over US µs per 100 ms")
    args = ap.parse_args()
    if args.gaps is not None:
        stream_gaps(args.trace, args.gaps)
    else:
        summarise(args.trace, args.top)
