"""CFG-parallel diffusion on the CPU (gloo, 2 processes) with a tiny Qwen-Image (and a two-expert Wan, whose
follower holds both DiTs): the images equal one process's,
bad settings fail at start-up naming the option, and a dead rank fails the step and the stage restarts.

Tolerance: float32, both ranks run the same DiT on the same rows; what differs is each forward's row count and
its text padding (Qwen-Image trims padding to the forward's own longest prompt, so a rank's share of the rows may
attend unpadded where one process attends masked padding), which changes rounding, not the math. One process
already differs by about 1e-5 between a request alone and batched with another (the same effect); ATOL on images
in [0, 1] is a few times that and far below what the negative branch changes (checked below)."""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import pytest
import torch

from omnistage import Omni
from omnistage.engine.diffusion import DiffusionEngine, DiffusionParams
from omnistage.errors import ConfigError
from omnistage.families.registry import load_pipeline
from omnistage.testing.qwen_image import tiny_qwen_image
from omnistage.testing.wan import tiny_wan
from omnistage.types import OmniRequest

ATOL = 5e-5
BASE = DiffusionParams(prompt="a photo of a cat", width=64, height=48, num_inference_steps=3, seed=7)
CFG = replace(BASE, prompt="a red house by the sea", negative_prompt="blurry, low quality", true_cfg_scale=4.0,
              seed=3)


def deploy(**options: object) -> dict:
    return {"worker_backend": "inline", "stages": {"dit": {"dtype": "float32", "devices": "cpu", "options": options}}}


@pytest.fixture(scope="module")
def path() -> str:
    return str(tiny_qwen_image("t2i"))


@pytest.fixture(scope="module")
def engines(path: str):
    """(pipeline, one-process engine, cfg-parallel engine)."""
    pipeline = load_pipeline(path, deploy())
    parallel = load_pipeline(path, deploy(cfg_parallel=True)).build_engine("dit")
    yield pipeline, pipeline.build_engine("dit"), parallel
    parallel.shutdown()


# Wan2.2 T2V-A14B: CFG on every step, its last step on the low-noise expert (guided with guidance_scale_2).
WAN = DiffusionParams(prompt="a cat walking on a beach", negative_prompt="blurry, static", width=48, height=32,
                      num_frames=9, num_inference_steps=4, guidance_scale=4.0, guidance_scale_2=2.0, seed=5,
                      max_sequence_length=32)


def run(pipeline, engine: DiffusionEngine, joins: dict[int, dict[str, DiffusionParams]]) -> dict[str, np.ndarray]:
    """Steps the engine, adding `joins[k]` before step k; each finished request's images."""
    images, k = {}, 0
    while engine.has_work() or any(s >= k for s in joins):
        for rid, p in joins.get(k, {}).items():
            request = OmniRequest(rid, prompt=p.prompt, output_modalities=("image",), options={"diffusion": p})
            engine.add_request(pipeline.preprocess(request))
        for out in engine.step():
            assert out.error is None, out.error
            if out.finished:
                images[out.request_id] = out.tensors[engine.output_name].numpy()
        k += 1
    return images


@pytest.mark.parametrize("joins", [
    {0: {"cfg": CFG, "plain": BASE}},  # 3 rows: rank 0 runs 2, rank 1 one
    {0: {"cfg": replace(CFG, n=2)}, 1: {"late": replace(BASE, n=2, seed=9)}},  # all guided, then 6 rows
    {0: {"alone": BASE}},  # no CFG, one row: rank 0 alone
], ids=["cfg_and_plain", "cfg_n2_then_plain", "one_row"])
def test_cfg_parallel_gives_one_process_images(engines, joins) -> None:
    pipeline, single, parallel = engines
    want, got = run(pipeline, single, joins), run(pipeline, parallel, joins)
    assert set(got) == set(want) == {rid for step in joins.values() for rid in step}
    for rid in want:
        np.testing.assert_allclose(got[rid], want[rid], rtol=0, atol=ATOL)


def test_a_two_expert_video_model() -> None:
    wan = str(tiny_wan("t2v"))
    pipeline = load_pipeline(wan, deploy())
    parallel = load_pipeline(wan, deploy(cfg_parallel=True)).build_engine("dit")
    joins = {0: {"a": WAN}, 1: {"b": replace(WAN, prompt="a dog", seed=6)}}
    proc = parallel.model.ranks.procs[0][0]
    try:
        want, got = run(pipeline, pipeline.build_engine("dit"), joins), run(pipeline, parallel, joins)
    finally:
        parallel.shutdown()
    assert proc.exitcode == 0  # left its loop on `stop`
    for rid in ("a", "b"):
        np.testing.assert_allclose(got[rid], want[rid], rtol=0, atol=ATOL)


def test_after_an_encode_stage(path: str, engines) -> None:
    """Text encoders in a stage of their own: rank 0 holds the DiT and VAE only, the conditioning comes over the
    edge; the image equals the one-stage, one-process engine's (as PIL images: uint8, 1 level for rounding)."""
    pipeline, single, _ = engines
    want = (run(pipeline, single, {0: {"r": CFG}})["r"] * 255).round().astype(int)
    config = deploy(cfg_parallel=True)
    config["stages"]["encode"] = {"dtype": "float32", "devices": "cpu"}
    with Omni(path, config) as omni:
        (out,) = omni.generate(CFG.prompt, output_modalities=("image",), diffusion=CFG)
        assert not hasattr(omni.orchestrator.workers["dit"][0].loop.engine.model.local, "text_encoder")
    assert out.error is None
    assert np.abs(np.stack([np.asarray(image) for image in out.images]).astype(int) - want).max() <= 1


def test_the_comparison_can_fail(engines) -> None:
    """The tolerance is far below what the negative branch changes."""
    pipeline, single, _ = engines
    guided, unguided = run(pipeline, single, {0: {"a": CFG, "b": replace(CFG, true_cfg_scale=1.0)}}).values()
    assert np.abs(guided - unguided).max() > 100 * ATOL


@pytest.mark.parametrize("stage, match", [
    ({"devices": "0"}, r"stages\.dit\.options\.cfg_parallel needs exactly 2 devices.*'0'"),
    ({"devices": "0,1,2"}, r"needs exactly 2 devices"),
    ({"options": {"cfg_parallel": True, "compile": True}}, r"cannot be combined with options\.compile"),
    ({"options": {"cfg_parallel": True, "cache": {}}}, r"cannot be combined with options\.cache"),
    ({"options": {"cfg_parallel": True, "cpu_offload": True}}, r"cannot be combined with options\.cpu_offload"),
    ({"options": {"cfg_parallel": True, "lora_root": "/tmp"}}, r"cannot be combined with options\.lora_root"),
])
def test_bad_settings_are_config_errors(path: str, stage: dict, match: str) -> None:
    config = deploy(cfg_parallel=True)
    config["stages"]["dit"] |= stage
    with pytest.raises(ConfigError, match=match):
        load_pipeline(path, config).build_engine("dit")


def test_a_dead_follower_fails_requests_and_the_stage_restarts(path: str, caplog) -> None:
    def generate(omni: Omni):
        (out,) = omni.generate(CFG.prompt, output_modalities=("image",), diffusion=CFG)
        return out

    with Omni(path, deploy(cfg_parallel=True)) as omni:
        expected = np.stack([np.asarray(image) for image in generate(omni).images])
        proc = follower(omni)
        proc.kill()
        proc.join()
        started = time.monotonic()
        failed = generate(omni)
        assert failed.error is not None and time.monotonic() - started < 30
        assert wait_for(lambda: omni.orchestrator.health()[0], 60), "the stage was not restarted"
        again = generate(omni)
        assert again.error is None and follower(omni) is not proc  # a fresh group
        assert np.array_equal(np.stack([np.asarray(image) for image in again.images]), expected)
    assert "cfg-parallel rank 1 exited" in caplog.text


def follower(omni: Omni):
    """The stage's rank-1 process (inline backend: the engine lives in this process)."""
    return omni.orchestrator.workers["dit"][0].loop.engine.model.ranks.procs[0][0]


def wait_for(check, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.2)
    return False


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL between two GPUs")
@pytest.mark.parametrize("option", [{"cfg_parallel": True}, {"ulysses_degree": 2}], ids=["cfg_parallel", "ulysses"])
def test_two_gpus_give_one_gpus_video(option: dict) -> None:
    """On two GPUs (NCCL), float32: the two-expert Wan video of one GPU, for both parallel paths."""
    wan = str(tiny_wan("t2v"))
    def on(devices: str, **options: object) -> dict:
        return {"worker_backend": "inline", "stages": {"dit": {"dtype": "float32", "devices": devices,
                                                               "options": options}}}

    pipeline = load_pipeline(wan, on("0"))
    parallel = load_pipeline(wan, on("0,1", **option)).build_engine("dit")
    joins = {0: {"a": WAN, "b": replace(WAN, prompt="a dog", seed=6)}}
    try:
        want, got = run(pipeline, pipeline.build_engine("dit"), joins), run(pipeline, parallel, joins)
    finally:
        parallel.shutdown()
    for rid in ("a", "b"):
        np.testing.assert_allclose(got[rid], want[rid], rtol=0, atol=ATOL)
