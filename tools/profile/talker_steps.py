"""Qwen2.5-Omni's talker alone: milliseconds per decode step at a batch size, sampled steps in flight or not.

The full pipeline's talker step time mixes the talker's own cost with the thinker and token2wav sharing the GPU
and the Python threads; this runs only the talker engine (loaded through the family's normal loader from the
checkpoint `omni_qwen2_5.py` writes), fed whole thinker replies of random states, with the released talker
sampling (temperature 0.9, top-k 40, top-p 0.8, repetition penalty 1.05) kept on codec ids token2wav can embed.

    python tools/profile/talker_steps.py --checkpoint /tmp/omni --batches 1,32 --out talker.jsonl   # GPU
    python tools/profile/talker_steps.py --checkpoint /tmp/omni --batches 1 --host-profile   # host time by function
    python tools/profile/talker_steps.py --checkpoint /tmp/omni --kernel-profile   # device time by kernel
    python tools/profile/talker_steps.py --checkpoint /tmp/omni --bursts 1,4,8,16  # decode bursts of those lengths
    python tools/profile/talker_steps.py --tiny --codes 40                                          # CPU smoke run
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # the benchmarks these profile
import argparse
import cProfile
import gc
import pstats
import time
from pathlib import Path

import stand_in
import torch
from omni_qwen2_5 import apply_settings, checkpoint_path, only_graph_buckets, parse_settings
from recording import recorder

from omnistage.config.deploy import load_deploy_config
from omnistage.families.registry import detect_family
from omnistage.sampling_params import SamplingParams
from omnistage.types import StageInput


def talker_input(pipeline, rid: str, prompt_len: int, reply_len: int, params: SamplingParams) -> StageInput:
    """A whole thinker reply as the thinker->talker edge hands it over: states for the prompt and reply rows."""
    cfg = pipeline.config
    width = cfg.thinker_config.text_config.hidden_size
    rows = prompt_len + reply_len
    tensors = {
        "thinker_embed": torch.randn(rows, width) * 0.02, "thinker_last": torch.randn(rows, width) * 0.02,
        "text_eos": torch.tensor(cfg.talker_config.tts_text_end_token_id),
        "text_pad": torch.tensor(cfg.talker_config.tts_text_pad_token_id),
        "prompt_ids": torch.arange(prompt_len) % 1000 + 100,
        "voice_bos": torch.tensor(next(iter(pipeline.voice_bos.values()))),
        "first_token": torch.tensor(101),
    }
    return StageInput(rid, [], params=params, tensors=tensors, final=True)


def run(path: Path, batch: int, codes: int, overlap_sampled: bool, record, host_profile: bool = False,
        kernel_profile: bool = False, eager: bool = False, burst: int = 1, beside_solve: str | None = None,
        settings: dict | None = None, prompt_len: int = 156, replays: int = 0,
        crowd: tuple[str, ...] = ()) -> None:
    family, info = detect_family(path)
    fields = {"stages": {"talker": {"max_model_len": 2048, "max_num_seqs": max(batch, 1), "enforce_eager": eager,
                                    "advanced": {"overlap_sampled": overlap_sampled, "decode_burst": burst}}}}
    apply_settings(fields, settings or {})
    deploy = load_deploy_config(fields)
    pipeline = family.pipeline(info, deploy)
    engine = pipeline.build_engine("talker")
    params = SamplingParams(max_tokens=codes, temperature=0.9, top_k=40, top_p=0.8, repetition_penalty=1.05,
                            ignore_eos=True, bad_token_ids=list(pipeline.undecodable_codes))  # as the pipeline bans
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    try:
        for wave in ("warm-up", "measured"):
            for i in range(batch):
                engine.add_request(talker_input(pipeline, f"{wave}-{i}", prompt_len, 128, params))
            while engine.stats()["num_running"] < batch or any(s.num_computed < s.num_prompt_tokens
                                                               for s in engine.seqs.values()):
                engine.step()  # prefills (and a first code each)
            sync()
            if kernel_profile and wave == "measured":
                print_kernel_profile(engine, batch, sync)
            profiler = cProfile.Profile() if host_profile and wave == "measured" else None
            solve = None
            if beside_solve and wave == "measured":  # stand_in's matmuls, queued to outlast the talker's run
                solve = beside(codes * batch * 1.2, beside_solve)
            steps, drawn, start = 0, 0, time.perf_counter()
            if profiler:
                profiler.enable()
            while engine.has_work():
                drawn += sum(len(out.token_ids) for out in engine.step())
                steps += 1
            sync()
            seconds = time.perf_counter() - start
            if profiler:
                profiler.disable()
                print(f"== host profile, batch {batch}, overlap_sampled={overlap_sampled}", flush=True)
                pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
        if replays and engine.runner.burst_graphs:  # the batch's burst graph alone, back to back (a diagnostic)
            graph = engine.runner.burst_graphs[min(b for b in engine.runner.burst_graphs if b >= batch)]
            record(part="burst_replays", batch=batch, replays=replays, settings=settings,
                   ms_per_replay=replay_ms(graph, replays))
            for action in crowd:  # then after each action, in order (graphs kept for the process, run 34/35)
                kept = crowd_action(action, engine.device)
                record(part="burst_replays", batch=batch, replays=replays, settings=settings, after=action,
                       other_graphs=len(kept), ms_per_replay=replay_ms(graph, replays))
        record(part="talker_steps", batch=batch, codes=codes, overlap_sampled=overlap_sampled, decode_burst=burst,
               eager=eager, steps=steps, ms_per_step=round(1000 * seconds / max(steps, 1), 3),
               ms_per_code=round(1000 * seconds * batch / max(drawn, 1), 3),
               overlapped_steps=engine.num_overlapped_steps, burst_steps=engine.num_burst_steps,
               prompt_len=prompt_len, **({"settings": settings} if settings else {}),
               **({"stand_in": beside_solve, "solve_passes_a_ms_alone": solve["alone"],
                   "solve_passes_a_ms_beside": solve["beside"](1000 * seconds)} if solve else {}))
    finally:
        engine.shutdown()


def replay_ms(graph: torch.cuda.CUDAGraph, replays: int = 100) -> float:
    """Milliseconds a replay of `graph`, `replays` queued back to back (after one to warm up)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return round(start.elapsed_time(end) / replays, 4)


_crowd: list[torch.cuda.CUDAGraph] = []  # kept for the process: each --crowd step adds to the ones before


def crowd_action(action: str, device: torch.device) -> list[torch.cuda.CUDAGraph]:
    """One --crowd step: "GxN" captures G more graphs of N one-element additions each and keeps them (never
    replayed); "own" captures one of one addition as omnistage's runners capture (a stream of its own,
    thread-local mode); "eager" runs 1,000 additions without a graph; "gc" and "empty_cache" do what
    `torch.cuda.graph` does on entering; "drop" lets every kept graph go.
    Does a graph replay slow down as a process instantiates other graphs (run 34: the talker's batch-1 burst
    graph replayed 4% slower once graphs for other batch sizes were captured)? Returns the graphs kept."""
    x = torch.zeros(1, device=device)
    if action == "eager":
        for _ in range(1000):
            x.add_(1)
    elif action == "gc":
        gc.collect()
    elif action == "empty_cache":
        torch.cuda.empty_cache()
    elif action == "own":  # one single-kernel graph captured as the runners capture theirs
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=torch.cuda.Stream(device), capture_error_mode="thread_local"):
            x.add_(1)
        _crowd.append(graph)
    elif action == "drop":
        _crowd.clear()
        gc.collect()
    else:
        graphs, nodes = (int(v) for v in action.split("x"))
        for _ in range(graphs):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(nodes):
                    x.add_(1)
            _crowd.append(graph)
    torch.cuda.synchronize(device)
    return _crowd


def beside(ms: float, kernels: str) -> dict:
    """stand_in's solve graph replayed back to back on a stream of its own for about twice `ms`: its passes a ms
    alone, and a function giving its passes a ms in the first `until_ms` of the replays queued now (call it once
    they are done)."""
    side, graph, alone = stand_in.alone(kernels)
    start, ends = stand_in.replay(side, graph, 2 * max(1, round(ms * alone / stand_in.PASSES)))
    return {"alone": round(alone, 3),
            "beside": lambda until_ms: round(stand_in.passes_per_ms(start, ends, until_ms), 3)}


def print_kernel_profile(engine, batch: int, sync, steps: int = 20) -> None:
    """Device time by kernel over `steps` engine steps (kernels replayed from CUDA graphs are listed too)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] if torch.cuda.is_available() else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        sync()
    key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    total = sum(getattr(e, key.replace("cuda", "device")) for e in prof.key_averages()) / 1000
    print(f"== kernels, batch {batch}: {total / steps:.3f} ms of device time per step over {steps} steps "
          f"(decode_burst {engine.config.decode_burst}, eager {engine.config.enforce_eager})", flush=True)
    print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=90), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--checkpoint", type=Path, help="a full-size checkpoint (benchmarks/omni_qwen2_5.py writes one)")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--codes", type=int, default=600)
    ap.add_argument("--out")
    ap.add_argument("--host-profile", action="store_true", help="also print cProfile's top functions per run")
    ap.add_argument("--kernel-profile", action="store_true", help="a table of device time by kernel over 20 steps")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs (each kernel keeps its op's name)")
    ap.add_argument("--bursts", default="1", help="decode_burst values to run (steps with overlap_sampled)")
    ap.add_argument("--beside-solve", nargs="?", const="cublas", choices=("cublas", "triton"),
                    help="the measured wave beside stand_in.py's DiT-shaped matmuls on a stream of their own (on "
                         "cuBLAS, the default, or in small Triton tiles)")
    ap.add_argument("--buckets", help="capture decode graphs for only these batch sizes (a diagnostic), e.g. 1,64")
    ap.add_argument("--replays", type=int, default=0, help="then time the burst graph alone, this many replays")
    ap.add_argument("--crowd", default="", help="with --replays: again after each step, in order: GRAPHSxNODES "
                    "(more graphs of small kernels, kept), own, eager, gc, empty_cache, drop "
                    "(see crowd_action): 1x1,1x1000,drop")
    ap.add_argument("--prompt-len", type=int, default=156, help="the thinker prompt rows the talker prefills")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a deploy-config field, e.g. stages.talker.max_model_len=8192 (as the pipeline's config)")
    args = ap.parse_args()
    if args.beside_solve and not torch.cuda.is_available():
        ap.error("--beside-solve needs a GPU (stand_in.py's matmuls run in a CUDA graph)")

    record = recorder(args.out)
    only_graph_buckets(args.buckets)
    path = checkpoint_path(args.tiny, args.checkpoint)
    for batch in (int(b) for b in args.batches.split(",")):
        for burst in (int(b) for b in args.bursts.split(",")):
            for overlap_sampled in (True,) if burst > 1 or args.kernel_profile else (False, True):
                run(path, batch, args.codes, overlap_sampled, record, args.host_profile, args.kernel_profile,
                    args.eager, burst, args.beside_solve, parse_settings(args.set), args.prompt_len,
                    args.replays, tuple(c for c in args.crowd.split(",") if c))


if __name__ == "__main__":
    main()
