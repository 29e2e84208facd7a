"""Text encoders as a stage of their own (`stages.encode` in the deploy config), for every image family: the encode
stage batches the prompts of all ready requests in one pass, and the images equal those of the one-stage pipeline
(whose images the families' parity tests pin to diffusers).

Tolerance: float32 on the CPU; the two layouts batch the text encoders over different rows, so images in [0, 1]
agree to ATOL (the families' parity tolerance)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import numpy as np
import pytest
import torch
from PIL import Image

from omnistage.engine.diffusion import DiffusionParams
from omnistage.engine.diffusion.encoder import PROMPT_TOKENS
from omnistage.entrypoints.async_omni import AsyncOmni
from omnistage.errors import ConfigError
from omnistage.families.registry import load_pipeline
from omnistage.testing.flux import tiny_flux
from omnistage.testing.qwen_image import tiny_qwen_image
from omnistage.testing.z_image import tiny_z_image
from omnistage.types import OmniRequest

ATOL = 1e-5
CPU = {"dtype": "float32", "devices": "cpu"}
BASE = DiffusionParams(width=32, height=32, num_inference_steps=3, seed=5, max_sequence_length=32)
CHECKPOINTS = {"flux-dev": lambda: tiny_flux("dev"), "qwen-image": lambda: tiny_qwen_image("t2i"),
               "qwen-image-edit-plus": lambda: tiny_qwen_image("edit-plus"), "z-image": lambda: tiny_z_image("base")}


def deploy(split: bool, backend: str = "inline") -> dict:
    stages = {"*": CPU, "encode": {"max_num_seqs": 8}} if split else {"*": CPU}
    return {"worker_backend": backend, "stages": stages}


def requests(name: str) -> list[OmniRequest]:
    """Prompts of several lengths, one request with a CFG branch and one with two images per prompt; the edit
    model's requests bring one and two input images."""
    cfg = {"negative_prompt": "blurry", "true_cfg_scale": 3.0} if name != "z-image" else {"guidance_scale": 4.0}
    params = [replace(BASE, prompt="a cat"), replace(BASE, prompt="a red house by the sea at dusk", seed=9, **cfg),
              replace(BASE, prompt="mountains", n=2, seed=1)]
    rng = np.random.default_rng(0)
    out = []
    for i, p in enumerate(params):
        media = {}
        if name == "qwen-image-edit-plus":
            media["image"] = [Image.fromarray(rng.integers(0, 256, (40, 24 + 8 * k, 3), dtype=np.uint8))
                              for k in range(1 + i % 2)]
        out.append(OmniRequest(f"r{i}", prompt=p.prompt, output_modalities=("image",), media=media,
                               options={"diffusion": p}))
    return out


async def _images(path: str, config: dict, name: str) -> dict[str, np.ndarray]:
    engine = AsyncOmni.from_model(path, config)
    try:
        async def one(request: OmniRequest) -> tuple[str, np.ndarray]:
            images = []
            async for out in engine.generate(request):
                assert out.error is None, out.error
                images += out.images
            return request.request_id, np.stack([np.asarray(image, dtype=np.float32) / 255 for image in images])

        return dict(await asyncio.gather(*(one(r) for r in requests(name))))
    finally:
        engine.shutdown()


def images(path: str, config: dict, name: str) -> dict[str, np.ndarray]:
    return asyncio.run(_images(path, config, name))


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_encode_stage_images_equal_one_stage(name: str) -> None:
    path = str(CHECKPOINTS[name]())
    assert [s.name for s in load_pipeline(path, deploy(True)).stages] == ["encode", "dit"]
    one_stage, split = images(path, deploy(False), name), images(path, deploy(True), name)
    assert set(split) == {"r0", "r1", "r2"} and split["r2"].shape[0] == 2
    for rid in split:  # uint8 images: a float within ATOL of a .5 boundary may round either way
        assert np.abs(split[rid] - one_stage[rid]).max() <= 1 / 255 + ATOL, rid
    assert np.abs(split["r0"] - split["r1"][:1]).max() > 0.05  # different prompts make different images


def test_encode_stage_batches_every_ready_request_in_one_pass() -> None:
    """One engine step encodes all ready requests; each request's encoding equals its encoding alone."""
    path = str(tiny_qwen_image("edit-plus"))
    pipeline = load_pipeline(path, deploy(True))
    encoder = pipeline.build_engine("encode")
    calls = []
    encode = encoder.model.model.encode
    encoder.model.model.encode = lambda *a: calls.append(len(a[0])) or encode(*a)
    inputs = [pipeline.preprocess(r) for r in requests("qwen-image-edit-plus")]
    for inp in inputs:
        encoder.add_request(inp)
    together = {o.request_id: o for o in encoder.step()}
    assert encoder.num_steps == 1 and calls == [4]  # 3 requests, one with a negative branch: one encode call
    assert all(o.finished and o.error is None for o in together.values())
    for inp in inputs:
        encoder.add_request(inp)
        (alone,) = encoder.step()
        assert set(alone.tensors) == set(together[inp.request_id].tensors)
        for key, value in alone.tensors.items():
            assert value.device == torch.device("cpu")
            mine = together[inp.request_id].tensors[key]
            if mine.ndim > 1:  # sequences are zero-padded to the batch's longest
                assert not mine[:, value.shape[1]:].any()
                mine = mine[:, :value.shape[1]]
            torch.testing.assert_close(mine, value, rtol=0, atol=ATOL)
    assert int(together["r1"].tensors[PROMPT_TOKENS]) > int(together["r0"].tensors[PROMPT_TOKENS])
    assert any(k.startswith("uncond.") for k in together["r1"].tensors)
    assert not any(k.startswith("uncond.") for k in together["r0"].tensors)


def test_encode_stage_across_processes() -> None:
    """The conditioning crosses a process boundary (the process backend's connector) unchanged; which requests share
    a forward depends on arrival timing, so the images agree within the one-stage comparison's bound."""
    path = str(tiny_flux("dev"))
    inline, process = images(path, deploy(True), "flux-dev"), images(path, deploy(True, "process"), "flux-dev")
    assert process.keys() == inline.keys() == {"r0", "r1", "r2"}
    for rid in inline:
        assert np.abs(process[rid] - inline[rid]).max() <= 1 / 255 + ATOL, rid


def test_encode_stage_loads_only_its_parts_and_takes_no_options() -> None:
    path = str(tiny_flux("dev"))
    pipeline = load_pipeline(path, deploy(True))
    encoder, dit = pipeline.build_engine("encode").model.model, pipeline.build_engine("dit").model
    assert hasattr(encoder, "text_encoder_2") and not hasattr(encoder, "transformer")
    assert hasattr(dit, "transformer") and not hasattr(dit, "text_encoder")
    with pytest.raises(ConfigError, match="stages.encode.options: this stage takes no options"):
        load_pipeline(path, {"stages": {"encode": {"options": {"compile": True}}}})
