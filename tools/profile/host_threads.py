"""Where the server process's threads spend the interpreter during a Qwen2.5-Omni wave: a per-thread profile
(yappi: every thread, CPU or wall clock) of one wave of concurrent speech requests, after a warm-up wave; or,
with --stacks, where each stage thread is (its Python stack, sampled every 2 ms) in phases of the wave, and the
talker's while token2wav is inside a step or idle: a thread waiting in a CUDA call shows there.

Inline stages share one interpreter: host work on one stage's thread (routing a token, applying an input,
detokenizing) delays the others', so at 32 concurrent requests the host, not the GPU, can set the pace. This
names the functions that cost the most per thread.

    pip install yappi
    python tools/profile/host_threads.py --checkpoint /tmp/omni --concurrency 32          # full size (GPU)
    python tools/profile/host_threads.py --tiny --concurrency 8 --codes 60                 # CPU smoke run
    python tools/profile/host_threads.py --checkpoint /tmp/omni --stacks \\
        --set stages.talker.advanced.overlap_sampled=false
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # the benchmarks these profile
import argparse
import asyncio
import collections
import sys
import threading
import time
from pathlib import Path

import yaml
from omni_qwen2_5 import DEPLOY, codec_limits, engine_events, one_request, write_full_checkpoint

from omnistage import AsyncOmni, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--checkpoint", type=Path, default=Path("/tmp/omni"))
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--codes", type=int, default=600)
    ap.add_argument("--clocks", default="cpu,wall", help="yappi clocks, one profiled wave each")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--stacks", action="store_true", help="sample stage threads' stacks instead of profiling")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a deploy-config setting (YAML value), e.g. stages.talker.advanced.overlap_sampled=false")
    args = ap.parse_args()
    import torch

    if args.tiny:
        from omnistage.testing import tiny_checkpoint

        path = Path(tiny_checkpoint("qwen2_5_omni"))
    else:
        path = args.checkpoint
        if not (path / "config.json").is_file():
            write_full_checkpoint(path)
    limit, vocab = codec_limits(path)
    params = {"thinker": SamplingParams(max_tokens=128, temperature=0, ignore_eos=True),
              "talker": SamplingParams(max_tokens=args.codes, temperature=0.9, top_k=40, top_p=0.8,
                                       repetition_penalty=1.05, ignore_eos=True,
                                       bad_token_ids=list(range(limit, vocab)))}
    deploy = yaml.safe_load(DEPLOY.read_text())
    for name in ("thinker", "talker"):
        deploy["stages"][name].update(max_model_len=2048, max_num_seqs=args.concurrency)
    deploy["stages"]["token2wav"].update(max_num_seqs=args.concurrency)
    if torch.cuda.is_available():
        deploy["stages"]["token2wav"]["dtype"] = "bfloat16"
    else:
        for stage in deploy["stages"].values():
            stage.pop("devices", None)
            stage.pop("gpu_memory_utilization", None)
    for key, value in (kv.split("=", 1) for kv in args.set):
        *parents, leaf = key.split(".")
        node = deploy
        for name in parents:
            node = node.setdefault(name, {})
        node[leaf] = yaml.safe_load(value)
    engine = AsyncOmni(path, deploy)

    async def wave() -> float:
        start = time.perf_counter()
        await asyncio.gather(*(one_request(engine_events(engine, f"r{i}", params)) for i in range(args.concurrency)))
        return time.perf_counter() - start

    try:
        asyncio.run(wave())  # warm-up
        names = {t.ident: t.name for t in threading.enumerate()}
        if args.stacks:
            print(f"== stage threads' stacks, a wave of {args.concurrency}, settings {args.set}")
            stacks(names, lambda: asyncio.run(wave()))
            return
        import yappi

        for clock in args.clocks.split(","):
            yappi.clear_stats()
            yappi.set_clock_type(clock)
            yappi.start()
            seconds = asyncio.run(wave())
            yappi.stop()
            print(f"== {clock} clock: a wave of {args.concurrency} in {seconds:.2f} s (under the profiler)")
            for thread in sorted(yappi.get_thread_stats(), key=lambda t: -t.ttot):
                if thread.ttot < 0.05 * seconds:
                    continue
                print(f"-- thread {names.get(thread.tid, thread.name)}: {thread.ttot:.2f} s")
                stats = yappi.get_func_stats(filter={"ctx_id": thread.id})
                stats.sort("tsub")
                for f in list(stats)[: args.top]:
                    print(f"  {f.tsub:7.3f} s own {f.ttot:7.3f} s total {f.ncall:8d} calls  "
                          f"{Path(f.module).name}:{f.lineno} {f.name}")
    finally:
        engine.shutdown()


def stacks(names: dict[int, str], run_wave, every_s: float = 0.002) -> None:
    """Sample the stage threads' innermost omnistage/torch frames while `run_wave()` runs; print, per phase of
    the wave, each thread's most frequent stacks, then the talker's while token2wav is inside a step vs idle."""
    samples: list[tuple[float, dict[str, str]]] = []
    done = threading.Event()

    def sample() -> None:
        start = time.perf_counter()
        while not done.is_set():
            now, at = time.perf_counter() - start, {}
            for ident, frame in sys._current_frames().items():
                if not names.get(ident, "").startswith("stage-"):
                    continue
                frames = []
                while frame is not None and len(frames) < 5:
                    where = frame.f_code.co_filename
                    if any(part in where for part in ("omnistage", "torch", "threading", "queue")):
                        frames.append(f"{Path(where).name}:{frame.f_lineno} {frame.f_code.co_name}")
                    frame = frame.f_back
                at[names[ident]] = " < ".join(frames)
            samples.append((now, at))
            time.sleep(every_s)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.perf_counter()
    run_wave()
    seconds = time.perf_counter() - started
    done.set()
    sampler.join()
    print(f"wave: {seconds:.2f} s, {len(samples)} samples")

    def show(title: str, picked: list[str]) -> None:
        counts = collections.Counter(picked)
        print(f"-- {title}: {len(picked)} samples")
        for stack, n in counts.most_common(8):
            print(f"  {n / max(len(picked), 1):6.1%}  {stack}")

    edges = [*(edge for edge in (0.0, 0.4, 1.0, 2.0) if edge < seconds), seconds]
    for lo, hi in zip(edges, edges[1:], strict=False):
        for thread in ("stage-thinker-0", "stage-talker-0", "stage-token2wav-0"):
            show(f"{thread}, {lo:.1f}-{hi:.1f} s", [at.get(thread, "") for t, at in samples if lo <= t < hi])
    for label, in_step in (("inside a step", True), ("idle", False)):
        picked = [at.get("stage-talker-0", "") for t, at in samples
                  if t > 1.0 and ("_drain" not in at.get("stage-token2wav-0", "_drain")) == in_step]
        show(f"talker after 1 s, token2wav {label}", picked)


if __name__ == "__main__":
    main()
