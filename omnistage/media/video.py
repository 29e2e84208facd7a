"""Video: encoded bytes -> evenly sampled RGB frames, and the audio track when asked; and generated frames (plus
an optional audio track) -> an mp4 (H.264 yuv420p, AAC). PyAV / FFmpeg."""

from __future__ import annotations

import io
import tempfile
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from omnistage.errors import RequestError
from omnistage.media.audio import decode_audio_track, resample, stream_seconds, too_long
from omnistage.media.image import DEFAULT_MAX_PIXELS
from omnistage.media.source import bad_media, over_limit

DEFAULT_MAX_VIDEO_PIXELS = 128 * 2**20  # LimitsConfig.max_video_pixels
# The sample rates FFmpeg's AAC encoder takes; audio at another rate is resampled to 48 kHz first.
AAC_RATES = (7350, 8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000, 64000, 88200, 96000)


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


def _big_frame(part: str, width: int, height: int, limit: int) -> RequestError:
    return over_limit(part, f"the video's frames have {width}x{height} pixels, more than the limit of {limit}",
                      "max_image_pixels")


def _many_pixels(part: str, frames: int, width: int, height: int, limit: int) -> RequestError:
    return over_limit(part, f"the video's {frames} sampled frames of {width}x{height} are more than the limit of "
                      f"{limit} pixels", "max_video_pixels")


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
    max_video_pixels: int = DEFAULT_MAX_VIDEO_PIXELS,
) -> Video:
    """Sample frames evenly at about `fps` per second (Qwen2.5-Omni's default is 2; the count is kept a multiple of
    `frame_multiple`, its temporal patch). With `with_audio`, also decode the audio track to mono float32 at
    `audio_rate` (a video without one is a 400). Frames larger than `max_pixels`, sampled frames of more than
    `max_video_pixels` in all, or a video longer than `max_seconds` are a 413, told from the headers and the
    demuxed packets before any frame is decoded; undecodable data is a 400."""
    import av

    try:
        with _open(data, part) as container:  # pass 1: count frames by demuxing only (no decoding)
            if not container.streams.video:
                raise bad_media(part, "could not decode the video: the file has no video stream")
            stream = container.streams.video[0]
            width, height = stream.codec_context.width, stream.codec_context.height
            if width * height > max_pixels:
                raise _big_frame(part, width, height, max_pixels)
            header_seconds = stream_seconds(stream, container)
            if max_seconds is not None and header_seconds is not None and header_seconds > max_seconds:
                raise too_long(part, header_seconds, max_seconds, "video")
            total = sum(1 for packet in container.demux(stream) if packet.size)
            duration = header_seconds or (total / float(stream.average_rate) if stream.average_rate else 0.0)
        if total == 0:
            raise bad_media(part, "could not decode the video: it has no frames")
        if max_seconds is not None and duration > max_seconds:
            raise too_long(part, duration, max_seconds, "video")
        wanted = _frame_indices(total, duration, fps, min_frames, max_frames, frame_multiple)
        if len(wanted) * width * height > max_video_pixels:
            raise _many_pixels(part, len(wanted), width, height, max_video_pixels)
        keep = set(wanted)
        frames: list[np.ndarray] = []
        kept_pixels = 0
        with _open(data, part) as container:  # pass 2: decode, keeping the wanted frames
            for index, frame in enumerate(container.decode(container.streams.video[0])):
                if frame.width * frame.height > max_pixels:  # the header may not have told
                    raise _big_frame(part, frame.width, frame.height, max_pixels)
                if index in keep:
                    kept_pixels += frame.width * frame.height
                    if kept_pixels > max_video_pixels:
                        raise _many_pixels(part, len(wanted), frame.width, frame.height, max_video_pixels)
                    frames.append(frame.to_ndarray(format="rgb24"))
                if index >= wanted[-1]:
                    break
        if not frames:
            raise bad_media(part, "could not decode the video: no frame decoded")
        audio = None
        if with_audio:
            with _open(data, part) as container:
                track = decode_audio_track(container, part, max_seconds, "video")
            if track is None or track[0].size == 0 or track[1] <= 0:
                raise bad_media(part, "the video has no audio track, but its audio was requested (use_audio_in_video)")
            audio = resample(track[0], track[1], audio_rate)
    except RequestError:
        raise
    except (av.error.FFmpegError, ValueError, OSError) as exc:
        raise bad_media(part, f"could not decode the video: {exc}") from None
    sampled_fps = len(frames) / duration if duration > 0 else fps
    return Video(np.stack(frames), sampled_fps, duration, audio, audio_rate if with_audio else None)


def encode_mp4(frames: np.ndarray, fps: float, audio: np.ndarray | None = None, sample_rate: int | None = None,
               **options: Any) -> bytes:
    """`write_mp4`'s file as bytes."""
    with tempfile.TemporaryDirectory(prefix="omnistage-mp4-") as tmp:
        path = Path(tmp) / "video.mp4"
        write_mp4(path, frames, fps, audio, sample_rate, **options)
        return path.read_bytes()


def write_mp4(path: str | Path, frames: np.ndarray, fps: float, audio: np.ndarray | None = None,
              sample_rate: int | None = None, *, crf: int = 18, preset: str = "medium") -> None:
    """uint8 RGB `frames` [F, H, W, 3] at `fps` -> an mp4 at `path`: H.264 (libx264, yuv420p, constant quality
    `crf`: 0 is lossless in luma, 18 visually lossless, 23 x264's default) with its index up front (`faststart`:
    players start before the whole file has arrived; FFmpeg rewrites the file for it, so this takes a path, not a
    stream). yuv420p needs even sides: an odd width or height gets one more column or row, a copy of the last.
    `audio` (float32 in [-1, 1], mono [n] or [channels, n] with 1-2 channels, at `sample_rate`) becomes an AAC
    track."""
    import av

    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8 or not len(frames):
        raise ValueError(f"frames must be uint8 [F, H, W, 3] with F >= 1 (got {frames.dtype} {frames.shape})")
    if not fps > 0:
        raise ValueError(f"fps must be positive (got {fps})")
    pad = ((0, 0), (0, frames.shape[1] % 2), (0, frames.shape[2] % 2), (0, 0))
    if any(p for _, p in pad):
        frames = np.pad(frames, pad, mode="edge")
    rate = Fraction(fps).limit_denominator(1001)
    with av.open(str(path), mode="w", format="mp4", options={"movflags": "+faststart"}) as container:
        video = container.add_stream("libx264", rate=rate)
        video.width, video.height, video.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        video.options = {"crf": str(crf), "preset": preset}
        sound = None
        if audio is not None:
            samples, sample_rate = _audio_planes(audio, sample_rate)
            sound = container.add_stream("aac", rate=sample_rate)
            sound.layout = "stereo" if samples.shape[0] == 2 else "mono"
        for i, rgb in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
            frame.pts = i
            container.mux(video.encode(frame))
        container.mux(video.encode())
        if sound is not None:
            frame = av.AudioFrame.from_ndarray(samples, format="fltp", layout=sound.layout.name)
            frame.sample_rate, frame.pts = sample_rate, 0
            container.mux(sound.encode(frame))  # the encoder cuts it into AAC frames
            container.mux(sound.encode())


def _audio_planes(audio: np.ndarray, sample_rate: int | None) -> tuple[np.ndarray, int]:
    """`audio` as float32 planes [channels, n] at a rate AAC takes."""
    from omnistage.media.audio import resample

    samples = np.asarray(audio, dtype=np.float32)
    samples = samples[None] if samples.ndim == 1 else samples
    if samples.ndim != 2 or samples.shape[0] not in (1, 2) or not samples.shape[1]:
        raise ValueError(f"audio must be [n] or [channels, n] with 1 or 2 channels (got {samples.shape})")
    if not sample_rate or sample_rate <= 0:
        raise ValueError(f"audio needs its positive sample_rate (got {sample_rate})")
    if sample_rate not in AAC_RATES:
        samples, sample_rate = np.stack([resample(c, sample_rate, 48000) for c in samples]), 48000
    return np.ascontiguousarray(np.clip(samples, -1, 1)), sample_rate


def video_thumbnail(path: str | Path, fmt: str = "webp") -> bytes:
    """The first frame of the video at `path` as an image file (WebP, as OpenAI's videos API serves thumbnails)."""
    import av

    with av.open(str(path)) as container:
        image = next(container.decode(video=0)).to_image()
    buffer = io.BytesIO()
    image.save(buffer, format=fmt.upper())
    return buffer.getvalue()
