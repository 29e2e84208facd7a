"""Media limits hold before decoding: a small file that would expand hugely is a 413 naming the part and the limit,
told from its header, without the decoder allocating the pixels, frames or samples. Real files, made here."""

from __future__ import annotations

import base64
import io
import tracemalloc

import numpy as np
import pytest

for _module in ("soundfile", "soxr", "av", "PIL"):
    pytest.importorskip(_module, reason="media tests need the omni extra (pip install 'omnistage[omni]')")

from omnistage.config.deploy import load_deploy_config  # noqa: E402
from omnistage.errors import ConfigError, RequestError  # noqa: E402
from omnistage.media import MediaBudget, MediaLimits, decode_audio, decode_video, load_part, prefetch  # noqa: E402
from omnistage.media.remote import RemotePolicy  # noqa: E402
from omnistage.testing.media_files import Image, av, make_video, sound_file, tone  # noqa: E402

PART = "messages[0].content[1]"


def b64_part(kind: str, data: bytes) -> dict:
    return {"type": kind, kind: {"url": base64.b64encode(data).decode()}}


def too_large(limit_field: str, call) -> RequestError:
    with pytest.raises(RequestError) as err:
        call()
    assert err.value.status == 413 and PART in err.value.message and f"limits.{limit_field}" in err.value.message
    return err.value


def peak_allocated(call) -> int:
    """Peak bytes numpy (and Python) allocate during `call` (numpy reports its buffers to tracemalloc)."""
    tracemalloc.start()
    try:
        with pytest.raises(RequestError):
            call()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_huge_png_is_refused_before_decoding(monkeypatch) -> None:
    buffer = io.BytesIO()
    Image.new("1", (8192, 8192)).save(buffer, format="PNG")  # 64 Mpx in a few KB
    data = buffer.getvalue()
    assert len(data) < 100_000

    from PIL import ImageFile

    def never(self):
        raise AssertionError("the pixels were decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", never)
    err = too_large("max_image_pixels", lambda: load_part(b64_part("image_url", data), PART))
    assert "8192x8192" in err.message
    small = io.BytesIO()
    Image.new("RGB", (40, 30)).save(small, format="PNG")
    too_large("max_image_pixels", lambda: load_part(b64_part("image_url", small.getvalue()), PART,
                                                    MediaLimits(max_pixels=40 * 30 - 1)))


def test_many_frame_video_is_refused_before_decoding() -> None:
    """100 s at 2 sampled frames per second of 256x256: 13 Mpx of frames; refused from the demuxed packets."""
    data = _long_video(frames=200, fps=2, size=256)
    limits = MediaLimits(max_video_pixels=4 * 2**20)
    err = too_large("max_video_pixels", lambda: load_part(b64_part("video_url", data), PART, limits))
    assert "200 sampled frames of 256x256" in err.message
    # nothing like the frames (200 x 196 KB) was allocated
    assert peak_allocated(lambda: decode_video(data, PART, max_video_pixels=4 * 2**20)) < 8 * 2**20
    video = decode_video(data, PART, max_video_pixels=14 * 2**20)
    assert video.frames.shape == (200, 256, 256, 3)
    too_large("max_video_seconds", lambda: decode_video(data, PART, max_seconds=60.0))
    too_large("max_image_pixels", lambda: decode_video(data, PART, max_pixels=256 * 256 - 1))


def test_long_audio_is_refused_before_decoding() -> None:
    samples = tone(440, 60.0, 16000)  # 60 s: 3.8 MB once decoded to float32
    wav = sound_file(samples, 16000, "WAV")
    err = too_large("max_audio_seconds", lambda: decode_audio(wav, 16000, PART, "wav", max_seconds=10.0))
    assert "60.0 s" in err.message
    assert peak_allocated(lambda: decode_audio(wav, 16000, PART, "wav", max_seconds=10.0)) < 2**20
    assert decode_audio(wav, 16000, PART, "wav", max_seconds=60.0).shape == (960000,)
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}}
    too_large("max_audio_seconds", lambda: load_part(part, PART, MediaLimits(max_audio_seconds=30)))
    pcm = (samples * 32767).astype("<i2").tobytes()  # headerless pcm16 at 24 kHz: 40 s
    too_large("max_audio_seconds", lambda: decode_audio(pcm, 16000, PART, "pcm16", max_seconds=30.0))
    aac = _aac(tone(440, 20.0, 16000), 16000)  # a container libsndfile cannot read: FFmpeg's headers tell
    too_large("max_audio_seconds", lambda: decode_audio(aac, 16000, PART, "mp4", max_seconds=5.0))
    assert abs(len(decode_audio(aac, 16000, PART, "mp4", max_seconds=30.0)) - 320000) < 4096


def _long_video(frames: int, fps: int, size: int) -> bytes:
    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        for i in range(frames):
            pixels = np.full((size, size, 3), i % 256, np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue()


def _aac(samples: np.ndarray, rate: int) -> bytes:
    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4") as container:
        stream = container.add_stream("aac", rate=rate)
        stream.layout = "mono"
        for start in range(0, len(samples), 1024):
            frame = av.AudioFrame.from_ndarray(samples[None, start : start + 1024], format="fltp", layout="mono")
            frame.sample_rate, frame.pts = rate, start
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue()


def test_video_with_its_audio_track_keeps_the_video_limit() -> None:
    data = make_video(frames=30, fps=10, audio_rate=16000)  # 3 s
    part = b64_part("video_url", data)
    too_large("max_video_seconds", lambda: load_part(part, PART, MediaLimits(max_video_seconds=2.0),
                                                     use_audio_in_video=True))
    assert load_part(part, PART, MediaLimits(max_video_seconds=5.0), use_audio_in_video=True).value.audio is not None


async def test_too_many_parts_and_bytes_per_request() -> None:
    png = io.BytesIO()
    Image.new("RGB", (2, 2)).save(png, format="PNG")
    parts = [b64_part("image_url", png.getvalue()) for _ in range(5)]
    messages = [{"role": "user", "content": [{"type": "text", "text": "x"}, *parts]}]
    with pytest.raises(RequestError) as err:
        await prefetch(messages, MediaLimits(max_parts=4), RemotePolicy())
    assert err.value.status == 413 and "messages[0].content[5]" in err.value.message
    assert "limits.max_media_parts" in err.value.message
    assert await prefetch(messages, MediaLimits(max_parts=5), RemotePolicy()) is None  # nothing to fetch
    budget = MediaBudget(3 * len(png.getvalue()))
    for j in range(3):
        load_part(parts[j], f"messages[0].content[{j + 1}]", budget=budget)
    with pytest.raises(RequestError) as err:
        load_part(parts[3], "messages[0].content[4]", budget=budget)
    assert err.value.status == 413 and "messages[0].content[4]" in err.value.message
    assert "limits.max_media_total_bytes" in err.value.message


def test_limits_come_from_the_deploy_config() -> None:
    deploy = load_deploy_config({"limits": {"max_image_pixels": 100, "max_media_parts": 2, "max_video_pixels": 5000,
                                            "max_audio_seconds": 1.5, "max_video_seconds": 2.5,
                                            "max_media_total_bytes": 4096}})
    assert MediaLimits.from_config(deploy.limits) == MediaLimits(
        max_bytes=20 * 2**20, max_parts=2, max_total_bytes=4096, max_pixels=100, max_video_pixels=5000,
        max_audio_seconds=1.5, max_video_seconds=2.5)
    for bad in ({"max_image_pixels": 0}, {"max_media_parts": -1}, {"max_audio_seconds": 0},
                {"max_media_total_bytes": 10}, {"max_video_frames": 3}):
        with pytest.raises(ConfigError, match="limits"):
            load_deploy_config({"limits": bad})
