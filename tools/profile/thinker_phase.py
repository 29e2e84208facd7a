"""One Qwen2.5-Omni request at a time (the omni_qwen2_5.py workload): the thinker's milliseconds per token alone
(text-only requests: the talker and token2wav never run) and beside the talker (speech requests: the talker
follows the reply token by token), plus each speech request's end and audio chunk times.

Where c=1's time goes before the reply ends: on an H200 (run 20b) the thinker alone took 3.90 ms a token and 4.61
beside the talker, so the talker's codes in that phase cost 0.71 ms each against ~1.2 alone.

    python tools/profile/thinker_phase.py --checkpoint /tmp/omni --out phase.jsonl     # GPU; omni_qwen2_5.py writes it
    python tools/profile/thinker_phase.py --checkpoint /tmp/omni --no-pdl               # the same without PDL
    python tools/profile/thinker_phase.py --tiny                                        # CPU smoke run
    python tools/profile/thinker_phase.py --checkpoint /tmp/omni --engine-only          # the thinker's engine alone

`--engine-only` steps the thinker's engine by itself (no talker, no other stage, no server loop) on a speech
request's input, with and without the hidden states the talker needs: what handing them on costs the thinker,
apart from the talker's GPU work beside it. `--prefill` times what comes before the first reply token: the
request's preprocessing and the thinker's first step (its prefill), host wall time and GPU time, with a
torch.profiler table of one such step (host ops by self time, kernels by GPU time).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # the benchmarks these profile
import asyncio
import contextlib
import time
from pathlib import Path

from omni_qwen2_5 import (
    PROMPT,
    checkpoint_path,
    one_at_a_time_deploy,
    only_graph_buckets,
    parse_settings,
    probe_arguments,
    request_params,
)
from recording import recorder
from switches import add_kernel_switches, apply_kernel_switches

from omnistage import AsyncOmni
from omnistage.types import OmniRequest

THINKER_TOKENS, CODES = 128, 600


async def one_request(engine: AsyncOmni, params: dict, modalities: tuple[str, ...]) -> dict:
    request = OmniRequest(request_id=f"r{time.monotonic_ns()}", messages=[{"role": "user", "content": PROMPT}],
                          stage_params=params, output_modalities=modalities, options={"voice": "Chelsie"})
    start = time.perf_counter()
    text_times, chunks = [], []
    async for out in engine.generate(request):
        if out.error:
            raise RuntimeError(out.error)
        now = time.perf_counter() - start
        if out.text or out.token_ids:
            text_times.append(now)
        if out.audio is not None and out.audio.size:
            chunks.append(round(now, 4))
    return {"first_text_s": round(text_times[0], 4), "last_text_s": round(text_times[-1], 4),
            "ms_per_token": round(1000 * (text_times[-1] - text_times[0]) / (THINKER_TOKENS - 1), 3),
            "e2e_s": round(time.perf_counter() - start, 4), "audio_chunks_s": chunks}


def engine_only(path: Path, deploy: dict, params: dict, requests: int, record) -> None:
    """The thinker's AR engine stepped alone on a speech request's input: ms a token with the hidden states the
    talker needs (`hidden`) and without (`plain`), alternating."""
    from omnistage.families.registry import load_pipeline as build_pipeline

    pipeline = build_pipeline(path, deploy)
    engine = pipeline.build_engine("thinker")
    try:
        for n in range(requests + 1):  # the first pair warms up
            for hidden in (True, False):
                request = OmniRequest(request_id=f"e{n}{hidden}", messages=[{"role": "user", "content": PROMPT}],
                                      stage_params=params, output_modalities=("text", "audio"),
                                      options={"voice": "Chelsie"})
                inp = pipeline.preprocess(request)
                inp.return_hidden_states = hidden
                engine.add_request(inp)
                times = []
                start = time.perf_counter()
                while engine.has_work():
                    for out in engine.step():
                        if out.token_ids:
                            times.append(time.perf_counter() - start)
                if n:
                    record(part="thinker_engine", request="hidden" if hidden else "plain", tokens=len(times),
                           ms_per_token=round(1000 * (times[-1] - times[0]) / (len(times) - 1), 3))
    finally:
        engine.shutdown()


def prefill(path: Path, deploy: dict, params: dict, requests: int, record) -> None:
    """Preprocessing and the thinker's first step, one speech request at a time (the first warms up); the last is
    also profiled."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from omnistage.families.registry import load_pipeline as build_pipeline

    pipeline = build_pipeline(path, deploy)
    engine = pipeline.build_engine("thinker")
    try:
        for n in range(requests + 2):
            request = OmniRequest(request_id=f"p{n}", messages=[{"role": "user", "content": PROMPT}],
                                  stage_params=params, output_modalities=("text", "audio"),
                                  options={"voice": "Chelsie"})
            start = time.perf_counter()
            inp = pipeline.preprocess(request)
            inp.return_hidden_states = True
            engine.add_request(inp)
            added = time.perf_counter()
            cuda = torch.cuda.is_available()
            sync = torch.cuda.synchronize if cuda else (lambda: None)
            gpu_start, gpu_end = (torch.cuda.Event(enable_timing=True) for _ in range(2)) if cuda else (None, None)
            sync()
            if cuda:
                gpu_start.record()
            host = time.perf_counter()
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with profile(activities=activities) if n == requests + 1 else contextlib.nullcontext() as prof:
                outs = engine.step()
                host_done = time.perf_counter()
                if cuda:
                    gpu_end.record()
                sync()
            synced = time.perf_counter()
            while engine.has_work():
                engine.step()
            if prof is not None:
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70))
                if cuda:
                    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=70))
            elif n:
                record(part="thinker_prefill", prompt_tokens=len(inp.token_ids),
                       first_token=bool(outs and outs[0].token_ids),
                       preprocess_ms=round(1000 * (added - start), 3), step_host_ms=round(1000 * (host_done - host), 3),
                       step_synced_ms=round(1000 * (synced - host), 3),
                       step_gpu_ms=round(gpu_start.elapsed_time(gpu_end), 3) if cuda else None)
    finally:
        engine.shutdown()


def main() -> None:
    ap = probe_arguments("of each kind, alternating")
    ap.add_argument("--engine-only", action="store_true", help="the thinker's engine alone, with and without the "
                    "hidden states the talker needs")
    ap.add_argument("--prefill", action="store_true", help="preprocessing and the thinker's first step, timed and "
                    "profiled")
    add_kernel_switches(ap)
    args = ap.parse_args()
    apply_kernel_switches(args)
    only_graph_buckets(args.graph_buckets)
    record = recorder(args.out)
    path = checkpoint_path(args.tiny, args.checkpoint)
    params = request_params(path, THINKER_TOKENS, CODES)
    settings = parse_settings(args.set)
    deploy = one_at_a_time_deploy(settings)
    if args.engine_only:
        engine_only(path, deploy, params, args.requests, record)
        return
    if args.prefill:
        prefill(path, deploy, params, args.requests, record)
        return
    engine = AsyncOmni(path, deploy)
    try:
        kinds = {"text": ("text",), "speech": ("text", "audio")}
        for modalities in kinds.values():  # warm-up
            asyncio.run(one_request(engine, params, modalities))
        for _ in range(args.requests):
            for kind, modalities in kinds.items():
                row = asyncio.run(one_request(engine, params, modalities))
                record(part="thinker_phase", request=kind, settings=settings, graph_buckets=args.graph_buckets,
                       **row)
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
