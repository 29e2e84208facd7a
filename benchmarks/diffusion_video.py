"""Video and audio generation: omnistage's diffusion engine vs the diffusers pipeline, in one run on one GPU.

Checkpoints: the released architectures (Wan2.2-TI2V-5B, Wan2.2-T2V-A14B, Stable Audio Open 1.0) with random bf16
weights, written once from the tiny factory's layout with each component's config replaced by the released one
(`FULL_SIZE`), so both sides load the same files. Per case, same prompt, size, frames, steps and seed; each side
in a process of its own (its own peak memory and compile state; `--tiny` runs them all in one):

- `diffusers`, `diffusers-compiled` (`compile_repeated_blocks(fullgraph=True)` on the DiT(s)): the pipeline's
  `__call__`;
- `omnistage`, `omnistage-compiled` (the `compile` option): the engine the server builds (`build_engine`), with
  max |diff| and PSNR of its output against diffusers' eager output (same seed, same steps);
- `concurrent`: two requests in the engine at once (`max_num_seqs` 2: one forward holds both), against the
  single request's output for the same seed;
- `cache`: cache-dit step caching (refused for two-expert checkpoints: the refusal is the row); it runs the
  case's full schedule, since which steps are cached depends on it (PSNR against `omnistage` when that ran the
  same steps).

Video cases run `--steps` + 1 denoising steps per side: the first is the warm-up (and compile), s/step is the
mean of the others, and the per-video time is extrapolated as s/step x the case's steps + encode + decode
(`s_per_video_extrapolated`). The audio case is short: a warm-up clip, then one timed clip of its full steps.

    python benchmarks/diffusion_video.py --case ti2v --steps 3 --out video.jsonl
    python benchmarks/diffusion_video.py --case t2v,audio --sides diffusers,omnistage --stop-after 480
    python benchmarks/diffusion_video.py --tiny        # every case on the tiny checkpoints (CPU is fine)
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from recording import recorder

from omnistage.engine.diffusion import DiffusionParams
from omnistage.families.registry import load_pipeline
from omnistage.testing.factory import tiny_checkpoint
from omnistage.types import OmniRequest


@dataclass(frozen=True)
class Case:
    arch: str  # the tiny factory's layout
    steps: int  # the released model card's denoising steps
    width: int = 0
    height: int = 0
    frames: int = 0
    seconds: float = 0.0  # audio: the clip's length

    @property
    def video(self) -> bool:
        return self.frames > 0


CASES = {"ti2v": Case("wan2_2_ti2v", 50, 1280, 704, 121), "t2v": Case("wan2_2_t2v", 40, 832, 480, 81),
         "audio": Case("stable_audio", 100, seconds=10.0)}
# The tiny checkpoints' sizes (multiples of their VAE x patch) and the tiny Stable Audio's 1 s window.
TINY = {"ti2v": {"width": 64, "height": 64, "frames": 9}, "t2v": {"width": 48, "height": 32, "frames": 9},
        "audio": {"seconds": 1.0}}
SIDES = ("diffusers", "omnistage", "diffusers-compiled", "omnistage-compiled", "concurrent", "cache")
PROMPT = {"video": "a red fox trotting through fresh snow at sunrise, the camera tracking beside it",
          "audio": "128 BPM tech house drum loop with a deep bassline"}
SEED = 1234
CACHE = {"Fn_compute_blocks": 8, "Bn_compute_blocks": 0, "max_warmup_steps": 4, "residual_diff_threshold": 0.12,
         "taylorseer": {"taylorseer_order": 1}}  # benchmarks/diffusion_images.py's preset

# The released configs, as overrides of the tiny factory's component configs (tokenizers stay the factory's: only
# their ids' range differs, not the shapes the models compute on). Wan: the DiTs and VAEs of diffusers'
# scripts/convert_wan_to_diffusers.py (model types Wan2.2-TI2V-5B, Wan2.2-T2V-A14B; the Wan2.1 VAE is
# `AutoencoderKLWan()`'s defaults, the Wan2.2 VAE `vae22_diffusers_config` less `clip_output`, which this diffusers'
# class does not take), and google/umt5-xxl's config.json.
# Stable Audio: stable-audio-tools' stable_audio_open_1_0.json model config through diffusers'
# scripts/convert_stable_audio.py, and t5-base's config.json.
_WAN_DIT = {"added_kv_proj_dim": None, "attention_head_dim": 128, "cross_attn_norm": True, "eps": 1e-6,
            "freq_dim": 256, "patch_size": [1, 2, 2], "qk_norm": "rms_norm_across_heads", "text_dim": 4096,
            "rope_max_seq_len": 1024}
_UMT5_XXL = {"vocab_size": 256384, "d_model": 4096, "d_ff": 10240, "d_kv": 64, "num_heads": 64, "num_layers": 24,
             "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128,
             "feed_forward_proj": "gated-gelu"}
_WAN22_VAE_MEAN = [-0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542, 0.2813,
                   0.0891, 0.157, -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108,
                   -0.2158, 0.2502, -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.123, -0.0313,
                   -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.052, 0.3748, 0.0152, 0.1957, 0.1433, -0.2944,
                   0.3573, -0.0548, -0.1681, -0.0667]
_WAN22_VAE_STD = [0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.499, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894, 1.0901,
                  0.6885, 0.6165, 0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
                  0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944,
                  0.5726, 1.2042, 0.5458, 1.6887, 0.3971, 1.06, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744]
FULL_SIZE: dict[str, dict[str, dict[str, Any]]] = {
    "ti2v": {
        "transformer": {**_WAN_DIT, "ffn_dim": 14336, "in_channels": 48, "out_channels": 48,
                        "num_attention_heads": 24, "num_layers": 30},
        "vae": {"base_dim": 160, "decoder_base_dim": 256, "z_dim": 48, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2,
                "attn_scales": [], "temperal_downsample": [False, True, True], "is_residual": True,
                "in_channels": 12, "out_channels": 12, "patch_size": 2, "scale_factor_temporal": 4,
                "scale_factor_spatial": 16, "latents_mean": _WAN22_VAE_MEAN,
                "latents_std": _WAN22_VAE_STD},
        "text_encoder": _UMT5_XXL},
    "t2v": {
        "transformer": {**_WAN_DIT, "ffn_dim": 13824, "in_channels": 16, "out_channels": 16,
                        "num_attention_heads": 40, "num_layers": 40},
        "vae": {"base_dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_scales": [],
                "temperal_downsample": [False, True, True]},
        "text_encoder": _UMT5_XXL},
    "audio": {
        "transformer": {"sample_size": 1024, "in_channels": 64, "num_layers": 24, "attention_head_dim": 64,
                        "num_attention_heads": 24, "num_key_value_attention_heads": 12, "out_channels": 64,
                        "cross_attention_dim": 768, "time_proj_dim": 256, "global_states_input_dim": 1536,
                        "cross_attention_input_dim": 768},
        "vae": {"encoder_hidden_size": 128, "downsampling_ratios": [2, 4, 4, 8, 8],
                "channel_multiples": [1, 2, 4, 8, 16], "decoder_channels": 128, "decoder_input_channels": 64,
                "audio_channels": 2, "sampling_rate": 44100},
        "projection_model": {"text_encoder_dim": 768, "conditioning_dim": 768, "min_value": 0, "max_value": 512},
        "text_encoder": {"vocab_size": 32128, "d_model": 768, "d_ff": 3072, "d_kv": 64, "num_heads": 12,
                         "num_layers": 12, "relative_attention_num_buckets": 32,
                         "relative_attention_max_distance": 128, "feed_forward_proj": "relu"}},
}
TOKENIZER_LENGTH = {"audio": 128}  # the released tokenizer's model_max_length (every prompt is padded to it)
SHARED = {"ti2v": {"text_encoder": "umt5-xxl"}, "t2v": {"text_encoder": "umt5-xxl"}}  # one copy on disk


# ---- checkpoints ---------------------------------------------------------------------------------


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return out


@torch.no_grad()
def _fill(model: torch.nn.Module) -> None:
    """Random weights of the default initializers' scale, drawn once (the modules' own init is skipped: the 14B
    DiT's would take minutes on a CPU): biases 0, norm scales 1, the rest U(-1/sqrt(fan_in), 1/sqrt(fan_in)),
    torch.nn.Linear's default."""
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            p.zero_()
        elif "norm" in name and p.numel() == p.shape[0]:
            p.fill_(1.0)
        else:
            bound = 1 / math.sqrt(p[0].numel() if p.ndim > 1 else p.numel())
            p.uniform_(-bound, bound)


def _build_component(entry: list[str], tiny: Path, over: dict[str, Any], out: Path) -> None:
    import diffusers
    import transformers
    from transformers.initialization import no_init_weights

    library, cls_name = entry
    cls = getattr(transformers if library == "transformers" else diffusers, cls_name)
    config = _merge(json.loads((tiny / "config.json").read_text()), over)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with device, no_init_weights():
        if library != "transformers":
            model = cls.from_config(config)
        else:
            model = cls._from_config(cls.config_class.from_dict(config))
    model = model.to(torch.bfloat16)
    _fill(model)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tmp.rename(out)


def full_size_checkpoint(case: str, root: Path) -> Path:
    """The tiny checkpoint of `case` with every component of FULL_SIZE re-made at full size (random bf16); the
    UMT5 encoder is written once for both Wan cases, and T2V-A14B's `transformer_2` is a directory of links to
    `transformer`'s files (two 14B experts would not fit the GPU machine's disk; both are loaded, so the compute and
    the GPU memory are the two experts')."""
    out = root / case
    if (out / "model_index.json").is_file():
        return out
    tiny = tiny_checkpoint(CASES[case].arch)
    index = json.loads((tiny / "model_index.json").read_text())
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(tiny, tmp)
    for name, over in FULL_SIZE[case].items():
        shutil.rmtree(tmp / name)
        shared = SHARED.get(case, {}).get(name)
        target = root / shared if shared else tmp / name
        if not (target / "config.json").is_file():
            _build_component(index[name], tiny / name, over, target)
        if shared:
            (tmp / name).symlink_to(target.resolve())
        torch.cuda.empty_cache()
    if (index.get("transformer_2") or [None])[0] is not None:
        shutil.rmtree(tmp / "transformer_2")
        (tmp / "transformer_2").mkdir()
        for f in (tmp / "transformer").iterdir():
            (tmp / "transformer_2" / f.name).symlink_to(Path("..") / "transformer" / f.name)
    if case in TOKENIZER_LENGTH:
        config_path = tmp / "tokenizer" / "tokenizer_config.json"
        config = json.loads(config_path.read_text())
        config_path.write_text(json.dumps({**config, "model_max_length": TOKENIZER_LENGTH[case]}, indent=2))
    tmp.rename(out)
    return out


# ---- measuring -----------------------------------------------------------------------------------


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def peak_gib() -> float:
    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else 0.0


def reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


class Spans:
    """Synchronized seconds spent in named methods of objects, by wrapping the bound methods (what runs is
    unchanged)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def wrap(self, obj: Any, method: str, label: str) -> None:
        fn = getattr(obj, method)

        def timed(*args: Any, **kwargs: Any) -> Any:
            sync()
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            sync()
            self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - t0
            return out

        setattr(obj, method, timed)

    def reset(self) -> None:
        self.seconds = {}


def compare(got: np.ndarray, want: np.ndarray) -> dict[str, Any]:
    """max |diff| and PSNR (dB, signal range 1 for videos in [0, 1], 2 for audio in [-1, 1])."""
    got_dtype, want_dtype = got.dtype, want.dtype
    got, want = got.astype(np.float32), want.astype(np.float32)
    if got.shape != want.shape:
        return {"shape_mismatch": f"{list(got.shape)} vs {list(want.shape)}"}
    diff = got - want
    peak = 1.0 if want.min() >= 0 else 2.0
    mse = float(np.mean(diff**2))
    psnr = math.inf if mse == 0 else 10 * math.log10(peak**2 / mse)
    row = {"max_abs_diff": round(float(np.abs(diff).max()), 5), "psnr_db": round(psnr, 2)}
    return {**row, "stored_as": "float16"} if np.float16 in (got_dtype, want_dtype) else row


def timing(case: Case, full_steps: int, step_s: list[float], spans: dict[str, float], first: float) -> dict[str, Any]:
    """One row's timing fields from the timed steps' seconds (the warm-up step excluded)."""
    s_step = sum(step_s) / len(step_s) if step_s else float("nan")
    encode, decode = spans.get("encode", 0.0), spans.get("decode", 0.0)
    row = {"s_per_step": round(s_step, 4), "step_s": [round(s, 4) for s in step_s], "encode_s": round(encode, 3),
           "decode_s": round(decode, 3), "first_step_s": round(first, 2)}
    if case.video:
        row["s_per_video_extrapolated"] = round(s_step * full_steps + encode + decode, 2)
    else:
        row["s_per_clip"] = round(sum(step_s) + encode + decode, 3)
    return row


# ---- the sides -----------------------------------------------------------------------------------


@dataclass
class Job:
    case: str
    path: str
    params: DiffusionParams
    full_steps: int
    tiny: bool
    outdir: str  # where each side leaves its output for the others to compare with
    out: str | None

    def output_file(self, side: str, params: DiffusionParams | None = None) -> Path:
        p = params or self.params
        shape = f"{p.width}x{p.height}x{p.num_frames}" if CASES[self.case].video else f"{p.audio_length:g}s"
        return Path(self.outdir) / f"{self.case}-{side}-{shape}-{p.num_inference_steps}.npy"

    def save(self, side: str, array: np.ndarray, params: DiffusionParams | None = None) -> None:
        Path(self.outdir).mkdir(parents=True, exist_ok=True)
        # float16 for the large ones (a 720p TI2V video is 1.3 GB in float32): a floor of ~5e-4 on max |diff|
        np.save(self.output_file(side, params), array.astype(np.float16 if array.nbytes > 2**28 else np.float32))

    def load(self, side: str, params: DiffusionParams | None = None) -> np.ndarray | None:
        path = self.output_file(side, params)
        return np.load(path) if path.is_file() else None


def run_side(job: Job, side: str) -> None:
    """One side in this (fresh) process; an exception becomes the row's error."""
    record = recorder(job.out)
    try:
        if side.startswith("diffusers"):
            row = diffusers_side(job, compiled=side == "diffusers-compiled")
        else:
            row = omnistage_side(job, side)
    except Exception as exc:
        row = {"error": f"{type(exc).__name__}: {str(exc)[:400]}"}
    record(case=job.case, side=side, **row)


def diffusers_side(job: Job, compiled: bool) -> dict[str, Any]:
    import diffusers

    case, p = CASES[job.case], job.params
    path = Path(job.path)
    index = json.loads((path / "model_index.json").read_text())
    cls = getattr(diffusers, index["_class_name"])
    if compiled and not torch.cuda.is_available():
        return {"skipped": "compile: not timed on the CPU"}
    if compiled and not getattr(getattr(diffusers, index["transformer"][1]), "_repeated_blocks", None):
        return {"skipped": f"{index['transformer'][1]} declares no repeated blocks (compile_repeated_blocks)"}
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kwargs: dict[str, Any] = {}
    if case.video:  # the Wan VAE in float32, as the model cards (and omnistage) run it
        kwargs["vae"] = diffusers.AutoencoderKLWan.from_pretrained(path / "vae", torch_dtype=torch.float32)
    pipe = cls.from_pretrained(path, torch_dtype=dtype, **kwargs).to(device)
    pipe.set_progress_bar_config(disable=True)
    if compiled:
        for name in ("transformer", "transformer_2"):
            if getattr(pipe, name, None) is not None:
                getattr(pipe, name).compile_repeated_blocks(fullgraph=True)
    spans = Spans()
    spans.wrap(pipe, "encode_prompt", "encode")
    spans.wrap(pipe.vae, "decode", "decode")
    marks: list[float] = []

    def mark() -> None:
        sync()
        marks.append(time.perf_counter())

    call = {"prompt": p.prompt, "negative_prompt": p.negative_prompt, "num_inference_steps": p.num_inference_steps,
            "guidance_scale": p.guidance_scale, "output_type": "np"}
    if case.video:
        call.update(height=p.height, width=p.width, num_frames=p.num_frames, max_sequence_length=p.max_sequence_length,
                    callback_on_step_end=lambda pipe, i, t, kw: mark() or {})
        if p.guidance_scale_2 is not None:
            call["guidance_scale_2"] = p.guidance_scale_2
    else:
        call.update(audio_start_in_s=p.audio_start, audio_end_in_s=p.audio_start + p.audio_length,
                    callback=lambda i, t, latents: mark())

    def generate() -> tuple[np.ndarray, float, float]:
        marks.clear()
        spans.reset()
        sync()
        t0 = time.perf_counter()
        result = pipe(generator=torch.Generator("cpu").manual_seed(p.seed), **call)
        sync()
        out = result.frames[0] if case.video else result.audios[0]
        return (out.float().cpu().numpy() if torch.is_tensor(out) else np.asarray(out)), t0, time.perf_counter()

    reset_peak()
    first_call = None
    if not case.video:  # a warm-up clip; the timed clip's every step counts
        output, t0, t1 = generate()
        first_call = round(t1 - t0, 2)
    output, t0, t1 = generate()
    # step i ends at marks[i]; the first step starts after the prompt's encoding
    first = marks[0] - t0 - spans.seconds.get("encode", 0.0)
    step_s = [float(s) for s in np.diff(marks)]
    row = timing(case, job.full_steps, step_s if case.video else [first, *step_s], spans.seconds, first)
    row.update(steps=p.num_inference_steps, peak_gib=peak_gib(), total_s=round(t1 - t0, 2))
    if not case.video:
        row["first_call_s"] = first_call
    if not compiled:  # the reference of the omnistage rows
        job.save("diffusers", output)
    return row


def _engine(job: Job, options: dict[str, Any], max_num_seqs: int) -> tuple[Any, Any]:
    device = "0" if torch.cuda.is_available() else "cpu"
    deploy = {"stages": {"*": {"devices": device, "max_num_seqs": max_num_seqs, "options": options}}}
    pipeline = load_pipeline(job.path, deploy)
    return pipeline, pipeline.build_engine("dit")


def drive(pipeline: Any, engine: Any, requests: list[DiffusionParams], modality: str
          ) -> tuple[dict[str, np.ndarray], list[float]]:
    """All `requests` added at once, stepped to the end: each request's output, and each engine step's seconds."""
    for i, p in enumerate(requests):
        engine.add_request(pipeline.preprocess(OmniRequest(f"r{i}", prompt=p.prompt, output_modalities=(modality,),
                                                           options={"diffusion": p})))
    outputs, seconds = {}, []
    while engine.has_work():
        t0 = time.perf_counter()
        deltas = engine.step()
        sync()
        seconds.append(time.perf_counter() - t0)
        for out in deltas:
            if out.error is not None:
                raise RuntimeError(f"{out.request_id}: {out.error}")
            if out.finished:
                outputs[out.request_id] = out.tensors[engine.output_name][0].numpy()
    return outputs, seconds


def omnistage_side(job: Job, side: str) -> dict[str, Any]:
    case, p = CASES[job.case], job.params
    modality = "video" if case.video else "audio"
    options: dict[str, Any] = {}
    if side == "omnistage-compiled":
        if not torch.cuda.is_available():
            return {"skipped": "compile: not timed on the CPU"}
        options["compile"] = True
    if side == "cache":
        cache = {**CACHE, "Fn_compute_blocks": 1} if job.tiny else dict(CACHE)  # the tiny DiTs have 2 blocks
        options["cache"] = cache
        p = replace(p, num_inference_steps=job.full_steps)
    concurrency = 2 if side == "concurrent" else 1
    reset_peak()
    pipeline, engine = _engine(job, options, concurrency)
    spans = Spans()
    spans.wrap(engine.model, "encode", "encode")
    spans.wrap(engine.model, "decode", "decode")
    first_call = None
    if not case.video:  # a warm-up clip; the timed clip's every step counts
        t0 = time.perf_counter()
        drive(pipeline, engine, [p], modality)
        first_call = round(time.perf_counter() - t0, 2)
        spans.reset()
        reset_peak()
    requests = [replace(p, seed=p.seed + i) for i in range(concurrency)]
    t0, forwards = time.perf_counter(), engine.num_steps
    outputs, seconds = drive(pipeline, engine, requests, modality)
    total = time.perf_counter() - t0
    # The first engine step also encodes (and warms up or compiles), the last also decodes.
    first = seconds[0] - spans.seconds.get("encode", 0.0)
    step_s = [first, *seconds[1:]] if first_call is not None else list(seconds[1:])
    step_s[-1] -= spans.seconds.get("decode", 0.0)
    row = timing(case, job.full_steps, step_s, spans.seconds, first)
    row.update(steps=p.num_inference_steps, peak_gib=peak_gib(), total_s=round(total, 2))
    if first_call is not None:
        row["first_call_s"] = first_call
    output = outputs["r0"]
    if side == "cache":
        row["cache"] = options["cache"]
        lossless = job.load("omnistage", p)
        row["vs_lossless"] = compare(output, lossless) if lossless is not None else "no omnistage output of these steps"
    elif side == "concurrent":
        # forwards == steps: the two requests shared every forward
        row.update(requests=concurrency, completed=len(outputs), forwards=engine.num_steps - forwards)
        single = job.load("omnistage")
        row["vs_single"] = compare(output, single) if single is not None else "no omnistage output to compare"
    else:
        reference = job.load("diffusers")
        row["vs_diffusers"] = compare(output, reference) if reference is not None else "no diffusers output"
    if side == "omnistage":  # the reference of the concurrent and cache rows
        job.save(side, output, p)
    return row


# ---- the run -------------------------------------------------------------------------------------


def case_params(name: str, args: argparse.Namespace, path: Path) -> tuple[DiffusionParams, int]:
    """The request every side runs (the checkpoint's defaults under the case's size) and the case's full steps."""
    case = CASES[name]
    sizes = {**{"width": case.width, "height": case.height, "frames": case.frames, "seconds": case.seconds},
             **(TINY[name] if args.tiny else {})}
    if args.size:
        sizes["width"], sizes["height"] = (int(v) for v in args.size.lower().split("x"))
    if args.frames:
        sizes["frames"] = args.frames
    pipeline = load_pipeline(path, {"stages": {"*": {"devices": "cpu"}}})
    if case.video:
        p = DiffusionParams(prompt=PROMPT["video"], width=sizes["width"], height=sizes["height"],
                            num_frames=sizes["frames"], num_inference_steps=args.steps + 1, seed=SEED)
    else:
        p = DiffusionParams(prompt=PROMPT["audio"], audio_start=0.0, audio_length=sizes["seconds"],
                            num_inference_steps=case.steps, seed=SEED)
    p = pipeline.resolve(p, []).check()
    return p, case.steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", action="append", default=None,
                        help="ti2v, t2v, audio (repeatable or comma-separated; default ti2v,audio,t2v)")
    parser.add_argument("--sides", default=",".join(SIDES), help=f"any of {','.join(SIDES)}")
    parser.add_argument("--steps", type=int, default=3, help="video: timed denoising steps after one warm-up step")
    parser.add_argument("--frames", type=int, default=None, help="video: frames (4k+1) instead of the case's")
    parser.add_argument("--size", default=None, help="video: WIDTHxHEIGHT instead of the case's")
    parser.add_argument("--stop-after", type=float, default=0.0,
                        help="start no further checkpoint or side after this many seconds (recorded as skipped)")
    parser.add_argument("--root", default="/tmp/omnistage-bench", help="where the full-size checkpoints are written")
    parser.add_argument("--tiny", action="store_true", help="the tiny checkpoints instead (a smoke run; CPU is fine)")
    parser.add_argument("--drop-checkpoints", action="store_true",
                        help="delete each case's checkpoint (not the shared UMT5) once its sides ran: disk room")
    parser.add_argument("--out", default=None, help="append the rows to this .jsonl file")
    args = parser.parse_args()
    cases = [c for arg in (args.case or ["ti2v,audio,t2v"]) for c in arg.split(",") if c]
    sides = [s for s in args.sides.split(",") if s]
    for name, valid in [(c, CASES) for c in cases] + [(s, SIDES) for s in sides]:
        if name not in valid:
            parser.error(f"unknown case or side {name!r}; expected one of {sorted(valid)}")
    record = recorder(args.out)
    root = Path(args.root)
    start = time.perf_counter()
    spawn = multiprocessing.get_context("spawn")

    def isolated(fn: Any, *fn_args: Any) -> int:
        """`fn` in a fresh process (its GPU memory is freed with it; a crash there is its exit code, not a hang)."""
        proc = spawn.Process(target=fn, args=fn_args)
        proc.start()
        proc.join()
        return proc.exitcode

    def late(what: str, **row: Any) -> bool:
        if args.stop_after and time.perf_counter() - start > args.stop_after:
            record(**row, skipped=f"{what}: past --stop-after {args.stop_after:g}s")
            return True
        return False

    for name in cases:
        if late("checkpoint", case=name):
            continue
        if args.tiny:
            path = tiny_checkpoint(CASES[name].arch)
        else:
            t0, path = time.perf_counter(), root / name
            code = isolated(full_size_checkpoint, name, root)
            if code != 0 or not (path / "model_index.json").is_file():
                record(case=name, error=f"building the checkpoint failed (exit code {code})")
                continue
            record(case=name, checkpoint=str(path), build_s=round(time.perf_counter() - t0, 1))
        p, full_steps = case_params(name, args, path)
        note = {"note": "transformer_2 is links to transformer's files: both experts are loaded (the compute and "
                        "GPU memory of two), with the same weights"} if name == "t2v" else {}
        record(case=name, params={k: v for k, v in p.as_wire().items() if v is not None}, full_steps=full_steps,
               torch=torch.__version__, **note)
        outdir = root / ("tiny-out" if args.tiny else "out")
        job = Job(name, str(path), p, full_steps, args.tiny, str(outdir), args.out)
        for side in sides:
            if side == "concurrent" and name != "ti2v":
                continue  # the two-jobs check is TI2V's (720p)
            if side == "cache" and not CASES[name].video:
                continue
            if late(side, case=name, side=side):
                continue
            if args.tiny:  # small enough to share this process
                run_side(job, side)
            elif (code := isolated(run_side, job, side)) != 0:
                record(case=name, side=side, error=f"the side's process exited with code {code}")
        if args.drop_checkpoints and not args.tiny:
            shutil.rmtree(path)
            for f in Path(outdir).glob(f"{name}-*.npy"):
                f.unlink()


if __name__ == "__main__":
    main()
