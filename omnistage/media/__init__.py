"""Media for multimodal requests: OpenAI message parts -> what HF processors take, and audio out -> bytes.

    image_url    {"image_url": {"url": URL | data URL | base64}}          -> RGB PIL image
    input_audio  {"input_audio": {"data": base64, "format": "wav"|...}}  -> mono float32 numpy at `audio_rate`
    audio_url    {"audio_url": {"url": ...}}                             -> same
    video_url    {"video_url": {"url": ...}}                             -> Video (frames, fps, audio track if asked)

Sizes are checked against the caller's MediaLimits (413 when exceeded, before decoding); anything that cannot be
fetched or decoded is a 400 naming the part. Decoders: Pillow, soundfile + soxr, PyAV (`pip install
'omnistage[omni]'`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from omnistage.media.audio import decode_audio, encodable_formats, encode_audio, resample
from omnistage.media.image import DEFAULT_MAX_PIXELS, decode_image
from omnistage.media.source import DEFAULT_TIMEOUT_S, MediaBytes, aload_source, bad_media, load_source
from omnistage.media.video import Video, decode_video

__all__ = [
    "MediaItem", "MediaLimits", "Video", "aload_part", "decode_audio", "decode_image", "decode_video",
    "encodable_formats", "encode_audio", "load_part", "load_source", "resample",
]

MEDIA_PART_TYPES = ("image_url", "input_audio", "audio_url", "video_url")


@dataclass
class MediaLimits:
    max_bytes: int = 20 * 2**20  # encoded size of one item (DeployConfig.limits.max_media_bytes)
    timeout_s: float = DEFAULT_TIMEOUT_S  # fetching one URL
    max_pixels: int = DEFAULT_MAX_PIXELS  # one image or video frame
    max_audio_seconds: float | None = None
    max_video_seconds: float | None = None


@dataclass
class MediaItem:
    kind: str  # "image" | "audio" | "video"
    value: Any  # PIL image | float32 numpy | Video


@dataclass
class _Source:
    kind: str
    source: str
    fmt: str | None = None


def _source_of(part: dict[str, Any], name: str) -> _Source:
    if not isinstance(part, dict):
        raise bad_media(name, "a content part must be an object")
    kind = part.get("type")
    if kind not in MEDIA_PART_TYPES:
        raise bad_media(name, f"unknown media part type {kind!r}; expected one of {', '.join(MEDIA_PART_TYPES)}")
    body = part.get(kind)
    if kind == "input_audio":
        if not isinstance(body, dict) or not isinstance(body.get("data"), str) or not body["data"]:
            raise bad_media(name, "input_audio needs {'data': <base64>, 'format': <wav|mp3|...>}")
        return _Source("audio", body["data"], body.get("format"))
    url = body.get("url") if isinstance(body, dict) else body
    if not isinstance(url, str) or not url:
        raise bad_media(name, f"{kind} needs {{'url': <http(s) URL, data URL or base64>}}")
    return _Source({"image_url": "image", "audio_url": "audio", "video_url": "video"}[kind], url)


def _decode(
    src: _Source, media: MediaBytes, name: str, limits: MediaLimits, audio_rate: int, video_fps: float,
    use_audio_in_video: bool,
) -> MediaItem:
    if src.kind == "image":
        return MediaItem("image", decode_image(media.data, name, limits.max_pixels))
    if src.kind == "audio":
        fmt = src.fmt or (media.mime.split("/")[-1] if media.mime else None)
        return MediaItem("audio", decode_audio(media.data, audio_rate, name, fmt, limits.max_audio_seconds))
    return MediaItem("video", decode_video(
        media.data, name, fps=video_fps, with_audio=use_audio_in_video, audio_rate=audio_rate,
        max_pixels=limits.max_pixels, max_seconds=limits.max_video_seconds,
    ))


def load_part(
    part: dict[str, Any],
    name: str = "content",
    limits: MediaLimits | None = None,
    *,
    audio_rate: int = 16000,
    video_fps: float = 2.0,
    use_audio_in_video: bool = False,
) -> MediaItem:
    """Fetch (if a URL) and decode one OpenAI media part. `name` is how errors name it, e.g.
    "messages[0].content[1]". Audio (and a video's audio track, with `use_audio_in_video`) comes back at
    `audio_rate`; video frames are sampled at about `video_fps` per second."""
    limits = limits or MediaLimits()
    src = _source_of(part, name)
    media = load_source(src.source, name, limits.max_bytes, limits.timeout_s)
    return _decode(src, media, name, limits, audio_rate, video_fps, use_audio_in_video)


async def aload_part(
    part: dict[str, Any],
    name: str = "content",
    limits: MediaLimits | None = None,
    *,
    audio_rate: int = 16000,
    video_fps: float = 2.0,
    use_audio_in_video: bool = False,
) -> MediaItem:
    """`load_part` for an event loop: URLs are fetched without blocking it, decoding runs in a thread."""
    limits = limits or MediaLimits()
    src = _source_of(part, name)
    media = await aload_source(src.source, name, limits.max_bytes, limits.timeout_s)
    return await asyncio.to_thread(_decode, src, media, name, limits, audio_rate, video_fps, use_audio_in_video)
