"""Qwen3-TTS serving benchmark: omnistage (streamed, batched) against the authors' `qwen-tts` package, one run.

The checkpoint is the Qwen3-TTS-12Hz-1.7B CustomVoice architecture (FULL_SIZE below) with random bf16 weights,
built by the tiny factory (`omnistage.testing.qwen3_tts`) re-sized; the codec head's eos row is zeroed and the
other rows scaled up, so eos never enters the sampler's top-k and both sides make exactly `--frames` frames.

- reference: `Qwen3TTSModel.from_pretrained(...).generate_custom_voice` in a subprocess with its own PYTHONPATH
  (`--reference-site`, transformers 4.57). c=1: one request at a time; c>1: its batch API (lists of texts and
  speakers in one call, the package left-pads them). It does not stream: first packet = the whole call.
- omnistage: `AsyncOmni` in this process, streamed audio (`stream_audio`), every level's requests submitted at
  once. Per request: time to first audio chunk, end time, audio seconds and the worst playback stall (a listener
  starting at the first chunk: the longest wait for a chunk after the audio before it finished playing).

Columns: ttfp (s, mean / p90 / max), rtf (request wall / its audio, mean), audio_s_per_s (level audio / level wall),
stall_max_s (worst over the level). One JSON line per (side, level) to `--out`.

    python benchmarks/tts_qwen3.py --out benchmarks/results/tts_qwen3-h200.jsonl [--reference-site DIR]
    python benchmarks/tts_qwen3.py --tiny           # CPU, tiny checkpoint, both sides, end to end
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SAMPLE_RATE = 24000
SAMPLES_PER_FRAME = 1920  # 12.5 frames a second
# The released Qwen3-TTS-12Hz-1.7B-CustomVoice config (talker_config and its code_predictor_config) and the
# Qwen3-TTS-Tokenizer-12Hz config (decoder_config). The package's config classes default to other sizes for the
# talker (hidden 1024, 20 layers) and the decoder (hidden 1024, intermediate 3072, head_dim hidden / heads).
FULL_SIZE: dict[str, Any] = {
    "talker": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                   num_key_value_heads=8, head_dim=128, text_hidden_size=2048, rope_theta=1000000.0),
    "mrope_section": [24, 20, 20],  # interleaved; sums to head_dim / 2
    "text_vocab_size": 151936,
    "predictor": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=5, num_attention_heads=16,
                      num_key_value_heads=8, head_dim=128, rope_theta=1000000.0),
    "num_code_groups": 16,
    "codebook_size": 2048,
    "codec_vocab_size": 3072,
    "decoder": dict(codebook_size=2048, codebook_dim=512, latent_dim=1024, hidden_size=512, intermediate_size=1024,
                    num_attention_heads=16, num_key_value_heads=16, head_dim=64, num_hidden_layers=8,
                    num_quantizers=16, sliding_window=72, decoder_dim=1536, upsample_rates=[8, 5, 4, 3],
                    upsampling_ratios=[2, 2]),
}
TEXT = "The quick brown fox jumps over the lazy dog, and then it runs far away into the quiet green forest."
_EOS_OFF_GAIN = 3.0  # the non-eos codec-head rows' gain: their top-k logits stay far above eos's zero


# ---------------------------------------------------------------- checkpoint


def make_checkpoint(out: Path, tiny: bool) -> Path:
    """The CustomVoice checkpoint at `out` (tiny: the factory's sizes, fp32; else FULL_SIZE, bf16), eos kept off."""
    import torch
    from safetensors.torch import load_file, save_file

    import omnistage.testing.qwen3_tts as factory

    marker = out / ".tts_qwen3_done"
    if marker.exists():
        return out
    saved = {k: getattr(factory, k) for k in ("Q", "CODEBOOK", "CODEC_VOCAB", "CODEC_IDS", "SPEAKERS", "LANGUAGES",
                                               "TALKER", "PREDICTOR", "CODEC_DECODER", "CODEC_ENCODER")}
    if not tiny:  # the factory reads its module constants when called: re-size them for this one call
        cb = FULL_SIZE["codebook_size"]
        shift = cb - factory.CODEBOOK  # control ids keep their offsets above the codebook
        factory.Q, factory.CODEBOOK, factory.CODEC_VOCAB = FULL_SIZE["num_code_groups"], cb, FULL_SIZE[
            "codec_vocab_size"]
        factory.CODEC_IDS = {k: v + shift for k, v in saved["CODEC_IDS"].items()}
        factory.SPEAKERS = {k: v + shift for k, v in saved["SPEAKERS"].items()}
        factory.LANGUAGES = {k: v + shift for k, v in saved["LANGUAGES"].items()}
        factory.TALKER, factory.PREDICTOR = FULL_SIZE["talker"], FULL_SIZE["predictor"]
        factory.CODEC_DECODER = _decoder_config()
        factory.CODEC_ENCODER = dict(saved["CODEC_ENCODER"], num_quantizers=factory.Q, codebook_size=cb)
    try:
        factory.make_tiny_qwen3_tts(out, "custom_voice")
        eos = factory.CODEC_IDS["codec_eos_token_id"]
    finally:
        for k, v in saved.items():
            setattr(factory, k, v)
    config = json.loads((out / "config.json").read_text())
    talker = config["talker_config"]
    weights = load_file(str(out / "model.safetensors"))
    if not tiny:
        g = torch.Generator().manual_seed(1)
        vocab, th = FULL_SIZE["text_vocab_size"], FULL_SIZE["talker"]["text_hidden_size"]
        weights["talker.model.text_embedding.weight"] = torch.randn(vocab, th, generator=g)
        talker.update(text_vocab_size=vocab, max_position_embeddings=32768,
                      rope_scaling={"rope_type": "default", "mrope_section": FULL_SIZE["mrope_section"],
                                    "interleaved": True})
        talker["code_predictor_config"]["max_position_embeddings"] = 65536
        config.update(dtype="bfloat16", tts_model_size="1b7")
    head = weights["talker.codec_head.weight"] * _EOS_OFF_GAIN
    head[eos] = 0.0
    weights["talker.codec_head.weight"] = head
    dtype = torch.float32 if tiny else torch.bfloat16
    save_file({k: v.to(dtype).contiguous() for k, v in weights.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    if not tiny:
        st = out / "speech_tokenizer" / "model.safetensors"
        save_file({k: v.to(dtype).contiguous() for k, v in load_file(str(st)).items()}, str(st))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    marker.write_text("ok\n")
    return out


def _decoder_config() -> dict[str, Any]:
    """FULL_SIZE's decoder, less the fields omnistage's codec decoder does not read: the factory writes the weights
    omnistage builds and the config as given, so a field only one side reads would make the two disagree."""
    from omnistage.families.qwen3_tts import codec

    read = {*getattr(codec, "_DECODER_FIELDS", ()), "latent_dim", "codebook_dim"}
    dropped = sorted(set(FULL_SIZE["decoder"]) - read)
    if dropped:
        print(f"warning: omnistage's codec decoder ignores {dropped}: the checkpoint is built without them",
              file=sys.stderr, flush=True)
    return {k: v for k, v in FULL_SIZE["decoder"].items() if k in read}


def speakers(path: Path) -> list[str]:
    return sorted(json.loads((path / "config.json").read_text())["talker_config"]["spk_id"])


# ---------------------------------------------------------------- reference (runs in the package's environment)


def reference_worker(req_path: str, rep_path: str) -> None:
    """In the reference interpreter: imports only torch and qwen_tts. Times generate_custom_voice per level."""
    import torch
    from qwen_tts import Qwen3TTSModel

    req = json.loads(Path(req_path).read_text())
    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda else torch.float32
    tts = Qwen3TTSModel.from_pretrained(req["path"], dtype=dtype, device_map="cuda" if cuda else "cpu")
    kw = dict(max_new_tokens=req["frames"] + 1, do_sample=True)  # the package counts its eos step

    def call(n: int, offset: int) -> tuple[float, list[float]]:
        texts = [req["text"]] * n
        voices = [req["speakers"][(offset + i) % len(req["speakers"])] for i in range(n)]
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        wavs, rate = tts.generate_custom_voice(texts if n > 1 else texts[0], voices if n > 1 else voices[0], **kw)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0, [len(w) / rate for w in wavs]

    call(1, 0)  # warm-up
    rows = []
    for level in req["levels"]:
        if level == 1:  # sequential single requests
            walls, audio = [], []
            for i in range(req["requests_c1"]):
                w, a = call(1, i)
                walls.append(w)
                audio += a
            rows.append({"level": 1, "walls": walls, "audio": audio, "level_wall": sum(walls), "mode": "sequential"})
        else:  # one batched call of `level` requests: all finish together
            w, audio = call(level, 0)
            rows.append({"level": level, "walls": [w] * level, "audio": audio, "level_wall": w, "mode": "batch"})
    import transformers

    Path(rep_path).write_text(json.dumps({"rows": rows, "transformers": transformers.__version__}))


def reference_side(path: Path, args: argparse.Namespace, levels: list[int], record: Any) -> None:
    python = args.reference_python or (str(ROOT / ".venvs/qwen-tts/bin/python") if args.tiny else sys.executable)
    env = dict(os.environ)
    if args.reference_site:  # the site alone: nothing of omnistage's (transformers 5, hub 2, kernels) leaks in
        env["PYTHONPATH"] = args.reference_site
    with tempfile.TemporaryDirectory() as tmp:
        req, rep = Path(tmp, "req.json"), Path(tmp, "rep.json")
        req.write_text(json.dumps({"path": str(path), "frames": args.frames, "levels": levels, "text": TEXT,
                                   "speakers": speakers(path), "requests_c1": args.requests_c1}))
        proc = subprocess.run([python, __file__, "--reference-worker", str(req), str(rep)], env=env,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            record(side="qwen-tts", error=proc.stderr[-1500:])
            return
        got = json.loads(rep.read_text())
        rows = got["rows"]
    for r in rows:
        walls, audio = r["walls"], r["audio"]
        record(side="qwen-tts", level=r["level"], mode=r["mode"], requests=len(audio), frames=args.frames,
               ttfp_mean_s=_r(sum(walls) / len(walls)), ttfp_p90_s=_r(_pct(walls, 0.9)), ttfp_max_s=_r(max(walls)),
               rtf=_r(sum(w / a for w, a in zip(walls, audio, strict=True)) / len(audio)),
               audio_s_per_s=_r(sum(audio) / r["level_wall"]), audio_s=_r(sum(audio) / len(audio)),
               stall_max_s=0.0, transformers=got["transformers"],
               note="no streaming: first packet = whole call; stall 0 (audio comes whole)")


# ---------------------------------------------------------------- omnistage


def stall_of(chunks: list[tuple[float, float]]) -> float:
    """Worst wait of a listener who starts playing at the first chunk: chunks are (arrival s, audio s)."""
    worst, playhead = 0.0, None
    for at, seconds in chunks:
        if playhead is not None and at > playhead:
            worst = max(worst, at - playhead)
        playhead = max(playhead or at, at) + seconds
    return worst


async def one_request(engine: Any, rid: str, voice: str, frames: int, start: float) -> dict:
    from omnistage.types import OmniRequest

    params = _talker_params(engine, frames)
    request = OmniRequest(request_id=rid, prompt=TEXT, output_modalities=("audio",), stage_params={"talker": params},
                          options={"stream_audio": True, "voice": voice})
    chunks = []
    async for out in engine.generate(request):
        if out.error:
            raise RuntimeError(out.error)
        if out.audio is not None and len(out.audio):
            chunks.append((time.perf_counter() - start, len(out.audio) / SAMPLE_RATE))
    end = time.perf_counter() - start
    return {"ttfp": chunks[0][0] if chunks else end, "end": end, "audio": sum(s for _, s in chunks),
            "stall": stall_of(chunks), "chunks": len(chunks)}


def _talker_params(engine: Any, frames: int) -> Any:
    """The checkpoint's default talker sampling (generation_config.json) with exactly `frames` frames."""
    from dataclasses import replace

    return replace(engine.pipeline.stage_config("talker").sampling_params(), max_tokens=frames, ignore_eos=True)


def omnistage_side(path: Path, args: argparse.Namespace, levels: list[int], record: Any,
                   windows: tuple[int, int] | None = None) -> None:
    import asyncio

    from omnistage.entrypoints.async_omni import AsyncOmni

    device = "cpu" if args.tiny else "0"
    seqs = max(levels)
    deploy: dict[str, Any] = {"stages": {"*": {"devices": device},
                                         "talker": {"max_num_seqs": seqs}, "codec": {"max_num_seqs": seqs}}}
    if windows is not None:
        deploy["stages"]["codec"]["options"] = {"first_window": windows[0], "window": windows[1]}
    t0 = time.perf_counter()
    engine = AsyncOmni.from_model(path, deploy)
    print(f"omnistage up in {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
    voices = speakers(path)
    try:
        async def wave(n: int) -> tuple[list[dict], float]:
            start = time.perf_counter()
            got = await asyncio.gather(*(one_request(engine, f"c{n}-{i}-{time.monotonic_ns()}",
                                                     voices[i % len(voices)], args.frames, start) for i in range(n)))
            return list(got), time.perf_counter() - start

        async def run() -> None:
            await wave(1)  # warm-up
            for n in levels:
                got, wall = await wave(n)
                ttfp = [g["ttfp"] for g in got]
                row = dict(side="omnistage", level=n, mode="streamed", requests=n, frames=args.frames,
                           ttfp_mean_s=_r(sum(ttfp) / n), ttfp_p90_s=_r(_pct(ttfp, 0.9)), ttfp_max_s=_r(max(ttfp)),
                           rtf=_r(sum(g["end"] / g["audio"] for g in got) / n),
                           audio_s_per_s=_r(sum(g["audio"] for g in got) / wall),
                           audio_s=_r(sum(g["audio"] for g in got) / n),
                           stall_max_s=_r(max(g["stall"] for g in got)),
                           chunks_mean=_r(sum(g["chunks"] for g in got) / n), transformers=_transformers())
                if windows is not None:
                    row["codec_windows"] = list(windows)
                record(**row)

        asyncio.run(run())
    finally:
        engine.shutdown()


def profile_side(path: Path, args: argparse.Namespace, record: Any) -> None:
    """One c=1 request under torch.profiler, stages inline (one process, so CUPTI sees every kernel): wall and GPU
    kernel time per frame, kernel launches per frame, and the top ops to `--profile DIR`."""
    import asyncio

    import torch
    from torch.profiler import ProfilerActivity, profile

    from omnistage.entrypoints.async_omni import AsyncOmni

    device = "cpu" if args.tiny else "0"
    engine = AsyncOmni.from_model(path, {"worker_backend": "inline", "stages": {"*": {"devices": device}}})
    out = Path(args.profile)
    out.mkdir(parents=True, exist_ok=True)
    voice = speakers(path)[0]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])

    async def run() -> tuple[Any, dict, float]:
        await one_request(engine, "warm", voice, args.frames, time.perf_counter())
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            got = await one_request(engine, "profiled", voice, args.frames, start)
            return prof, got, time.perf_counter() - start

    try:
        prof, got, wall = asyncio.run(run())
    finally:
        engine.shutdown()
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_s = sum(e.self_device_time_total for e in kernels) / 1e6
    launches = sum(e.count for e in kernels)
    for key in ("self_cpu_time_total", "self_device_time_total"):
        (out / f"tts_profile_{key}.txt").write_text(events.table(sort_by=key, row_limit=40))
    record(side="omnistage profile", level=1, frames=args.frames, wall_s=_r(wall), ttfp_s=_r(got["ttfp"]),
           wall_ms_per_frame=_r(1000 * wall / args.frames), gpu_kernel_ms_per_frame=_r(1000 * gpu_s / args.frames),
           kernel_launches_per_frame=_r(launches / args.frames), transformers=_transformers())


# ---------------------------------------------------------------- output


def _transformers() -> str:
    import transformers

    return transformers.__version__


def _r(x: float) -> float:
    return round(float(x), 4)


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def recorder(out: str | None, rows: list[dict]) -> Any:
    def record(**row: Any) -> None:
        import torch

        row["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        rows.append(row)
        print(json.dumps(row), flush=True)
        if out:
            with open(out, "a") as f:
                f.write(json.dumps(row) + "\n")
    return record


COLUMNS = ("side", "level", "mode", "codec_windows", "ttfp_mean_s", "ttfp_p90_s", "ttfp_max_s", "rtf",
           "audio_s_per_s", "audio_s", "stall_max_s")


def table(rows: list[dict]) -> str:
    shown = [r for r in rows if "error" not in r and "skipped" not in r]
    lines = [" | ".join(COLUMNS), " | ".join("---" for _ in COLUMNS)]
    lines += [" | ".join(str(r.get(c, "")) for c in COLUMNS) for r in shown]
    lines += [f"{r['side']}: ERROR {r['error'][-300:]}" for r in rows if "error" in r]
    lines += [f"{r['side']}: skipped ({r['skipped']})" for r in rows if "skipped" in r]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny checkpoint on CPU: levels 1,2, 8 frames")
    ap.add_argument("--checkpoint", help="where the random checkpoint is (made there if missing)")
    ap.add_argument("--frames", type=int, default=125, help="frames per request (12.5 a second)")
    ap.add_argument("--concurrency", default="1,8,32,64")
    ap.add_argument("--reference-levels", default="1,8", help="levels the package runs (c>1: its batch API)")
    ap.add_argument("--requests-c1", type=int, default=3, help="sequential package requests at c=1")
    ap.add_argument("--reference-site", help="dir prepended to PYTHONPATH for the package's subprocess")
    ap.add_argument("--reference-python", help="interpreter for the package (default: this one; --tiny: "
                                               ".venvs/qwen-tts/bin/python)")
    ap.add_argument("--skip-reference", action="store_true")
    ap.add_argument("--codec-windows", default="", help="also sweep codec first_window,window pairs at the "
                                                        "--sweep-levels, e.g. '2,6;4,12;8,24'")
    ap.add_argument("--sweep-levels", default="1,32", help="levels of each --codec-windows pair")
    ap.add_argument("--stop-after", type=float, default=0.0, help="start no further part (reference, omnistage, "
                    "each window pair) once this many seconds have passed since the start; 0: no limit")
    ap.add_argument("--out", help="append JSON rows to this .jsonl")
    ap.add_argument("--profile", help="only profile one c=1 request (stages inline) and write op tables to this dir")
    ap.add_argument("--reference-worker", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.reference_worker:
        reference_worker(*args.reference_worker)
        return
    levels = [int(x) for x in args.concurrency.split(",")]
    ref_levels = [int(x) for x in args.reference_levels.split(",")]
    sweep_levels = [int(x) for x in args.sweep_levels.split(",")]
    if args.tiny:
        levels, ref_levels, sweep_levels, args.frames = [1, 2], [1, 2], [1, 2], 8
    default = Path(tempfile.gettempdir()) / ("tts_qwen3_tiny" if args.tiny else "tts_qwen3_1p7b")
    path = Path(args.checkpoint or default)
    t0 = start = time.perf_counter()
    make_checkpoint(path, args.tiny)
    print(f"checkpoint {path} ready in {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
    rows: list[dict] = []
    record = recorder(args.out, rows)

    def may_start(part: str) -> bool:
        late = args.stop_after and time.perf_counter() - start > args.stop_after
        if late:
            print(f"skipped {part}: past --stop-after {args.stop_after:g}s", file=sys.stderr, flush=True)
            record(side=part, skipped=f"past --stop-after {args.stop_after:g}s")
        return not late

    if args.profile:
        profile_side(path, args, record)
        print(table(rows))
        return
    if not args.skip_reference and may_start("qwen-tts"):
        reference_side(path, args, ref_levels, record)
    if may_start("omnistage"):
        omnistage_side(path, args, levels, record)
    for pair in filter(None, args.codec_windows.split(";")):
        first, window = (int(x) for x in pair.split(","))
        if may_start(f"omnistage codec_windows {first},{window}"):
            omnistage_side(path, args, sweep_levels, record, (first, window))
    print(table(rows))


if __name__ == "__main__":
    main()
