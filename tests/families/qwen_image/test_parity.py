"""Qwen-Image, Qwen-Image-Edit and Qwen-Image-Edit-Plus through omnistage's diffusion engine equal diffusers'
pipelines on the same tiny checkpoint, seed, prompt, input images, size and steps; and a request's image does not
depend on what else is in its batch (other prompts and text lengths, other steps, CFG rows, other input sizes).

Tolerance: float32 on the CPU, both sides run the same ops; only batched kernels (text encoder, DiT and VAE over
more rows, attention over padded text) may round differently, so images in [0, 1] agree to ATOL."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline
from PIL import Image

from omnistage.engine.diffusion import DiffusionEngine, DiffusionParams
from omnistage.errors import ConfigError, RequestError
from omnistage.families.diffusion import ImagePipeline
from omnistage.families.qwen_image import (
    QwenImageEditImagePipeline,
    QwenImageEditPlusImagePipeline,
    QwenImageImagePipeline,
)
from omnistage.families.registry import load_pipeline
from omnistage.types import OmniRequest

ATOL = 1e-4
DEPLOY = {"worker_backend": "inline", "stages": {"*": {"dtype": "float32", "devices": "cpu"}}}
BASE = DiffusionParams(prompt="a photo of a cat", width=64, height=48, num_inference_steps=3, seed=7)
CFG = replace(BASE, negative_prompt="blurry, low quality", true_cfg_scale=4.0, seed=3)
# Edit models condition on ~1024x1024-pixel latents (4096 tokens per input image) whatever the output size: few steps.
EDIT, EDIT_CFG = replace(BASE, num_inference_steps=2), replace(CFG, num_inference_steps=2, n=2)


def picture(width: int, height: int, seed: int) -> Image.Image:
    """A smooth random RGB picture (what the VAE and the vision tower see)."""
    g = torch.Generator().manual_seed(seed)
    small = torch.rand(3, 4, 4, generator=g)[None]
    big = torch.nn.functional.interpolate(small, size=(height, width), mode="bilinear")[0]
    return Image.fromarray((big.permute(1, 2, 0) * 255).round().to(torch.uint8).numpy())


PICTURES = [picture(56, 40, 0), picture(40, 64, 1), picture(48, 48, 2)]


def load(path: str) -> tuple[ImagePipeline, DiffusionEngine, DiffusionPipeline]:
    pipeline = load_pipeline(path, DEPLOY)
    reference = DiffusionPipeline.from_pretrained(path)
    reference.set_progress_bar_config(disable=True)
    return pipeline, pipeline.build_engine("dit"), reference


@pytest.fixture(scope="module")
def t2i(tiny_qwen_image_t2i: str) -> tuple:
    return load(tiny_qwen_image_t2i)


@pytest.fixture(scope="module")
def edit(tiny_qwen_image_edit: str) -> tuple:
    return load(tiny_qwen_image_edit)


@pytest.fixture(scope="module")
def edit_plus(tiny_qwen_image_edit_plus: str) -> tuple:
    return load(tiny_qwen_image_edit_plus)


def diffusers_images(ref: DiffusionPipeline, p: DiffusionParams, images: list[Image.Image] | None = None
                     ) -> np.ndarray:
    kwargs = {}
    if images is not None:  # Edit takes one image, Edit-Plus a list
        kwargs["image"] = images[0] if type(ref).__name__ == "QwenImageEditPipeline" else images
    if p.max_sequence_length is not None:
        kwargs["max_sequence_length"] = p.max_sequence_length
    return ref(prompt=p.prompt, negative_prompt=p.negative_prompt, true_cfg_scale=p.true_cfg_scale or 1.0,
               width=p.width,
               height=p.height, num_inference_steps=p.num_inference_steps, num_images_per_prompt=p.n,
               generator=torch.Generator("cpu").manual_seed(p.seed), output_type="np", **kwargs).images


def request(rid: str, p: DiffusionParams, images: list[Image.Image] | None = None) -> OmniRequest:
    return OmniRequest(rid, prompt=p.prompt, output_modalities=("image",), options={"diffusion": p},
                       media={"image": images} if images else {})


def run(pipeline: ImagePipeline, engine: DiffusionEngine, joins: dict[int, dict[str, tuple]]
        ) -> tuple[dict[str, np.ndarray], list]:
    """Steps the engine; before step k adds the requests of `joins[k]` ({id: (params, images)}, through the
    family's preprocessing). Returns each finished request's images and every delta."""
    images, deltas, k = {}, [], 0
    while engine.has_work() or any(s >= k for s in joins):
        for rid, (p, pictures) in joins.get(k, {}).items():
            engine.add_request(pipeline.preprocess(request(rid, p, pictures)))
        for out in engine.step():
            assert out.error is None, out.error
            deltas.append(out)
            if out.finished:
                images[out.request_id] = out.tensors["images"].numpy()
        k += 1
    return images, deltas


def alone(parts: tuple, p: DiffusionParams, pictures: list[Image.Image] | None = None) -> np.ndarray:
    return run(parts[0], parts[1], {0: {"r": (p, pictures)}})[0]["r"]


# ---- text to image ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("p", [BASE, CFG], ids=["plain", "true_cfg"])
def test_t2i_matches_diffusers(t2i, p) -> None:
    got, want = alone(t2i, p), diffusers_images(t2i[2], p)
    assert got.shape == want.shape == (1, 48, 64, 3)
    np.testing.assert_allclose(got, want, rtol=0, atol=ATOL)
    # the tolerance is far below what the seed (or CFG) changes: the comparison can fail
    other = diffusers_images(t2i[2], replace(p, seed=p.seed + 1) if p is BASE else replace(p, true_cfg_scale=1.0))
    assert np.abs(other - want).max() > 100 * ATOL


def test_t2i_n_images_and_max_sequence_length(t2i) -> None:
    p = replace(BASE, n=2, seed=11, max_sequence_length=40)
    got = alone(t2i, p)
    np.testing.assert_allclose(got, diffusers_images(t2i[2], p), rtol=0, atol=ATOL)
    assert got.shape == (2, 48, 64, 3) and np.abs(got[0] - got[1]).max() > 100 * ATOL


def test_t2i_batched_at_different_steps_matches_alone(t2i) -> None:
    """4 requests with different seeds and prompts (so text lengths) share forwards, joining at different steps,
    one with CFG: each equals its own single-request image and diffusers'."""
    joins = {
        0: {"a": (replace(BASE, num_inference_steps=5, seed=21), None),
            "b": (replace(BASE, prompt="a red house by the sea at sunset, oil painting", seed=22), None)},
        1: {"cfg": (replace(CFG, seed=23), None)},
        3: {"late": (replace(BASE, prompt="mountains", num_inference_steps=2, seed=24), None)},
    }
    batched, deltas = run(t2i[0], t2i[1], joins)
    assert set(batched) == {"a", "b", "cfg", "late"}
    assert any(d.request_id == "cfg" and d.num_output_tokens == 1 for d in deltas)  # joined a running batch
    for rid, (p, _) in ((rid, v) for step in joins.values() for rid, v in step.items()):
        single = alone(t2i, p)
        np.testing.assert_allclose(batched[rid], single, rtol=0, atol=ATOL)
        np.testing.assert_allclose(single, diffusers_images(t2i[2], p), rtol=0, atol=ATOL)


def test_t2i_detection_defaults_and_checks(t2i, tiny_qwen_image_t2i) -> None:
    pipeline = t2i[0]
    assert type(pipeline) is QwenImageImagePipeline
    assert [(s.name, s.kind) for s in pipeline.stages] == [("dit", "diffusion")]
    assert pipeline.output_modalities == ("image",) and pipeline.max_input_images == 0
    resolved = DiffusionParams.of(pipeline.preprocess(request("r", DiffusionParams(prompt="x"))).params)
    # diffusers' defaults: 128 x the VAE's scale factor per side, 50 steps, text length 512
    assert (resolved.width, resolved.height, resolved.num_inference_steps, resolved.max_sequence_length) == (
        1024, 1024, 50, 512)
    for bad, field in ((replace(BASE, width=40), "width"), (replace(BASE, height=8), "height"),
                       (replace(BASE, max_sequence_length=1025), "max_sequence_length")):
        with pytest.raises(RequestError) as info:
            pipeline.preprocess(request("r", bad))
        assert info.value.param == field
        assert field != "width" or "multiple of 16" in str(info.value)
    with pytest.raises(RequestError, match="does not take input images"):
        pipeline.preprocess(request("r", BASE, PICTURES[:1]))
    with pytest.raises(ConfigError, match="stages.dit.options.bogus"):
        load_pipeline(tiny_qwen_image_t2i, {"stages": {"dit": {"options": {"bogus": True}}}})


# ---- editing ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("p", [EDIT, EDIT_CFG], ids=["plain", "true_cfg"])
def test_edit_matches_diffusers(edit, p) -> None:
    got, want = alone(edit, p, PICTURES[:1]), diffusers_images(edit[2], p, PICTURES[:1])
    assert got.shape == want.shape == (p.n, 48, 64, 3)
    np.testing.assert_allclose(got, want, rtol=0, atol=ATOL)
    assert np.abs(diffusers_images(edit[2], p, PICTURES[1:2]) - want).max() > 100 * ATOL  # the image matters


def test_edit_plus_two_images_matches_diffusers(edit_plus) -> None:
    p = replace(EDIT, seed=5)
    got, want = alone(edit_plus, p, PICTURES[:2]), diffusers_images(edit_plus[2], p, PICTURES[:2])
    assert got.shape == want.shape == (1, 48, 64, 3)
    np.testing.assert_allclose(got, want, rtol=0, atol=ATOL)
    assert np.abs(diffusers_images(edit_plus[2], p, PICTURES[1::-1]) - want).max() > 100 * ATOL  # order matters


def test_edit_plus_batch_of_different_inputs_matches_alone(edit_plus) -> None:
    """Requests whose input images differ in number and size (so conditioning shapes) and whose text lengths
    differ share a batch; each equals its own single-request image."""
    joins = {0: {"one": (replace(EDIT, seed=1), PICTURES[2:3]),
                 "two": (replace(EDIT_CFG, prompt="make it blue", seed=2), PICTURES[:2])},
             1: {"same": (replace(EDIT, prompt="a much longer instruction about the sky", seed=3), PICTURES[2:3])}}
    batched, deltas = run(edit_plus[0], edit_plus[1], joins)
    assert any(d.request_id == "same" and d.num_output_tokens == 1 for d in deltas)
    for rid, (p, pictures) in ((rid, v) for step in joins.values() for rid, v in step.items()):
        np.testing.assert_allclose(batched[rid], alone(edit_plus, p, pictures), rtol=0, atol=ATOL)


def test_edit_defaults_and_checks(edit, edit_plus) -> None:
    assert type(edit[0]) is QwenImageEditImagePipeline and type(edit_plus[0]) is QwenImageEditPlusImagePipeline
    assert edit[0].input_modalities == ("text", "image")
    assert (edit[0].max_input_images, edit_plus[0].max_input_images) == (1, 4)
    for parts in (edit, edit_plus):
        with pytest.raises(RequestError, match="at least 1 input image") as info:
            parts[0].preprocess(request("r", BASE))
        assert info.value.param == "image"
        with pytest.raises(RequestError, match="multiple of 16"):
            parts[0].preprocess(request("r", replace(BASE, width=72, height=50), PICTURES[:1]))
    with pytest.raises(RequestError, match="at most 1 input image"):
        edit[0].preprocess(request("r", BASE, PICTURES[:2]))
    # without a size the output has ~1024x1024 pixels in the aspect ratio of the first (Edit) / last (Plus) image
    unsized = DiffusionParams(prompt="x")
    sized = DiffusionParams.of(edit[0].preprocess(request("r", unsized, PICTURES[:1])).params)
    assert (sized.width, sized.height, sized.num_inference_steps) == (1216, 864, 50)
    sized = DiffusionParams.of(edit_plus[0].preprocess(request("r", unsized, PICTURES[:2])).params)
    assert (sized.width, sized.height) == (800, 1280)
