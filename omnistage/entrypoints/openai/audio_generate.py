"""Text to audio, `POST /v1/audio/generate` (JSON), for a model that generates audio clips from a prompt (a
pipeline with `generates_audio`, e.g. Stable Audio Open):

    {"model", "input": the prompt, "negative_prompt", "audio_length" and "audio_start" (seconds),
     "num_inference_steps", "guidance_scale", "seed", "response_format": wav | flac | mp3 | aac | opus | pcm}

The reply is the whole clip in `response_format` (default wav; pcm is headerless 16-bit little-endian with the
channels interleaved), at the model's sample rate and channels, with usage in response headers (USAGE_HEADERS).
Unknown fields are ignored, an `extra_body` object is merged in first (its keys win), and a wrong type, a clip
beyond the model's window or any other bad value is a 400 naming the field, all before anything is queued.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import TYPE_CHECKING, Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, model_validator

from omnistage.engine.diffusion.params import DiffusionParams
from omnistage.entrypoints.openai.serving import check_model, run_admitted, validated
from omnistage.errors import RequestError
from omnistage.media.audio import aac_encodable, encodable_formats, encode_aac, encode_audio
from omnistage.types import OmniRequest

if TYPE_CHECKING:
    from omnistage.entrypoints.async_omni import AsyncOmni

__all__ = ["USAGE_HEADERS", "AudioGenerateRequest", "router"]

router = APIRouter()
RESPONSE_FORMATS = ("wav", "flac", "mp3", "aac", "opus", "pcm")
MEDIA_TYPES = {"mp3": "audio/mpeg", "opus": "audio/ogg", "aac": "audio/aac", "flac": "audio/flac",
               "wav": "audio/wav", "pcm": "audio/pcm"}
USAGE_HEADERS = {"input_tokens": "X-Usage-Input-Tokens", "denoising_steps": "X-Usage-Denoising-Steps",
                 "audio_seconds": "X-Usage-Audio-Seconds"}


class AudioGenerateRequest(BaseModel):
    """The body; unknown fields are ignored, known ones type-checked."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    input: str
    negative_prompt: str | None = None
    audio_length: float | None = Field(None, gt=0)
    audio_start: float | None = Field(None, ge=0)
    num_inference_steps: int | None = Field(None, ge=1, le=1000)
    guidance_scale: float | None = Field(None, ge=0)
    seed: int | None = Field(None, ge=0, lt=2**63)
    response_format: str = "wav"

    @model_validator(mode="before")
    @classmethod
    def _merge(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("extra_body"), dict):
            data = {**data, **data["extra_body"]}
        return data

    def params(self) -> DiffusionParams:
        given = {name: getattr(self, name) for name in ("negative_prompt", "audio_length", "audio_start",
                                                        "num_inference_steps", "guidance_scale", "seed")
                 if getattr(self, name) is not None}
        return DiffusionParams(prompt=self.input, **given)


def _parse(raw: bytes) -> AudioGenerateRequest:
    try:
        data = json.loads(raw or b"null")
    except ValueError as exc:
        raise RequestError(f"request body is not valid JSON ({exc}); send a JSON object") from None
    if not isinstance(data, dict):
        raise RequestError("request body must be a JSON object with at least 'input' (the prompt)")
    return validated(AudioGenerateRequest, data)


def audio_pipeline(engine: AsyncOmni | None) -> Any:
    """The engine's pipeline if it generates audio clips from a prompt; else a 400 saying what the model does."""
    pipeline = getattr(engine, "pipeline", None)
    if not getattr(pipeline, "generates_audio", False):
        outputs = list(getattr(engine, "output_modalities", ()) or ())
        hint = " (for speech from text use POST /v1/audio/speech)" if "audio" in outputs else ""
        raise RequestError(f"this model does not generate audio from a prompt; it produces {outputs}{hint}. Serve "
                           "a text-to-audio model (e.g. Stable Audio Open) for /v1/audio/generate", "model")
    return pipeline


def available_formats() -> list[str]:
    have = set(encodable_formats())
    usable = {"wav", "flac", "mp3", "opus"} & have | ({"pcm"} if "pcm16" in have else set())
    return [f for f in RESPONSE_FORMATS if f in usable or (f == "aac" and aac_encodable())]


def _response_format(value: str) -> str:
    fmt = value.lower().strip()
    formats = available_formats()
    if fmt not in formats:
        raise RequestError(f"response_format {value!r} is not supported here; use one of: {', '.join(formats)}",
                           "response_format")
    return fmt


def encode_clip(samples: np.ndarray, rate: int, fmt: str) -> bytes:
    if fmt == "aac":
        return encode_aac(samples, rate)
    return encode_audio(samples, rate, "pcm16" if fmt == "pcm" else fmt)


@router.post("/v1/audio/generate", response_model=None)
async def audio_generate(request: Request) -> Response:
    """A prompt to an audio clip, returned whole in `response_format`."""
    engine: AsyncOmni = request.app.state.engine
    body = _parse(await request.body())
    check_model(request.app.state.model_names, body.model)
    pipeline = audio_pipeline(engine)
    fmt = _response_format(body.response_format)
    if not body.input.strip():
        raise RequestError("'input' is empty; send the text that describes the audio", "input")
    omni = OmniRequest(f"audiogen-{uuid.uuid4().hex}", prompt=body.input, output_modalities=("audio",),
                       options={"diffusion": body.params()})
    pipeline.request_params(omni)  # the model's checks (window, conditioners) answer 400 before anything queues
    outputs = await run_admitted(request, [omni])
    if isinstance(outputs, Response):
        return outputs
    out = outputs[0]
    rate = out.sample_rate or pipeline.audio_sample_rate
    samples = np.zeros(0, np.float32) if out.audio is None else np.asarray(out.audio, np.float32)
    data = await asyncio.to_thread(encode_clip, samples, rate, fmt)
    usage = {"input_tokens": out.num_prompt_tokens, "denoising_steps": out.num_output_tokens,
             "audio_seconds": round(samples.shape[0] / rate, 3) if rate else 0.0}
    return Response(data, media_type=MEDIA_TYPES[fmt], headers={USAGE_HEADERS[k]: str(v) for k, v in usage.items()})
