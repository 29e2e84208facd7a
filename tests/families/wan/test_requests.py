"""The Wan2.2 family as a server's caller meets it (AsyncOmni): detection and per-checkpoint defaults, videos and
progress on the outputs, the 400s of requests a checkpoint cannot take, the text encoders (and the I2V image's
VAE encoding) as a stage of their own, and the deploy options: the switches apply to both experts or are refused
at start-up with the reason."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import numpy as np
import pytest
import torch
from diffusers import WanImageToVideoPipeline
from PIL import Image

from omnistage.engine.diffusion import DiffusionParams
from omnistage.entrypoints.async_omni import AsyncOmni
from omnistage.errors import ConfigError, RequestError
from omnistage.families.registry import load_pipeline
from omnistage.families.wan import WanVideoPipeline
from omnistage.types import OmniOutput, OmniRequest

CPU = {"dtype": "float32", "devices": "cpu"}
DEPLOY = {"worker_backend": "inline", "stages": {"*": CPU}}
SMALL = DiffusionParams(width=48, height=32, num_frames=5, num_inference_steps=3, seed=3, max_sequence_length=32)
ATOL = 2e-5  # the parity tests' tolerance (the two layouts batch the encoders over different rows)


def video_request(p: DiffusionParams, prompt: str = "a fox in the snow", image: Image.Image | None = None,
            rid: str = "r") -> OmniRequest:
    return OmniRequest(rid, prompt=prompt, output_modalities=("video",), options={"diffusion": p},
                       media={"image": [image]} if image is not None else {})


async def _generate(engine: AsyncOmni, requests: list[OmniRequest]) -> list[list[OmniOutput]]:
    async def one(r: OmniRequest) -> list[OmniOutput]:
        return [out async for out in engine.generate(r)]

    return list(await asyncio.gather(*(one(r) for r in requests)))


def generate(path: str, requests: list[OmniRequest], deploy: dict = DEPLOY) -> list[list[OmniOutput]]:
    engine = AsyncOmni.from_model(path, deploy)
    try:
        return asyncio.run(_generate(engine, requests))
    finally:
        engine.shutdown()


def image(seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (24, 30, 3), dtype=np.uint8))


def test_detection_and_defaults(tiny_wan_t2v: str, tiny_wan_i2v: str, tiny_wan_ti2v: str) -> None:
    want = {  # (w, h, frames, fps, steps, guidance, guidance_2, boundary, flow shift): the model cards' defaults
        tiny_wan_t2v: (832, 480, 81, 16, 40, 4.0, 3.0, 0.875, 12.0),
        # the image's 5:4 aspect at 832x480's area (704x560: the nearest multiples of 16 below)
        tiny_wan_i2v: (704, 560, 81, 16, 40, 3.5, 3.5, 0.9, 5.0),
        tiny_wan_ti2v: (1280, 704, 121, 24, 50, 5.0, None, None, 5.0),
    }
    for path, defaults in want.items():
        pipeline = load_pipeline(path, DEPLOY)
        assert isinstance(pipeline, WanVideoPipeline)
        assert [(s.name, s.kind) for s in pipeline.stages] == [("dit", "diffusion")]
        assert pipeline.output_modalities == ("video",)
        p = pipeline.request_params(video_request(DiffusionParams(), image=image() if path == tiny_wan_i2v else None))
        assert (p.width, p.height, p.num_frames, p.fps, p.num_inference_steps, p.guidance_scale, p.guidance_scale_2,
                p.boundary_ratio, p.flow_shift) == defaults
        assert p.max_sequence_length == 512
    # TI2V sizes a video after its image too (multiples of 32), and a size the request gives wins
    pipeline = load_pipeline(tiny_wan_ti2v, DEPLOY)
    portrait = Image.new("RGB", (90, 160))
    p = pipeline.request_params(video_request(DiffusionParams(), image=portrait))
    assert (p.width, p.height) == (704, 1248)  # 9:16 at 1280x704's area
    p = pipeline.request_params(video_request(DiffusionParams(width=64, height=32), image=portrait))
    assert (p.width, p.height) == (64, 32)


def test_videos_progress_and_usage(tiny_wan_ti2v: str) -> None:
    """Each step's delta says how far the request is; the last carries n uint8 videos [F, H, W, 3] and their fps."""
    p = replace(SMALL, width=64, fps=8, n=2)
    (outs,) = generate(tiny_wan_ti2v, [video_request(p, image=image())])
    assert [o.progress for o in outs] == [(1, 3), (2, 3), (3, 3)]
    assert all(not o.videos for o in outs[:-1])
    last = outs[-1]
    assert last.finished and last.error is None and last.fps == 8.0
    assert len(last.videos) == 2
    assert all(v.dtype == np.uint8 and v.shape == (5, 32, 64, 3) for v in last.videos)
    assert np.abs(last.videos[0].astype(int) - last.videos[1].astype(int)).max() > 10  # two different videos
    assert last.num_prompt_tokens > 0
    (outs,) = generate(tiny_wan_ti2v, [video_request(replace(SMALL, width=64, fps=None))])
    assert outs[-1].fps == 24.0  # the checkpoint's default


@pytest.mark.parametrize(("kind", "change", "match", "param"), [
    ("t2v", {"num_frames": 8}, r"num_frames must be 4k\+1 \(e\.g\. 5 or 9\)", "num_frames"),
    ("t2v", {"width": 40}, "width must be a multiple of 16", "width"),
    ("ti2v", {"height": 48}, "height must be a multiple of 32", "height"),
    ("i2v", {}, "needs an input image", "image"),
    ("t2v", {"image": True}, "takes no input image", "image"),
    ("ti2v", {"guidance_scale_2": 2.0}, "applies to two-expert checkpoints", "guidance_scale_2"),
    ("ti2v", {"boundary_ratio": 0.5}, "applies to two-expert checkpoints", "boundary_ratio"),
], ids=["frames", "width", "ti2v-height", "i2v-without-image", "t2v-with-image", "guidance-2", "boundary"])
def test_bad_requests_are_400s(request: pytest.FixtureRequest, kind, change, match, param) -> None:
    pipeline = load_pipeline(request.getfixturevalue(f"tiny_wan_{kind}"), DEPLOY)
    change = dict(change)
    picture = image() if change.pop("image", False) else None
    with pytest.raises(RequestError, match=match) as info:
        pipeline.preprocess(video_request(replace(SMALL, **{"width": 64 if kind == "ti2v" else 48, **change}),
                                          image=picture))
    assert info.value.param == param and info.value.status == 400


def test_bad_request_fails_generate(tiny_wan_i2v: str) -> None:
    """Through AsyncOmni the same check rejects the request before it reaches the engine."""
    engine = AsyncOmni.from_model(tiny_wan_i2v, DEPLOY)
    try:
        with pytest.raises(RequestError, match="needs an input image"):
            asyncio.run(_generate(engine, [video_request(SMALL)]))
    finally:
        engine.shutdown()


def test_encode_stage_matches_one_stage(tiny_wan_i2v: str) -> None:
    """`stages.encode`: the text encoder and the image's VAE encoding in a stage of their own; the videos equal
    diffusers' (the one-stage pipeline's, per the parity tests)."""
    split = {"worker_backend": "inline", "stages": {"*": CPU, "encode": {"max_num_seqs": 4}}}
    assert [s.name for s in load_pipeline(tiny_wan_i2v, split).stages] == ["encode", "dit"]
    params = [replace(SMALL, negative_prompt="blurry", guidance_scale=3.0, guidance_scale_2=2.0),
              replace(SMALL, guidance_scale=1.0, seed=8)]
    outs = generate(tiny_wan_i2v, [video_request(p, image=image(i), rid=f"r{i}") for i, p in enumerate(params)], split)
    ref = WanImageToVideoPipeline.from_pretrained(tiny_wan_i2v)
    ref.set_progress_bar_config(disable=True)
    for i, (p, out) in enumerate(zip(params, outs, strict=True)):
        want = ref(image(i), prompt="a fox in the snow", negative_prompt=p.negative_prompt, height=32, width=48,
                   num_frames=5, num_inference_steps=3, guidance_scale=p.guidance_scale,
                   guidance_scale_2=p.guidance_scale_2, generator=torch.Generator("cpu").manual_seed(p.seed),
                   max_sequence_length=32, output_type="np").frames[0]
        # uint8 frames: at most one level of rounding apart
        assert np.abs(out[-1].videos[0].astype(int) - np.round(want * 255).astype(int)).max() <= 1


def options(**values) -> dict:
    return {"worker_backend": "inline", "stages": {"*": {**CPU, "options": values}}}


def test_switches_apply_to_both_experts_or_are_refused(tiny_wan_t2v: str, tiny_wan_ti2v: str) -> None:
    pipeline = load_pipeline(tiny_wan_t2v, options(attention_backend="_native_math"))
    model = pipeline.build_engine("dit").model
    assert len(model.transformers) == 2
    for expert in model.transformers:
        backends = {str(m.processor._attention_backend) for m in expert.modules() if hasattr(m, "processor")}
        assert backends == {"AttentionBackendName._NATIVE_MATH"}
    # regional compilation of each expert's repeated block (compiled lazily, at its first forward)
    model = load_pipeline(tiny_wan_t2v, options(compile=True)).build_engine("dit").model
    assert all(block._compiled_call_impl is not None for expert in model.transformers for block in expert.blocks)
    with pytest.raises(ConfigError, match="options.cache: .* 2 DiTs"):
        load_pipeline(tiny_wan_t2v, options(cache={})).build_engine("dit")
    with pytest.raises(ConfigError, match="offload_idle_expert: this checkpoint has one DiT"):
        load_pipeline(tiny_wan_ti2v, options(offload_idle_expert=True))
    with pytest.raises(ConfigError, match="offload_idle_expert and cpu_offload"):
        load_pipeline(tiny_wan_t2v, options(offload_idle_expert=True, cpu_offload=True))


def test_offload_idle_expert_gives_the_same_video(tiny_wan_t2v: str) -> None:
    p = replace(SMALL, num_inference_steps=4, guidance_scale=4.0, guidance_scale_2=2.0)
    (resident,), (offloaded,) = (generate(tiny_wan_t2v, [video_request(p)], d)
                                 for d in (DEPLOY, options(offload_idle_expert=True)))
    np.testing.assert_array_equal(resident[-1].videos[0], offloaded[-1].videos[0])



@pytest.mark.skipif(not torch.cuda.is_available(), reason="moves the experts between the GPU and host memory")
@pytest.mark.parametrize("switch", ["offload_idle_expert", "cpu_offload"])
def test_offloading_on_the_gpu_gives_the_resident_video(tiny_wan_t2v: str, switch: str) -> None:
    """On a GPU the idle expert goes to host memory between switches (or every module streams in as it runs):
    the same video as with both experts resident (float32, the same kernels on the same rows)."""
    p = replace(SMALL, num_inference_steps=4, guidance_scale=4.0, guidance_scale_2=2.0)
    gpu = {"dtype": "float32", "devices": "0"}
    resident, offloaded = ({"worker_backend": "inline", "stages": {"*": {**gpu, "options": o}}}
                           for o in ({}, {switch: True}))
    (a,), (b,) = (generate(tiny_wan_t2v, [video_request(p)], d) for d in (resident, offloaded))
    assert a[-1].error is None and b[-1].error is None, (a[-1].error, b[-1].error)
    np.testing.assert_allclose(b[-1].videos[0], a[-1].videos[0], rtol=0, atol=1e-5)
