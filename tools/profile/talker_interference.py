"""Why Qwen2.5-Omni's talker is slower in the pipeline than alone (on an H200 ~1.45 ms a code after the thinker's
reply against 1.25 alone, runs 16-17): the talker's milliseconds per code with each neighbour the pipeline gives
it, added one at a time, each on its own CUDA stream as the inline workers run them (the talker's at high
priority, token2wav's at normal):

- `alone`: the talker on its high-priority stream, nothing else on the GPU;
- `token2wav_paced`: token2wav solving a 192-code window (the default steady-state window) every `--pace` seconds
  on another thread, as the pipeline does while the talker writes those codes;
- `token2wav_loop`: windows back to back (the worst case); `solve_loop`, `vocoder_loop`: only the windows'
  flow-matching solves, or only their vocoder passes, back to back;
- `thinker_idle`: the thinker engine loaded (weights and KV cache resident) but idle, then with `token2wav_paced`.

Each row also reports token2wav's windows (count, median ms) during the talker's run. Options as in
`omni_qwen2_5.py --set` apply to every stage (`--set stages.token2wav.advanced.cublas_sm_carveout=32`).

    python tools/profile/talker_interference.py --checkpoint /tmp/omni --out interference.jsonl   # GPU
    python tools/profile/talker_interference.py --tiny --codes 40                                   # CPU smoke run
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # the benchmarks these profile
import argparse
import contextlib
import statistics
import threading
import time
from pathlib import Path

import torch
import yaml
from cuda_context import SecondContext, log_triton_loads, other_context, replay_ms
from omni_qwen2_5 import DEPLOY, apply_settings, checkpoint_path, parse_settings
from recording import recorder
from talker_steps import talker_input
from torch.utils._python_dispatch import TorchDispatchMode

from omnistage.config.deploy import load_deploy_config
from omnistage.families.registry import detect_family
from omnistage.sampling_params import SamplingParams
from omnistage.types import StageInput


def stream(device: torch.device, high: bool):
    """A stream like the inline worker's (None on CPU)."""
    return torch.cuda.Stream(device, priority=-1 if high else 0) if device.type == "cuda" else None


def on(s) -> contextlib.AbstractContextManager:
    return torch.cuda.stream(s) if s is not None else contextlib.nullcontext()


class WindowLoad:
    """token2wav solving steady-state windows on its own thread and stream: one every `pace` seconds, or back to
    back (pace 0), until stopped."""

    def __init__(self, engine, window: int, pace: float, codes_limit: int, part: str = "window"):
        decoder = engine.model
        self.decoder, self.pace, self.part = decoder, pace, part
        done = decoder.left + window
        tail = torch.zeros(1, decoder.dit.mel_dim, decoder.vocoder_context, device=decoder.device)
        self.inputs = lambda: [StageInput("load", [(7 * j) % codes_limit for j in range(done + window + decoder.right)],
                                          params={"voice": next(iter(decoder.speakers)), "emitted": done,
                                                  "mel_tail": tail, "seed": 0}, final=False)]
        self.frames = max(frames for _, frames in decoder.window_shapes())  # a steady-state window's vocoder pass
        self.stream = stream(decoder.device, high=False)
        self.window_ms: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        decoder = self.decoder
        mel = torch.zeros(1, decoder.dit.mel_dim, self.frames, device=decoder.device)
        with on(self.stream), torch.inference_mode():
            while not self._stop.is_set():
                start = time.perf_counter()
                if self.part == "vocoder":
                    decoder.vocode(mel).cpu()
                else:
                    decoder.generate(self.inputs())  # audio copied to the host: the window is done
                self.window_ms.append(1000 * (time.perf_counter() - start))
                if self.pace:
                    self._stop.wait(max(0.0, self.pace - (time.perf_counter() - start)))

    def __enter__(self) -> WindowLoad:
        if self.part == "solve":  # the flow-matching solve only: the vocoder's pass is skipped
            decoder, self._vocode = self.decoder, self.decoder.vocode
            decoder.vocode = lambda mel: torch.zeros(mel.shape[0], mel.shape[-1] * decoder.HOP, device=mel.device)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        if self.part == "solve":
            self.decoder.vocode = self._vocode


class Poking:
    """A second CUDA context (cuda_context.SecondContext) given a 4-byte memset every `every` seconds, on a thread
    of its own, while the block runs."""

    def __init__(self, device_index: int, every: float):
        self.device_index, self.every, self.pokes = device_index, every, 0
        self.stop = threading.Event()

    def _run(self) -> None:
        while not self.stop.wait(self.every):
            self.second.poke()
            self.pokes += 1

    def __enter__(self) -> Poking:
        self.second = SecondContext(self.device_index)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        self.second.close()


def talker_ms_per_code(engine, pipeline, params: SamplingParams, tag: str, s) -> float:
    """One request's codes after its (whole) reply, decoded on stream `s`: milliseconds per code."""
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    with on(s):
        engine.add_request(talker_input(pipeline, tag, 156, 128, params))
        while engine.stats()["num_running"] < 1 or any(q.num_computed < q.num_prompt_tokens
                                                        for q in engine.seqs.values()):
            engine.step()  # the prefill (and a first code)
        sync()
        drawn, start = 0, time.perf_counter()
        while engine.has_work():
            drawn += sum(len(out.token_ids) for out in engine.step())
        sync()
    return 1000 * (time.perf_counter() - start) / max(drawn, 1)


class SlowingOps(TorchDispatchMode):
    """Inside the first step: after every aten op, the burst graph replayed alone on the default stream (10 times);
    records each op after which it is slow, with the ops before it (the Triton kernels between aten ops are not
    seen one by one), then runs another context to make it fast again and goes on (up to `limit` finds)."""

    def __init__(self, engine, record, limit: int = 12) -> None:
        super().__init__()
        graphs = engine.runner.burst_graphs
        self.graph, self.record, self.ops, self.fast, self.found = graphs[min(graphs)], record, [], None, 0
        self.device, self.limit = engine.device.index or 0, limit

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.found < self.limit:
            self.ops.append(str(func))
            torch.cuda.synchronize()
            ms = replay_ms(self.graph, 10, stream=torch.cuda.default_stream())
            self.fast = self.fast or ms
            if ms > self.fast + 0.15:
                self.found += 1
                self.record(part="slowing_op", op=len(self.ops), ms=ms, fast=self.fast, ops=self.ops[-6:])
                other_context(self.device)
        return out


def stepwise(engine, pipeline, params: SamplingParams, s, burst_replay_ms, record) -> None:
    """One request stepped after a reset (another context run), the burst graph timed after every step."""
    other_context(engine.device.index or 0)
    record(part="stepwise", step=-1, ms_per_replay=burst_replay_ms())
    with on(s):
        engine.add_request(talker_input(pipeline, "stepwise", 156, 128, params))
    step = 0
    while engine.has_work():
        with on(s), (SlowingOps(engine, record) if step == 0 else contextlib.nullcontext()):
            codes = sum(len(out.token_ids) for out in engine.step())
        torch.cuda.synchronize()
        record(part="stepwise", step=step, codes=codes, running=engine.stats()["num_running"],
               ms_per_replay=burst_replay_ms())
        step += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--checkpoint", type=Path, help="a full-size checkpoint (omni_qwen2_5.py writes one)")
    ap.add_argument("--codes", type=int, default=600)
    ap.add_argument("--pace", type=float, default=0.28, help="seconds between windows in token2wav_paced")
    ap.add_argument("--window", type=int, default=192)
    ap.add_argument("--token2wav-dtype", default="bfloat16")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--modes", default="alone,token2wav_paced,token2wav_loop,thinker",
                    help="which measurements (thinker: thinker_idle and thinker_idle+token2wav_paced)")
    ap.add_argument("--reset-check", action="store_true",
                    help="before each measurement another CUDA context runs once on the device; after it, the "
                         "talker's batch-1 burst graph is timed alone: which neighbour puts the process back in "
                         "run 35's slow state?")
    ap.add_argument("--poke-every", type=float, default=0.0, metavar="SECONDS",
                    help="during each measurement, a memset in a second CUDA context this often (the GPU switches "
                         "to it and back): does it keep run 35's slow state away, and what does it cost?")
    ap.add_argument("--stepwise", action="store_true",
                    help="after the warm-up: another CUDA context runs once, then one request is stepped with the "
                         "talker's burst graph timed alone after every step: which step puts the process back in "
                         "run 35's slow state?")
    ap.add_argument("--keep-second-context", action="store_true",
                    help="after the warm-up, a second CUDA context made and kept, idle, for the rest of the run "
                         "(run 36: while one lives, work on other streams left the "
                         "chain fast)")
    ap.add_argument("--log-loads", action="store_true",
                    help="a line whenever Triton loads a kernel's module onto the device (run 36)")
    ap.add_argument("--out")
    args = ap.parse_args()
    modes = args.modes.split(",")
    record = recorder(args.out)
    if args.log_loads and torch.cuda.is_available():
        log_triton_loads(record)
    path = checkpoint_path(args.tiny, args.checkpoint)
    deploy = yaml.safe_load(DEPLOY.read_text())
    for name in ("thinker", "talker"):
        deploy["stages"][name].update(max_model_len=2048, max_num_seqs=1)
    deploy["stages"]["token2wav"]["dtype"] = args.token2wav_dtype
    settings = parse_settings(args.set)
    apply_settings(deploy, settings)
    family, info = detect_family(path)
    pipeline = family.pipeline(info, load_deploy_config(deploy))
    talker, token2wav = pipeline.build_engine("talker"), pipeline.build_engine("token2wav")
    params = SamplingParams(max_tokens=args.codes, temperature=0.9, top_k=40, top_p=0.8, repetition_penalty=1.05,
                            ignore_eos=True, bad_token_ids=list(pipeline.undecodable_codes))
    talker_stream = stream(talker.device, high=True)
    limit = pipeline.config.token2wav_config.dit_config.num_embeds
    window = min(args.window, token2wav.model.max_window) if token2wav.model.max_window else args.window
    talker_ms_per_code(talker, pipeline, params, "warm-up", talker_stream)

    def burst_replay_ms() -> float | None:
        graphs = talker.runner.burst_graphs
        return replay_ms(graphs[min(graphs)], 200 if not args.stepwise else 30) if graphs else None

    second = (SecondContext(talker.device.index or 0)
              if args.keep_second_context and talker.device.type == "cuda" else None)
    if args.stepwise and talker.device.type == "cuda":
        stepwise(talker, pipeline, params, talker_stream, burst_replay_ms, record)

    def measure(mode: str, pace: float | None) -> None:
        if args.reset_check and talker.device.type == "cuda":
            other_context(talker.device.index or 0)
            record(part="burst_replays", before=mode, after_reset=True, ms_per_replay=burst_replay_ms())
        part = mode.split("_")[0] if mode.startswith(("solve", "vocoder")) else "window"
        load = WindowLoad(token2wav, window, pace, limit, part) if pace is not None else contextlib.nullcontext()
        poking = (Poking(talker.device.index or 0, args.poke_every)
                  if args.poke_every and talker.device.type == "cuda" else contextlib.nullcontext())
        with load, poking:
            ms = talker_ms_per_code(talker, pipeline, params, mode, talker_stream)
        windows = load.window_ms if pace is not None else []
        record(part="talker_interference", mode=mode, settings=settings, codes=args.codes, window=window,
               pace_s=pace, talker_ms_per_code=round(ms, 3), windows=len(windows),
               window_ms_median=round(statistics.median(windows), 1) if windows else None,
               **({"poke_every_s": args.poke_every, "pokes": poking.pokes} if isinstance(poking, Poking) else {}))
        if args.reset_check and talker.device.type == "cuda":
            record(part="burst_replays", after=mode, ms_per_replay=burst_replay_ms())

    for mode, pace in (("alone", None), ("token2wav_paced", args.pace), ("token2wav_loop", 0.0),
                       ("solve_loop", 0.0), ("vocoder_loop", 0.0), ("alone", None)):
        if mode in modes:
            measure(mode, pace)
    if "thinker" in modes:
        thinker = pipeline.build_engine("thinker")  # resident, never stepped
        measure("thinker_idle", None)
        measure("thinker_idle+token2wav_paced", args.pace)
        thinker.shutdown()
    talker.shutdown()
    if second is not None:
        second.close()


if __name__ == "__main__":
    main()
