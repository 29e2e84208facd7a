"""POST /v1/images/generations on a real server over tiny Qwen-Image, with the official client: the image (with and
without true CFG) equals diffusers' QwenImagePipeline for the same prompt, size, steps and seed (PNG pixels within
1 of 255); a size that is not a multiple of 16 is a 400 naming the multiple."""

from __future__ import annotations

import base64
import io

import numpy as np
import openai
import pytest
import torch
from diffusers import QwenImagePipeline
from PIL import Image

from omnistage.entrypoints.async_omni import AsyncOmni
from omnistage.entrypoints.openai.server import BackgroundServer

STEPS, SEED = 3, 7


@pytest.fixture(scope="module")
def client(tiny_qwen_image_t2i: str):
    # float32 on the CPU, as the diffusers reference runs
    deploy = {"worker_backend": "inline", "stages": {"*": {"dtype": "float32", "devices": "cpu"}}}
    engine = AsyncOmni.from_model(tiny_qwen_image_t2i, deploy, served_model_name="qwen-image")
    with BackgroundServer(engine) as server:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    engine.shutdown()


def _pixels(item) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(item.b64_json))).convert("RGB")).astype(np.int16)


@pytest.mark.parametrize("negative", [None, "blurry"], ids=["plain", "true_cfg"])
def test_generation_equals_diffusers(client: openai.OpenAI, tiny_qwen_image_t2i: str, negative: str | None) -> None:
    extra = {"num_inference_steps": STEPS, "seed": SEED}
    if negative is not None:
        extra |= {"negative_prompt": negative, "true_cfg_scale": 4.0}
    out = client.images.generate(model="qwen-image", prompt="a red fox in the snow", size="64x48", extra_body=extra)
    pipe = QwenImagePipeline.from_pretrained(tiny_qwen_image_t2i)
    pipe.set_progress_bar_config(disable=True)
    (want,) = pipe(prompt="a red fox in the snow", negative_prompt=negative, true_cfg_scale=4.0, width=64, height=48,
                   num_inference_steps=STEPS, generator=torch.Generator("cpu").manual_seed(SEED)).images
    got = _pixels(out.data[0])
    assert got.shape == (48, 64, 3)
    assert np.abs(got - np.asarray(want.convert("RGB")).astype(np.int16)).max() <= 1
    # usage: the prompt tokens diffusers' encode_prompt keeps (its mask), the DiT's image tokens (2x2 patches)
    embeds, mask = pipe.encode_prompt("a red fox in the snow", device="cpu")  # mask None: no padding
    text = embeds.shape[1] if mask is None else int(mask.sum())
    image = (64 // (pipe.vae_scale_factor * 2)) * (48 // (pipe.vae_scale_factor * 2))
    assert text > 3 and (out.usage.input_tokens, out.usage.output_tokens) == (text, image)
    assert out.usage.input_tokens_details.image_tokens == 0


def test_size_not_a_multiple_is_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="multiple of 16"):
        client.images.generate(model="qwen-image", prompt="x", size="72x50", extra_body={"num_inference_steps": 1})
