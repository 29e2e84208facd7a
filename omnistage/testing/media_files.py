"""Real media files for tests, made with soundfile, Pillow and PyAV (tones, pictures, short videos).
Needs the omni extra; test modules import it after `pytest.importorskip` of those packages."""

from __future__ import annotations

import io

import av
import numpy as np
import soundfile as sf
from PIL import Image

__all__ = ["Image", "make_video", "png_bytes", "sf", "sound_file", "tone"]


def tone(freq: float, seconds: float, rate: int, amplitude: float = 0.3) -> np.ndarray:
    t = np.arange(int(round(seconds * rate))) / rate
    return (amplitude * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def sound_file(samples: np.ndarray, rate: int, fmt: str, subtype: str = "PCM_16") -> bytes:
    buffer = io.BytesIO()
    sf.write(buffer, samples, rate, format=fmt, subtype=subtype)
    return buffer.getvalue()


def png_bytes(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def make_video(
    frames: int = 30, fps: int = 10, audio_rate: int | None = 16000, size: tuple[int, int] = (64, 48)
) -> bytes:
    """An MP4 (MPEG-4 video, AAC audio at 440 Hz when audio_rate is set) whose frame i is filled with red = 8 * i."""
    width, height = size
    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4") as container:
        video = container.add_stream("mpeg4", rate=fps)
        video.width, video.height, video.pix_fmt = width, height, "yuv420p"
        audio = None
        if audio_rate:
            audio = container.add_stream("aac", rate=audio_rate)
            audio.layout = "mono"
        for i in range(frames):
            pixels = np.zeros((height, width, 3), np.uint8)
            pixels[..., 0] = 8 * i
            for packet in video.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in video.encode():
            container.mux(packet)
        if audio is not None:
            samples = tone(440, frames / fps, audio_rate)
            for start in range(0, len(samples), 1024):
                frame = av.AudioFrame.from_ndarray(samples[None, start : start + 1024], format="fltp", layout="mono")
                frame.sample_rate, frame.pts = audio_rate, start
                for packet in audio.encode(frame):
                    container.mux(packet)
            for packet in audio.encode():
                container.mux(packet)
    return out.getvalue()
