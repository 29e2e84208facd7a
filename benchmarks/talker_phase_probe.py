"""One Qwen2.5-Omni request (the omni_qwen2_5.py workload, concurrency 1): where the talker's time goes once the
thinker is done. Is the talker's thread waiting on the GPU or on the host, and is its stream busy?

1. Each stage thread's Python stack, sampled every millisecond through one request; the samples after the last
   text token (the talker phase) are counted by stack.
2. A torch-profiler trace of another request: each CUDA stream's busy share per 50 ms, the late kernels by time,
   and the talker stream's idle gaps. Under programmatic dependent launch a kernel's span includes its wait, so
   busy shares then read high.

    python benchmarks/talker_phase_probe.py --checkpoint /tmp/omni            # GPU; omni_qwen2_5.py writes it
    python benchmarks/talker_phase_probe.py --checkpoint /tmp/omni --set stages.token2wav.options.max_window=96
    python benchmarks/talker_phase_probe.py --tiny                             # CPU smoke run (no kernel trace)
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import yaml
from omni_qwen2_5 import (
    DEPLOY,
    apply_settings,
    engine_events,
    one_request,
    parse_settings,
    request_params,
    write_full_checkpoint,
)

from omnistage import AsyncOmni

SLICE_US = 50_000


def stacks(engine: AsyncOmni, params: dict) -> None:
    names = {t.ident: t.name for t in threading.enumerate()}
    samples, stop = [], threading.Event()

    def sample() -> None:
        start = time.perf_counter()
        while not stop.is_set():
            now = time.perf_counter() - start
            for ident, frame in sys._current_frames().items():
                name = names.get(ident, "")
                if not (name.startswith("stage-") or name == "MainThread"):
                    continue
                where, f = [], frame
                while f is not None and len(where) < 4:
                    if any(part in f.f_code.co_filename for part in ("omnistage", "torch", "threading", "asyncio")):
                        where.append(f"{Path(f.f_code.co_filename).name}:{f.f_lineno} {f.f_code.co_name}")
                    f = f.f_back
                samples.append((now, name, " < ".join(where)))
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    r = asyncio.run(one_request(engine_events(engine, "stacks", params)))
    stop.set()
    sampler.join()
    print("stacks request", {k: round(r[k], 3) for k in ("ttfp", "e2e", "last_text")})
    for name in sorted({n for _, n, _ in samples}):
        phase = (r["last_text"] + 0.05, r["e2e"] - 0.05)
        counts = collections.Counter(w for t, n, w in samples if n == name and phase[0] < t < phase[1])
        total = sum(counts.values()) or 1
        print(f"=== {name} in the talker phase: {total} samples")
        for where, k in counts.most_common(8):
            print(f"  {k / total:5.1%}  {where}")


def _busy(spans: list[tuple[float, float, str]], lo: float, hi: float) -> float:
    total, reached = 0.0, lo
    for a, z, _ in spans:
        a, z = max(a, reached), min(z, hi)
        if z > a:
            total, reached = total + z - a, z
    return total


def kernel_trace(engine: AsyncOmni, params: dict) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        r = asyncio.run(one_request(engine_events(engine, "traced", params)))
    print("traced request", {k: round(r[k], 3) for k in ("ttfp", "e2e", "last_text")})
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        kernels = [e for e in json.load(open(f.name))["traceEvents"] if e.get("cat") == "kernel"]
    if not kernels:
        print("no CUDA kernels traced")
        return
    t0 = min(e["ts"] for e in kernels)
    streams = collections.defaultdict(list)
    for e in kernels:
        streams[e["args"].get("stream")].append((e["ts"] - t0, e["ts"] - t0 + e["dur"], e["name"]))
    end = max(z for spans in streams.values() for _, z, _ in spans)
    for stream, spans in streams.items():
        spans.sort()
        if len(spans) < 50:
            continue
        print(f"stream {stream}: busy per 50 ms:",
              [round(_busy(spans, lo, lo + SLICE_US) / SLICE_US, 2) for lo in range(0, int(end), SLICE_US)])
        late, count = collections.Counter(), collections.Counter()
        for a, z, name in spans:
            if a > 0.55 * end:
                late[name[:60]] += z - a
                count[name[:60]] += 1
        print("   late kernels (ms, count):", [(k, round(t / 1000, 1), count[k]) for k, t in late.most_common(8)])
    talker = max(streams, key=lambda s: sum(1 for a, _, _ in streams[s] if a > 0.6 * end))
    spans = streams[talker]
    gaps = sorted(spans[i + 1][0] - spans[i][1] for i in range(len(spans) - 1) if spans[i][0] > 0.6 * end)
    print(f"talker stream {talker}: idle gaps over 20 us {sum(g for g in gaps if g > 20) / 1000:.2f} ms in "
          f"{sum(1 for g in gaps if g > 20)}, largest (us) {[round(g) for g in gaps[-10:]]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, help="the full-size checkpoint (written there if missing)")
    ap.add_argument("--tiny", action="store_true", help="the tiny test checkpoint instead")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a deploy-config field")
    args = ap.parse_args()
    if args.tiny:
        from omnistage.testing.factory import tiny_checkpoint

        path, thinker_tokens, codes = tiny_checkpoint("qwen2_5_omni"), 16, 60
    elif args.checkpoint is None:
        ap.error("--checkpoint or --tiny")
    else:
        path, thinker_tokens, codes = args.checkpoint, 128, 600
        if not (path / "config.json").is_file():
            write_full_checkpoint(path)
    params = request_params(path, thinker_tokens, codes)
    deploy = yaml.safe_load(DEPLOY.read_text())
    for name in ("thinker", "talker"):
        deploy["stages"][name].update(max_model_len=2048, max_num_seqs=1)
    deploy["stages"]["token2wav"].update(max_num_seqs=1, dtype="bfloat16" if torch.cuda.is_available() else "float32")
    apply_settings(deploy, parse_settings(args.set))
    engine = AsyncOmni(path, deploy)
    try:
        for _ in range(2):  # compiled, captured, tuned
            asyncio.run(one_request(engine_events(engine, "warm-up", params)))
        stacks(engine, params)
        kernel_trace(engine, params)
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
