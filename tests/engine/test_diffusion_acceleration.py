"""The diffusion stage's switches on a real DiT (tiny FLUX.1-dev): LoRA adapters per request (diffusers' image,
never batched across adapters, paths confined to the root), step caching through cache-dit (cohort batching, a
stated bound), regional compilation (same image), and the refusals of switches this machine cannot run."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import FluxPipeline

from omnistage.engine.diffusion import DiffusionEngine, DiffusionParams
from omnistage.errors import ConfigError
from omnistage.families.registry import load_pipeline
from omnistage.testing.flux import tiny_flux
from omnistage.testing.lora import make_tiny_lora
from omnistage.types import OmniRequest

BASE = DiffusionParams(prompt="a photo of a cat", width=32, height=32, num_inference_steps=3, seed=3,
                       max_sequence_length=32)
CACHE_ATOL = 0.05  # images in [0, 1]: a cached step reuses the residual of a step whose input differed little


@pytest.fixture(scope="module", autouse=True)
def _keep_logging_as_it_was():
    """Importing cache-dit replaces `logging.Logger.warning_once` for the whole process; later tests rely on
    transformers' own (an lru_cache they can clear)."""
    import logging

    saved = getattr(logging.Logger, "warning_once", None)
    yield
    if saved is not None:
        logging.Logger.warning_once = saved


@pytest.fixture(scope="module")
def path() -> Path:
    return tiny_flux("dev")


@pytest.fixture(scope="module")
def lora_root(path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("loras")
    make_tiny_lora(path, root / "style", seed=1)
    make_tiny_lora(path, root / "other", seed=2)
    return root


def engine_with(path: Path, **options) -> tuple:
    deploy = {"worker_backend": "inline", "stages": {"*": {"dtype": "float32", "devices": "cpu", "options": options}}}
    pipeline = load_pipeline(path, deploy)
    return pipeline, pipeline.build_engine("dit")


def run(pipeline, engine: DiffusionEngine, requests: dict[str, DiffusionParams], joins: dict[int, dict] | None = None,
        ) -> tuple[dict[str, np.ndarray], dict[str, object], list[list[str]]]:
    """Adds `requests` at once (and `joins[k]` before step k), steps to the end. Returns images, failures and
    the running request ids of each step."""
    images, failures, batches, k = {}, {}, [], 0
    joins = {0: requests, **(joins or {})}
    while engine.has_work() or any(s >= k for s in joins):
        for rid, p in joins.get(k, {}).items():
            engine.add_request(pipeline.preprocess(OmniRequest(rid, prompt=p.prompt, output_modalities=("image",),
                                                               options={"diffusion": p})))
        outs = engine.step()
        batches.append(sorted(o.request_id for o in outs if o.error is None))
        for out in outs:
            if out.error is not None:
                failures[out.request_id] = out
            elif out.finished:
                images[out.request_id] = out.tensors["images"].numpy()
        k += 1
    return images, failures, batches


def with_lora(name: str | None, scale: float = 1.0, **kw) -> DiffusionParams:
    from dataclasses import replace

    return replace(BASE, lora=None if name is None else {"name": name, "path": name, "scale": scale}, **kw)


def test_lora_gives_diffusers_image_and_is_never_batched_across_adapters(path: Path, lora_root: Path) -> None:
    pipeline, engine = engine_with(path, lora_root=str(lora_root))
    ref = FluxPipeline.from_pretrained(path)
    ref.set_progress_bar_config(disable=True)
    ref.load_lora_weights(lora_root / "style", adapter_name="style")
    ref.set_adapters(["style"], [0.7])
    expected = ref(BASE.prompt, width=BASE.width, height=BASE.height, num_inference_steps=BASE.num_inference_steps,
                   generator=torch.Generator("cpu").manual_seed(BASE.seed), max_sequence_length=32,
                   output_type="np").images

    alone = {rid: run(pipeline, engine, {rid: p})[0][rid] for rid, p in
             {"plain": with_lora(None), "style": with_lora("style", 0.7), "other": with_lora("other")}.items()}
    np.testing.assert_allclose(alone["style"], expected, atol=1e-5)
    assert np.abs(alone["style"] - alone["plain"]).max() > 1e-3  # the adapter changes the image
    together = {"plain": with_lora(None), "style": with_lora("style", 0.7), "style2": with_lora("style", 0.7, seed=9),
                "other": with_lora("other")}
    images, failures, batches = run(pipeline, engine, together)
    assert not failures
    for rid in ("plain", "style", "other"):
        np.testing.assert_allclose(images[rid], alone[rid], atol=1e-5)
    groups = {"plain": 0, "style": 1, "style2": 1, "other": 2}
    assert all(len({groups[r] for r in batch}) <= 1 for batch in batches)  # one adapter state per forward
    assert any(set(batch) == {"style", "style2"} for batch in batches)  # same adapter and scale: batched


def test_lora_requests_are_confined_to_the_root(path: Path, lora_root: Path, tmp_path: Path) -> None:
    outside = make_tiny_lora(path, tmp_path / "evil")
    pipeline, engine = engine_with(path, lora_root=str(lora_root))
    requests = {"escape": with_lora("../" * 8 + str(outside).lstrip("/")), "absolute": with_lora(str(outside)),
                "missing": with_lora("nope")}
    _, failures, _ = run(pipeline, engine, requests)
    assert {rid: out.error_status for rid, out in failures.items()} == dict.fromkeys(requests, 400)
    assert "inside the server's LoRA directory" in failures["escape"].error
    _, unconfigured = engine_with(path)
    _, failures, _ = run(pipeline, unconfigured, {"a": with_lora("style")})
    assert failures["a"].error_status == 400 and "lora_root" in failures["a"].error


def test_step_cache_stays_within_bound_and_batches_in_cohorts(path: Path) -> None:
    import cache_dit

    steps = 12
    p = DiffusionParams(prompt="a cat", width=64, height=64, num_inference_steps=steps, seed=3, max_sequence_length=32)
    lossless = run(*engine_with(path), {"a": p})[0]["a"]
    cache = {"Fn_compute_blocks": 1, "Bn_compute_blocks": 0, "max_warmup_steps": 2, "residual_diff_threshold": 0.5}
    pipeline, engine = engine_with(path, cache=cache)
    from dataclasses import replace

    images, failures, batches = run(pipeline, engine, {"a": p}, joins={3: {"late": replace(p, seed=4)}})
    assert not failures
    stats = cache_dit.summary(engine.model.transformer, details=False)
    assert sum(len(s.cached_steps or []) for s in stats) > 0  # steps were actually cached
    assert 0 < np.abs(images["a"] - lossless).max() <= CACHE_ATOL
    # the late request did not join the running cohort: it ran after it, alone
    assert all(batch == ["a"] for batch in batches[:steps]) and batches[steps] == ["late"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="inductor's CPU compile of the DiT takes a minute")
def test_compiled_blocks_give_the_same_image(path: Path) -> None:
    deploy = {"worker_backend": "inline", "stages": {"*": {"dtype": "float32", "devices": "0"}}}
    pipeline = load_pipeline(path, deploy)
    eager = run(pipeline, pipeline.build_engine("dit"), {"a": BASE})[0]["a"]
    compiled_pipeline = load_pipeline(path, {**deploy, "stages": {"*": {**deploy["stages"]["*"],
                                                                        "options": {"compile": True}}}})
    compiled = run(compiled_pipeline, compiled_pipeline.build_engine("dit"), {"a": BASE})[0]["a"]
    np.testing.assert_allclose(compiled, eager, atol=1e-3)


@pytest.mark.parametrize(("options", "message"), [
    ({"quantization": "fp8"}, "fp8 needs a CUDA GPU"),
    ({"cpu_offload": True}, "this stage runs on the CPU"),
    ({"attention_backend": "no-such-backend"}, "attention_backend"),
    ({"cache": {"no_such_field": 1}}, "cache-dit"),
    ({"compile": "yes"}, "stages.dit.options.compile"),
])
def test_switches_that_cannot_run_are_refused_at_start(path: Path, options: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        engine_with(path, **options)
