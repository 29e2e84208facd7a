"""Ulysses sequence parallelism on the CPU (gloo, 2 rank processes, float32) with the tiny Qwen-Image rebuilt
with a 2-head DiT (CFG rows, prompts of different lengths: uneven sequence slices and a text mask) and the tiny
two-expert Wan (2 heads): the images equal one process's, the ranks really run diffusers' Ulysses
at degree 2, and settings that cannot run fail at start-up naming the option.

Tolerance: float32; the ranks run the same weights on the same rows, each attending its heads over the whole
sequence after the all-to-all, so what differs from one process is only the order of some sums (the attention's
matmuls over a head subset, the gathers), i.e. rounding. Measured differences on images in [0, 1]: below 1e-6
without CFG, up to 8e-6 for Qwen-Image under true CFG at scale 4 (which amplifies the branches' difference); ATOL is a
few times the largest and far below what another seed changes (checked below)."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from omnistage.engine.diffusion import DiffusionEngine, DiffusionParams
from omnistage.engine.parallel import GroupLost
from omnistage.errors import ConfigError
from omnistage.families.registry import load_pipeline
from omnistage.testing.flux import tiny_flux
from omnistage.testing.qwen_image import tiny_qwen_image
from omnistage.testing.wan import tiny_wan
from omnistage.testing.z_image import tiny_z_image
from omnistage.types import OmniRequest

ATOL = 2e-5
BASE = DiffusionParams(prompt="a photo of a cat", width=64, height=48, num_inference_steps=3, seed=7)
# Wan2.2 T2V-A14B: CFG on every step, its last step on the low-noise expert.
WAN = DiffusionParams(prompt="a cat walking on a beach", negative_prompt="blurry, static", width=48, height=32,
                      num_frames=9, num_inference_steps=3, guidance_scale=4.0, guidance_scale_2=2.0, seed=5,
                      max_sequence_length=32)


def deploy(**options: object) -> dict:
    return {"worker_backend": "inline", "stages": {"dit": {"dtype": "float32", "devices": "cpu", "options": options}}}


def run(pipeline, engine: DiffusionEngine, requests: dict[str, DiffusionParams]) -> dict[str, np.ndarray]:
    """Every request added at once, stepped to the end; each one's images."""
    for rid, p in requests.items():
        request = OmniRequest(rid, prompt=p.prompt, output_modalities=("image",), options={"diffusion": p})
        engine.add_request(pipeline.preprocess(request))
    images = {}
    while engine.has_work():
        for out in engine.step():
            assert out.error is None, out.error
            if out.finished:
                images[out.request_id] = out.tensors[engine.output_name].numpy()
    return images


def two_head_qwen_image(out: Path) -> Path:
    """The tiny Qwen-Image checkpoint with its DiT rebuilt at 2 attention heads (the default tiny one has 1, which
    degree 2 cannot split), scaled as the factory scales its DiT so the image depends on the prompt."""
    from diffusers import QwenImageTransformer2DModel

    shutil.copytree(tiny_qwen_image("t2i"), out)
    config = json.loads((out / "transformer" / "config.json").read_text())
    config = {k: v for k, v in config.items() if not k.startswith("_")} | {"num_attention_heads": 2}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        dit = QwenImageTransformer2DModel(**config)
    with torch.no_grad():
        dit.proj_out.weight.mul_(20.0)
        for block in dit.transformer_blocks:
            block.img_mod[1].weight.mul_(10.0)
            block.txt_mod[1].weight.mul_(10.0)
    shutil.rmtree(out / "transformer")
    dit.save_pretrained(out / "transformer", safe_serialization=True)
    return out


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """(pipeline, one-process engine, Ulysses-2 engine) of the 2-head Qwen-Image."""
    path = str(two_head_qwen_image(tmp_path_factory.mktemp("ulysses") / "qwen"))
    pipeline = load_pipeline(path, deploy())
    parallel = load_pipeline(path, deploy(ulysses_degree=2)).build_engine("dit")
    yield pipeline, pipeline.build_engine("dit"), parallel
    parallel.shutdown()


@pytest.mark.parametrize("requests", [
    # one forward of 4 rows: CFG rows and a shorter prompt (a text mask; odd text lengths split unevenly)
    {"cfg": replace(BASE, prompt="a red house by the sea at dawn", negative_prompt="blurry", true_cfg_scale=4.0,
                    seed=3), "short": replace(BASE, prompt="a cat", seed=4, n=2)},
    {"alone": BASE},
], ids=["cfg_and_uneven_prompts", "one_row"])
def test_ulysses_gives_one_process_images(qwen, requests) -> None:
    pipeline, single, parallel = qwen
    want, got = run(pipeline, single, requests), run(pipeline, parallel, requests)
    assert set(got) == set(want) == set(requests)
    for rid in want:
        np.testing.assert_allclose(got[rid], want[rid], rtol=0, atol=ATOL)
    # Each rank's DiT runs diffusers' Ulysses at degree 2; the stage's own DiT holds no weights.
    assert parallel.model.ranks.degrees == [{"transformer": 2}] * 2
    assert {p.device.type for p in parallel.model.local.transformer.parameters()} == {"meta"}


def test_the_comparison_can_fail(qwen) -> None:
    """The tolerance is far below what another seed changes."""
    pipeline, single, _ = qwen
    a, b = run(pipeline, single, {"a": BASE, "b": replace(BASE, seed=8)}).values()
    assert np.abs(a - b).max() > 1000 * ATOL


def test_a_two_expert_video_model() -> None:
    """Wan2.2 A14B: both experts split over the ranks, CFG rows in the same forward; then a dead rank fails the
    next step with GroupLost (the stage restarts), and the live rank still leaves its loop on `stop`."""
    path = str(tiny_wan("t2v"))
    pipeline = load_pipeline(path, deploy())
    parallel = load_pipeline(path, deploy(ulysses_degree=2)).build_engine("dit")
    (rank0, _), (rank1, _) = parallel.model.ranks.procs
    try:
        requests = {"a": WAN}
        want, got = run(pipeline, pipeline.build_engine("dit"), requests), run(pipeline, parallel, requests)
        assert parallel.model.ranks.degrees == [{"transformer": 2, "transformer_2": 2}] * 2
        rank1.kill()
        rank1.join()
        with pytest.raises(GroupLost, match="ulysses rank 1 exited"):
            run(pipeline, parallel, {"b": WAN})
    finally:
        parallel.shutdown()
    assert rank0.exitcode == 0
    np.testing.assert_allclose(got["a"], want["a"], rtol=0, atol=ATOL)


@pytest.mark.parametrize("checkpoint, stage, match", [
    ("flux", {"devices": "0"}, r"stages\.dit\.options\.ulysses_degree needs exactly 2 devices.*'0'"),
    ("flux", {"options": {"ulysses_degree": 3}}, r"ulysses_degree: 3 does not divide the DiT's 2 attention heads"),
    ("qwen", {}, r"ulysses_degree: 2 does not divide the DiT's 1 attention heads"),
    ("z_image", {}, r"ulysses_degree: not available for this model: its DiT \(ZImageTransformer2DModel\)"),
    ("flux", {"options": {"ulysses_degree": 1}}, r"ulysses_degree"),
    *[("flux", {"options": {"ulysses_degree": 2, name: value}}, rf"cannot be combined with options\.{name}")
      for name, value in [("cfg_parallel", True), ("compile", True), ("cache", {}), ("cpu_offload", True),
                          ("lora_root", "/tmp"), ("quantization", "fp8")]],
])
def test_bad_settings_are_config_errors(checkpoint: str, stage: dict, match: str) -> None:
    path = {"flux": lambda: tiny_flux("dev"), "qwen": lambda: tiny_qwen_image("t2i"), "z_image": tiny_z_image}
    config = deploy(ulysses_degree=2)
    config["stages"]["dit"] |= stage
    with pytest.raises(ConfigError, match=match):
        load_pipeline(str(path[checkpoint]()), config).build_engine("dit")
