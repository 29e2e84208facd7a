"""Wan2.2 through omnistage's diffusion engine equals diffusers' WanPipeline / WanImageToVideoPipeline on the same
tiny checkpoint, seed, prompt, size, frames and steps: T2V-A14B's two experts with the boundary inside the schedule
and a different CFG scale per expert, I2V-A14B with an image, TI2V-5B with and without one; and a request's frames
do not depend on what else is in its forwards (rows at other steps, on the other expert, with or without an image).

Tolerance: float32 on the CPU, both sides run the same ops; only batched kernels (the text encoder, DiTs and VAE
over more rows) may round differently, so frames in [0, 1] agree to ATOL."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from diffusers import UniPCMultistepScheduler, WanImageToVideoPipeline, WanPipeline
from PIL import Image

from omnistage.engine.diffusion import DiffusionEngine, DiffusionParams
from omnistage.families.registry import load_pipeline
from omnistage.families.wan import WanVideoPipeline
from omnistage.types import OmniRequest

ATOL = 2e-5  # CFG (scale 4) amplifies the branches' rounding fivefold
DEPLOY = {"worker_backend": "inline", "stages": {"*": {"dtype": "float32", "devices": "cpu", "max_num_seqs": 8}}}
# 4 steps at the tiny T2V's flow shift 12: timesteps 999, 973, 923, 800; its boundary 0.875 -> the last step runs
# on the low-noise expert.
T2V = DiffusionParams(prompt="a cat walking on a beach", negative_prompt="blurry, static", width=48, height=32,
                      num_frames=9, num_inference_steps=4, guidance_scale=4.0, guidance_scale_2=2.0, seed=5,
                      max_sequence_length=32)
TI2V = replace(T2V, width=64, guidance_scale_2=None, seed=9)


def picture(width: int = 52, height: int = 40, seed: int = 0) -> Image.Image:
    """A smooth random picture (not of the video's size: the pipelines resize it)."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)
    return Image.fromarray(small).resize((width, height), Image.BILINEAR)


def engine_for(path: str) -> tuple[WanVideoPipeline, DiffusionEngine]:
    pipeline = load_pipeline(path, DEPLOY)
    return pipeline, pipeline.build_engine("dit")


def reference_for(path: str, cls: type) -> WanPipeline:
    pipe = cls.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def diffusers_frames(ref, p: DiffusionParams, image: Image.Image | None = None) -> np.ndarray:
    """diffusers' frames for `p`; a request's flow_shift and boundary_ratio become the scheduler's and the
    pipeline's config, as a diffusers user sets them."""
    config = dict(ref.config)
    scheduler = ref.scheduler
    try:
        if p.flow_shift is not None:
            ref.scheduler = UniPCMultistepScheduler.from_config(scheduler.config, flow_shift=p.flow_shift)
        if p.boundary_ratio is not None:
            ref.register_to_config(boundary_ratio=p.boundary_ratio)
        kwargs = {"image": image} if image is not None else {}
        if p.guidance_scale_2 is not None:
            kwargs["guidance_scale_2"] = p.guidance_scale_2
        return ref(prompt=p.prompt, negative_prompt=p.negative_prompt, height=p.height, width=p.width,
                   num_frames=p.num_frames, num_inference_steps=p.num_inference_steps, guidance_scale=p.guidance_scale,
                   num_videos_per_prompt=p.n, generator=torch.Generator("cpu").manual_seed(p.seed),
                   max_sequence_length=p.max_sequence_length, output_type="np", **kwargs).frames
    finally:
        ref.scheduler = scheduler
        ref.register_to_config(boundary_ratio=config["boundary_ratio"])


def run(pipeline: WanVideoPipeline, engine: DiffusionEngine,
        joins: dict[int, dict[str, tuple[DiffusionParams, Image.Image | None]]]) -> tuple[dict[str, np.ndarray], list]:
    """Steps the engine; before step k adds the requests of `joins[k]` (through the family's preprocessing).
    Returns each finished request's frames [n, F, H, W, 3] and each step's deltas."""
    videos, deltas, k = {}, [], 0
    while engine.has_work() or any(s >= k for s in joins):
        for rid, (p, image) in joins.get(k, {}).items():
            request = OmniRequest(rid, prompt=p.prompt, output_modalities=("video",), options={"diffusion": p},
                                  media={"image": [image]} if image is not None else {})
            engine.add_request(pipeline.preprocess(request))
        deltas.append(engine.step())
        for out in deltas[-1]:
            assert out.error is None, out.error
            if out.finished:
                videos[out.request_id] = out.tensors["video"].numpy()
        k += 1
    return videos, deltas


def differs(a: np.ndarray, b: np.ndarray) -> bool:
    """Far beyond the tolerance: the comparisons above it can fail."""
    return float(np.abs(a - b).max()) > 1000 * ATOL


# ---- T2V-A14B: two experts ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def t2v(tiny_wan_t2v: str) -> tuple:
    return (*engine_for(tiny_wan_t2v), reference_for(tiny_wan_t2v, WanPipeline))


def test_the_boundary_is_inside_the_schedule(t2v) -> None:
    pipeline, engine, _ = t2v
    params = pipeline.request_params(OmniRequest("r", prompt="x", options={"diffusion": T2V}))
    timesteps = engine.model.schedule(params).timesteps
    boundary = params.boundary_ratio * 1000
    assert params.boundary_ratio == 0.875 and (timesteps >= boundary).sum() == 3 and (timesteps < boundary).sum() == 1


@pytest.mark.parametrize("p", [T2V, replace(T2V, boundary_ratio=0.95, seed=6), replace(T2V, flow_shift=3.0, n=2)],
                         ids=["two-experts-cfg", "request-boundary", "flow-shift-n2"])
def test_t2v_matches_diffusers(t2v, p) -> None:
    pipeline, engine, ref = t2v
    videos, _ = run(pipeline, engine, {0: {"a": (p, None)}})
    want = diffusers_frames(ref, p)
    assert videos["a"].shape == want.shape == (p.n, 9, 32, 48, 3)
    np.testing.assert_allclose(videos["a"], want, rtol=0, atol=ATOL)
    # the low-noise expert's own scale and the boundary both show in the frames
    assert differs(diffusers_frames(ref, replace(p, guidance_scale_2=p.guidance_scale)), want)
    assert differs(diffusers_frames(ref, replace(p, boundary_ratio=0.5)), want)
    assert differs(diffusers_frames(ref, replace(p, seed=p.seed + 1)), want)
    if p.n == 2:
        assert differs(videos["a"][0], videos["a"][1])


def test_t2v_batched_across_experts_matches_alone(t2v) -> None:
    """Requests joining at different steps share forwards with rows on both experts, with and without CFG and
    with n=2; each equals its own diffusers run."""
    pipeline, engine, ref = t2v
    target = replace(T2V, num_inference_steps=5, seed=21)
    joins = {
        0: {"t": (target, None), "pair": (replace(T2V, prompt="two dogs", seed=2, n=2), None)},
        3: {"late": (replace(T2V, prompt="a red house by the sea", guidance_scale=1.0, seed=3), None)},
        4: {"last": (replace(T2V, boundary_ratio=0.95, seed=4), None)},
    }
    batched, steps = run(pipeline, engine, joins)
    assert {"t", "pair", "late", "last"} <= set(batched)
    # one forward: "late"'s first step (timestep 999, high-noise expert) beside "pair"'s last (800, low-noise)
    assert any({(d.request_id, d.num_output_tokens) for d in step} >= {("late", 1), ("pair", 4)} for step in steps)
    for step in joins.values():
        for rid, (p, _) in step.items():
            np.testing.assert_allclose(batched[rid], diffusers_frames(ref, p), rtol=0, atol=ATOL, err_msg=rid)


# ---- I2V-A14B: an image and two experts -------------------------------------------------------------------------

def test_i2v_matches_diffusers(tiny_wan_i2v: str) -> None:
    pipeline, engine = engine_for(tiny_wan_i2v)
    ref = reference_for(tiny_wan_i2v, WanImageToVideoPipeline)
    image, other = picture(seed=1), picture(seed=2)
    p = replace(T2V, guidance_scale=3.5, guidance_scale_2=1.5)
    q = replace(p, prompt="a bird over a lake", seed=8, n=2)
    videos, _ = run(pipeline, engine, {0: {"a": (p, image)}, 2: {"b": (q, other)}})
    want = diffusers_frames(ref, p, image)
    assert videos["a"].shape == want.shape == (1, 9, 32, 48, 3)
    np.testing.assert_allclose(videos["a"], want, rtol=0, atol=ATOL)
    np.testing.assert_allclose(videos["b"], diffusers_frames(ref, q, other), rtol=0, atol=ATOL)
    assert differs(diffusers_frames(ref, p, other), want)  # the image conditions the video


# ---- TI2V-5B: one DiT, per-token timesteps, an optional image ---------------------------------------------------

def test_ti2v_matches_diffusers_with_and_without_image(tiny_wan_ti2v: str) -> None:
    pipeline, engine = engine_for(tiny_wan_ti2v)
    t2v, i2v = reference_for(tiny_wan_ti2v, WanPipeline), reference_for(tiny_wan_ti2v, WanImageToVideoPipeline)
    image = picture(seed=3)
    text_only, with_image = TI2V, replace(TI2V, prompt="a bird over a lake", seed=10, n=2)
    # one batch: a row keeping its image's first frame beside rows denoising all frames, at different steps
    videos, _ = run(pipeline, engine, {0: {"t": (text_only, None)}, 1: {"i": (with_image, image)}})
    want_t, want_i = diffusers_frames(t2v, text_only), diffusers_frames(i2v, with_image, image)
    assert videos["t"].shape == want_t.shape == (1, 9, 32, 64, 3)
    assert videos["i"].shape == want_i.shape == (2, 9, 32, 64, 3)
    np.testing.assert_allclose(videos["t"], want_t, rtol=0, atol=ATOL)
    np.testing.assert_allclose(videos["i"], want_i, rtol=0, atol=ATOL)
    assert differs(diffusers_frames(t2v, with_image), want_i)  # the image conditions the video
    alone, _ = run(pipeline, engine, {0: {"i": (with_image, image)}})
    np.testing.assert_allclose(alone["i"], videos["i"], rtol=0, atol=ATOL)


def test_vae_tiling_is_diffusers_tiled_decode(t2v) -> None:
    """`vae_use_tiling` decodes in overlapping spatial tiles as diffusers' `vae.enable_tiling()` does (a video wider
    than one tile: the blended seams make it differ from the whole-frame decode)."""
    pipeline, engine, ref = t2v
    p = replace(T2V, width=288, num_frames=5, guidance_scale=1.0, vae_use_tiling=True)
    videos, _ = run(pipeline, engine, {0: {"a": (p, None)}})
    ref.vae.enable_tiling()
    try:
        want = diffusers_frames(ref, p)
    finally:
        ref.vae.disable_tiling()
    np.testing.assert_allclose(videos["a"], want, rtol=0, atol=ATOL)
    assert differs(diffusers_frames(ref, p), want)
