"""FLUX.1 through omnistage's diffusion engine equals diffusers' FluxPipeline on the same tiny checkpoint, seed,
prompt, size and steps; and a request's image does not depend on what else is in its batch.

Tolerance: float32 on the CPU, both sides run the same ops; only batched kernels (text encoders, DiT and VAE over
more rows) may round differently, so images in [0, 1] agree to ATOL."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from diffusers import FluxPipeline

from omnistage import Omni
from omnistage.engine.diffusion import DiffusionEngine, DiffusionParams
from omnistage.errors import ConfigError, RequestError
from omnistage.families.flux import FluxImagePipeline
from omnistage.families.registry import load_pipeline
from omnistage.types import OmniRequest

ATOL = 1e-5
BASE = DiffusionParams(prompt="a photo of a cat", width=48, height=32, num_inference_steps=4, seed=7,
                       max_sequence_length=32)


@pytest.fixture(scope="module", params=["dev", "schnell"])
def variant(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def path(variant: str, request: pytest.FixtureRequest) -> str:
    return request.getfixturevalue(f"tiny_flux_{variant}")


@pytest.fixture(scope="module")
def reference(path: str) -> FluxPipeline:
    pipe = FluxPipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def pipeline(path: str) -> FluxImagePipeline:
    return load_pipeline(path, {"worker_backend": "inline", "stages": {"*": {"dtype": "float32", "devices": "cpu"}}})


@pytest.fixture(scope="module")
def engine(pipeline: FluxImagePipeline) -> DiffusionEngine:
    return pipeline.build_engine("dit")


def diffusers_images(ref: FluxPipeline, p: DiffusionParams) -> np.ndarray:
    kwargs = {} if p.guidance_scale is None else {"guidance_scale": p.guidance_scale}
    return ref(p.prompt, negative_prompt=p.negative_prompt, true_cfg_scale=p.true_cfg_scale or 1.0, width=p.width,
               height=p.height, num_inference_steps=p.num_inference_steps, num_images_per_prompt=p.n,
               generator=torch.Generator("cpu").manual_seed(p.seed), max_sequence_length=p.max_sequence_length,
               output_type="np", **kwargs).images


def run(pipeline: FluxImagePipeline, engine: DiffusionEngine, joins: dict[int, dict[str, DiffusionParams]],
        aborts: dict[int, list[str]] | None = None) -> tuple[dict[str, np.ndarray], list]:
    """Steps the engine; before step k adds the requests of `joins[k]` (through the family's preprocessing) and
    aborts `aborts[k]`. Returns each finished request's images and every delta."""
    images, deltas, k = {}, [], 0
    while engine.has_work() or any(s >= k for s in joins):
        for rid, p in joins.get(k, {}).items():
            request = OmniRequest(rid, prompt=p.prompt, output_modalities=("image",), options={"diffusion": p})
            engine.add_request(pipeline.preprocess(request))
        for rid in (aborts or {}).get(k, []):
            engine.abort(rid)
        for out in engine.step():
            assert out.error is None, out.error
            deltas.append(out)
            if out.finished:
                images[out.request_id] = out.tensors["images"].numpy()
        k += 1
    return images, deltas


def test_image_matches_diffusers(pipeline, engine, reference) -> None:
    images, _ = run(pipeline, engine, {0: {"a": BASE}})
    want = diffusers_images(reference, BASE)
    assert images["a"].shape == want.shape == (1, 32, 48, 3)
    np.testing.assert_allclose(images["a"], want, rtol=0, atol=ATOL)
    # the tolerance is far below what a different seed changes: the comparison can fail
    other = diffusers_images(reference, replace(BASE, seed=8))
    assert np.abs(other - want).max() > 1000 * ATOL


def test_n_images_are_diffusers_num_images_per_prompt(pipeline, engine, reference) -> None:
    p = replace(BASE, n=3, seed=11)
    images, _ = run(pipeline, engine, {0: {"a": p}})
    want = diffusers_images(reference, p)
    assert images["a"].shape == (3, 32, 48, 3)
    np.testing.assert_allclose(images["a"], want, rtol=0, atol=ATOL)
    assert np.abs(images["a"][0] - images["a"][1]).max() > 1000 * ATOL


def test_true_cfg_matches_diffusers(pipeline, engine, reference) -> None:
    p = replace(BASE, negative_prompt="blurry, low quality", true_cfg_scale=4.0, seed=3)
    images, _ = run(pipeline, engine, {0: {"a": p}})
    want = diffusers_images(reference, p)
    np.testing.assert_allclose(images["a"], want, rtol=0, atol=ATOL)
    assert np.abs(diffusers_images(reference, replace(p, true_cfg_scale=1.0)) - want).max() > 1000 * ATOL


def test_batched_at_different_steps_matches_alone(pipeline, engine, reference, variant) -> None:
    target = replace(BASE, num_inference_steps=6, seed=21, guidance_scale=2.0)
    alone, _ = run(pipeline, engine, {0: {"t": target}})
    others = {
        0: {"t": target, "n2": replace(BASE, prompt="a red house by the sea", n=2, num_inference_steps=3)},
        2: {"cfg": replace(BASE, negative_prompt="ugly", true_cfg_scale=3.0, seed=5, guidance_scale=5.0)},
        4: {"late": replace(BASE, prompt="mountains", num_inference_steps=2, seed=1)},
    }
    batched, deltas = run(pipeline, engine, others)
    assert engine.stats()["num_steps"] > 0 and {"t", "n2", "cfg", "late"} <= set(batched)
    # the target shared forwards with requests at other steps of other schedules
    assert any(d.request_id == "cfg" and d.num_output_tokens == 1 for d in deltas)
    np.testing.assert_allclose(batched["t"], alone["t"], rtol=0, atol=ATOL)
    np.testing.assert_allclose(alone["t"], diffusers_images(reference, target), rtol=0, atol=ATOL)
    for rid in ("n2", "cfg", "late"):  # per-row guidance and timesteps: each matches its own diffusers run
        p = others[next(k for k, v in others.items() if rid in v)][rid]
        np.testing.assert_allclose(batched[rid], diffusers_images(reference, p), rtol=0, atol=ATOL)


def test_abort_between_steps(pipeline, engine, reference) -> None:
    keep = replace(BASE, seed=4)
    images, deltas = run(pipeline, engine, {0: {"gone": replace(BASE, seed=2), "keep": keep}}, aborts={2: ["gone"]})
    assert set(images) == {"keep"}
    assert max(d.num_output_tokens for d in deltas if d.request_id == "gone") == 2
    np.testing.assert_allclose(images["keep"], diffusers_images(reference, keep), rtol=0, atol=ATOL)
    assert not engine.has_work() and not engine.running


def test_progress_deltas(pipeline, engine) -> None:
    _, deltas = run(pipeline, engine, {0: {"a": BASE}})
    assert [d.tensors["progress"].tolist() for d in deltas] == [[[i, 4]] for i in range(1, 5)]
    assert [d.finished for d in deltas] == [False, False, False, True]
    outs = [pipeline.to_output("dit", d) for d in deltas]
    assert [o.num_output_tokens for o in outs] == [1, 2, 3, 4]
    assert [len(o.images) for o in outs] == [0, 0, 0, 1]
    assert outs[-1].images[0].size == (48, 32)


def test_offline_omni_matches_diffusers_pil(path, reference) -> None:
    """End to end through the runtime: PIL images as diffusers' `output_type="pil"` rounds them."""
    p = replace(BASE, n=2, seed=13)
    with Omni(path, {"worker_backend": "inline", "stages": {"*": {"dtype": "float32", "devices": "cpu"}}}) as omni:
        (out,) = omni.generate(p.prompt, output_modalities=("image",), diffusion=p)
    assert out.error is None and out.num_output_tokens == 4
    want = (diffusers_images(reference, p) * 255).round().astype(np.uint8)
    got = np.stack([np.asarray(image) for image in out.images])
    assert got.shape == want.shape
    assert np.abs(got.astype(int) - want).max() <= 1  # a float within ATOL of a .5 boundary may round either way


def test_family_detection_defaults_and_checks(path, variant, pipeline) -> None:
    assert isinstance(pipeline, FluxImagePipeline)
    assert [(s.name, s.kind) for s in pipeline.stages] == [("dit", "diffusion")]
    assert pipeline.output_modalities == ("image",)
    inp = pipeline.preprocess(OmniRequest("r", prompt="x", output_modalities=("image",)))
    resolved = DiffusionParams.of(inp.params)
    # diffusers' defaults: 128 x the VAE's scale factor per side, guidance 3.5, T5 length 512; steps per variant
    assert (resolved.width, resolved.height, resolved.guidance_scale, resolved.max_sequence_length) == (
        256, 256, 3.5, 512)
    assert resolved.num_inference_steps == (28 if variant == "dev" else 4)
    for bad, field in ((replace(BASE, width=42), "width"), (replace(BASE, max_sequence_length=600),
                                                              "max_sequence_length")):
        with pytest.raises(RequestError) as info:
            pipeline.preprocess(OmniRequest("r", prompt="x", output_modalities=("image",), options={"diffusion": bad}))
        assert info.value.param == field
    with pytest.raises(ConfigError, match="stages.dit.options.acceleration: unknown field"):
        load_pipeline(path, {"stages": {"dit": {"options": {"acceleration": ["torch_compile"]}}}})
