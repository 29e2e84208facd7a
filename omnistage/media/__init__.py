"""Media for multimodal requests: OpenAI message parts -> what HF processors take, and audio out -> bytes.

    image_url    {"image_url": {"url": URL | data URL | base64}}          -> RGB PIL image
    input_audio  {"input_audio": {"data": base64, "format": "wav"|...}}  -> mono float32 numpy at `audio_rate`
    audio_url    {"audio_url": {"url": ...}}                             -> same
    video_url    {"video_url": {"url": ...}}                             -> Video (frames, fps, audio track if asked)

Limits (MediaLimits, from the deploy config's `limits`) are checked before decoding, from the bytes' size and
the format's header (pixels, frames, seconds), and again while decoding where a header can lie: 413 naming the
part and the limit. URLs are fetched under a RemotePolicy (the deploy config's `media`; see `remote`); anything
that cannot be fetched or decoded is a 400 naming the part. AsyncOmni fetches a request's URLs on its event loop
(`prefetch`) before admission, which then only decodes. Decoders: Pillow, soundfile + soxr, PyAV
(`pip install 'omnistage[omni]'`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from omnistage.errors import RequestError
from omnistage.media.audio import decode_audio, encodable_formats, encode_audio, resample
from omnistage.media.image import DEFAULT_MAX_PIXELS, decode_image
from omnistage.media.remote import RemotePolicy, fetch, read_local
from omnistage.media.source import MediaBudget, MediaBytes, bad_media, inline_source, is_url, too_large
from omnistage.media.video import DEFAULT_MAX_VIDEO_PIXELS, Video, decode_video

if TYPE_CHECKING:
    from omnistage.config.deploy import LimitsConfig

__all__ = [
    "MediaBudget", "MediaBytes", "MediaItem", "MediaLimits", "RemotePolicy", "Video", "aload_part",
    "check_part_count", "decode_audio", "decode_image", "decode_video", "encodable_formats", "encode_audio",
    "has_media", "load_part", "load_source", "media_parts", "prefetch", "resample",
]

MEDIA_PART_TYPES = ("image_url", "input_audio", "audio_url", "video_url")


@dataclass
class MediaLimits:
    """What one request's media may amount to; the defaults are LimitsConfig's."""

    max_bytes: int = 20 * 2**20  # one item, encoded (max_media_bytes)
    max_parts: int = 16  # media parts in a request (max_media_parts)
    max_total_bytes: int = 64 * 2**20  # all items of a request, encoded (max_media_total_bytes)
    max_pixels: int = DEFAULT_MAX_PIXELS  # one image or video frame (max_image_pixels)
    max_video_pixels: int = DEFAULT_MAX_VIDEO_PIXELS  # the frames sampled from one video, summed
    max_audio_seconds: float | None = 600.0
    max_video_seconds: float | None = 600.0

    @classmethod
    def from_config(cls, limits: LimitsConfig) -> MediaLimits:
        return cls(limits.max_media_bytes, limits.max_media_parts, limits.max_media_total_bytes,
                   limits.max_image_pixels, limits.max_video_pixels, limits.max_audio_seconds,
                   limits.max_video_seconds)


@dataclass
class MediaItem:
    kind: str  # "image" | "audio" | "video"
    value: Any  # PIL image | float32 numpy | Video


@dataclass
class _Source:
    kind: str
    source: str | MediaBytes
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
    if not isinstance(url, MediaBytes) and (not isinstance(url, str) or not url):  # MediaBytes: fetched already
        raise bad_media(name, f"{kind} needs {{'url': <http(s) URL, data URL or base64>}}")
    return _Source({"image_url": "image", "audio_url": "audio", "video_url": "video"}[kind], url)


def media_parts(messages: list[dict[str, Any]] | None) -> Iterator[tuple[str, int, int, dict[str, Any]]]:
    """(name, message index, part index, part) of every OpenAI media part in `messages`."""
    for i, message in enumerate(messages or []):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            for j, part in enumerate(content):
                if isinstance(part, dict) and part.get("type") in MEDIA_PART_TYPES:
                    yield f"messages[{i}].content[{j}]", i, j, part


def has_media(messages: list[dict[str, Any]] | None) -> bool:
    return next(media_parts(messages), None) is not None


def check_part_count(messages: list[dict[str, Any]] | None, limits: MediaLimits) -> None:
    """More than `limits.max_parts` media parts is a 413 naming the first part over the limit."""
    for count, (name, *_) in enumerate(media_parts(messages), 1):
        if count > limits.max_parts:
            raise RequestError(f"{name}: the request has more than the limit of {limits.max_parts} media parts "
                               "(limits.max_media_parts)", name, status=413)


def load_source(source: str | MediaBytes, part: str, limits: MediaLimits, policy: RemotePolicy | None = None,
                budget: MediaBudget | None = None) -> MediaBytes:
    """Bytes of `source`: fetched already (MediaBytes), inline (data URL, base64) or a URL under `policy` (fetched
    on an event loop of its own: call this from a worker thread)."""
    policy = policy or RemotePolicy()
    if isinstance(source, str) and source.startswith("file://"):
        media = read_local(source, part, limits.max_bytes, policy)
    elif isinstance(source, str) and is_url(source):
        return asyncio.run(fetch(source, part, limits.max_bytes, policy, budget))  # spends the budget as it reads
    else:
        media = _inline(source, part, limits)
    if budget is not None:
        budget.spend(len(media.data), part)
    return media


async def aload_source(source: str | MediaBytes, part: str, limits: MediaLimits,
                       policy: RemotePolicy | None = None, budget: MediaBudget | None = None) -> MediaBytes:
    """`load_source` for an event loop: URLs are fetched on it (cancelled with the caller), files read in a thread."""
    policy = policy or RemotePolicy()
    if isinstance(source, str) and source.startswith("file://"):
        media = await asyncio.to_thread(read_local, source, part, limits.max_bytes, policy)
    elif isinstance(source, str) and is_url(source):
        return await fetch(source, part, limits.max_bytes, policy, budget)
    else:
        media = _inline(source, part, limits)
    if budget is not None:
        budget.spend(len(media.data), part)
    return media


def _inline(source: str | MediaBytes, part: str, limits: MediaLimits) -> MediaBytes:
    if isinstance(source, MediaBytes):
        if len(source.data) > limits.max_bytes:
            raise too_large(part, limits.max_bytes, len(source.data))
        return source
    if not isinstance(source, str) or not source:
        raise bad_media(part, "media source must be a non-empty string (URL, data URL or base64)")
    return inline_source(source, part, limits.max_bytes)


async def prefetch(messages: list[dict[str, Any]] | None, limits: MediaLimits, policy: RemotePolicy
                   ) -> list[dict[str, Any]] | None:
    """`messages` with each URL media part's URL replaced by its bytes (MediaBytes), all fetched concurrently under
    `policy` and the request's byte budget; None when no part has a URL. Too many parts is a 413 before any fetch;
    the first failure cancels the other fetches, and so does cancelling the caller."""
    check_part_count(messages, limits)
    urls = {(i, j): (name, src) for name, i, j, part in media_parts(messages)
            if isinstance((src := _source_of(part, name)).source, str) and is_url(src.source)}
    if not urls:
        return None
    budget = MediaBudget(limits.max_total_bytes)
    tasks = {key: asyncio.ensure_future(aload_source(src.source, name, limits, policy, budget))
             for key, (name, src) in urls.items()}
    try:
        await asyncio.gather(*tasks.values())
    finally:
        for task in tasks.values():
            task.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)  # their connections closed before we go on
    out = [dict(m) for m in messages or []]
    for (i, j), task in tasks.items():
        content = out[i]["content"] = list(out[i]["content"])
        kind = content[j]["type"]
        body = content[j][kind]
        fetched = task.result()
        content[j] = {**content[j], kind: {**body, "url": fetched} if isinstance(body, dict) else {"url": fetched}}
    return out


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
        max_pixels=limits.max_pixels, max_seconds=limits.max_video_seconds, max_video_pixels=limits.max_video_pixels,
    ))


def load_part(
    part: dict[str, Any],
    name: str = "content",
    limits: MediaLimits | None = None,
    *,
    policy: RemotePolicy | None = None,
    budget: MediaBudget | None = None,
    audio_rate: int = 16000,
    video_fps: float = 2.0,
    use_audio_in_video: bool = False,
) -> MediaItem:
    """Get (fetch if a URL, under `policy`: by default any public host) and decode one OpenAI media part. `name`
    is how errors name it, e.g. "messages[0].content[1]"; `budget` counts the request's bytes. Audio (and a
    video's audio track, with `use_audio_in_video`) comes back at `audio_rate`; video frames are sampled at about
    `video_fps` per second."""
    limits = limits or MediaLimits()
    src = _source_of(part, name)
    media = load_source(src.source, name, limits, policy, budget)
    return _decode(src, media, name, limits, audio_rate, video_fps, use_audio_in_video)


async def aload_part(
    part: dict[str, Any],
    name: str = "content",
    limits: MediaLimits | None = None,
    *,
    policy: RemotePolicy | None = None,
    budget: MediaBudget | None = None,
    audio_rate: int = 16000,
    video_fps: float = 2.0,
    use_audio_in_video: bool = False,
) -> MediaItem:
    """`load_part` for an event loop: URLs are fetched without blocking it, decoding runs in a thread."""
    limits = limits or MediaLimits()
    src = _source_of(part, name)
    media = await aload_source(src.source, name, limits, policy, budget)
    return await asyncio.to_thread(_decode, src, media, name, limits, audio_rate, video_fps, use_audio_in_video)
