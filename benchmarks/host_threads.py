"""Where the server process's threads spend the interpreter during a Qwen2.5-Omni wave: a per-thread profile
(yappi: every thread, CPU or wall clock) of one wave of concurrent speech requests, after a warm-up wave.

Inline stages share one interpreter: host work on one stage's thread (routing a token, applying an input,
detokenizing) delays the others', so at 32 concurrent requests the host, not the GPU, can set the pace. This
names the functions that cost the most per thread.

    pip install yappi
    python benchmarks/host_threads.py --checkpoint /tmp/omni --concurrency 32          # full size (GPU)
    python benchmarks/host_threads.py --tiny --concurrency 8 --codes 60                 # CPU smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import yaml
from omni_qwen2_5 import DEPLOY, codec_limits, one_request, write_full_checkpoint

from omnistage import AsyncOmni, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--checkpoint", type=Path, default=Path("/tmp/omni"))
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--codes", type=int, default=600)
    ap.add_argument("--clocks", default="cpu,wall", help="yappi clocks, one profiled wave each")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    import torch
    import yappi

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
    engine = AsyncOmni(path, deploy)
    names = {}

    async def wave() -> float:
        start = time.perf_counter()
        await asyncio.gather(*(one_request(engine, f"r{i}", params) for i in range(args.concurrency)))
        return time.perf_counter() - start

    try:
        asyncio.run(wave())  # warm-up
        import threading

        names = {t.ident: t.name for t in threading.enumerate()}
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


if __name__ == "__main__":
    main()
