"""POST /v1/images/generations on a real server over tiny FLUX.1-dev, with the official client: the image equals
diffusers' FluxPipeline for the same prompt, size, steps and seed (PNG pixels within 1 of 255); n images are
diffusers' num_images_per_prompt; concurrent requests batch and each keeps its own image; the bytes equal the
same request through the Python API; vLLM-Omni's fields (also in a literal `extra_body`, also as JSON strings)
parse, unknown fields are ignored and bad input is a 400 in OpenAI's error format."""

from __future__ import annotations

import base64
import concurrent.futures
import io
import json
import queue
import uuid

import httpx
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
def served(flux_path: str):
    from omnistage.entrypoints.async_omni import AsyncOmni

    # float32 on the CPU, as the diffusers reference runs (on a GPU the default would be bfloat16 on the GPU)
    engine = AsyncOmni.from_model(flux_path, {"stages": {"*": {"dtype": "float32", "devices": "cpu"}}},
                                  served_model_name="flux")
    with BackgroundServer(engine) as server:
        yield engine, server
    engine.shutdown()


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served[1].url}/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def http(served):
    with httpx.Client(base_url=served[1].url, timeout=60) as c:
        yield c


def python_api(engine, prompt: str, images: list | None = None, **params) -> list[str]:
    """The same generation through the engine's Python side (the orchestrator), as base64 PNGs; `images`: an
    edit's input PIL images."""
    from omnistage.engine.diffusion.params import DiffusionParams
    from omnistage.entrypoints.openai.images import encode_image
    from omnistage.types import OmniOutput, OmniRequest

    done: queue.SimpleQueue = queue.SimpleQueue()
    request = OmniRequest(f"py-{uuid.uuid4().hex}", prompt=prompt, output_modalities=("image",),
                          media={"image": list(images)} if images else {},
                          options={"diffusion": DiffusionParams(**params)})
    engine.orchestrator.submit(request, done.put)
    merged = OmniOutput(request.request_id)
    while not merged.finished:
        merged.merge(done.get(timeout=120))
    assert merged.error is None, merged.error
    return [encode_image(image, "png") for image in merged.images]


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


def _post(http: httpx.Client, **body) -> httpx.Response:
    return http.post("/v1/images/generations", json={"model": "flux", "prompt": "a red fox", "size": "32x48", **body})


def _error(resp: httpx.Response, status: int, *words: str) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert {"message", "type", "param", "code"} <= error.keys()
    for word in words:
        assert word in error["message"], error["message"]
    return error


def test_http_bytes_equal_python_api(client: openai.OpenAI, served) -> None:
    out = client.images.generate(model="flux", prompt="a red fox", n=2, **KW)
    want = python_api(served[0], "a red fox", width=32, height=48, num_inference_steps=3, seed=7, guidance_scale=3.5,
                      n=2)
    assert [item.b64_json for item in out.data] == want
    assert not out.data[0].b64_json.startswith("data:")  # raw base64, no data-URL prefix


def test_literal_extra_body_wins_and_unknown_fields_are_ignored(http: httpx.Client, client: openai.OpenAI) -> None:
    ref = client.images.generate(model="flux", prompt="a red fox", **KW).data[0].b64_json
    resp = _post(http, num_inference_steps=1, seed=1, temperature=0.7, top_p=0.9, max_tokens=5, whatever={"a": 1},
                 extra_body={"num_inference_steps": 3, "seed": 7, "guidance_scale": 3.5})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["data"][0]["b64_json"] == ref and body["size"] == "32x48" and isinstance(body["created"], int)


def test_output_formats(http: httpx.Client) -> None:
    from PIL import Image

    for fmt, magic in (("png", b"\x89PNG"), ("jpeg", b"\xff\xd8"), ("webp", b"RIFF")):
        sizes = []
        for quality in (10, 95):
            resp = _post(http, output_format=fmt, output_compression=quality, num_inference_steps=1, seed=3)
            assert resp.status_code == 200, resp.text
            raw = base64.b64decode(resp.json()["data"][0]["b64_json"])
            assert raw.startswith(magic) and Image.open(io.BytesIO(raw)).size == (32, 48)
            sizes.append(raw)
        assert (sizes[0] == sizes[1]) == (fmt == "png")  # quality matters for JPEG/WebP only


def test_vae_switches_and_lora_shapes_parse(http: httpx.Client) -> None:
    resp = _post(http, num_inference_steps=1, vae_use_slicing=True, vae_use_tiling=False)
    assert resp.status_code == 200, resp.text
    # a LoRA the server cannot load (no lora_root, nonexistent path) is a 4xx, never a crash; object or JSON string
    for lora in ({"path": "/nonexistent/my-style", "scale": 0.8}, json.dumps({"path": "/nonexistent/a.safetensors"})):
        resp = _post(http, num_inference_steps=1, lora=lora)
        assert 400 <= resp.status_code < 500, resp.text
        assert resp.json()["error"]["message"]
    _error(_post(http, lora={"path": "/x", "scale": "high"}), 400, "lora")
    _error(_post(http, lora="{not json"), 400, "lora")
    _error(_post(http, lora={"path": "/x", "rank": 4}), 400, "lora")


def test_lora_name_defaults_to_the_directory_name() -> None:
    from omnistage.entrypoints.openai.images import LoraSpec

    assert LoraSpec(path="/loras/ink-style").as_params() == {"name": "ink-style", "path": "/loras/ink-style",
                                                            "scale": 1.0}
    assert LoraSpec(path="/loras/ink/adapter_model.safetensors", scale=0.5).as_params()["name"] == "ink"
    assert LoraSpec(path="/loras/ink/", name="mine").as_params()["name"] == "mine"


@pytest.mark.parametrize("body, status, words", [
    ({"n": "2"}, 400, ["n"]),
    ({"n": 0}, 400, ["n"]),
    ({"n": 17}, 400, ["n"]),
    ({"num_inference_steps": 0}, 400, ["num_inference_steps"]),
    ({"num_inference_steps": 1001}, 400, ["num_inference_steps"]),
    ({"num_inference_steps": 2.5}, 400, ["num_inference_steps"]),
    ({"seed": "7"}, 400, ["seed"]),
    ({"guidance_scale": "high"}, 400, ["guidance_scale"]),
    ({"vae_use_tiling": "yes"}, 400, ["vae_use_tiling"]),
    ({"output_compression": 101}, 400, ["output_compression"]),
    ({"output_format": "gif"}, 400, ["output_format"]),
    ({"size": "33x48"}, 400, ["multiple of"]),
    ({"size": "4096x8192"}, 400, ["max_image_pixels"]),
    ({"prompt": ""}, 400, ["prompt"]),
    ({"prompt": 5}, 400, ["prompt"]),
    ({"stream": True}, 400, ["stream"]),
    ({"model": "other"}, 404, ["other"]),
    ({"extra_body": [1]}, 400, ["extra_body"]),
    ({"extra_body": {"size": "31x31"}}, 400, ["multiple"]),
])
def test_bad_fields_are_4xx_before_any_work(http: httpx.Client, body: dict, status: int, words: list[str]) -> None:
    _error(_post(http, **body), status, *words)


def test_body_not_json_is_400(http: httpx.Client) -> None:
    _error(http.post("/v1/images/generations", content=b"{nope", headers={"content-type": "application/json"}), 400,
           "JSON")


def test_usage_counts_the_dits_tokens(client: openai.OpenAI, flux_path: str) -> None:
    """`usage`: input = the prompt's T5 tokens (what FLUX's DiT attends to), output = the image tokens of the n
    images as diffusers' FluxPipeline packs its latents."""
    import torch
    from diffusers import FluxPipeline
    from transformers import T5TokenizerFast

    prompt = "a red fox in the snow"
    out = client.images.generate(model="flux", prompt=prompt, n=2, **KW)
    text = len(T5TokenizerFast.from_pretrained(f"{flux_path}/tokenizer_2")(prompt).input_ids)
    pipe = FluxPipeline.from_pretrained(flux_path)
    latents, _ = pipe.prepare_latents(2, pipe.transformer.config.in_channels // 4, 48, 32, torch.float32, "cpu",
                                      torch.Generator("cpu").manual_seed(0))
    image = latents.shape[0] * latents.shape[1]
    usage = out.usage
    assert usage is not None and text > 3
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (text, image, text + image)
    assert (usage.input_tokens_details.text_tokens, usage.input_tokens_details.image_tokens) == (text, 0)
    assert usage.output_tokens_details.image_tokens == image
    longer = client.images.generate(model="flux", prompt=prompt + " at dawn, in oil paint", **KW).usage
    assert longer.input_tokens > text and longer.output_tokens == image // 2
