"""Video: encoded bytes -> evenly sampled RGB frames, and the audio track when asked (PyAV / FFmpeg)."""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np

from omnistage.errors import RequestError
from omnistage.media.audio import decode_audio_track, resample
from omnistage.media.image import DEFAULT_MAX_PIXELS
from omnistage.media.source import bad_media, too_large


@dataclass
class Video:
    frames: np.ndarray  # [T, H, W, 3] uint8, RGB
    fps: float  # rate of the sampled frames: what the processor's `fps` should be told
    duration: float  # seconds
    audio: np.ndarray | None = None  # mono float32 at `audio_rate`, when asked for
    audio_rate: int | None = None


def _open(data: bytes, part: str):
    import av

    try:
        return av.open(io.BytesIO(data), mode="r")
    except (av.error.FFmpegError, ValueError, OSError) as exc:
        raise bad_media(part, f"could not decode the video: {exc}") from None


def _frame_indices(
    total: int, duration: float, fps: float, min_frames: int, max_frames: int, multiple: int
) -> list[int]:
    """`n` evenly spaced frame indices: n ~ duration * fps, within [min_frames, max_frames], a multiple of
    `multiple`, and never more frames than the video has."""
    n = round(duration * fps) if duration > 0 else total
    n = min(max(n, min_frames), max_frames, total)
    if n >= multiple:
        n -= n % multiple
    n = max(n, 1)
    return sorted(set(np.linspace(0, total - 1, n).round().astype(int).tolist())) if n > 1 else [0]


def decode_video(
    data: bytes,
    part: str = "video",
    *,
    fps: float = 2.0,
    min_frames: int = 4,
    max_frames: int = 768,
    frame_multiple: int = 2,
    with_audio: bool = False,
    audio_rate: int = 16000,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    max_seconds: float | None = None,
) -> Video:
    """Sample frames evenly at about `fps` per second (Qwen2.5-Omni's default is 2; the count is kept a multiple of
    `frame_multiple`, its temporal patch). With `with_audio`, also decode the audio track to mono float32 at
    `audio_rate` (a video without one is a 400). Frames larger than `max_pixels` or a video longer than
    `max_seconds` are a 413; undecodable data is a 400."""
    import av

    try:
        with _open(data, part) as container:  # pass 1: count frames by demuxing only (no decoding)
            if not container.streams.video:
                raise bad_media(part, "could not decode the video: the file has no video stream")
            stream = container.streams.video[0]
            width, height = stream.codec_context.width, stream.codec_context.height
            if width * height > max_pixels:
                raise too_large(part, max_pixels)
            total = sum(1 for packet in container.demux(stream) if packet.size)
            duration = 0.0
            if stream.duration is not None and stream.time_base is not None:
                duration = float(stream.duration * stream.time_base)
            elif container.duration is not None:
                duration = container.duration / av.time_base
            elif stream.average_rate:
                duration = total / float(stream.average_rate)
        if total == 0:
            raise bad_media(part, "could not decode the video: it has no frames")
        if max_seconds is not None and duration > max_seconds:
            raise RequestError(
                f"{part}: video is longer than the limit of {max_seconds:g} s ({duration:.1f} s)", part, status=413
            )
        wanted = _frame_indices(total, duration, fps, min_frames, max_frames, frame_multiple)
        keep = set(wanted)
        frames: list[np.ndarray] = []
        with _open(data, part) as container:  # pass 2: decode, keeping the wanted frames
            for index, frame in enumerate(container.decode(container.streams.video[0])):
                if frame.width * frame.height > max_pixels:  # the header may not have told
                    raise too_large(part, max_pixels)
                if index in keep:
                    frames.append(frame.to_ndarray(format="rgb24"))
                if index >= wanted[-1]:
                    break
        if not frames:
            raise bad_media(part, "could not decode the video: no frame decoded")
        audio = None
        if with_audio:
            with _open(data, part) as container:
                track = decode_audio_track(container)
            if track is None or track[0].size == 0 or track[1] <= 0:
                raise bad_media(part, "the video has no audio track, but its audio was requested (use_audio_in_video)")
            audio = resample(track[0], track[1], audio_rate)
    except RequestError:
        raise
    except (av.error.FFmpegError, ValueError, OSError) as exc:
        raise bad_media(part, f"could not decode the video: {exc}") from None
    sampled_fps = len(frames) / duration if duration > 0 else fps
    return Video(np.stack(frames), sampled_fps, duration, audio, audio_rate if with_audio else None)
