"""OpenAI's text-to-speech route, `POST /v1/audio/speech`, plus vLLM-Omni's Qwen3-TTS fields.

A JSON body becomes one OmniRequest for a TTS pipeline (one whose outputs are audio and that has `speakers`): the
input text as the prompt, the voice/instructions/language/task_type/reference audio as request options (the
contract in docs/families/qwen3_tts.md), `max_new_tokens`/`seed` as the talker's sampling params. The reply is the
whole file in `response_format`, or a stream: `stream_format` "sse" (OpenAI's `speech.audio.delta` / `.done` events,
base64 pcm16 or a wav-headed first piece) or "audio" (raw chunked pcm16, or wav with a header of unknown length).
Usage goes in response headers (USAGE_HEADERS). docs/audio_api.md describes the route for users.
"""

from __future__ import annotations

import asyncio
import base64
import json
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from omnistage.entrypoints.openai.serving import (
    Fanout,
    Release,
    check_model,
    raise_if_failed,
    run_admitted,
    streaming_wav_header,
)
from omnistage.entrypoints.openai.voices import router as voices_router
from omnistage.entrypoints.openai.voices import store_of
from omnistage.errors import RequestError
from omnistage.media import MediaLimits, RemotePolicy, aload_source, decode_audio, encodable_formats, encode_audio
from omnistage.media.audio import resample
from omnistage.sampling_params import InvalidParams, SamplingParams
from omnistage.types import OmniOutput, OmniRequest

if TYPE_CHECKING:
    from omnistage.entrypoints.async_omni import AsyncOmni

__all__ = ["USAGE_HEADERS", "SpeechRequest", "router", "tts_pipeline"]

router = APIRouter()
router.include_router(voices_router)  # the voices routes come with speech (server.py includes this router)

RESPONSE_FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")
STREAM_FORMATS = ("sse", "audio")
STREAMABLE = ("pcm", "wav")  # formats whose bytes can go out as the audio is made
MEDIA_TYPES = {"mp3": "audio/mpeg", "opus": "audio/ogg", "aac": "audio/aac", "flac": "audio/flac",
               "wav": "audio/wav", "pcm": "audio/pcm"}
SUBTALKER = ("subtalker_dosample", "subtalker_temperature", "subtalker_top_k", "subtalker_top_p")
TASK_TYPES = {"CustomVoice": "custom_voice", "VoiceDesign": "voice_design", "Base": "base"}
# The usage of a whole (non-streamed) reply, in response headers (a streamed reply's comes in its done event).
USAGE_HEADERS = {"input_characters": "X-Usage-Input-Characters", "input_tokens": "X-Usage-Input-Tokens",
                 "output_frames": "X-Usage-Output-Frames", "audio_seconds": "X-Usage-Audio-Seconds"}


class SpeechRequest(BaseModel):
    """The body. Unknown fields are ignored (OpenAI clients send ones of their own); `extra_body` sent literally
    is merged first, so its fields count as top-level ones."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    model: str | None = None
    input: str
    voice: str | None = Field(None, alias="voice")
    instructions: str | None = None
    response_format: str | None = None
    speed: float = 1.0
    sample_rate: int | None = Field(None, ge=8000, le=192000)
    stream: bool = False
    stream_format: Literal["sse", "audio"] | None = None
    task_type: Literal["CustomVoice", "VoiceDesign", "Base"] | None = None
    language: str | None = None
    ref_audio: str | None = None
    ref_text: str | None = None
    x_vector_only_mode: bool = False
    max_new_tokens: int | None = Field(None, ge=1)
    seed: int | None = None
    # the code predictor's sampling (the family's options; default: the checkpoint's generation config)
    subtalker_dosample: bool | None = None
    subtalker_temperature: float | None = Field(None, ge=0)
    subtalker_top_k: int | None = Field(None, ge=0)
    subtalker_top_p: float | None = Field(None, gt=0, le=1)

    @model_validator(mode="before")
    @classmethod
    def _merge(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        extra = data.pop("extra_body", None)
        if isinstance(extra, dict):
            data = {**data, **extra}
        if data.get("voice") is None and isinstance(data.get("speaker"), str):
            data["voice"] = data["speaker"]  # vLLM-Omni's alias
        return data

    @model_validator(mode="after")
    def _check(self) -> SpeechRequest:
        if not 0.25 <= self.speed <= 4.0:
            raise ValueError(f"speed must be in [0.25, 4.0] (got {self.speed:g})")
        return self


def _parse(raw: bytes) -> SpeechRequest:
    try:
        data = json.loads(raw or b"null")
    except ValueError as exc:
        raise RequestError(f"request body is not valid JSON ({exc}); send a JSON object") from None
    if not isinstance(data, dict):
        raise RequestError("request body must be a JSON object with at least 'input'")
    try:
        return SpeechRequest.model_validate(data)
    except ValidationError as exc:
        from omnistage.entrypoints.openai.server import validation_message

        message, param = validation_message(exc.errors())
        raise RequestError(message, param) from None


def tts_pipeline(engine: AsyncOmni | None) -> Any:
    """The engine's pipeline if it is a TTS family (audio out, a `speakers` method); else a 400 naming the kind."""
    pipeline = getattr(engine, "pipeline", None)
    outputs = tuple(getattr(engine, "output_modalities", ()) or ())
    if pipeline is None or "audio" not in outputs or not (hasattr(pipeline, "speakers")
                                                          or hasattr(pipeline, "clone_features")
                                                          or hasattr(pipeline, "talker_config")):
        kind = type(pipeline).__name__ if pipeline is not None else "unknown"
        raise RequestError(f"this model ({kind}, outputs {list(outputs)}) is not a text-to-speech model; "
                           "serve one (e.g. Qwen3-TTS) for /v1/audio/speech", "model")
    return pipeline


def speakers_of(pipeline: Any) -> list[str]:
    if hasattr(pipeline, "speakers"):
        return list(pipeline.speakers())
    if pipeline.config.get("tts_model_type") != "custom_voice":
        return []
    return list(pipeline.talker_config.get("spk_id", {}))


def tts_kind(pipeline: Any) -> str:
    return getattr(pipeline, "tts_kind", None) or pipeline.config.get("tts_model_type", "")


def can_clone(pipeline: Any) -> bool:
    return bool(getattr(pipeline, "can_clone", False))


def _voice(pipeline: Any, voices: Any, name: str | None) -> tuple[dict[str, Any], list[str]]:
    """Options for `voice`: a checkpoint speaker (case-insensitive), or an uploaded voice's features."""
    if name is None:
        return {}, []
    speakers = speakers_of(pipeline)
    match = next((s for s in speakers if s.lower() == name.lower()), None)
    if match is not None:
        return {"voice": match}, []
    uploaded = voices.get(name) if voices is not None else None
    if uploaded is not None:
        return {"voice_features": uploaded.features, "ref_text": uploaded.ref_text}, []
    names = speakers + (voices.names() if voices is not None else [])
    listed = ", ".join(names) if names else "none (this model takes no named voice)"
    raise RequestError(f"unknown voice {name!r}; this model's voices: {listed}", "voice")


def _response_format(body: SpeechRequest) -> str:
    fmt = (body.response_format or ("mp3" if "mp3" in encodable_formats() else "wav")).lower().strip()
    available = [f for f in RESPONSE_FORMATS if f in _available()]
    if fmt not in available:
        raise RequestError(f"response_format {fmt!r} is not supported here; use one of: {', '.join(available)}",
                           "response_format")
    if body.stream and fmt not in STREAMABLE:
        raise RequestError(f"stream: true needs response_format pcm or wav ({fmt} cannot be streamed); send "
                           "response_format 'pcm' or 'wav', or stream: false", "stream")
    return fmt


def _available() -> set[str]:
    have = set(encodable_formats())
    out = {f for f in ("mp3", "opus", "flac", "wav") if f in have} | ({"pcm"} if "pcm16" in have else set())
    if _aac_encodable():
        out.add("aac")
    return out


def _aac_encodable() -> bool:
    try:
        import av

        return "aac" in av.codecs_available
    except ImportError:
        return False


def _encode(samples: np.ndarray, rate: int, fmt: str) -> bytes:
    if fmt == "pcm":
        return encode_audio(samples, rate, "pcm16")
    if fmt == "aac":
        return _encode_aac(samples, rate)
    return encode_audio(samples, rate, fmt)


def _encode_aac(samples: np.ndarray, rate: int) -> bytes:
    """ADTS AAC through PyAV (libsndfile has no AAC)."""
    import io

    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="adts") as out:
        stream = out.add_stream("aac", rate=rate, layout="mono")
        frame = av.AudioFrame.from_ndarray(np.clip(samples, -1, 1).astype(np.float32)[None], format="flt",
                                           layout="mono")
        frame.sample_rate = rate
        for packet in stream.encode(frame):
            out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()


def change_tempo(samples: np.ndarray, rate: int, speed: float) -> np.ndarray:
    """`samples` played `speed` times as fast at the same pitch: FFmpeg's atempo (each stage takes 0.5-2, so a
    chain of them reaches 0.25-4)."""
    if abs(speed - 1.0) < 1e-6 or samples.size == 0:
        return samples
    import av
    from av.filter import Graph

    factors, left = [], speed
    while left > 2.0:
        factors.append(2.0)
        left /= 2.0
    while left < 0.5:
        factors.append(0.5)
        left /= 0.5
    factors.append(left)
    graph = Graph()
    src = graph.add_abuffer(format="flt", sample_rate=rate, layout="mono", time_base=f"1/{rate}")
    nodes = [src, *(graph.add("atempo", f"{f:.6f}") for f in factors), graph.add("abuffersink")]
    for a, b in zip(nodes, nodes[1:], strict=False):
        a.link_to(b)
    graph.configure()
    frame = av.AudioFrame.from_ndarray(samples.astype(np.float32)[None], format="flt", layout="mono")
    frame.sample_rate, frame.pts = rate, 0
    graph.push(frame)
    graph.push(None)
    pieces = []
    while True:
        try:
            pieces.append(graph.pull().to_ndarray().reshape(-1))
        except (av.BlockingIOError, av.EOFError):
            break
    return np.concatenate(pieces).astype(np.float32) if pieces else samples[:0]


async def _ref_audio(engine: AsyncOmni, source: str, limits: Any, rate: int) -> np.ndarray:
    """Reference audio from a data URL, raw base64, a local path (under the media policy's allowed_local_path) or
    an http(s) URL, decoded to mono float32 at `rate` within the media limits."""
    deploy = engine.pipeline.deploy
    policy = getattr(engine, "media_policy", None) or RemotePolicy.from_config(deploy.media)
    if source.startswith("/"):
        source = f"file://{source}"
    media = await aload_source(source, "ref_audio", MediaLimits.from_config(limits), policy)
    return await asyncio.to_thread(decode_audio, media.data, rate, "ref_audio", None, limits.max_audio_seconds)


def _talker_params(engine: AsyncOmni, body: SpeechRequest) -> dict[str, SamplingParams]:
    if body.max_new_tokens is None and body.seed is None:
        return {}
    pipeline = engine.pipeline
    base = pipeline.stage_config("talker").sampling_params()
    overrides: dict[str, Any] = {}
    if body.max_new_tokens is not None:
        overrides["max_tokens"] = body.max_new_tokens
    if body.seed is not None:
        overrides["seed"] = body.seed
    try:
        params = base.with_overrides(**overrides)
        params.validate()
    except InvalidParams as exc:
        raise exc.at("") from None
    return {"talker": params}


async def speech_request(engine: AsyncOmni, body: SpeechRequest, voices: Any, rid: str) -> OmniRequest:
    """Check the body against the model and build its OmniRequest; every failure is a 4xx before work is queued."""
    pipeline = tts_pipeline(engine)
    limits = pipeline.deploy.limits
    if not body.input.strip():
        raise RequestError("'input' is empty; send the text to speak", "input")
    if len(body.input) > limits.max_speech_input_chars:
        raise RequestError(f"'input' has {len(body.input)} characters, over this server's limit of "
                           f"{limits.max_speech_input_chars}; send shorter text", "input")
    kind = tts_kind(pipeline)
    if body.task_type is not None and TASK_TYPES[body.task_type] != kind:
        does = {v: k for k, v in TASK_TYPES.items()}.get(kind, kind)
        raise RequestError(f"task_type {body.task_type} does not fit this model: it is a {does} model; send "
                           f"task_type {does!r} or leave it out", "task_type")
    options: dict[str, Any] = {"stream_audio": body.stream}
    voice_options, _ = _voice(pipeline, voices, body.voice)
    options.update(voice_options)
    if body.instructions:
        options["instruct"] = body.instructions
    if body.language:
        options["language"] = body.language
    if body.task_type:
        options["task_type"] = body.task_type
    options.update({k: getattr(body, k) for k in SUBTALKER if getattr(body, k) is not None})
    if body.ref_audio is not None:
        if not can_clone(pipeline):
            raise RequestError("this model does not clone voices: ref_audio needs a Qwen3-TTS Base checkpoint; "
                               "leave ref_audio out or pick one of its voices", "ref_audio")
        options["ref_audio"] = await _ref_audio(engine, body.ref_audio, limits, pipeline.audio_sample_rate)
        options["x_vector_only_mode"] = body.x_vector_only_mode
    if body.ref_text is not None:
        options["ref_text"] = body.ref_text
    return OmniRequest(request_id=rid, prompt=body.input, output_modalities=("audio",),
                       stage_params=_talker_params(engine, body), options=options)


# ---------------------------------------------------------------- responses


def samples_per_frame(pipeline: Any) -> int:
    """Model-rate samples per codec frame (speech_tokenizer/config.json's decode_upsample_rate); 0 if unknown."""
    try:
        config = json.loads((pipeline.model_path / "speech_tokenizer" / "config.json").read_text(encoding="utf-8"))
        return int(config.get("decode_upsample_rate", 0))
    except (OSError, ValueError, TypeError, AttributeError):
        return 0


def _usage(body: SpeechRequest, out: OmniOutput, model_samples: int, samples: int, rate: int,
           per_frame: int) -> dict[str, Any]:
    """`model_samples` at the model's rate (before tempo/resampling) count the frames: the final (codec) stage's
    output reports no token counts of the talker."""
    frames = out.num_output_tokens or (model_samples // per_frame if per_frame else 0)
    return {"input_characters": len(body.input), "input_tokens": out.num_prompt_tokens, "output_frames": frames,
            "audio_seconds": round(samples / rate, 3) if rate else 0.0}


def _headers(usage: dict[str, Any]) -> dict[str, str]:
    return {USAGE_HEADERS[k]: str(v) for k, v in usage.items()}


def _post(samples: np.ndarray, rate: int, body: SpeechRequest) -> tuple[np.ndarray, int]:
    """Tempo first (at the model's rate), then the requested rate."""
    samples = change_tempo(samples, rate, body.speed)
    if body.sample_rate and body.sample_rate != rate:
        samples, rate = resample(samples, rate, body.sample_rate).astype(np.float32), body.sample_rate
    return samples, rate


async def _stream(fan: Fanout, body: SpeechRequest, fmt: str, rate: int) -> AsyncIterator[bytes]:
    """Audio pieces as pcm16 bytes (a wav header first for wav). Tempo and resampling apply per piece, each a
    whole utterance segment, so their edges may differ slightly from the one-shot file's."""
    out_rate = body.sample_rate or rate
    yield streaming_wav_header(out_rate) if fmt == "wav" else b""
    merged = OmniOutput(request_id=fan.requests[0].request_id)
    async for _, out in fan.events():
        raise_if_failed(out)
        merged.merge(out)
        if out.audio is not None and out.audio.size:
            piece, _ = _post(np.asarray(out.audio, dtype=np.float32).reshape(-1), out.sample_rate or rate, body)
            yield encode_audio(piece, out_rate, "pcm16")
    fan.usage = merged  # type: ignore[attr-defined]  # for the done event


async def _sse(fan: Fanout, body: SpeechRequest, fmt: str, rate: int) -> AsyncIterator[str]:
    total = 0
    try:
        async for data in _stream(fan, body, fmt, rate):
            if data:
                total += len(data) - (44 if data[:4] == b"RIFF" else 0)
                event = {"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()}
                yield f"data: {json.dumps(event)}\n\n"
        merged = getattr(fan, "usage", OmniOutput(fan.requests[0].request_id))
        model_samples = 0 if merged.audio is None else int(np.asarray(merged.audio).size)
        usage = _usage(body, merged, model_samples, total // 2, body.sample_rate or rate,
                       samples_per_frame(fan.engine.pipeline))
        yield f"data: {json.dumps({'type': 'speech.audio.done', 'usage': usage})}\n\n"
    except Exception as exc:  # headers already sent
        from omnistage.entrypoints.openai.server import _sse_error

        yield _sse_error(exc)


class _Stream(StreamingResponse):
    """A streamed reply that closes (aborts) its generation and releases its admission however it ends."""

    def __init__(self, content: AsyncIterator[Any], media_type: str, fan: Fanout, release: Release) -> None:
        super().__init__(content, media_type=media_type, headers={"Cache-Control": "no-cache",
                                                                  "X-Accel-Buffering": "no"})
        self.fan, self.release = fan, release

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.fan.aclose()
            self.release()


@router.post("/v1/audio/speech", response_model=None)
async def speech(request: Request) -> Response:
    """Text to speech: the whole file, or a stream of pcm16/wav audio (raw or as SSE events)."""
    engine: AsyncOmni = request.app.state.engine
    body = _parse(await request.body())
    check_model(request.app.state.model_names, body.model)
    pipeline = tts_pipeline(engine)
    fmt = _response_format(body)
    rid = f"speech-{uuid.uuid4().hex}"
    omni = await speech_request(engine, body, store_of(request.app), rid)
    rate = pipeline.audio_sample_rate

    def stream(fan: Fanout, release: Release) -> Response:
        if (body.stream_format or "audio") == "sse":
            return _Stream(_sse(fan, body, fmt, rate), "text/event-stream", fan, release)
        return _Stream(_stream(fan, body, fmt, rate), MEDIA_TYPES[fmt], fan, release)

    outputs = await run_admitted(request, [omni], stream if body.stream else None)
    if isinstance(outputs, Response):
        return outputs
    out = outputs[0]
    model_audio = np.zeros(0, np.float32) if out.audio is None else np.asarray(out.audio, np.float32).reshape(-1)
    samples, out_rate = await asyncio.to_thread(_post, model_audio, out.sample_rate or rate, body)
    data = await asyncio.to_thread(_encode, samples, out_rate, fmt)
    usage = _usage(body, out, model_audio.size, samples.size, out_rate, samples_per_frame(pipeline))
    return Response(data, media_type=MEDIA_TYPES[fmt], headers=_headers(usage))
