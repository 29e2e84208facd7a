"""Image generation: omnistage's diffusion engine vs the diffusers pipeline, in one process and one run.

Checkpoints: the released architectures with random bf16 weights, written once from the tiny factory's layout
with each component's config replaced by the full-size one (`FULL_SIZE`), so both sides load the same files.
Per family, on one GPU, same prompt, size, steps and seed:

- diffusers: `__call__` eager, then with `transformer.compile_repeated_blocks(fullgraph=True)`: s/image, peak.
- omnistage: the engine the server builds (`build_engine`), lossless (`compile`): s/image, peak, and max |diff|
  against diffusers' compiled image; 8 requests at once (throughput against diffusers' compiled s/image x 8,
  and when each request took its first step); step caching (`cache`, the shipped preset) and `fp8`, each with
  PSNR / SSIM against the lossless image.

    python benchmarks/diffusion_images.py --family flux-dev --out flux.jsonl
    python benchmarks/diffusion_images.py --family qwen-image --steps 20 --parts ours
    python benchmarks/diffusion_images.py --family flux-dev --tiny      # the tiny checkpoint (CPU is fine)
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from recording import recorder

from omnistage.engine.diffusion import DiffusionEngine, DiffusionParams
from omnistage.families.registry import load_pipeline
from omnistage.testing.factory import tiny_checkpoint
from omnistage.types import OmniRequest

# The released configs' sizes, as overrides of the tiny factory's component configs (tokenizers stay the
# factory's: only their ids' range differs, not the shapes the models compute on).
_FLUX_VAE = {"block_out_channels": [128, 256, 512, 512], "down_block_types": ["DownEncoderBlock2D"] * 4,
             "up_block_types": ["UpDecoderBlock2D"] * 4, "layers_per_block": 2, "latent_channels": 16,
             "norm_num_groups": 32, "sample_size": 1024}
_CLIP_L = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
           "projection_dim": 768, "hidden_act": "quick_gelu"}
_T5_XXL = {"d_model": 4096, "d_ff": 10240, "d_kv": 64, "num_heads": 64, "num_layers": 24,
           "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128}
_QWEN25_VL_7B_TEXT = {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                      "num_attention_heads": 28, "num_key_value_heads": 4}
_QWEN3_4B = {"hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36, "num_attention_heads": 32,
             "num_key_value_heads": 8, "head_dim": 128, "layer_types": ["full_attention"] * 36}
FULL_SIZE: dict[str, dict[str, dict[str, Any]]] = {
    "flux-dev": {
        "transformer": {"in_channels": 64, "num_layers": 19, "num_single_layers": 38, "attention_head_dim": 128,
                        "num_attention_heads": 24, "joint_attention_dim": 4096, "pooled_projection_dim": 768,
                        "axes_dims_rope": [16, 56, 56]},
        "vae": _FLUX_VAE, "text_encoder": _CLIP_L, "text_encoder_2": _T5_XXL},
    "qwen-image": {
        "transformer": {"in_channels": 64, "out_channels": 16, "num_layers": 60, "attention_head_dim": 128,
                        "num_attention_heads": 24, "joint_attention_dim": 3584, "axes_dims_rope": [16, 56, 56]},
        "vae": {"base_dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2,
                "latents_mean": [0.0] * 16, "latents_std": [1.0] * 16},
        # Qwen2.5-VL-7B's width, 4 of its 28 layers: the full encoder does not fit the GPU machine's disk beside
        # the 20B DiT, and encoding one prompt is a small part of an image's time.
        "text_encoder": {"text_config": {
            **_QWEN25_VL_7B_TEXT, "num_hidden_layers": 4, "layer_types": ["full_attention"] * 4, "rope_parameters": {
            "rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}},
            "vision_config": {"out_hidden_size": 3584}}},
    "z-image-turbo": {
        "transformer": {"in_channels": 16, "dim": 3840, "n_layers": 30, "n_refiner_layers": 2, "n_heads": 30,
                        "n_kv_heads": 30, "cap_feat_dim": 2560, "axes_dims": [32, 48, 48],
                        "axes_lens": [1024, 512, 512]},
        "vae": _FLUX_VAE, "text_encoder": _QWEN3_4B},
}
FULL_SIZE["qwen-image-edit"] = FULL_SIZE["qwen-image"]
FULL_SIZE["flux-schnell"] = {**FULL_SIZE["flux-dev"], "transformer": {**FULL_SIZE["flux-dev"]["transformer"],
                                                                       "guidance_embeds": False}}
CACHE_PRESET = {"Fn_compute_blocks": 8, "Bn_compute_blocks": 0, "max_warmup_steps": 4,
                "residual_diff_threshold": 0.12, "taylorseer": {"taylorseer_order": 1}}


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return out


def full_size_checkpoint(family: str, out: Path) -> Path:
    """The tiny checkpoint of `family` with every component of FULL_SIZE re-made at full size (random bf16)."""
    import diffusers
    import transformers

    if (out / "model_index.json").is_file():
        return out
    tiny = tiny_checkpoint(family)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(tiny, tmp)
    index = json.loads((tiny / "model_index.json").read_text())
    for name, over in FULL_SIZE[family].items():
        library, cls_name = index[name]
        cls = getattr(diffusers if library == "diffusers" else transformers, cls_name)
        config = _merge(json.loads((tiny / name / "config.json").read_text()), over)
        shutil.rmtree(tmp / name)
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            if library == "diffusers":
                model = cls.from_config(config).to(torch.bfloat16)
            else:
                model = cls._from_config(cls.config_class.from_dict(config), dtype=torch.bfloat16)
        model.save_pretrained(tmp / name, safe_serialization=True)
        del model
        gc.collect()
        torch.cuda.empty_cache()
    tmp.rename(out)
    return out


def psnr_ssim(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """PSNR (dB) and a global SSIM of two images in [0, 1] (means/variances over the whole image)."""
    mse = float(np.mean((a - b) ** 2))
    psnr = math.inf if mse == 0 else 10 * math.log10(1 / mse)
    ma, mb, va, vb = a.mean(), b.mean(), a.var(), b.var()
    cov = float(np.mean((a - ma) * (b - mb)))
    c1, c2 = 0.01**2, 0.03**2
    ssim = ((2 * ma * mb + c1) * (2 * cov + c2)) / ((ma**2 + mb**2 + c1) * (va + vb + c2))
    return psnr, float(ssim)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


def reset_peak() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def input_images(path: Path, p: DiffusionParams) -> list[Any]:
    """Edit models take an input image: one fixed random picture of the output's size; none for the others."""
    from PIL import Image

    if "Edit" not in json.loads((path / "model_index.json").read_text())["_class_name"]:
        return []
    pixels = np.random.default_rng(0).integers(0, 256, (p.height, p.width, 3), dtype=np.uint8)
    return [Image.fromarray(pixels)]


def diffusers_side(path: Path, p: DiffusionParams, images: int, record: Any) -> dict[str, np.ndarray]:
    import diffusers

    index = json.loads((path / "model_index.json").read_text())
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    pipe = getattr(diffusers, index["_class_name"]).from_pretrained(path, torch_dtype=dtype)
    pipe.to("cuda" if torch.cuda.is_available() else "cpu")
    pipe.set_progress_bar_config(disable=True)
    kwargs = {"width": p.width, "height": p.height, "num_inference_steps": p.num_inference_steps,
              "output_type": "np"}
    if inputs := input_images(path, p):
        kwargs["image"] = inputs[0]
    if p.negative_prompt is not None:
        kwargs.update(negative_prompt=p.negative_prompt, true_cfg_scale=p.true_cfg_scale)
    if p.guidance_scale is not None:
        kwargs["guidance_scale"] = p.guidance_scale
    out = {}
    for mode in ("eager", "compiled"):
        if mode == "compiled":
            pipe.transformer.compile_repeated_blocks(fullgraph=True)
        reset_peak()
        t0 = time.perf_counter()
        pipe(prompt=p.prompt, generator=torch.Generator("cpu").manual_seed(p.seed), **kwargs)  # warm-up (and compile)
        sync()
        warm = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(images):
            image = pipe(prompt=p.prompt, generator=torch.Generator("cpu").manual_seed(p.seed), **kwargs).images[0]
        sync()
        seconds = (time.perf_counter() - t0) / images
        out[mode] = image
        record(side="diffusers", mode=mode, s_per_image=round(seconds, 3), first_call_s=round(warm, 1),
               peak_gib=round(peak_gib(), 2))
    del pipe
    reset_peak()
    return out


def run_engine(pipeline: Any, engine: DiffusionEngine, requests: list[DiffusionParams]) -> dict[str, Any]:
    """All `requests` added at once; steps to the end. Per request: image, first-step and finish seconds."""
    inputs = input_images(pipeline.model_path, requests[0])
    t0 = time.perf_counter()
    for i, p in enumerate(requests):
        engine.add_request(pipeline.preprocess(OmniRequest(f"r{i}", prompt=p.prompt, output_modalities=("image",),
                                                           media={"image": inputs} if inputs else {},
                                                           options={"diffusion": p})))
    first, done, images = {}, {}, {}
    while engine.has_work():
        for out in engine.step():
            assert out.error is None, out.error
            first.setdefault(out.request_id, time.perf_counter() - t0)
            if out.finished:
                done[out.request_id] = time.perf_counter() - t0
                images[out.request_id] = out.tensors["images"][0].numpy()
    sync()
    return {"images": images, "first": first, "done": done, "total": time.perf_counter() - t0}


def ours_side(path: Path, p: DiffusionParams, images: int, out: str | None, reference: np.ndarray | None,
              modes: list[str], concurrency: int, cache: dict[str, Any]) -> None:
    """Each mode in a fresh process: its peak memory and compile time are its own."""
    import multiprocessing

    lossless = None
    for mode in modes:
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            image = pool.apply(ours_mode, (path, p, images, out, reference, lossless, mode, concurrency, cache))
        if mode == "lossless":
            lossless = image


def ours_mode(path: Path, p: DiffusionParams, images: int, out: str | None, reference: np.ndarray | None,
              lossless: np.ndarray | None, mode: str, concurrency: int, cache: dict[str, Any]) -> np.ndarray | None:
    record = recorder(out)
    device = "0" if torch.cuda.is_available() else "cpu"
    options = {"lossless": {"compile": True}, "eager": {}, "cache": {"compile": True, "cache": cache},
               "fp8": {"compile": True, "quantization": "fp8"},
               "fp8+cache": {"compile": True, "quantization": "fp8", "cache": cache}}[mode]
    deploy = {"stages": {"*": {"devices": device, "max_num_seqs": concurrency, "options": options}}}
    reset_peak()
    try:
        pipeline = load_pipeline(path, deploy)
        engine = pipeline.build_engine("dit")
    except Exception as exc:
        record(side="omnistage", mode=mode, error=str(exc)[:300])
        return None
    t0 = time.perf_counter()
    run_engine(pipeline, engine, [p])  # warm-up (and compile)
    warm = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(images):
        single = run_engine(pipeline, engine, [p])
    seconds = (time.perf_counter() - t0) / images
    image = single["images"]["r0"]
    row = {"side": "omnistage", "mode": mode, "s_per_image": round(seconds, 3), "first_call_s": round(warm, 1),
           "peak_gib": round(peak_gib(), 2)}
    if mode != "lossless" and "cache" in options:
        row["cache"] = cache
    if reference is not None:
        row["max_abs_diff_vs_diffusers"] = round(float(np.abs(image - reference).max()), 4)
    if lossless is not None:
        row["psnr_db"], row["ssim"] = (round(v, 4) for v in psnr_ssim(image, lossless))
    record(**row)
    if mode in ("lossless", "eager", "cache") and concurrency > 1:
        from dataclasses import replace

        batch = [replace(p, seed=p.seed + i) for i in range(concurrency)]
        run_engine(pipeline, engine, batch)  # the batched shapes compile once
        reset_peak()
        wave = run_engine(pipeline, engine, batch)
        record(side="omnistage", mode=mode, concurrency=concurrency, total_s=round(wave["total"], 3),
               images_per_s=round(concurrency / wave["total"], 4),
               first_step_s=[round(wave["first"][f"r{i}"], 2) for i in range(concurrency)],
               done_s=[round(wave["done"][f"r{i}"], 2) for i in range(concurrency)],
               peak_gib=round(peak_gib(), 2))
    return image


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="flux-dev", choices=sorted(FULL_SIZE))
    parser.add_argument("--checkpoint", default=None, help="where the full-size checkpoint is (written if absent)")
    parser.add_argument("--tiny", action="store_true", help="the tiny checkpoint instead (a smoke run)")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=None, help="denoising steps (default: the family's)")
    parser.add_argument("--true-cfg", action="store_true", help="a negative prompt and true_cfg_scale 4")
    parser.add_argument("--images", type=int, default=2, help="timed images per mode (after one warm-up)")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--parts", default="diffusers,ours")
    parser.add_argument("--modes", default="lossless,cache,fp8", help="omnistage modes: eager,lossless,cache,fp8")
    parser.add_argument("--cache-threshold", type=float, default=None,
                        help="DBCache residual_diff_threshold (random weights change more per step than trained ones)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    record = recorder(args.out)
    path = tiny_checkpoint(args.family) if args.tiny else full_size_checkpoint(
        args.family, Path(args.checkpoint or f"/tmp/omnistage-bench/{args.family}"))
    pipeline = load_pipeline(path, {"stages": {"*": {"devices": "cpu"}}})
    p = pipeline.resolve(DiffusionParams(prompt="a red fox standing in fresh snow, morning light, detailed fur",
                                         width=args.size, height=args.size, num_inference_steps=args.steps,
                                         seed=1234, negative_prompt=" " if args.true_cfg else None,
                                         true_cfg_scale=4.0 if args.true_cfg else 1.0), [])
    record(family=args.family, size=args.size, steps=p.num_inference_steps, true_cfg=args.true_cfg,
           torch=torch.__version__)
    reference = None
    if "diffusers" in args.parts:
        reference = diffusers_side(path, p, args.images, record)["compiled"]
    if "ours" in args.parts:
        cache = {**CACHE_PRESET, "Fn_compute_blocks": 1} if args.tiny else dict(CACHE_PRESET)  # the tiny DiT: 2 blocks
        if args.cache_threshold is not None:
            cache["residual_diff_threshold"] = args.cache_threshold
        ours_side(path, p, args.images, args.out, reference, args.modes.split(","), args.concurrency, cache)


if __name__ == "__main__":
    main()
