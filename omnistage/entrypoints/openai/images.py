"""POST /v1/images/generations: OpenAI's image API over a model that outputs images, plus vLLM-Omni's extensions
(negative_prompt, num_inference_steps, guidance_scale, true_cfg_scale, seed, width, height).

A request's `n` images are ONE generation (one seed, as diffusers' `num_images_per_prompt`), so a seed gives the
images diffusers gives for `generator=torch.Generator("cpu").manual_seed(seed)`. Images come back as base64 PNG
(or JPEG / WebP with `output_format`); `response_format: url` is refused: the server stores no images.
"""

from __future__ import annotations

import base64
import io
import re
import time
import uuid
from typing import TYPE_CHECKING, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from omnistage.engine.diffusion.params import DiffusionParams
from omnistage.entrypoints.openai.protocol import MAX_N
from omnistage.entrypoints.openai.serving import Fanout, check_model, collect
from omnistage.errors import RequestError
from omnistage.types import OmniRequest

if TYPE_CHECKING:
    from omnistage.entrypoints.async_omni import AsyncOmni

router = APIRouter()
_SIZE = re.compile(r"^(\d+)x(\d+)$")


class ImageGenerationRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    prompt: str = Field(min_length=1)
    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    size: str | None = None  # "WxH" or "auto"
    response_format: Literal["b64_json", "url"] | None = None
    output_format: Literal["png", "jpeg", "webp"] | None = None
    stream: bool | None = None
    # OpenAI fields that choose among OpenAI's own models' behaviours; accepted and ignored
    quality: str | None = None
    style: str | None = None
    background: str | None = None
    moderation: str | None = None
    output_compression: int | None = None
    user: str | None = None
    # vLLM-Omni's extensions
    negative_prompt: str | None = None
    num_inference_steps: int | None = Field(None, ge=1, le=1000)
    guidance_scale: float | None = Field(None, ge=0)
    true_cfg_scale: float | None = Field(None, ge=0)
    seed: int | None = Field(None, ge=0, lt=2**63)
    width: int | None = Field(None, ge=1)
    height: int | None = Field(None, ge=1)

    def dimensions(self) -> tuple[int | None, int | None]:
        """(width, height) from `size` and/or `width` / `height`, which must agree when both are given."""
        width, height = self.width, self.height
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

    def to_request(self, request_id: str) -> OmniRequest:
        if self.response_format == "url":
            raise RequestError("response_format 'url' is not supported (this server stores no images); "
                               "use 'b64_json'", "response_format")
        if self.stream:
            raise RequestError("streaming image generation is not supported; leave stream unset", "stream")
        width, height = self.dimensions()
        params = DiffusionParams(
            negative_prompt=self.negative_prompt, width=width, height=height,
            num_inference_steps=self.num_inference_steps, guidance_scale=self.guidance_scale,
            true_cfg_scale=1.0 if self.true_cfg_scale is None else self.true_cfg_scale, n=self.n, seed=self.seed)
        return OmniRequest(request_id, prompt=self.prompt, output_modalities=("image",), options={"diffusion": params})


def encode_image(image: Any, fmt: str) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt.upper())
    return base64.b64encode(buffer.getvalue()).decode("ascii")


@router.post("/v1/images/generations", response_model=None)
async def image_generations(body: ImageGenerationRequest, request: Request) -> Response:
    from omnistage.entrypoints.openai.server import ClientGone, unless_disconnected  # server.py includes this router

    engine: AsyncOmni = request.app.state.engine
    check_model(request.app.state.model_names, body.model)
    if "image" not in engine.output_modalities:
        raise RequestError(f"this model does not generate images; it produces {list(engine.output_modalities)}",
                           "model")
    fan = Fanout(engine, [body.to_request(f"img-{uuid.uuid4().hex}")])
    try:
        await unless_disconnected(request, fan.start())
        (out,) = await unless_disconnected(request, collect(fan))
    except ClientGone:
        return Response(status_code=499)
    fmt = body.output_format or "png"
    data = [{"b64_json": encode_image(image, fmt)} for image in out.images]
    size = f"{out.images[0].width}x{out.images[0].height}" if out.images else None
    return JSONResponse({"created": int(time.time()), "data": data, "output_format": fmt, "size": size})
