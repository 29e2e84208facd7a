"""Z-Image through omnistage's diffusion engine equals diffusers' ZImagePipeline on the same tiny checkpoint, seed,
prompt, size and steps (with and without CFG); a request's image does not depend on what else is in its batch; and
the family detects Turbo and resolves its defaults.

Tolerance: float32 on the CPU, both sides run the same ops; only batched kernels (the text encoder over prompts
padded to another length, the DiT and VAE over more rows) may round differently, so images in [0, 1] agree to ATOL."""

from __future__ import annotations

import base64
import io
from dataclasses import replace

import numpy as np
import openai
import pytest
import torch
from diffusers import ZImagePipeline
from PIL import Image

from omnistage.engine.diffusion import DiffusionEngine, DiffusionParams
from omnistage.entrypoints.async_omni import AsyncOmni
from omnistage.entrypoints.openai.server import BackgroundServer
from omnistage.errors import RequestError
from omnistage.families.registry import load_pipeline
from omnistage.families.z_image import ZImageImagePipeline
from omnistage.types import OmniRequest

ATOL = 2e-5  # CFG (scale 4) amplifies the branches' rounding fivefold
DEPLOY = {"worker_backend": "inline", "stages": {"*": {"dtype": "float32", "devices": "cpu"}}}
PLAIN = DiffusionParams(prompt="a photo of a cat", width=48, height=32, num_inference_steps=4, seed=7,
                        guidance_scale=0.0, max_sequence_length=64)
CFG = replace(PLAIN, negative_prompt="blurry, low quality", guidance_scale=4.0, seed=3)


@pytest.fixture(scope="module", params=["base", "turbo"])
def variant(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def path(variant: str, request: pytest.FixtureRequest) -> str:
    return request.getfixturevalue(f"tiny_z_image_{variant}")


@pytest.fixture(scope="module")
def reference(path: str) -> ZImagePipeline:
    pipe = ZImagePipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def pipeline(path: str) -> ZImageImagePipeline:
    return load_pipeline(path, DEPLOY)


@pytest.fixture(scope="module")
def engine(pipeline: ZImageImagePipeline) -> DiffusionEngine:
    return pipeline.build_engine("dit")


def diffusers_images(ref: ZImagePipeline, p: DiffusionParams) -> np.ndarray:
    return ref(p.prompt, negative_prompt=p.negative_prompt, guidance_scale=p.guidance_scale, width=p.width,
               height=p.height, num_inference_steps=p.num_inference_steps, num_images_per_prompt=p.n,
               generator=torch.Generator("cpu").manual_seed(p.seed), max_sequence_length=p.max_sequence_length,
               output_type="np").images


def run(pipeline: ZImageImagePipeline, engine: DiffusionEngine, joins: dict[int, dict[str, DiffusionParams]]
        ) -> tuple[dict[str, np.ndarray], list]:
    """Steps the engine; before step k adds the requests of `joins[k]` (through the family's preprocessing).
    Returns each finished request's images and every delta."""
    images, deltas, k = {}, [], 0
    while engine.has_work() or any(s >= k for s in joins):
        for rid, p in joins.get(k, {}).items():
            request = OmniRequest(rid, prompt=p.prompt, output_modalities=("image",), options={"diffusion": p})
            engine.add_request(pipeline.preprocess(request))
        for out in engine.step():
            assert out.error is None, out.error
            deltas.append(out)
            if out.finished:
                images[out.request_id] = out.tensors["images"].numpy()
        k += 1
    return images, deltas


@pytest.mark.parametrize("p", [PLAIN, CFG], ids=["plain", "cfg"])
def test_image_matches_diffusers(pipeline, engine, reference, p) -> None:
    images, _ = run(pipeline, engine, {0: {"a": p}})
    want = diffusers_images(reference, p)
    assert images["a"].shape == want.shape == (1, 32, 48, 3)
    np.testing.assert_allclose(images["a"], want, rtol=0, atol=ATOL)
    # the tolerance is far below what a different seed or prompt changes: the comparison can fail
    assert np.abs(diffusers_images(reference, replace(p, seed=p.seed + 1)) - want).max() > 1000 * ATOL
    assert np.abs(diffusers_images(reference, replace(p, prompt="a dog")) - want).max() > 1000 * ATOL


def test_cfg_changes_the_image(reference) -> None:
    assert np.abs(diffusers_images(reference, CFG) - diffusers_images(reference, replace(CFG, guidance_scale=0.0))
                  ).max() > 1000 * ATOL


def test_n_images_are_diffusers_num_images_per_prompt(pipeline, engine, reference) -> None:
    p = replace(PLAIN, n=2, seed=11)
    images, _ = run(pipeline, engine, {0: {"a": p}})
    want = diffusers_images(reference, p)
    assert images["a"].shape == (2, 32, 48, 3)
    np.testing.assert_allclose(images["a"], want, rtol=0, atol=ATOL)
    assert np.abs(images["a"][0] - images["a"][1]).max() > 1000 * ATOL


def test_batched_at_different_steps_matches_alone(pipeline, engine, reference, variant) -> None:
    """Four requests of different seeds and prompt lengths (so different caption lengths), joining at different
    steps, each equal their own single-request image; on base one of them runs CFG in the same forwards."""
    target = replace(PLAIN, prompt="a lighthouse on a cliff above a stormy sea at dusk", num_inference_steps=6,
                     seed=21)
    alone, _ = run(pipeline, engine, {0: {"t": target}})
    others = {
        0: {"t": target, "short": replace(PLAIN, prompt="fox", num_inference_steps=3, seed=2)},
        2: {"mid": replace(CFG if variant == "base" else PLAIN, prompt="a red house by the sea", seed=5)},
        4: {"late": replace(PLAIN, prompt="snowy mountains under a clear blue winter sky", num_inference_steps=2,
                            seed=1)},
    }
    batched, deltas = run(pipeline, engine, others)
    assert {"t", "short", "mid", "late"} <= set(batched)
    # the target shared forwards with requests at other steps of other schedules
    assert any(d.request_id == "mid" and d.num_output_tokens == 1 for d in deltas)
    assert any(d.request_id == "late" and d.num_output_tokens == 1 for d in deltas)
    np.testing.assert_allclose(batched["t"], alone["t"], rtol=0, atol=ATOL)
    np.testing.assert_allclose(alone["t"], diffusers_images(reference, target), rtol=0, atol=ATOL)
    for rid in ("short", "mid", "late"):  # per-row timesteps and captions: each matches its own diffusers run
        p = others[next(k for k, v in others.items() if rid in v)][rid]
        np.testing.assert_allclose(batched[rid], diffusers_images(reference, p), rtol=0, atol=ATOL)


def test_detection_defaults_and_checks(path, variant, pipeline) -> None:
    assert isinstance(pipeline, ZImageImagePipeline)
    assert [(s.name, s.kind) for s in pipeline.stages] == [("dit", "diffusion")]
    assert pipeline.output_modalities == ("image",)

    def resolved(pipe: ZImageImagePipeline) -> DiffusionParams:
        return DiffusionParams.of(pipe.preprocess(OmniRequest("r", prompt="x", output_modalities=("image",))).params)

    # diffusers' ZImagePipeline defaults; Turbo (detected by its scheduler shift) as its authors run it
    p = resolved(pipeline)
    assert (p.width, p.height, p.max_sequence_length) == (1024, 1024, 512)
    assert (p.num_inference_steps, p.guidance_scale) == ((9, 0.0) if variant == "turbo" else (50, 5.0))
    for preset, want in (("base", (50, 5.0)), ("turbo", (9, 0.0))):
        pipe = load_pipeline(path, {**DEPLOY, "stages": {"*": DEPLOY["stages"]["*"],
                                                         "dit": {"options": {"preset": preset}}}})
        assert (resolved(pipe).num_inference_steps, resolved(pipe).guidance_scale) == want
    with pytest.raises(RequestError, match="multiple of 4") as info:
        pipeline.preprocess(OmniRequest("r", prompt="x", output_modalities=("image",),
                                        options={"diffusion": replace(PLAIN, width=42)}))
    assert info.value.param == "width"


def test_http_generation_equals_diffusers(tiny_z_image_turbo: str) -> None:
    """POST /v1/images/generations on a real server: the PNG equals diffusers' for the same request."""
    engine = AsyncOmni.from_model(tiny_z_image_turbo, DEPLOY, served_model_name="z-image-turbo")
    try:
        with BackgroundServer(engine) as server:
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
            out = client.images.generate(model="z-image-turbo", prompt="a red fox in the snow", size="48x32",
                                         extra_body={"num_inference_steps": 3, "seed": 7})
            with pytest.raises(openai.BadRequestError, match="multiple of 4"):
                client.images.generate(model="z-image-turbo", prompt="x", size="42x32",
                                       extra_body={"num_inference_steps": 1})
    finally:
        engine.shutdown()
    pipe = ZImagePipeline.from_pretrained(tiny_z_image_turbo)
    pipe.set_progress_bar_config(disable=True)
    (want,) = pipe("a red fox in the snow", width=48, height=32, num_inference_steps=3, guidance_scale=0.0,
                   generator=torch.Generator("cpu").manual_seed(7)).images
    got = np.asarray(Image.open(io.BytesIO(base64.b64decode(out.data[0].b64_json))).convert("RGB")).astype(np.int16)
    assert got.shape == (32, 48, 3)
    assert np.abs(got - np.asarray(want.convert("RGB")).astype(np.int16)).max() <= 1
    # usage: the caption tokens diffusers encodes for the prompt, and the DiT's image tokens (2x2 latent patches)
    (embeds,), _ = pipe.encode_prompt("a red fox in the snow", device="cpu", do_classifier_free_guidance=False)
    image = (48 // (pipe.vae_scale_factor * 2)) * (32 // (pipe.vae_scale_factor * 2))
    assert (out.usage.input_tokens_details.text_tokens, out.usage.output_tokens) == (embeds.shape[0], image)
    assert out.usage.total_tokens == embeds.shape[0] + image
