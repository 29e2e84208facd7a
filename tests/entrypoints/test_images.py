"""POST /v1/images/generations on a real server over tiny FLUX.1-dev, with the official client: the image equals
diffusers' FluxPipeline for the same prompt, size, steps and seed (PNG pixels within 1 of 255); n images are
diffusers' num_images_per_prompt; concurrent requests batch and each keeps its own image; bad input is a 400."""

from __future__ import annotations

import base64
import concurrent.futures
import io

import numpy as np
import openai
import pytest

pytest.importorskip("diffusers")

from omnistage.entrypoints.openai.server import BackgroundServer  # noqa: E402

KW = {"size": "32x48", "extra_body": {"num_inference_steps": 3, "seed": 7, "guidance_scale": 3.5}}


@pytest.fixture(scope="module")
def flux_path() -> str:
    from omnistage.testing.flux import tiny_flux

    return str(tiny_flux("dev"))


@pytest.fixture(scope="module")
def client(flux_path: str):
    from omnistage.entrypoints.async_omni import AsyncOmni

    # float32 on the CPU, as the diffusers reference runs (on a GPU the default would be bfloat16 on the GPU)
    engine = AsyncOmni.from_model(flux_path, {"stages": {"*": {"dtype": "float32", "devices": "cpu"}}},
                                  served_model_name="flux")
    with BackgroundServer(engine) as server:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    engine.shutdown()


def _pixels(item) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(base64.b64decode(item.b64_json))).convert("RGB")).astype(np.int16)


def _diffusers(path: str, prompt: str, n: int = 1) -> list[np.ndarray]:
    import torch
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(path)
    images = pipe(prompt, width=32, height=48, num_inference_steps=3, guidance_scale=3.5, num_images_per_prompt=n,
                  generator=torch.Generator("cpu").manual_seed(7)).images
    return [np.asarray(im.convert("RGB")).astype(np.int16) for im in images]


def test_image_equals_diffusers_and_n_is_num_images_per_prompt(client: openai.OpenAI, flux_path: str) -> None:
    out = client.images.generate(model="flux", prompt="a red fox in the snow", n=2, **KW)
    want = _diffusers(flux_path, "a red fox in the snow", n=2)
    assert len(out.data) == 2
    for item, ref in zip(out.data, want, strict=True):
        got = _pixels(item)
        assert got.shape == (48, 32, 3) and np.abs(got - ref).max() <= 1
    assert np.abs(_pixels(out.data[0]) - _pixels(out.data[1])).max() > 1  # the two images differ


def test_concurrent_requests_keep_their_own_images(client: openai.OpenAI) -> None:
    prompts = ["a red fox", "a blue lake", "a red fox"]
    alone = [_pixels(client.images.generate(model="flux", prompt=p, **KW).data[0]) for p in prompts[:2]]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        outs = list(pool.map(lambda p: _pixels(client.images.generate(model="flux", prompt=p, **KW).data[0]),
                             prompts))
    for got, ref in zip(outs, [alone[0], alone[1], alone[0]], strict=True):
        assert np.abs(got - ref).max() <= 1


@pytest.mark.parametrize("kwargs, words", [
    ({"size": "33x48"}, "multiple"),
    ({"size": "big"}, "WIDTHxHEIGHT"),
    ({"response_format": "url"}, "url"),
])
def test_bad_requests_are_400(client: openai.OpenAI, kwargs: dict, words: str) -> None:
    with pytest.raises(openai.BadRequestError, match=words):
        client.images.generate(model="flux", prompt="x", **{"size": "32x48", **kwargs})
