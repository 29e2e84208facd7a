"""Where one request's last ~100 ms go: host times of every talker step and token2wav launch/landing, and GPU
times of each window's solve end and vocoder end (timed CUDA events against one recorded at the request's start).

The omni_qwen2_5.py workload at concurrency 1 (128 text tokens, 600 codes), the default deploy config plus
`--set` overrides. The engines' `step`, `Token2Wav.launch` and `GenerationEngine._landed` are wrapped for the run
(a diagnostic: nothing in the package changes). One line per request; the first request warms up.

    python tools/profile/tail_trace.py --checkpoint /tmp/omni --out tail.jsonl     # GPU; omni_qwen2_5.py writes it
    python tools/profile/tail_trace.py --tiny --requests 1                           # CPU smoke run (host times only)
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # the benchmarks these profile
import asyncio
import dataclasses
import time

import torch
from cuda_context import SecondContext, log_triton_loads, other_context, replay_ms
from omni_qwen2_5 import (
    checkpoint_path,
    engine_events,
    one_at_a_time_deploy,
    one_request,
    only_graph_buckets,
    parse_settings,
    probe_arguments,
    request_params,
)
from recording import recorder

from omnistage import AsyncOmni
from omnistage.engine.ar.engine import AREngine
from omnistage.engine.generation.engine import GenerationEngine
from omnistage.families.qwen2_5_omni.models import Token2Wav


class Trace:
    """The wrapped methods' events for the request in progress."""

    def __init__(self) -> None:
        self.events: list[dict] = []
        self.start, self.reference = 0.0, None
        self.cuda = torch.cuda.is_available()
        self.engines: dict[str, AREngine] = {}  # by stage name, as steps are seen

    def begin(self) -> None:
        self.events = []
        if self.cuda:
            torch.cuda.synchronize()
            self.reference = torch.cuda.Event(enable_timing=True)
            self.reference.record()
            torch.cuda.synchronize()
        self.start = time.perf_counter()

    def now(self) -> float:
        return round(time.perf_counter() - self.start, 4)

    def finish(self) -> list[dict]:
        """The events, with GPU marks as seconds since the request's start."""
        if self.cuda:
            torch.cuda.synchronize()
        for event in self.events:
            for key, mark in event.pop("marks", {}).items():
                event[key] = round(self.reference.elapsed_time(mark) / 1000, 4)
        return self.events

    def install(self) -> None:
        trace, ar_step, launch, landed = self, AREngine.step, Token2Wav.launch, GenerationEngine._landed

        def traced_step(engine: AREngine):
            trace.engines[engine.name] = engine
            began, outputs = trace.now(), ar_step(engine)
            tokens = sum(len(out.token_ids) for out in outputs)
            if tokens or any(out.finished for out in outputs):
                trace.events.append({"ev": engine.name, "t0": began, "t1": trace.now(), "tokens": tokens,
                                     "finished": any(out.finished for out in outputs)})
            return outputs

        def traced_launch(decoder: Token2Wav, inputs):
            began = trace.now()
            windows = [(inp.params.get("emitted", 0), len(inp.token_ids), inp.final) for inp in inputs]
            flight = launch(decoder, inputs)
            event = {"ev": "launch", "t0": began, "t1": trace.now(), "windows": windows}
            if trace.cuda:  # after the solves on the stage's stream; after the vocoder on its own (when apart)
                solved, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                solved.record()
                done.record(decoder._side[1] if decoder._side else torch.cuda.current_stream())
                event["marks"] = {"gpu_solved": solved, "gpu_vocoded": done}
            trace.events.append(event)
            return flight

        def traced_landed(engine: GenerationEngine):
            outputs = landed(engine)
            if outputs:
                trace.events.append({"ev": "landed", "t": trace.now(),
                                     "samples": [out.tensors.get("audio", torch.zeros(0)).numel() for out in outputs]})
            return outputs

        AREngine.step, Token2Wav.launch, GenerationEngine._landed = traced_step, traced_launch, traced_landed


def main() -> None:
    ap = probe_arguments("one after another; the first warms up")
    ap.add_argument("--reset-context", choices=("thread", "process"),
                    help="before each request, another CUDA context runs once on the device (run 35)")
    ap.add_argument("--reset-at-start", action="store_true",
                    help="another CUDA context runs once before the stages are built (before any of their streams "
                         "exists; run 35)")
    ap.add_argument("--replay-check", action="store_true",
                    help="after each request, time the talker's batch-1 burst graph replayed alone; after the last, "
                         "again once another CUDA context ran")
    ap.add_argument("--keep-second-context", action="store_true",
                    help="once the pipeline is built, a second CUDA context made and kept, idle, through the "
                         "requests (run 36)")
    ap.add_argument("--last-talker", action="append", default=[], metavar="FIELD=VALUE",
                    help="the last request's talker sampling with this field changed (e.g. presence_penalty=0.1): "
                         "does a new combination of sampling features stall the talker?")
    ap.add_argument("--log-loads", action="store_true",
                    help="a line whenever Triton loads a kernel's module onto the device (run 36: none during "
                         "requests)")
    args = ap.parse_args()
    only_graph_buckets(args.graph_buckets)
    path = checkpoint_path(args.tiny, args.checkpoint)
    settings = parse_settings(args.set)
    deploy = one_at_a_time_deploy(settings)
    record = recorder(args.out)
    trace = Trace()
    trace.install()
    if args.log_loads and torch.cuda.is_available():
        log_triton_loads(record)
    params = request_params(path, 128, 600)
    if args.reset_at_start and torch.cuda.is_available():  # torch's context made, then another context run, all
        # before any stage makes a stream or a graph
        torch.zeros(1, device="cuda")
        other_context(torch.cuda.current_device())
    engine = AsyncOmni(path, deploy)
    second = (SecondContext(torch.cuda.current_device())
              if args.keep_second_context and torch.cuda.is_available() else None)

    def replay_check(when: str) -> None:  # the talker's batch-1 burst graph alone, back to back (run 35)
        graphs = trace.engines["talker"].runner.burst_graphs if "talker" in trace.engines else {}
        if graphs:
            record(part="burst_replays", when=when, ms_per_replay=replay_ms(graphs[min(graphs)], 200))

    try:
        for n in range(args.requests):
            if args.reset_context:  # run 35: replays slow once a process captured graphs, till another context ran
                other_context(torch.cuda.current_device(), args.reset_context)
            trace.begin()
            changed = parse_settings(args.last_talker) if n == args.requests - 1 else {}
            asked = {**params, "talker": dataclasses.replace(params["talker"], **changed)} if changed else params
            result = asyncio.run(one_request(engine_events(engine, f"tail{n}", asked)))
            record(part="tail_trace", request=n, settings=settings, graph_buckets=args.graph_buckets,
                   started=round(trace.start, 4), talker_changed=changed,
                   e2e_s=round(result["e2e"], 4),
                   last_text_s=round(result["last_text"], 4), chunks=result["chunks"], events=trace.finish())
            if args.replay_check:
                replay_check(f"after request {n}")
                if n == args.requests - 1 and torch.cuda.is_available():
                    other_context(torch.cuda.current_device())
                    replay_check("after another context ran")
    finally:
        engine.shutdown()
        if second is not None:
            second.close()


if __name__ == "__main__":
    main()
