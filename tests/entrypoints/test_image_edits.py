"""POST /v1/images/edits (multipart) on real servers over tiny Qwen-Image-Edit (one input image) and
Qwen-Image-Edit-Plus (several): the official client's `images.edit` and raw multipart (string-typed fields,
repeated `image` / `image[]` parts, JSON-string `lora` and `extra_body`) give the bytes the Python API gives for
the same request; bad fields are a 400, undecodable images a 400, oversized uploads a 413."""

from __future__ import annotations

import base64
import io
import json

import httpx
import openai
import pytest

pytest.importorskip("diffusers")

from omnistage.entrypoints.openai.server import BackgroundServer  # noqa: E402

MAX_MEDIA_BYTES = 64 * 1024  # the servers' limits.max_media_bytes, so a 413 needs no big upload
GEN = {"num_inference_steps": 2, "seed": 5, "true_cfg_scale": 1.0}
PARAMS = {"width": 32, "height": 32, "num_inference_steps": 2, "seed": 5, "true_cfg_scale": 1.0}


def _png(size: tuple[int, int], color: tuple[int, int, int]) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="PNG")
    return buffer.getvalue()


def _pil(data: bytes):
    from PIL import Image

    return Image.open(io.BytesIO(data)).convert("RGB")


RED, BLUE = _png((40, 56), (200, 30, 30)), _png((32, 32), (20, 40, 220))


def _serve(arch: str):
    from omnistage.entrypoints.async_omni import AsyncOmni
    from omnistage.testing import tiny_checkpoint

    deploy = {"stages": {"*": {"dtype": "float32", "devices": "cpu"}}, "limits": {"max_media_bytes": MAX_MEDIA_BYTES}}
    engine = AsyncOmni.from_model(str(tiny_checkpoint(arch)), deploy, served_model_name=arch)
    server = BackgroundServer(engine).start()
    return engine, server


@pytest.fixture(scope="module")
def edit():
    engine, server = _serve("qwen-image-edit")
    with httpx.Client(base_url=server.url, timeout=120) as http:
        yield engine, openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0), http
    server.stop()
    engine.shutdown()


@pytest.fixture(scope="module")
def plus():
    engine, server = _serve("qwen-image-edit-plus")
    with httpx.Client(base_url=server.url, timeout=120) as http:
        yield engine, openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0), http
    server.stop()
    engine.shutdown()


def _form(model: str, **fields) -> dict[str, str]:
    return {"model": model, "prompt": "make it green", "size": "32x32", **{k: str(v) for k, v in GEN.items()},
            **fields}


def _error(resp: httpx.Response, status: int, *words: str) -> None:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert {"message", "type", "param", "code"} <= error.keys()
    for word in words:
        assert word in error["message"], error["message"]


def test_openai_client_edit_equals_python_api(edit) -> None:
    from test_images import python_api

    engine, client, _ = edit
    out = client.images.edit(model="qwen-image-edit", image=("red.png", RED, "image/png"), prompt="make it green",
                             size="32x32", extra_body=GEN)
    assert [item.b64_json for item in out.data] == python_api(engine, "make it green", [_pil(RED)], **PARAMS)
    assert _pil(base64.b64decode(out.data[0].b64_json)).size == (32, 32)


def test_string_fields_json_extra_body_and_auto_size(edit) -> None:
    from test_images import python_api

    engine, _, http = edit
    fields = _form("qwen-image-edit", size="auto", n="2", vae_use_slicing="TRUE", vae_use_tiling="False",
                   temperature="0.3", extra_body=json.dumps({"seed": 6}))
    resp = http.post("/v1/images/edits", data=fields, files=[("image", ("red.png", RED, "image/png"))])
    assert resp.status_code == 200, resp.text
    got = [item["b64_json"] for item in resp.json()["data"]]
    assert resp.json()["size"] == "32x48"  # the input's 40x56, down to the model's multiple of 16
    want = python_api(engine, "make it green", [_pil(RED)], **{**PARAMS, "width": 32, "height": 48, "seed": 6,
                                                               "n": 2, "vae_use_slicing": True})
    assert got == want


def test_json_string_lora_parses(edit) -> None:
    _, _, http = edit
    files = [("image", ("red.png", RED, "image/png"))]
    lora = json.dumps({"path": "/nonexistent/style", "scale": 0.5})
    resp = http.post("/v1/images/edits", data=_form("qwen-image-edit", lora=lora), files=files)
    assert 400 <= resp.status_code < 500 and resp.json()["error"]["message"]  # no such adapter: a 4xx, no crash
    _error(http.post("/v1/images/edits", data=_form("qwen-image-edit", lora="{bad"), files=files), 400, "lora")


@pytest.mark.parametrize("fields, files, status, words", [
    ({"n": "two"}, None, 400, ["n"]),
    ({"num_inference_steps": "0"}, None, 400, ["num_inference_steps"]),
    ({"guidance_scale": "much"}, None, 400, ["guidance_scale"]),
    ({"vae_use_tiling": "maybe"}, None, 400, ["vae_use_tiling"]),
    ({"size": "30x32"}, None, 400, ["multiple of 16"]),
    ({"stream": "true"}, None, 400, ["stream"]),
    ({}, [("image", ("bad.png", b"not an image at all", "image/png"))], 400, ["image[0]", "decode"]),
    ({}, [("image", ("big.png", b"\0" * (MAX_MEDIA_BYTES + 1), "image/png"))], 413, ["max_media_bytes"]),
    ({}, [], 400, ["image"]),
    ({}, [("image", ("a.png", RED, "image/png")), ("image", ("b.png", BLUE, "image/png"))], 400, ["at most 1"]),
    ({}, [("image", ("a.png", RED, "image/png")), ("mask", ("m.png", b"junk", "image/png"))], 400, ["mask"]),
])
def test_bad_edit_requests(edit, fields: dict, files: list | None, status: int, words: list[str]) -> None:
    _, _, http = edit
    files = [("image", ("red.png", RED, "image/png"))] if files is None else files
    resp = http.post("/v1/images/edits", data=_form("qwen-image-edit", **fields), files=files or None)
    _error(resp, status, *words)


def test_edits_need_multipart(edit) -> None:
    _, _, http = edit
    _error(http.post("/v1/images/edits", json={"prompt": "x"}), 400, "multipart")


def test_several_images_client_list_repeated_and_bracketed_parts(plus) -> None:
    from test_images import python_api

    engine, client, http = plus
    want = python_api(engine, "make it green", [_pil(RED), _pil(BLUE)], **PARAMS)
    out = client.images.edit(model="qwen-image-edit-plus", prompt="make it green", size="32x32", extra_body=GEN,
                             image=[("red.png", RED, "image/png"), ("blue.png", BLUE, "image/png")])
    assert [item.b64_json for item in out.data] == want
    for name in ("image", "image[]"):
        files = [(name, ("red.png", RED, "image/png")), (name, ("blue.png", BLUE, "image/png"))]
        resp = http.post("/v1/images/edits", data=_form("qwen-image-edit-plus"), files=files)
        assert resp.status_code == 200, resp.text
        assert [item["b64_json"] for item in resp.json()["data"]] == want
    swapped = [("image", ("blue.png", BLUE, "image/png")), ("image[]", ("red.png", RED, "image/png"))]
    resp = http.post("/v1/images/edits", data=_form("qwen-image-edit-plus"), files=swapped)
    assert resp.status_code == 200 and [item["b64_json"] for item in resp.json()["data"]] != want  # order counts


def test_chat_completions_edit_with_image_parts(plus) -> None:
    from test_images import python_api

    engine, client, _ = plus
    content = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(RED).decode()}},
               {"type": "text", "text": "make it green"}]
    reply = client.chat.completions.create(model="qwen-image-edit-plus",
                                           messages=[{"role": "user", "content": content}],
                                           extra_body={**GEN, "size": "32x32"})
    url = reply.choices[0].message.content[0]["image_url"]["url"]
    assert url.removeprefix("data:image/png;base64,") == python_api(engine, "make it green", [_pil(RED)], **PARAMS)[0]


def test_mask_is_refused_not_ignored(edit) -> None:
    """No family here reads a mask: a valid one is a 400 saying so, on the HTTP route and the Python API alike."""
    from omnistage.types import OmniRequest

    engine, client, http = edit
    files = [("image", ("red.png", RED, "image/png")), ("mask", ("m.png", BLUE, "image/png"))]
    _error(http.post("/v1/images/edits", data=_form("qwen-image-edit"), files=files), 400,
           "does not take a mask")
    assert http.post("/v1/images/edits", data=_form("qwen-image-edit"), files=files).json()["error"]["param"] == "mask"
    with pytest.raises(openai.BadRequestError, match="does not take a mask"):
        client.images.edit(model="qwen-image-edit", image=("red.png", RED, "image/png"),
                           mask=("m.png", BLUE, "image/png"), prompt="make it green", size="32x32", extra_body=GEN)
    from omnistage.errors import RequestError

    request = OmniRequest("masked", prompt="make it green", media={"image": [_pil(RED)], "mask": [_pil(BLUE)]},
                          output_modalities=("image",))
    with pytest.raises(RequestError, match="does not take a mask"):
        engine.pipeline.preprocess(request)


def test_edit_usage_counts_the_input_images_tokens(plus) -> None:
    """An edit's `usage` counts each input image's latent tokens in the DiT's sequence (sized as diffusers'
    `calculate_dimensions` sizes them) next to the prompt's text tokens; the output is the image's tokens."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

    engine, client, _ = plus
    vae = json.loads((engine.pipeline.model_path / "vae" / "config.json").read_text())
    token = 2 ** len(vae["temperal_downsample"]) * 2  # diffusers' vae_scale_factor, times the 2x2 patch

    def tokens(width: int, height: int) -> int:
        return (width // token) * (height // token)

    def edit(images: list[bytes]):
        return client.images.edit(model="qwen-image-edit-plus", prompt="make it green", size="32x32",
                                  extra_body=GEN, image=[(f"{i}.png", im, "image/png") for i, im in enumerate(images)])

    one, two = edit([RED]).usage, edit([RED, BLUE]).usage
    red = tokens(*calculate_dimensions(1024 * 1024, 40 / 56)[:2])
    blue = tokens(*calculate_dimensions(1024 * 1024, 1.0)[:2])
    assert (one.input_tokens_details.image_tokens, two.input_tokens_details.image_tokens) == (red, red + blue)
    for usage in (one, two):
        assert usage.input_tokens_details.text_tokens > 0
        assert usage.input_tokens == usage.input_tokens_details.text_tokens + usage.input_tokens_details.image_tokens
        assert usage.output_tokens == tokens(32, 32) and usage.total_tokens == usage.input_tokens + tokens(32, 32)
    # the second picture's vision tokens and its "Picture 2" label reach the DiT as text-encoder tokens too
    assert two.input_tokens_details.text_tokens > one.input_tokens_details.text_tokens
