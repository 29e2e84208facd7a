"""OpenAI's speech-to-text routes: `POST /v1/audio/transcriptions` and `POST /v1/audio/translations`.

A multipart form (OpenAI's fields, numbers as strings) becomes one chat request for the entry stage: the decoded
audio (mono float32 at 16 kHz) as an audio part plus the instruction the pipeline's `transcription_messages` builds,
text out only. The reply's text is the transcript, rendered as json, text, srt, vtt or verbose_json, or streamed as
`transcript.text.delta` events. The model gives no timestamps: srt, vtt and verbose_json carry one segment that spans
the whole audio. Only models that hear (`Pipeline.input_modalities` has "audio") serve these routes. docs/audio_api.md
describes them for users.
"""

from __future__ import annotations

import asyncio
import logging
import math
import uuid
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import PurePath
from typing import TYPE_CHECKING, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel
from starlette.datastructures import FormData, UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException

from omnistage.entrypoints.openai.protocol import close_match
from omnistage.entrypoints.openai.serving import Fanout, check_model, collect, raise_if_failed
from omnistage.errors import RequestError
from omnistage.media import decode_audio
from omnistage.media.source import too_large
from omnistage.sampling_params import InvalidParams, SamplingParams
from omnistage.types import OmniOutput, OmniRequest

if TYPE_CHECKING:
    from omnistage.entrypoints.async_omni import AsyncOmni

__all__ = ["SAMPLE_RATE", "router"]

log = logging.getLogger("omnistage.server")
router = APIRouter()

SAMPLE_RATE = 16000  # what the audio is decoded to: the rate speech encoders (Whisper's features) take
RESPONSE_FORMATS = ("json", "text", "srt", "verbose_json", "vtt")
FIELDS = ("file", "model", "language", "prompt", "response_format", "temperature", "stream", "max_tokens")
# OpenAI's fields that make no sense without timestamps or server-side chunking: accepted, logged, unused.
IGNORED = ("timestamp_granularities", "chunking_strategy")
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off", "")

# ISO-639-1 codes (what OpenAI's `language` takes) -> the name the instruction uses; other values pass as given.
LANGUAGES = {
    "ar": "Arabic", "ca": "Catalan", "cs": "Czech", "da": "Danish", "de": "German", "el": "Greek", "en": "English",
    "es": "Spanish", "fa": "Persian", "fi": "Finnish", "fr": "French", "he": "Hebrew", "hi": "Hindi",
    "hu": "Hungarian", "id": "Indonesian", "it": "Italian", "ja": "Japanese", "ko": "Korean", "ms": "Malay",
    "nl": "Dutch", "no": "Norwegian", "pl": "Polish", "pt": "Portuguese", "ro": "Romanian", "ru": "Russian",
    "sv": "Swedish", "th": "Thai", "tr": "Turkish", "uk": "Ukrainian", "ur": "Urdu", "vi": "Vietnamese",
    "yue": "Cantonese", "zh": "Chinese",
}


@dataclass
class AudioForm:
    """One request's form, checked: every value has its type and range."""

    data: bytes
    filename: str
    model: str | None = None
    language: str | None = None
    prompt: str | None = None
    response_format: str = "json"
    temperature: float = 0.0  # OpenAI's default for these routes
    stream: bool = False
    max_tokens: int | None = None  # omnistage's: None lets the reply run to the end of the context, as chat does


def _one(form: FormData, name: str) -> Any:
    values = form.getlist(name)
    if len(values) > 1:
        raise RequestError(f"'{name}' was sent {len(values)} times; send it once", name)
    return values[0] if values else None


def _text(form: FormData, name: str) -> str | None:
    value = _one(form, name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise RequestError(f"'{name}' must be a text field, not a file", name)
    return value.strip() or None


def _temperature(text: str | None) -> float:
    if text is None:
        return 0.0
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.0 <= value <= 2.0:  # NaN fails too
        raise RequestError(f"temperature must be a number in [0, 2] (got {text!r})", "temperature")
    return value


def _bool(text: str | None, name: str) -> bool:
    if text is None or text.lower() in _FALSE:
        return False
    if text.lower() in _TRUE:
        return True
    raise RequestError(f"{name} must be true or false (got {text!r})", name)


def _max_tokens(text: str | None) -> int | None:
    if text is None:
        return None
    if not text.isdigit() or int(text) < 1:
        raise RequestError(f"max_tokens must be a whole number of at least 1 (got {text!r})", "max_tokens")
    return int(text)


def _language(text: str | None) -> str | None:
    if text is None:
        return None
    if len(text) > 32 or not all(c.isalpha() or c in "-_ " for c in text):
        raise RequestError(f"language must be a language code such as 'en' (ISO-639-1) or a language name "
                           f"(got {text[:40]!r})", "language")
    return text


def _check_fields(form: FormData) -> None:
    for name in dict.fromkeys(form.keys()):
        base = name.removesuffix("[]").split("[", 1)[0]
        if base in IGNORED:
            log.debug("audio request: ignoring %s=%r (no timestamps or chunking here)", name, form.getlist(name))
        elif name not in FIELDS:
            close = close_match(base, FIELDS)
            hint = f"did you mean '{close}'?" if close else f"the fields are {', '.join(FIELDS)}"
            raise RequestError(f"unknown field '{name}'; {hint}", name)


async def read_form(request: Request, max_bytes: int) -> AudioForm:
    """The multipart form, checked; a file over `max_bytes` is a 413."""
    if not request.headers.get("content-type", "").lower().startswith("multipart/form-data"):
        raise RequestError("send the request as multipart/form-data with the audio in a 'file' field "
                           "(curl -F file=@speech.wav)", "file")
    try:
        form = await request.form(max_files=4, max_fields=64)
    except StarletteHTTPException as exc:  # python-multipart could not parse it
        raise RequestError(f"could not read the multipart form: {exc.detail}", "file") from None
    try:
        _check_fields(form)
        upload = _one(form, "file")
        if upload is None:
            raise RequestError("'file' is required: the audio file to transcribe", "file")
        if not isinstance(upload, UploadFile):
            raise RequestError("'file' must be a file upload (curl -F file=@speech.wav), not a text field", "file")
        if upload.size is not None and upload.size > max_bytes:
            raise too_large("file", max_bytes, upload.size)
        data = await upload.read()
        if len(data) > max_bytes:
            raise too_large("file", max_bytes, len(data))
        response_format = _text(form, "response_format") or "json"
        if response_format not in RESPONSE_FORMATS:
            raise RequestError(f"response_format must be one of {', '.join(RESPONSE_FORMATS)} "
                               f"(got {response_format!r})", "response_format")
        parsed = AudioForm(
            data=data, filename=upload.filename or "", model=_text(form, "model"),
            language=_language(_text(form, "language")), prompt=_text(form, "prompt"),
            response_format=response_format, temperature=_temperature(_text(form, "temperature")),
            stream=_bool(_text(form, "stream"), "stream"), max_tokens=_max_tokens(_text(form, "max_tokens")),
        )
    finally:
        await form.close()
    if parsed.stream and parsed.response_format not in ("json", "text"):
        raise RequestError(f"stream needs response_format json or text; {parsed.response_format} has no streamed "
                           "form", "stream")
    return parsed


def _format_hint(filename: str) -> str | None:
    """The file name's extension as decode_audio's format hint (it sniffs the bytes; "pcm16" alone is raw)."""
    suffix = PurePath(filename).suffix.lower().lstrip(".")
    return suffix or None


# ---------------------------------------------------------------- responses


class TranscriptDelta(BaseModel):
    type: Literal["transcript.text.delta"] = "transcript.text.delta"
    delta: str


class TranscriptDone(BaseModel):
    type: Literal["transcript.text.done"] = "transcript.text.done"
    text: str
    usage: dict[str, Any] | None = None


def _usage(out: OmniOutput) -> dict[str, Any]:
    return {"type": "tokens", "input_tokens": out.num_prompt_tokens, "output_tokens": out.num_output_tokens,
            "total_tokens": out.num_prompt_tokens + out.num_output_tokens}


def _timestamp(seconds: float, separator: str) -> str:
    ms = round(seconds * 1000)
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    secs, ms = divmod(ms, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{separator}{ms:03d}"


def subtitles(text: str, duration: float, fmt: str) -> str:
    """One cue spanning the audio (the model gives no timestamps); srt or vtt."""
    cue = f"{_timestamp(0.0, ',' if fmt == 'srt' else '.')} --> {_timestamp(duration, ',' if fmt == 'srt' else '.')}"
    if fmt == "srt":
        return f"1\n{cue}\n{text.strip()}\n\n"
    return f"WEBVTT\n\n{cue}\n{text.strip()}\n\n"


def _compression_ratio(text: str) -> float:
    """Whisper's: text bytes over zlib-compressed bytes (high: repetitive text, a looping decoder)."""
    raw = text.encode()
    return round(len(raw) / len(zlib.compress(raw)), 4) if raw else 0.0


def verbose(task: str, language: str | None, duration: float, out: OmniOutput, temperature: float) -> dict[str, Any]:
    logprobs = [lp.logprob for lp in out.logprobs or []]
    if language is None:
        spoken = "english" if task == "translate" else "unknown"
    else:
        spoken = LANGUAGES.get(language.lower(), language).lower() if task == "transcribe" else "english"
    segment = {
        "id": 0, "seek": 0, "start": 0.0, "end": round(duration, 3), "text": out.text,
        "tokens": list(out.token_ids), "temperature": temperature,
        "avg_logprob": round(sum(logprobs) / len(logprobs), 6) if logprobs else 0.0,
        "compression_ratio": _compression_ratio(out.text),
        "no_speech_prob": 0.0,  # the model does not estimate it
    }
    return {"task": task, "language": spoken, "duration": round(duration, 3), "text": out.text,
            "segments": [segment], "usage": {"type": "duration", "seconds": math.ceil(duration)}}


async def _stream(fan: Fanout) -> AsyncIterator[BaseModel]:
    merged = OmniOutput(request_id=fan.requests[0].request_id)
    async for _, out in fan.events():
        raise_if_failed(out)
        merged.merge(out)
        if out.text:
            yield TranscriptDelta(delta=out.text)
    yield TranscriptDone(text=merged.text, usage=_usage(merged))


# ---------------------------------------------------------------- the routes


def _params(engine: AsyncOmni, form: AudioForm) -> SamplingParams:
    """The entry stage's deploy defaults under the form's temperature and max_tokens. As on chat, no max_tokens
    lets the reply fill the rest of the context; verbose_json reports the sampled tokens' mean logprob."""
    try:
        params = replace(engine.default_sampling_params().with_overrides(temperature=form.temperature),
                         max_tokens=form.max_tokens, logprobs=0 if form.response_format == "verbose_json" else None)
        params.validate()
    except InvalidParams as exc:
        raise exc.at("") from None
    return params


async def speech_to_text(request: Request, task: str) -> Response:
    # server.py includes this router: its HTTP-edge pieces are imported when a request comes, not at import time
    from omnistage.entrypoints.openai.server import ClientGone, EventStream, unless_disconnected

    engine: AsyncOmni = request.app.state.engine
    pipeline = getattr(engine, "pipeline", None)
    limits = pipeline.deploy.limits if pipeline is not None else None
    form = await read_form(request, limits.max_media_bytes if limits is not None else 20 * 2**20)
    check_model(request.app.state.model_names, form.model)
    if pipeline is None or "audio" not in pipeline.input_modalities:
        raise RequestError("this model does not take audio input; serve a model that hears (e.g. Qwen2.5-Omni)",
                           "model")
    # Admitted before decoding: decoding and the model's preprocessing are the costly part of a refused request.
    release = request.app.state.edge.admit(1)
    fan: Fanout | None = None
    streaming = False
    try:
        audio = await asyncio.to_thread(decode_audio, form.data, SAMPLE_RATE, "file", _format_hint(form.filename),
                                        limits.max_audio_seconds)
        duration = len(audio) / SAMPLE_RATE
        language = LANGUAGES.get(form.language.lower(), form.language) if form.language else None
        omni = OmniRequest(request_id=f"{'trans' if task == 'translate' else 'transcr'}-{uuid.uuid4().hex}",
                           messages=pipeline.transcription_messages(audio, task, language, form.prompt),
                           output_modalities=("text",), stage_params={"*": _params(engine, form)})
        fan = Fanout(engine, [omni])
        await unless_disconnected(request, fan.start())
        if form.stream:
            streaming = True
            return EventStream(_stream(fan), fan, release)
        out = (await unless_disconnected(request, collect(fan)))[0]
    except ClientGone:
        log.info("client left; aborted %s", fan.requests[0].request_id if fan else "(not started)")
        return Response(status_code=499)
    finally:
        if not streaming:
            release()
    if form.response_format == "json":
        return JSONResponse({"text": out.text, "usage": _usage(out)})
    if form.response_format == "text":
        return PlainTextResponse(out.text)
    if form.response_format == "verbose_json":
        return JSONResponse(verbose(task, form.language, duration, out, form.temperature))
    media = "text/vtt" if form.response_format == "vtt" else "text/plain"
    return PlainTextResponse(subtitles(out.text, duration, form.response_format), media_type=media)


@router.post("/v1/audio/transcriptions", response_model=None)
async def transcriptions(request: Request) -> Response:
    """Speech to text in the language spoken."""
    return await speech_to_text(request, "transcribe")


@router.post("/v1/audio/translations", response_model=None)
async def translations(request: Request) -> Response:
    """Speech to English text."""
    return await speech_to_text(request, "translate")
