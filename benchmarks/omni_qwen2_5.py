"""Qwen2.5-Omni speech serving vs HF transformers' sequential `generate`, in one process and one run.

Workload (BENCHMARKING.md): the speech system prompt and a question (156 tokens with the factory's
tokenizer; BENCHMARKING.md's reference used 64), 128 thinker tokens and 600 codec tokens (12 s of speech) per
request; random weights from the real config with the released talker size, the talker kept
on codec ids token2wav can embed, so both sides do the same work.

- HF: `Qwen2_5OmniForConditionalGeneration.generate`, one request: end-to-end seconds (its only audio
  packet arrives at the end) and RTF.
- omnistage: `AsyncOmni` with streaming between stages and windowed token2wav: time to first audio
  packet, end-to-end latency and RTF at concurrency 1, then request and audio throughput at 8 and 32.

Each omnistage row also carries, per stage, its engine steps and mean step time over that wave, and how
long a listener playing the audio chunks as they arrive would have waited after the first one (stalls).
omnistage runs with the one-GPU deploy config (configs/qwen2_5_omni/1gpu.yaml: stages inline, a CUDA stream
each) or the one `--deploy-config` names; `--backends process` puts each stage in its own process instead.

    python benchmarks/omni_qwen2_5.py --out omni.jsonl            # full size (GPU)
    python benchmarks/omni_qwen2_5.py --checkpoint /tmp/omni      # write it once, reuse it later
    python benchmarks/omni_qwen2_5.py --parts ours --token2wav-dtype bfloat16   # the bf16 DiT
    python benchmarks/omni_qwen2_5.py --parts ours --tf32                       # the TF32 DiT
    python benchmarks/omni_qwen2_5.py --parts ours --backends inline,process    # both backends
    python benchmarks/omni_qwen2_5.py --parts ours --deploy-config configs/qwen2_5_omni/2gpu.yaml   # two GPUs
    python benchmarks/omni_qwen2_5.py --parts ours --http         # through the real HTTP server
    python benchmarks/omni_qwen2_5.py --parts ours --vary-codes 96   # every request a length not seen before
    python benchmarks/omni_qwen2_5.py --tiny                      # the tiny checkpoint (CPU is fine)

token2wav alone (window sizes, batches, DiT precision): `benchmarks/kernel_bench.py token2wav`; the talker
alone: tools/profile/talker_steps.py.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import gc
import json
import multiprocessing
import statistics
import sys
import tempfile
import time
import traceback
from base64 import b64decode
from collections.abc import AsyncIterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import httpx
import torch
import yaml
from recording import recorder
from switches import add_kernel_switches, apply_kernel_switches

from omnistage import AsyncOmni, SamplingParams
from omnistage.bench.serve import stream_events
from omnistage.entrypoints.openai.server import BackgroundServer
from omnistage.families.qwen2_5_omni import SPEECH_SYSTEM_PROMPT
from omnistage.types import OmniRequest

SAMPLE_RATE = 24000
DEPLOY = Path(__file__).resolve().parent.parent / "configs" / "qwen2_5_omni" / "1gpu.yaml"
PROMPT = "Please tell me, in a long and friendly story, everything you know about rivers, mountains and the sea."


def released_config():
    """The released 7B layout (HF's default thinker/token2wav) with the released talker size."""
    from transformers import Qwen2_5OmniConfig

    config = Qwen2_5OmniConfig()
    talker = config.talker_config
    talker.hidden_size, talker.intermediate_size, talker.num_hidden_layers = 896, 18944, 24
    talker.num_attention_heads, talker.num_key_value_heads, talker.head_dim, talker.embedding_size = 12, 4, 128, 3584
    thinker = config.thinker_config
    for name in ("audio_start_token_id", "audio_end_token_id", "vision_start_token_id", "vision_end_token_id",
                 "position_id_per_seconds", "seconds_per_chunk"):  # in the released config.json, not the defaults
        if getattr(thinker, name, None) is None:
            setattr(thinker, name, getattr(talker, name))
    if getattr(talker, "layer_types", None):  # one entry per layer, or the saved config does not load
        talker.layer_types = talker.layer_types[:talker.num_hidden_layers]
    return config


def write_full_checkpoint(path: Path, config=None) -> Path:
    """Random full-size weights plus our own tokenizer/processor files and two voices (text prompts only:
    the tiny tokenizer's media token ids do not match the released config)."""
    from transformers import Qwen2_5OmniForConditionalGeneration

    from omnistage.testing.qwen2_5_omni import make_omni_tokenizer, save_processor

    config = config or released_config()
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen2_5OmniForConditionalGeneration(config)
    torch.set_default_dtype(torch.float32)
    model.save_pretrained(path)
    make_omni_tokenizer(path)
    save_processor(path)
    t2w = config.token2wav_config
    voices = {name: {"bos_token": bos, "cond": torch.randn(1, t2w.dit_config.enc_emb_dim),
                     "ref_mel": torch.randn(1, 300, t2w.dit_config.mel_dim)}
              for name, bos in (("Chelsie", 151870), ("Ethan", 151872))}
    torch.save(voices, path / "spk_dict.pt")
    return path


def codec_limits(path: Path) -> tuple[int, int]:
    from transformers import Qwen2_5OmniConfig

    config = Qwen2_5OmniConfig.from_pretrained(path)
    return config.token2wav_config.dit_config.num_embeds, config.talker_config.vocab_size


def hf_reference(path: Path, thinker_tokens: int, codes: int, record) -> None:
    from transformers import Qwen2_5OmniForConditionalGeneration, Qwen2_5OmniProcessor

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(path, dtype=dtype).to(device).eval()
    model.token2wav.float()
    processor = Qwen2_5OmniProcessor.from_pretrained(path)
    messages = [{"role": "system", "content": [{"type": "text", "text": SPEECH_SYSTEM_PROMPT}]},
                {"role": "user", "content": PROMPT}]  # the same prompt omnistage builds for speech
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = processor(text=[text], return_tensors="pt")["input_ids"].to(device)
    limit, vocab = codec_limits(path)
    kw = dict(speaker="Chelsie", thinker_max_new_tokens=thinker_tokens, thinker_min_new_tokens=thinker_tokens,
              thinker_do_sample=False, talker_max_new_tokens=codes, talker_min_new_tokens=codes,
              talker_bad_words_ids=[[i] for i in range(limit, vocab)])
    with torch.no_grad():
        model.generate(input_ids=ids, **{**kw, "thinker_max_new_tokens": 4, "thinker_min_new_tokens": 4,
                                         "talker_max_new_tokens": 8, "talker_min_new_tokens": 8})  # warm-up
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        _, wav = model.generate(input_ids=ids, **kw)
        if device == "cuda":
            torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    audio = wav.numel() / SAMPLE_RATE
    record(part="hf_generate_with_audio", prompt_tokens=ids.shape[1], thinker_tokens=thinker_tokens, codes=codes,
           e2e_s=round(seconds, 3), first_audio_packet_s=round(seconds, 3), audio_s=round(audio, 3),
           rtf=round(seconds / audio, 3))
    del model
    if device == "cuda":
        torch.cuda.empty_cache()


async def engine_events(engine: AsyncOmni, rid: str, params: dict) -> AsyncIterator[tuple[bool, int, int]]:
    """One request through `AsyncOmni` in this process: (text came, audio samples, prompt tokens) per output."""
    request = OmniRequest(request_id=rid, messages=[{"role": "user", "content": PROMPT}], stage_params=params,
                          output_modalities=("text", "audio"), options={"voice": "Chelsie"})
    async for out in engine.generate(request):
        if out.error:
            raise RuntimeError(out.error)
        yield bool(out.text or out.token_ids), 0 if out.audio is None else out.audio.size, out.num_prompt_tokens or 0


async def http_events(client: httpx.AsyncClient, url: str, params: dict) -> AsyncIterator[tuple[bool, int, int]]:
    """The same request as a user sends it: a streamed chat completion with spoken output from the real server
    (per-stage sampling in `sampling_params_list`); per chunk (text came, audio samples, prompt tokens)."""
    defaults = asdict(SamplingParams())
    payload = {"messages": [{"role": "user", "content": PROMPT}], "stream": True, "return_token_ids": True,
               "stream_options": {"include_usage": True}, "modalities": ["text", "audio"],
               "audio": {"voice": "Chelsie", "format": "pcm16"},
               "sampling_params_list": [{k: v for k, v in asdict(params[stage]).items() if v != defaults[k]}
                                        for stage in ("thinker", "talker")]}
    async for chunk in stream_events(client, f"{url}/v1/chat/completions", payload):
        prompt = (chunk.get("usage") or {}).get("prompt_tokens", 0)
        for choice in chunk["choices"] or [{"delta": {}}]:
            delta, audio = choice["delta"], (choice["delta"].get("audio") or {}).get("data")
            samples = len(b64decode(audio)) // 2 if audio else 0  # pcm16: two bytes a sample
            yield bool(delta.get("content") or choice.get("token_ids")), samples, prompt


async def http_wave(url: str, params: list[dict]) -> list[dict]:
    """A request per item of `params` through the server at `url`, all at once, each timed by `one_request`."""
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=len(params))) as client:
        return await asyncio.gather(*(one_request(http_events(client, url, p)) for p in params))


def run_http_wave(url: str, params: list[dict]) -> list[dict]:
    """`http_wave` from a client process of its own."""
    return asyncio.run(http_wave(url, params))


async def one_request(events: AsyncIterator[tuple[bool, int, int]]) -> dict:
    """Times one request's outputs as they arrive (`engine_events` or `http_events`)."""
    start = time.perf_counter()
    first_audio, samples, prompt = None, 0, 0
    playhead = stall = 0.0  # a listener playing chunks as they come: where playback is, and time it waited
    first_text = last_text = None
    chunks = []  # (seconds since start, seconds of audio) per audio chunk: when the windows came out
    async for text, audio, prompt_tokens in events:
        prompt = prompt_tokens or prompt
        now = time.perf_counter() - start
        if text:
            first_text, last_text = first_text or now, now
        if audio:
            first_audio = first_audio or now
            if samples and now > playhead:  # the previous chunks ran out before this one arrived
                stall += now - playhead
            playhead = max(playhead, now) + audio / SAMPLE_RATE
            samples += audio
            chunks.append((round(now, 3), round(audio / SAMPLE_RATE, 3)))
    e2e = time.perf_counter() - start
    return {"ttfp": first_audio, "e2e": e2e, "audio": samples / SAMPLE_RATE, "prompt": prompt, "stall": stall,
            "first_text": first_text, "last_text": last_text, "chunks": chunks}


async def sample_stages(engine: AsyncOmni, start: float, every_s: float = 0.1) -> list[dict]:
    """Each stage's activity while a wave runs, per `every_s` slice: engine steps, the share of the slice its
    loop spent stepping (busy), requests with output per step (batch), and the share spent routing its outputs
    on (reporting). Cancel to stop; the task's result is the rows."""
    rows, before = [], engine.stats()
    try:
        while True:
            await asyncio.sleep(every_s)
            after = engine.stats()
            row = {"t": round(time.perf_counter() - start, 2)}
            for stage, stats in after.items():
                steps = stats.get("steps", 0) - before[stage].get("steps", 0)
                busy = stats.get("step_seconds", 0.0) - before[stage].get("step_seconds", 0.0)
                outputs = stats.get("step_outputs", 0) - before[stage].get("step_outputs", 0)
                routing = stats.get("report_seconds", 0.0) - before[stage].get("report_seconds", 0.0)
                row[stage] = [steps, round(busy / every_s, 2), round(outputs / max(steps, 1), 1),
                              round(routing / every_s, 2)]
            rows.append(row)
            before = after
    except asyncio.CancelledError:
        return rows


class GcPauses:
    """The cyclic garbage collector's pauses (every thread of the process waits while it runs), per wave."""

    def __init__(self) -> None:
        self.started, self.pauses = 0.0, []  # (generation, seconds)
        gc.callbacks.append(self._on)

    def _on(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.started = time.perf_counter()
        else:
            self.pauses.append((info["generation"], time.perf_counter() - self.started))

    def take(self) -> dict:
        pauses, self.pauses = self.pauses, []
        full = [s for g, s in pauses if g == 2]
        return {"collections": len(pauses), "seconds": round(sum(s for _, s in pauses), 3),
                "longest_s": round(max((s for _, s in pauses), default=0.0), 3), "full": len(full),
                "full_seconds": round(sum(full), 3)}


def request_params(path: Path, thinker_tokens: int, codes: int) -> dict[str, SamplingParams]:
    """Per-stage sampling of the workload: a greedy reply, the released talker sampling kept on codec ids
    token2wav can embed."""
    limit, vocab = codec_limits(path)
    return {"thinker": SamplingParams(max_tokens=thinker_tokens, temperature=0, ignore_eos=True),
            "talker": SamplingParams(max_tokens=codes, temperature=0.9, top_k=40, top_p=0.8, repetition_penalty=1.05,
                                     ignore_eos=True, bad_token_ids=list(range(limit, vocab)))}


def checkpoint_path(tiny: bool, checkpoint: Path | None) -> Path:
    """The tiny checkpoint (`--tiny`), or the full-size one at `checkpoint` (default /tmp/omni), written there
    first if it is not there yet."""
    if tiny:
        from omnistage.testing import tiny_checkpoint

        return Path(tiny_checkpoint("qwen2_5_omni"))
    path = Path(checkpoint or "/tmp/omni")
    if not (path / "config.json").is_file():
        write_full_checkpoint(path)
    return path


def parse_settings(items: list[str]) -> dict[str, Any]:
    """`--set KEY=VALUE` items as {dotted deploy-config key: value parsed as YAML}."""
    return {key: yaml.safe_load(value) for key, value in (item.split("=", 1) for item in items)}


def apply_settings(deploy: dict[str, Any], settings: dict[str, Any]) -> None:
    """Dotted deploy-config fields (`--set stages.token2wav.options.max_window=96`,
    `--set stages.talker.advanced.decode_burst=4`) into `deploy`; without a GPU,
    stages inline and without device placement."""
    for key, value in settings.items():
        *parents, leaf = key.split(".")
        node = deploy
        for name in parents:
            node = node.setdefault(name, {})
        node[leaf] = value
    if not torch.cuda.is_available():
        deploy.update(worker_backend="inline")
        for stage in deploy["stages"].values():
            stage.pop("devices", None)
            stage.pop("gpu_memory_utilization", None)


def one_at_a_time_deploy(settings: dict[str, Any]) -> dict[str, Any]:
    """The default deploy config sized for one request at a time (the bfloat16 DiT), `--set` overrides applied:
    what the c=1 probes (thinker_phase.py, tail_trace.py) run."""
    deploy = yaml.safe_load(DEPLOY.read_text())
    for name in ("thinker", "talker"):
        deploy["stages"][name].update(max_model_len=2048, max_num_seqs=1)
    deploy["stages"]["token2wav"].update(max_num_seqs=1, dtype="bfloat16")
    apply_settings(deploy, settings)
    return deploy


def probe_arguments(requests_help: str) -> argparse.ArgumentParser:
    """The command line the c=1 probes share: the checkpoint (or --tiny), how many requests, `--set`, `--out`."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--checkpoint", type=Path, help="a full-size checkpoint (omni_qwen2_5.py writes one)")
    ap.add_argument("--requests", type=int, default=3, help=requests_help)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a deploy-config field")
    ap.add_argument("--graph-buckets", help="AR stages capture decode graphs for only these batch sizes, e.g. 1 "
                                            "(a diagnostic: run 34's batch-1 graphs beside other sizes' ones)")
    ap.add_argument("--out")
    return ap


def only_graph_buckets(buckets: str | None) -> None:
    """A diagnostic: every AR stage built after this captures decode (and burst) graphs for only these batch sizes
    ("1,64"). Only for probes that decode no larger batch than the largest of them (the runner would look for a
    graph that is not there). None: the runner's buckets."""
    if buckets:
        import omnistage.engine.ar.cuda_graphs as cuda_graphs

        cuda_graphs.bucket_sizes = lambda max_batch: [int(b) for b in buckets.split(",")]


def ours(path: Path, thinker_tokens: int, codes: int, concurrency: list[int], record,
         backend: str | None = None, wave_timeout_s: float = 240.0, token2wav_dtype: str = "auto",
         tf32: bool = False, stream_priority: str = "auto", profile_dir: Path | None = None,
         overlap_decode: bool = True, overlap_sampled: bool | None = None, settings: dict[str, Any] | None = None,
         timeline_out: Path | None = None, gc_compare: bool = False, switch_intervals: list[float] = (),
         deploy_config: Path = DEPLOY, http: str | None = None, step_trace: bool = False,
         vary_codes: int = 0) -> None:
    params = request_params(path, thinker_tokens, codes)
    sent = 0  # requests so far, warm-up included (--vary-codes: each one's code count)

    def wave_params(n: int) -> list[dict]:
        """The next n requests' sampling: all `params`, or with --vary-codes a code count of its own per request
        (codes, codes - 1, ... down to codes - vary_codes + 1, then again): lengths a server has not seen yet."""
        nonlocal sent
        out = []
        for k in range(sent, sent + n):
            count = codes - k % vary_codes if vary_codes else codes
            out.append({**params, "talker": replace(params["talker"], max_tokens=count)})
        sent += n
        return out
    steps = None
    if step_trace:  # a diagnostic kept in tools/profile/
        sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "tools" / "profile"))
        from step_trace import StepTrace

        steps = StepTrace()
    deploy = yaml.safe_load(deploy_config.read_text())
    deploy["worker_backend"] = backend or deploy.get("worker_backend", "inline")
    for name in ("thinker", "talker"):
        deploy["stages"][name].update(max_model_len=2048, max_num_seqs=max(concurrency))
        advanced = deploy["stages"][name].setdefault("advanced", {})
        advanced["overlap_decode"] = overlap_decode
        if overlap_sampled is not None:  # else the engine's default (on)
            advanced["overlap_sampled"] = overlap_sampled
    deploy["stages"]["token2wav"].update(max_num_seqs=max(concurrency), dtype=token2wav_dtype)
    if tf32:
        deploy["stages"]["token2wav"].setdefault("advanced", {})["tf32"] = True
    if stream_priority != "auto":
        for stage in deploy["stages"].values():
            stage.setdefault("advanced", {})["stream_priority"] = stream_priority
    apply_settings(deploy, settings or {})
    started = time.perf_counter()
    engine = AsyncOmni(path, deploy)
    print(f"omnistage ({backend}) up in {time.perf_counter() - started:.1f}s", file=sys.stderr, flush=True)
    server = BackgroundServer(engine).start() if http else None
    client_process = None
    if http == "own-process":  # spawned: a fork would copy the server's threads' state mid-flight
        client_process = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        client_process.submit(int).result()  # started (imports done) before the first wave is timed
    try:
        timelines: dict[int, dict] = {}  # per concurrency, its last wave's stage activity and request events

        async def wave(n: int) -> tuple[list[dict], float]:
            print(f"wave of {n}", file=sys.stderr, flush=True)
            start = time.perf_counter()
            sampler = asyncio.ensure_future(sample_stages(engine, start))
            if steps is not None:
                steps.begin()
            each = wave_params(n)
            if server is None:
                requests = asyncio.gather(*(one_request(engine_events(engine, f"c{n}-{i}", p))
                                            for i, p in enumerate(each)))
            elif client_process is None:  # the client beside the server, in this process
                requests = http_wave(server.url, each)
            else:  # the client in a process of its own, as a user's would be
                requests = asyncio.get_running_loop().run_in_executor(client_process, run_http_wave, server.url,
                                                                      each)
            try:  # a stuck run reports, not hangs
                results = await asyncio.wait_for(requests, wave_timeout_s)
            except TimeoutError:
                faulthandler.dump_traceback(sys.stderr, all_threads=True)  # where inline stages are stuck
                raise
            finally:
                sampler.cancel()
            wall = time.perf_counter() - start
            events = ("first_text", "last_text", "ttfp", "e2e")
            timelines[n] = {"stages": await sampler, "requests": [
                {**{k: r[k] and round(r[k], 3) for k in events}, "chunks": r["chunks"]} for r in results]}
            if steps is not None:
                timelines[n]["steps"] = steps.take()
            return results, wall

        for n in sorted({1, max(concurrency)}):  # warm-up: kernels compiled and tuned for every batch shape seen
            asyncio.run(wave(n))
        pauses = GcPauses()
        # the engine froze what existed at start-up out of the collector's scans; --gc-compare: one more wave
        # of the largest concurrency with them back in
        # --switch-intervals: more waves at the largest concurrency, each with the interpreter's thread switch
        # interval set to one of them (how long a thread waiting for the GIL waits before asking for it)
        waves = [(n, "frozen", sys.getswitchinterval()) for n in concurrency]
        waves += [(max(concurrency), "frozen", interval) for interval in switch_intervals]
        waves += [(max(concurrency), "unfrozen", sys.getswitchinterval())] if gc_compare else []
        for n, collector, interval in waves:
            sys.setswitchinterval(interval)
            if collector == "unfrozen":
                gc.unfreeze()
            pauses.take()
            before = engine.stats()
            runs = [asyncio.run(wave(n)) for _ in range(3 if n == 1 else 1)]
            after = engine.stats()
            results = [r for rs, _ in runs for r in rs]
            wall = statistics.median(w for _, w in runs)
            audio = sum(r["audio"] for r in runs[0][0])
            record(part="omnistage", deploy_config=deploy_config.name, backend=deploy["worker_backend"],
                   token2wav_dtype=token2wav_dtype, tf32=tf32,
                   stream_priority=stream_priority, overlap_decode=overlap_decode,
                   overlap_sampled=deploy["stages"]["talker"]["advanced"].get("overlap_sampled", True),
                   decode_burst=deploy["stages"]["talker"]["advanced"].get("decode_burst", "family default"),
                   settings=settings or {}, concurrency=n, requests=len(runs[0][0]),
                   prompt_tokens=results[0]["prompt"],
                   thinker_tokens=thinker_tokens, codes=codes, vary_codes=vary_codes,
                   ttfp_s_median=round(statistics.median(r["ttfp"] for r in results), 3),
                   e2e_s_median=round(statistics.median(r["e2e"] for r in results), 3),
                   rtf_median=round(statistics.median(r["e2e"] / r["audio"] for r in results), 3),
                   # the slowest requests: a median can hide a few left far behind (run 12e)
                   e2e_s_max=round(max(r["e2e"] for r in results), 3),
                   rtf_max=round(max(r["e2e"] / r["audio"] for r in results), 3),
                   playback_stall_s_median=round(statistics.median(r["stall"] for r in results), 3),
                   requests_per_s=round(len(runs[0][0]) / wall, 3), audio_s_per_s=round(audio / wall, 2),
                   stages=stage_steps(before, after), gc_startup_objects=collector, gc_pauses=pauses.take(),
                   switch_interval_s=interval, client=f"http, {http}" if http else "in-process",
                   gpu_peak_allocated_gib=peak_allocated_gib(deploy["worker_backend"]))
            if timeline_out is not None:
                with timeline_out.open("a") as f:
                    f.write(json.dumps({"concurrency": n, "client": f"http, {http}" if http else "in-process",
                                        "gc_startup_objects": collector,
                                        "switch_interval_s": interval, "settings": settings or {},
                                        **timelines[n]}) + "\n")
        if profile_dir is not None:  # a trace of each concurrency's wave: host threads and GPU streams
            from torch.profiler import ProfilerActivity, profile

            profile_dir.mkdir(parents=True, exist_ok=True)
            for n in concurrency:
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    asyncio.run(wave(n))
                prof.export_chrome_trace(str(profile_dir / f"wave-c{n}.json"))
    finally:
        if client_process is not None:
            client_process.shutdown()
        if server is not None:
            server.stop()
        engine.shutdown()


def peak_allocated_gib(backend: str) -> dict[str, float] | None:
    """Peak memory torch allocated on each GPU so far (start-up included): inline stages only, as a process
    backend's stages allocate in processes of their own."""
    if backend != "inline" or not torch.cuda.is_available():
        return None
    peaks = {f"cuda:{d}": torch.cuda.max_memory_allocated(d) for d in range(torch.cuda.device_count())}
    return {device: round(peak / 2**30, 2) for device, peak in peaks.items() if peak}


def stage_steps(before: dict, after: dict) -> dict:
    """Per stage over a wave: engine steps, mean milliseconds per step, and the loop's milliseconds per step
    outside it: routing outputs on, applying arriving inputs."""
    out = {}
    for stage, stats in after.items():
        steps = stats.get("steps", 0) - before[stage].get("steps", 0)
        seconds = stats.get("step_seconds", 0.0) - before[stage].get("step_seconds", 0.0)
        routing = stats.get("report_seconds", 0.0) - before[stage].get("report_seconds", 0.0)
        commands = stats.get("command_seconds", 0.0) - before[stage].get("command_seconds", 0.0)
        out[stage] = {"steps": steps, "ms_per_step": round(1000 * seconds / max(steps, 1), 3),
                      "routing_ms_per_step": round(1000 * routing / max(steps, 1), 3),
                      "inputs_ms_per_step": round(1000 * commands / max(steps, 1), 3)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out")
    ap.add_argument("--parts", default="ours,hf", help="ours, hf or both")
    ap.add_argument("--deploy-config", type=Path, default=DEPLOY,
                    help="the deploy config omnistage starts from (the benchmark sizes its stages for the waves)")
    ap.add_argument("--http", nargs="?", const="own-process", choices=["own-process", "same-process"],
                    help="send omnistage's requests through the real HTTP server (streamed chat completions with "
                         "audio) instead of calling AsyncOmni in this process, from a client process of its own "
                         "(default) or from this one (its parsing then competes with the server for the GIL)")
    ap.add_argument("--backends", default="", help="omnistage worker backends to run, e.g. inline,process; "
                    "default: the deploy config's")
    ap.add_argument("--token2wav-dtype", default="auto", help="the DiT's dtype: auto (float32) or bfloat16")
    ap.add_argument("--tf32", action="store_true", help="token2wav's float32 DiT matmuls on TF32 tensor cores")
    ap.add_argument("--stream-priority", choices=["auto", "normal"], default="auto",
                    help="inline stages' CUDA stream priorities: auto (thinker and talker high) or all normal")
    ap.add_argument("--no-overlap", action="store_true", help="AR stages read each step's tokens before the next")
    ap.add_argument("--overlap-sampled", choices=["on", "off"],
                    help="sampled (talker) decode steps in flight, drawn on the device; default: the deploy config's")
    ap.add_argument("--wave-timeout", type=float, default=240.0, help="seconds before a wave counts as stuck")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--vary-codes", type=int, default=0, metavar="N",
                    help="request k asks for codes - k %% N codes (warm-up included): lengths not seen before, as "
                         "a server meets them (0: every request the same)")
    ap.add_argument("--profile", type=Path, help="also write a torch profiler trace of one wave per concurrency here")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a deploy-config setting (YAML value), e.g. stages.token2wav.dtype=bfloat16; repeatable")
    ap.add_argument("--timeline", type=Path, help="append each wave's stage activity (per 0.1 s) and per-request "
                    "event times (first/last text, each audio chunk) here as JSON lines")
    ap.add_argument("--step-trace", action="store_true",
                    help="with --timeline: every engine step of each wave too (tools/profile/step_trace.py)")
    ap.add_argument("--switch-intervals", default="",
                    help="comma-separated seconds: one more wave at the largest concurrency with each as the "
                         "interpreter's thread switch interval (sys.setswitchinterval)")
    ap.add_argument("--gc-compare", action="store_true",
                    help="one more wave at the largest concurrency with start-up objects back in the collector's scans")
    ap.add_argument("--checkpoint", help="where the full-size checkpoint is (written there if missing)")
    add_kernel_switches(ap)
    args = ap.parse_args()
    kernels = apply_kernel_switches(args)

    def record(**row) -> None:
        write(**row, **({"kernels": kernels} if kernels else {}))

    write = recorder(args.out)

    if args.tiny:
        from omnistage.testing import tiny_checkpoint

        path, thinker_tokens, codes = tiny_checkpoint("qwen2_5_omni"), 16, 60
    else:
        path = Path(args.checkpoint or Path(tempfile.mkdtemp()) / "omni")
        if not (path / "config.json").is_file():
            write_full_checkpoint(path)
        thinker_tokens, codes = 128, 600
    concurrency = [int(c) for c in args.concurrency.split(",")]
    if "ours" in args.parts:
        for backend in args.backends.split(",") if args.backends else [None]:
            try:
                ours(path, thinker_tokens, codes, concurrency, record, backend, args.wave_timeout,
                     token2wav_dtype=args.token2wav_dtype, tf32=args.tf32, stream_priority=args.stream_priority,
                     profile_dir=args.profile, overlap_decode=not args.no_overlap,
                     overlap_sampled=None if args.overlap_sampled is None else args.overlap_sampled == "on",
                     settings=parse_settings(args.set),
                     timeline_out=args.timeline, gc_compare=args.gc_compare,
                     switch_intervals=[float(x) for x in args.switch_intervals.split(",") if x],
                     deploy_config=args.deploy_config, http=args.http, step_trace=args.step_trace,
                     vary_codes=args.vary_codes)
            except Exception as exc:  # one backend's failure still leaves the others and HF to measure
                traceback.print_exc()
                record(part="omnistage", backend=backend, error=f"{type(exc).__name__}: {exc}")
    if "hf" in args.parts:
        hf_reference(path, thinker_tokens, codes, record)


if __name__ == "__main__":
    main()
