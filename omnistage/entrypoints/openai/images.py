"""OpenAI's image API over a model that outputs images, plus vLLM-Omni's extensions, on three routes:

    POST /v1/images/generations  JSON: a prompt -> images
    POST /v1/images/edits        multipart: a prompt and input image(s) (`image`, `image[]`; optional `mask`)
    POST /v1/chat/completions    on an image model: the last user message's text (and images) is the prompt; the
                                 reply's content is image_url parts; `stream` sends progress chunks (docs/api.md)

Every route reads the same generation fields (`ImageFields`): OpenAI's (n, size, response_format, output_format,
output_compression) and vLLM-Omni's (negative_prompt, num_inference_steps, guidance_scale, true_cfg_scale, seed,
max_sequence_length, lora, vae_use_slicing, vae_use_tiling), also inside an `extra_body` object whose keys win.
Unknown fields are ignored (clients send sampling fields meant for other model kinds); a known field of the wrong
type, a size that is no multiple of the model's factor or over `limits.max_image_pixels`, and undecodable input
images are a 400 and oversized uploads a 413, all before anything is queued.

A request's `n` images are ONE generation (one seed, as diffusers' `num_images_per_prompt`). Images come back as
raw base64 (no data-URL prefix) PNG, or JPEG / WebP with `output_format` (`output_compression` is their quality);
`response_format: url` is refused: the server stores no images.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.datastructures import FormData, UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import Scope

from omnistage.engine.diffusion.params import DiffusionParams
from omnistage.entrypoints.openai.protocol import MAX_N
from omnistage.entrypoints.openai.serving import (
    Fanout,
    Release,
    check_model,
    raise_if_failed,
    run_admitted,
    validated,
    with_extra_body,
)
from omnistage.errors import RequestError
from omnistage.media import MediaBudget, MediaLimits, RemotePolicy, aload_part, decode_image
from omnistage.media.source import too_large
from omnistage.types import OmniOutput, OmniRequest

if TYPE_CHECKING:
    from omnistage.entrypoints.async_omni import AsyncOmni

__all__ = ["ImageFields", "chat_router", "encode_image", "router"]

router = APIRouter()
_SIZE = re.compile(r"^(\d+)x(\d+)$")
_TRUE, _FALSE = "true", "false"


class LoraSpec(BaseModel):
    """A LoRA adapter of the DiT: `name` defaults to the adapter's directory name (the path's own name, or its
    parent's when the path names a weights file). Two-expert models (Wan2.2 A14B) take `path` / `scale` for the
    high-noise expert and `path_2` / `scale_2` for the low-noise one, either or both. The engine checks the paths
    against its `lora_root`."""

    model_config = ConfigDict(strict=True, extra="forbid")

    path: str | None = Field(None, min_length=1)
    name: str | None = None
    scale: float = Field(1.0, ge=-10, le=10)
    path_2: str | None = Field(None, min_length=1)
    scale_2: float = Field(1.0, ge=-10, le=10)

    @model_validator(mode="before")
    @classmethod
    def _json_text(cls, value: Any) -> Any:
        """ComfyUI and multipart clients send the object as a JSON string."""
        if isinstance(value, str):
            try:
                return json.loads(value)
            except ValueError:
                raise ValueError(f"lora must be an object or a JSON object string (got {value[:60]!r})") from None
        return value

    @model_validator(mode="after")
    def _has_a_path(self) -> LoraSpec:
        if self.path is None and self.path_2 is None:
            raise ValueError("lora needs a path (two-expert models: path and/or path_2)")
        return self

    def as_params(self) -> dict[str, Any]:
        path = PurePosixPath((self.path or self.path_2 or "").rstrip("/") or "/")
        out = {"name": self.name or (path.parent.name if path.suffix else path.name), "path": self.path,
               "scale": self.scale}
        if self.path_2 is not None:
            out.update(path_2=self.path_2, scale_2=self.scale_2)
        return out


class ImageFields(BaseModel):
    """The generation fields every image route reads; unknown fields are ignored, known ones are type-checked."""

    model_config = ConfigDict(strict=True, extra="ignore")

    prompt: str | None = None
    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    size: str | None = None  # "WxH" or "auto"
    width: int | None = Field(None, ge=1)
    height: int | None = Field(None, ge=1)
    response_format: Literal["b64_json", "url"] | None = None
    output_format: Literal["png", "jpeg", "webp"] | None = None
    output_compression: int | None = Field(None, ge=0, le=100)
    stream: bool | None = None
    negative_prompt: str | None = None
    num_inference_steps: int | None = Field(None, ge=1, le=1000)
    guidance_scale: float | None = Field(None, ge=0)
    true_cfg_scale: float | None = Field(None, ge=0)
    seed: int | None = Field(None, ge=0, lt=2**63)
    max_sequence_length: int | None = Field(None, ge=1)
    lora: LoraSpec | None = None
    vae_use_slicing: bool | None = None
    vae_use_tiling: bool | None = None

    @classmethod
    def parse(cls, data: Any) -> ImageFields:
        """`data` (a JSON object) with its `extra_body` merged in; a wrong type is a 400 naming the field."""
        if not isinstance(data, dict):
            raise RequestError("request body must be a JSON object")
        data = with_extra_body(data)
        if "num_outputs_per_prompt" in data:  # vLLM-Omni's name of n
            data["n"] = data.pop("num_outputs_per_prompt")
        return validated(cls, data)

    def dimensions(self, first_input: Any = None, multiple: int = 1) -> tuple[int | None, int | None]:
        """(width, height) from `size` and/or `width` / `height`, which must agree when both are given. `size`
        "auto" on an edit is the first input image's size, rounded down to the model's multiple."""
        width, height = self.width, self.height
        if self.size == "auto" and first_input is not None:
            w, h = (max(multiple, side // multiple * multiple) for side in first_input.size)
            return width or w, height or h
        if self.size not in (None, "auto"):
            match = _SIZE.match(self.size)
            if match is None:
                raise RequestError(f"size must be 'WIDTHxHEIGHT' (e.g. '1024x1024') or 'auto' (got {self.size!r})",
                                   "size")
            w, h = int(match[1]), int(match[2])
            if (width or w) != w or (height or h) != h:
                raise RequestError(f"size {self.size!r} disagrees with width/height", "size")
            width, height = w, h
        return width, height

    def to_request(self, engine: AsyncOmni, request_id: str, prompt: str | None = None,
                   images: list[Any] | None = None, mask: Any = None) -> OmniRequest:
        """The engine request, checked against the model (size factor, pixel limit, input images) up front."""
        if self.response_format == "url":
            raise RequestError("response_format 'url' is not supported (this server stores no images); "
                               "use 'b64_json'", "response_format")
        prompt = self.prompt if prompt is None else prompt
        if not prompt:
            raise RequestError("'prompt' is required: the text that describes the image", "prompt")
        pipeline = engine.pipeline
        multiple = getattr(pipeline, "size_multiple", 1)
        width, height = self.dimensions(images[0] if images else None, multiple)
        for name, side in (("width", width), ("height", height)):
            if side is not None and side % multiple:
                raise RequestError(f"size: {name} must be a multiple of {multiple} for this model (got {side})",
                                   "size")
        max_pixels = pipeline.deploy.limits.max_image_pixels
        if width and height and width * height > max_pixels:
            raise RequestError(f"size {width}x{height} has more pixels than the limit of {max_pixels} "
                               "(limits.max_image_pixels)", "size")
        accepted = getattr(pipeline, "max_input_images", 0)
        if images and not accepted:
            raise RequestError("this model does not take input images; serve an edit model to edit images", "image")
        if len(images or []) > accepted:
            raise RequestError(f"this model takes at most {accepted} input images (got {len(images or [])})",
                               "image")
        if not images and getattr(pipeline, "min_input_images", 0):
            raise RequestError("this model edits images: send the input image (POST /v1/images/edits)", "image")
        given = {name: getattr(self, name) for name in (
            "negative_prompt", "num_inference_steps", "guidance_scale", "true_cfg_scale", "seed",
            "max_sequence_length", "vae_use_slicing", "vae_use_tiling") if getattr(self, name) is not None}
        params = DiffusionParams(prompt=prompt, width=width, height=height, n=self.n,
                                 lora=self.lora.as_params() if self.lora else None, **given).check()
        if mask is not None:
            _check_mask(pipeline)
        media: dict[str, list[Any]] = {"image": list(images)} if images else {}
        if mask is not None:
            media["mask"] = [mask]
        return OmniRequest(request_id, prompt=prompt, media=media, output_modalities=("image",),
                           options={"diffusion": params})

    def encode(self, image: Any) -> str:
        return encode_image(image, self.output_format or "png", self.output_compression)


def _check_mask(pipeline: Any) -> None:
    """A mask is a 400 on a model whose family does not read one: never accepted and silently ignored."""
    if not getattr(pipeline, "accepts_mask", False):
        from omnistage.families.diffusion import MASK_REFUSED

        raise RequestError(MASK_REFUSED, "mask")


def encode_image(image: Any, fmt: str, quality: int | None = None) -> str:
    """Raw base64 of `image` as PNG, JPEG or WebP (`quality` 0-100 for the lossy two; PNG ignores it)."""
    buffer = io.BytesIO()
    options = {"quality": quality} if quality is not None and fmt in ("jpeg", "webp") else {}
    image.save(buffer, format=fmt.upper(), **options)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _image_engine(request: Request, model: str | None) -> AsyncOmni:
    engine: AsyncOmni = request.app.state.engine
    check_model(request.app.state.model_names, model)
    if "image" not in engine.output_modalities:
        raise RequestError(f"this model does not generate images; it produces {list(engine.output_modalities)}",
                           "model")
    return engine


async def _generate(request: Request, omni: OmniRequest,
                    stream: Callable[[Fanout, Release], Response] | None = None) -> OmniOutput | Response:
    """One image generation through `run_admitted`: its output, or a response (the stream `stream` builds, or the
    499 of a client that left)."""
    outputs = await run_admitted(request, [omni], stream)
    return outputs if isinstance(outputs, Response) else outputs[0]


def images_usage(pipeline: Any, out: OmniOutput, images: list[Any] | None = None) -> dict[str, Any]:
    """OpenAI's images `usage` in the DiT's tokens: input = the prompt's text tokens it attends to (the engine's
    `num_prompt_tokens`) plus the input images' latent tokens; output = the generated images' latent tokens."""
    text = out.num_prompt_tokens
    image_in = pipeline.input_image_tokens(images or [])
    image_out = sum(pipeline.image_tokens(image.width, image.height) for image in out.images)
    return {"input_tokens": text + image_in, "output_tokens": image_out, "total_tokens": text + image_in + image_out,
            "input_tokens_details": {"text_tokens": text, "image_tokens": image_in},
            "output_tokens_details": {"text_tokens": 0, "image_tokens": image_out}}


def _images_response(fields: ImageFields, out: OmniOutput, usage: dict[str, Any]) -> JSONResponse:
    fmt = fields.output_format or "png"
    data = [{"b64_json": fields.encode(image)} for image in out.images]
    size = f"{out.images[0].width}x{out.images[0].height}" if out.images else None
    return JSONResponse({"created": int(time.time()), "data": data, "output_format": fmt, "size": size,
                         "usage": usage})


def _no_stream(fields: ImageFields) -> None:
    if fields.stream:
        raise RequestError("streaming is not supported on the images API; leave stream unset (chat completions "
                           "stream progress for image models)", "stream")


@router.post("/v1/images/generations", response_model=None)
async def image_generations(request: Request) -> Response:
    try:
        data = await request.json()
    except ValueError:
        raise RequestError("request body is not valid JSON; send a JSON object") from None
    fields = ImageFields.parse(data)
    engine = _image_engine(request, fields.model)
    _no_stream(fields)
    omni = fields.to_request(engine, f"img-{uuid.uuid4().hex}")
    out = await _generate(request, omni)
    return out if isinstance(out, Response) else _images_response(fields, out, images_usage(engine.pipeline, out))


# ---------------------------------------------------------------- edits (multipart)

INT_FIELDS = ("n", "width", "height", "output_compression", "num_inference_steps", "seed", "max_sequence_length")
FLOAT_FIELDS = ("guidance_scale", "true_cfg_scale")
BOOL_FIELDS = ("stream", "vae_use_slicing", "vae_use_tiling")
IMAGE_PARTS = ("image", "image[]")


def _typed(name: str, text: str) -> Any:
    """A form field's text as its field's type; text that does not convert stays text, for the 400."""
    value = text.strip()
    try:
        if name in INT_FIELDS and re.fullmatch(r"[+-]?\d+", value):
            return int(value)
        if name in FLOAT_FIELDS:
            return float(value)
    except ValueError:
        return text
    if name in BOOL_FIELDS and value.lower() in (_TRUE, _FALSE):
        return value.lower() == _TRUE
    return text


async def _read_upload(upload: Any, part: str, limits: MediaLimits, budget: MediaBudget) -> bytes:
    if not isinstance(upload, UploadFile):
        raise RequestError(f"'{part}' must be a file upload (curl -F {part}=@photo.png), not a text field", part)
    if upload.size is not None and upload.size > limits.max_bytes:
        raise too_large(part, limits.max_bytes, upload.size)
    data = await upload.read()
    if len(data) > limits.max_bytes:
        raise too_large(part, limits.max_bytes, len(data))
    budget.spend(len(data), part)
    return data


async def read_edit_form(request: Request, limits: MediaLimits) -> tuple[ImageFields, list[bytes], bytes | None]:
    """The multipart form: its fields (as text, typed here) and the input images' and mask's bytes, in order."""
    if not request.headers.get("content-type", "").lower().startswith("multipart/form-data"):
        raise RequestError("send the request as multipart/form-data with the input image in an 'image' field "
                           "(curl -F image=@photo.png)", "image")
    try:
        form: FormData = await request.form(max_files=limits.max_parts + 1, max_fields=256)
    except StarletteHTTPException as exc:  # python-multipart could not parse it, or too many parts
        raise RequestError(f"could not read the multipart form: {exc.detail}", "image") from None
    try:
        budget = MediaBudget(limits.max_total_bytes)
        uploads = [value for name, value in form.multi_items() if name in IMAGE_PARTS]  # in the form's order
        if len(uploads) > limits.max_parts:
            raise RequestError(f"the request has more than the limit of {limits.max_parts} images "
                               "(limits.max_media_parts)", "image", status=413)
        images = [await _read_upload(upload, f"image[{i}]", limits, budget) for i, upload in enumerate(uploads)]
        masks = form.getlist("mask")
        if len(masks) > 1:
            raise RequestError("'mask' was sent more than once; send one mask", "mask")
        mask = await _read_upload(masks[0], "mask", limits, budget) if masks else None
        data: dict[str, Any] = {}
        for name, value in form.multi_items():
            if name in (*IMAGE_PARTS, "mask"):
                continue
            if not isinstance(value, str):
                raise RequestError(f"'{name}' must be a text field, not a file", name)
            data[name] = _typed(name, value)
    finally:
        await form.close()
    if not images:
        raise RequestError("'image' is required: the input image (or several 'image' / 'image[]' parts)", "image")
    return ImageFields.parse(data), images, mask


def _decode_all(images: list[bytes], mask: bytes | None, max_pixels: int) -> tuple[list[Any], Any]:
    decoded = [decode_image(data, f"image[{i}]", max_pixels) for i, data in enumerate(images)]
    return decoded, decode_image(mask, "mask", max_pixels) if mask is not None else None


@router.post("/v1/images/edits", response_model=None)
async def image_edits(request: Request) -> Response:
    engine: AsyncOmni = request.app.state.engine
    limits = MediaLimits.from_config(engine.pipeline.deploy.limits)
    fields, images, mask = await read_edit_form(request, limits)
    _image_engine(request, fields.model)
    _no_stream(fields)
    if mask is not None:  # refused before decoding anything
        _check_mask(engine.pipeline)
    decoded, mask_image = await asyncio.to_thread(_decode_all, images, mask, limits.max_pixels)
    omni = fields.to_request(engine, f"imgedit-{uuid.uuid4().hex}", images=decoded, mask=mask_image)
    out = await _generate(request, omni)
    if isinstance(out, Response):
        return out
    return _images_response(fields, out, images_usage(engine.pipeline, out, decoded))


# ---------------------------------------------------------------- chat completions on an image model


def serves_images(engine: Any) -> bool:
    """An image model (images out, no text): its chat completions are image generations."""
    modalities = tuple(getattr(engine, "output_modalities", ()) or ())
    return "image" in modalities and "text" not in modalities


class ImageModelRoute(APIRoute):
    """A route that matches only while the app serves an image model; otherwise the next route (the text chat
    route) takes the request, with its strict validation untouched."""

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        match, child = super().matches(scope)
        app = scope.get("app")
        if match is not Match.NONE and not serves_images(getattr(getattr(app, "state", None), "engine", None)):
            return Match.NONE, {}
        return match, child


chat_router = APIRouter(route_class=ImageModelRoute)


async def _chat_input(engine: AsyncOmni, messages: Any) -> tuple[str, list[Any]]:
    """The last user message's text and its images (decoded under the media limits and policy)."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' is required: a list with a user message holding the prompt", "messages")
    for i in reversed(range(len(messages))):
        message = messages[i]
        if isinstance(message, dict) and message.get("role") == "user":
            break
    else:
        raise RequestError("messages need a user message: its text is the image prompt", "messages")
    content = message.get("content")
    if isinstance(content, str):
        return content, []
    if not isinstance(content, list):
        raise RequestError(f"messages[{i}].content must be a string or a list of parts", f"messages[{i}].content")
    deploy = engine.pipeline.deploy
    limits = MediaLimits.from_config(deploy.limits)
    policy = getattr(engine, "media_policy", None) or RemotePolicy.from_config(deploy.media)
    budget = MediaBudget(limits.max_total_bytes)
    texts, images = [], []
    for j, part in enumerate(content):
        name = f"messages[{i}].content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "image_url":
            if len(images) >= limits.max_parts:
                raise RequestError(f"{name}: more than the limit of {limits.max_parts} images "
                                   "(limits.max_media_parts)", name, status=413)
            images.append((await aload_part(part, name, limits, policy=policy, budget=budget)).value)
        else:
            raise RequestError(f"{name}: an image model takes text and image_url parts (got {kind!r})", name)
    return " ".join(texts), images


def _chat_base(rid: str, model: str, obj: str) -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model}


def _image_parts(fields: ImageFields, out: OmniOutput) -> list[dict[str, Any]]:
    fmt = fields.output_format or "png"
    return [{"type": "image_url", "image_url": {"url": f"data:image/{fmt};base64,{fields.encode(image)}"}}
            for image in out.images]


def _chat_usage(out: OmniOutput) -> dict[str, int]:
    """Steps as completion tokens (the unit the engine counts for diffusion)."""
    return {"prompt_tokens": out.num_prompt_tokens, "completion_tokens": out.num_output_tokens,
            "total_tokens": out.num_prompt_tokens + out.num_output_tokens}


class _Chunk(BaseModel):
    model_config = ConfigDict(extra="allow")


async def _progress_chunks(fan: Fanout, fields: ImageFields, rid: str, model: str) -> AsyncIterator[BaseModel]:
    """A role chunk, one chunk per denoising step (empty delta plus `progress` {step, total}), then the images
    in one chunk with finish_reason "stop" and `usage`."""
    base = _chat_base(rid, model, "chat.completion.chunk")
    yield _Chunk(**base, choices=[{"index": 0, "delta": {"role": "assistant", "content": ""},
                                   "finish_reason": None}])
    merged = OmniOutput(request_id=rid)
    async for _, out in fan.events():
        raise_if_failed(out)
        merged.merge(out)
        if out.progress is not None and not out.finished:
            step, total = out.progress
            yield _Chunk(**base, choices=[{"index": 0, "delta": {}, "finish_reason": None}],
                         progress={"step": step, "total": total})
    step, total = merged.progress or (merged.num_output_tokens, merged.num_output_tokens)
    yield _Chunk(**base, choices=[{"index": 0, "delta": {"content": _image_parts(fields, merged)},
                                   "finish_reason": "stop"}],
                 progress={"step": step, "total": total}, usage=_chat_usage(merged))


@chat_router.post("/v1/chat/completions", response_model=None, include_in_schema=False)
async def image_chat_completions(request: Request) -> Response:
    """Chat completions on an image model: the last user message is the prompt (its images the edit's inputs),
    the generation fields come at the top level (the OpenAI SDK merges `extra_body` there) or in a literal
    `extra_body`; chat's own `response_format` (an object) is not the images API's and is dropped."""
    from omnistage.entrypoints.openai.server import EventStream

    try:
        data = await request.json()
    except ValueError:
        raise RequestError("request body is not valid JSON; send a JSON object") from None
    if not isinstance(data, dict):
        raise RequestError("request body must be a JSON object")
    stream = data.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(f"stream must be true or false (got {stream!r})", "stream")
    fields = ImageFields.parse({k: v for k, v in data.items() if k not in ("response_format", "stream", "prompt")})
    engine = _image_engine(request, fields.model)
    model = check_model(request.app.state.model_names, fields.model)
    prompt, images = await _chat_input(engine, data.get("messages"))
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    omni = fields.to_request(engine, rid, prompt=prompt, images=images)

    def progress(fan: Fanout, release: Release) -> Response:
        return EventStream(_progress_chunks(fan, fields, rid, model), fan, release)

    out = await _generate(request, omni, progress if stream else None)
    if isinstance(out, Response):
        return out
    message = {"role": "assistant", "content": _image_parts(fields, out)}
    return JSONResponse({**_chat_base(rid, model, "chat.completion"), "usage": _chat_usage(out),
                         "choices": [{"index": 0, "message": message, "finish_reason": "stop"}]})
