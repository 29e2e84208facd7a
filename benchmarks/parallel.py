"""Several GPUs against one, side by side in one run: tensor-parallel decode and parallel diffusion.

- `lm`: a Qwen2.5-7B-architecture checkpoint (random bf16, written once to disk: the TP follower loads its shard
  from the safetensors files) served by `Omni` with `tensor_parallel_size` 1 (devices "0") and 2 (devices "0,1"):
  one request (prompt 128, 256 greedy tokens, ignore_eos: output tok/s, ms per decode token) and 256 requests at
  once (output tok/s); whether both sides' greedy tokens agree for the first request.
- `image`: Qwen-Image at 1024x1024 (`full_size_checkpoint`), true CFG (negative prompt, true_cfg_scale 4), one
  process (devices "0") against `cfg_parallel` and `ulysses_degree: 2` (devices "0,1"): s/image after a warm-up
  image, and each parallel side's max |diff| and PSNR against the one-GPU image (same seed).

Every side runs in a process of its own (spawn), so its GPU memory and process groups are its own; rows are
appended as they come. `--tiny`: tiny checkpoints and every rank on the CPU (gloo), a smoke run of the code path.

    python benchmarks/parallel.py --out parallel.jsonl                   # both parts (two GPUs)
    python benchmarks/parallel.py --parts image --steps 20 --stop-after 480
    python benchmarks/parallel.py --tiny                                 # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import shutil
import statistics
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from diffusion_images import full_size_checkpoint, peak_gib, psnr_ssim, reset_peak, run_engine
from llm_throughput import qwen2_7b_config
from recording import recorder

from omnistage.engine.diffusion import DiffusionParams
from omnistage.testing.factory import make_tokenizer, tiny_checkpoint

REPEATS = 3
LM_SIDES = {"tp1": (1, "0"), "tp2": (2, "0,1")}
IMAGE_SIDES = {"one": ("0", {}), "cfg_parallel": ("0,1", {"cfg_parallel": True}),
               "ulysses2": ("0,1", {"ulysses_degree": 2})}


@dataclass(frozen=True)
class LMWork:
    prompt_len: int
    output_len: int
    requests: int


FULL_LM, TINY_LM = LMWork(128, 256, 256), LMWork(16, 16, 8)


def _call(conn: Any, fn: Any, args: tuple) -> None:
    try:
        conn.send((True, fn(*args)))
    except BaseException:
        conn.send((False, traceback.format_exc()))
        raise


def spawn(fn: Any, *args: Any) -> Any:
    """`fn(*args)` in a fresh spawned process (its own CUDA context, memory peaks and process groups). Not a Pool:
    its workers are daemons, which may not start the TP follower or the diffusion ranks."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_call, args=(child, fn, args))
    proc.start()
    child.close()
    try:
        ok, value = parent.recv()  # before join: a large result fills the pipe until it is read
    except EOFError:
        ok, value = False, "the side's process died without a result"
    proc.join()
    if not ok:
        raise RuntimeError(f"{getattr(fn, '__name__', fn)} failed (exit code {proc.exitcode}):\n{value}")
    return value


def gpu_used_gib() -> list[float]:
    """Memory in use on each GPU, by every process (so the TP follower's and the Ulysses ranks' count too)."""
    used = []
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        used.append(round((total - free) / 2**30, 2))
    return used


# ---- lm --------------------------------------------------------------------------------------


def lm_checkpoint(out: Path, tiny: bool) -> Path:
    """The factory's tokenizer beside a Qwen2.5-7B-architecture model (or llm_throughput's tiny one), random bf16,
    built on the GPU when there is one."""
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    if (out / "config.json").is_file():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tok = AutoTokenizer.from_pretrained(make_tokenizer(tmp))
    config = qwen2_7b_config(tiny)
    config.eos_token_id = tok.convert_tokens_to_ids("<|im_end|>")
    config.bos_token_id = config.pad_token_id = tok.convert_tokens_to_ids("<|endoftext|>")
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen2ForCausalLM._from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(tmp, safe_serialization=True)
    del model
    tmp.rename(out)
    return out


def lm_prompts(n: int, work: LMWork, seed: int) -> list[list[int]]:
    # ids inside the tokenizer's range (the model's vocabulary is larger: generated ids may lie beyond it)
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 500, (n, work.prompt_len), generator=g).tolist()


def lm_side(path: Path, side: str, tiny: bool, out: str | None) -> list[int] | None:
    from omnistage import Omni, SamplingParams

    record = recorder(out)
    work = TINY_LM if tiny else FULL_LM
    tp, devices = LM_SIDES[side]
    stage = {"tensor_parallel_size": tp, "devices": "cpu" if tiny else devices,
             "dtype": "float32" if tiny else "bfloat16", "max_model_len": 1024, "max_num_seqs": work.requests,
             "max_num_batched_tokens": 8192, "gpu_memory_utilization": 0.85}
    params = SamplingParams(max_tokens=work.output_len, temperature=0, ignore_eos=True)
    one, many = lm_prompts(1, work, 1), lm_prompts(work.requests, work, 2)
    t0 = time.perf_counter()
    with Omni(path, {"stages": {"lm": stage}}) as omni:
        record(part="lm", side=side, event="ready", start_s=round(time.perf_counter() - t0, 1))
        omni.generate(one, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))  # warm-up
        runs = []
        for _ in range(REPEATS):
            t = time.perf_counter()
            (o,) = omni.generate(one, params)
            assert o.error is None, o.error
            runs.append((time.perf_counter() - t, o))
        runs.sort(key=lambda r: r[0])
        seconds, first = runs[len(runs) // 2]
        m = first.metrics["lm"]
        decode_s = (m.finish_time - m.first_output_time) / (work.output_len - 1)
        record(part="lm", side=side, tp=tp, batch=1, output_tokens=len(first.token_ids), seconds=round(seconds, 3),
               seconds_min=round(runs[0][0], 3), seconds_max=round(runs[-1][0], 3),
               output_tok_per_s=round(work.output_len / seconds, 1), ms_per_token=round(decode_s * 1e3, 3),
               ttft_s=round(m.first_output_time - m.start_time, 4))
        omni.generate(many[:8], params)  # warm-up of batched shapes
        times = []
        for _ in range(2):
            t = time.perf_counter()
            outs = omni.generate(many, params)
            times.append(time.perf_counter() - t)
            assert all(o.error is None for o in outs), next(o.error for o in outs if o.error)
        generated = sum(len(o.token_ids) for o in outs)
        record(part="lm", side=side, tp=tp, requests=work.requests, prompt_len=work.prompt_len,
               output_len=work.output_len, seconds=round(min(times), 3), seconds_max=round(max(times), 3),
               output_tok_per_s=round(generated / min(times), 1),
               rank0_peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available()
               else None, gpu_used_gib=gpu_used_gib())
    return runs[0][1].token_ids


def lm_part(args: argparse.Namespace, record: Any, deadline: float) -> None:
    path = Path(args.lm_checkpoint or ("/tmp/omnistage-bench/qwen2-7b-random" + ("-tiny" if args.tiny else "")))
    t0 = time.perf_counter()
    spawn(lm_checkpoint, path, args.tiny)
    record(part="lm", event="checkpoint", path=str(path), seconds=round(time.perf_counter() - t0, 1))
    tokens: dict[str, list[int]] = {}
    for side in LM_SIDES:
        if time.monotonic() > deadline:
            record(part="lm", side=side, skipped="--stop-after")
            continue
        try:
            got = spawn(lm_side, path, side, args.tiny, args.out)
        except Exception:
            record(part="lm", side=side, error=traceback.format_exc()[-1500:])
            continue
        if got is not None:
            tokens[side] = got
    if len(tokens) == 2:
        a, b = tokens["tp1"], tokens["tp2"]
        first_diff = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        record(part="lm", compare="tp2_vs_tp1", same_greedy_tokens=a == b, first_differing_token=first_diff,
               tokens=len(a))


# ---- image -----------------------------------------------------------------------------------


def tiny_two_head_qwen_image(out: Path) -> Path:
    """The tiny Qwen-Image with its DiT re-made at 2 attention heads (the tiny one has 1: degree 2 cannot split
    it); random weights as the DiT's own init makes them."""
    from diffusers import QwenImageTransformer2DModel

    if (out / "model_index.json").is_file():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(tiny_checkpoint("qwen-image"), tmp)
    config = json.loads((tmp / "transformer" / "config.json").read_text())
    config = {k: v for k, v in config.items() if not k.startswith("_")} | {"num_attention_heads": 2}
    torch.manual_seed(0)
    dit = QwenImageTransformer2DModel(**config)
    shutil.rmtree(tmp / "transformer")
    dit.save_pretrained(tmp / "transformer", safe_serialization=True)
    tmp.rename(out)
    return out


def image_side(path: Path, side: str, p: DiffusionParams, images: int, tiny: bool,
               out: str | None) -> np.ndarray | None:
    from omnistage.families.registry import load_pipeline

    record = recorder(out)
    devices, options = IMAGE_SIDES[side]
    stage = {"devices": "cpu" if tiny else devices, "options": options}
    reset_peak()
    t0 = time.perf_counter()
    pipeline = load_pipeline(path, {"worker_backend": "inline", "stages": {"dit": stage}})
    engine = pipeline.build_engine("dit")
    try:
        p = pipeline.resolve(p, [])
        run_engine(pipeline, engine, [p])  # warm-up
        warm = time.perf_counter() - t0
        times = []
        for _ in range(images):
            single = run_engine(pipeline, engine, [p])
            times.append(single["total"])
        record(part="image", side=side, devices=stage["devices"], options=options, size=p.width,
               steps=p.num_inference_steps, true_cfg_scale=p.true_cfg_scale,
               s_per_image=round(statistics.median(times), 3), s_min=round(min(times), 3),
               s_max=round(max(times), 3), images=images, start_and_warmup_s=round(warm, 1),
               rank0_peak_gib=round(peak_gib(), 2), gpu_used_gib=gpu_used_gib())
        return single["images"]["r0"]
    finally:
        engine.shutdown()


def image_part(args: argparse.Namespace, record: Any, deadline: float) -> None:
    t0 = time.perf_counter()
    if args.tiny:
        path = spawn(tiny_two_head_qwen_image, Path("/tmp/omnistage-bench/qwen-image-tiny-2head"))
    else:
        path = spawn(full_size_checkpoint, "qwen-image",
                     Path(args.image_checkpoint or "/tmp/omnistage-bench/qwen-image"))
    record(part="image", event="checkpoint", path=str(path), seconds=round(time.perf_counter() - t0, 1))
    size = 64 if args.tiny else 1024
    p = DiffusionParams(prompt="a red fox standing in fresh snow, morning light, detailed fur", width=size,
                        height=size, num_inference_steps=3 if args.tiny else args.steps, seed=1234,
                        negative_prompt="blurry, low quality", true_cfg_scale=4.0)
    reference = None
    for side in IMAGE_SIDES:
        if time.monotonic() > deadline:
            record(part="image", side=side, skipped="--stop-after")
            continue
        try:
            image = spawn(image_side, path, side, p, args.images, args.tiny, args.out)
        except Exception:
            record(part="image", side=side, error=traceback.format_exc()[-1500:])
            continue
        if side == "one":
            reference = image
        elif reference is not None and image is not None:
            psnr, _ = psnr_ssim(image, reference)
            diff = float(np.abs(image - reference).max())
            record(part="image", compare=f"{side}_vs_one", max_abs_diff=float(f"{diff:.3g}"),
                   psnr_db=round(psnr, 2) if math.isfinite(psnr) else "inf")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="lm,image", help="lm, image or both")
    ap.add_argument("--out", help="append one JSON row per measurement here")
    ap.add_argument("--tiny", action="store_true", help="tiny checkpoints, every rank on the CPU (a smoke run)")
    ap.add_argument("--stop-after", type=float, default=None, metavar="S",
                    help="start no further side after S seconds")
    ap.add_argument("--steps", type=int, default=20, help="denoising steps of an image")
    ap.add_argument("--images", type=int, default=REPEATS, help="timed images per side (after one warm-up)")
    ap.add_argument("--lm-checkpoint", help="where the LM checkpoint is (written there if missing)")
    ap.add_argument("--image-checkpoint", help="where the Qwen-Image checkpoint is (written there if missing)")
    args = ap.parse_args()
    deadline = time.monotonic() + (args.stop_after if args.stop_after is not None else float("inf"))
    record = recorder(args.out)
    record(event="start", parts=args.parts, tiny=args.tiny, torch=torch.__version__)
    parts = args.parts.split(",")
    for name, part in (("lm", lm_part), ("image", image_part)):
        if name not in parts:
            continue
        if time.monotonic() > deadline:
            record(part=name, skipped="--stop-after")
            continue
        try:
            part(args, record, deadline)
        except Exception:
            traceback.print_exc()
            record(part=name, error=traceback.format_exc()[-1500:])


if __name__ == "__main__":
    main()
