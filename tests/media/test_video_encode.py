"""mp4 encoding of generated frames (H.264 yuv420p, optional AAC track), checked by decoding the file with PyAV:
frame count, rate, size, codecs, and the pixels within a stated bound. H.264 at crf 18 is lossy (and yuv420p halves
the chroma resolution), so the bound is on smooth content: mean absolute error under 4 of 255, every pixel within
32; crf 0 is tighter. The audio track keeps its length and its tone's pitch."""

from __future__ import annotations

import io

import numpy as np
import pytest

av = pytest.importorskip("av", reason="video encoding needs PyAV (pip install 'omnistage[video]')")

from omnistage.media import decode_video  # noqa: E402
from omnistage.media.video import encode_mp4, write_mp4  # noqa: E402


def smooth_frames(count: int, height: int, width: int) -> np.ndarray:
    """Gradients and a slow wave that move from frame to frame: content a video codec is made for."""
    y, x = np.mgrid[0:height, 0:width]
    frames = [np.stack([40 + x * 2 + t * 4, 30 + y * 3 + t * 2, 128 + 60 * np.sin(x / 9 + t / 3) * np.cos(y / 11)],
                       -1) for t in range(count)]
    return np.stack(frames).clip(0, 255).astype(np.uint8)


def decoded(data: bytes) -> tuple[np.ndarray, av.video.stream.VideoStream, list[str]]:
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(stream)])
        return frames, stream, [s.type for s in container.streams]


@pytest.mark.parametrize("fps", [16, 24])
def test_frames_rate_size_and_pixels(fps: int) -> None:
    frames = smooth_frames(17, 48, 64)
    data = encode_mp4(frames, fps)
    assert data[4:8] == b"ftyp" and data.find(b"moov") < data.find(b"mdat")  # faststart: the index first
    out, stream, kinds = decoded(data)
    assert kinds == ["video"]
    assert stream.codec_context.name == "h264" and stream.codec_context.pix_fmt == "yuv420p"
    assert stream.average_rate == fps and out.shape == frames.shape
    error = np.abs(out.astype(int) - frames)
    assert error.mean() < 4 and error.max() <= 32, (error.mean(), error.max())


def test_crf_0_is_closer() -> None:
    frames = smooth_frames(9, 32, 32)
    lossy = np.abs(decoded(encode_mp4(frames, 8))[0].astype(int) - frames).mean()
    near = np.abs(decoded(encode_mp4(frames, 8, crf=0))[0].astype(int) - frames).mean()
    assert near < lossy and near < 2.5


def test_the_decoder_reads_it_back() -> None:
    """omnistage's own decoder (the video_url path) reads the encoder's file: 33 frames at 16 fps is 2 s."""
    video = decode_video(encode_mp4(smooth_frames(33, 32, 48), 16), fps=16, min_frames=1, frame_multiple=1)
    assert video.frames.shape == (33, 32, 48, 3) and video.duration == pytest.approx(33 / 16, abs=0.07)


def test_odd_sides_are_padded_by_one() -> None:
    frames = smooth_frames(5, 31, 45)
    out, stream, _ = decoded(encode_mp4(frames, 10))
    assert (stream.width, stream.height) == (46, 32) and out.shape == (5, 32, 46, 3)
    assert np.abs(out[:, :31, :45].astype(int) - frames).mean() < 4


def test_fractional_rate() -> None:
    _, stream, _ = decoded(encode_mp4(smooth_frames(5, 16, 16), 24000 / 1001))
    assert float(stream.average_rate) == pytest.approx(23.976, abs=1e-3)


@pytest.mark.parametrize(("rate", "channels", "stored_rate"), [(16000, 1, 16000), (44100, 2, 44100),
                                                               (22000, 1, 48000)])
def test_audio_track(rate: int, channels: int, stored_rate: int) -> None:
    """A mono or stereo track (a rate AAC does not take is resampled to 48 kHz): its length and pitch survive."""
    seconds = 2.0
    t = np.arange(int(rate * seconds)) / rate
    tone = (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    audio = tone if channels == 1 else np.stack([tone, tone])
    data = encode_mp4(smooth_frames(33, 32, 32), 16, audio, rate)
    with av.open(io.BytesIO(data)) as container:
        assert [s.type for s in container.streams] == ["video", "audio"]
        track = container.streams.audio[0]
        assert track.codec_context.name == "aac" and track.rate == stored_rate and track.channels == channels
        samples = np.concatenate([f.to_ndarray()[0] for f in container.decode(track)])
    # the encoder's priming samples and last frame's padding: a few AAC frames at most
    assert abs(len(samples) - seconds * stored_rate) < 3 * 1024
    spectrum = np.abs(np.fft.rfft(samples[4096:4096 + stored_rate]))
    assert np.argmax(spectrum) == pytest.approx(440, abs=2)  # 1 s window: bins are 1 Hz


def test_write_mp4_to_a_path(tmp_path) -> None:
    path = tmp_path / "clip.mp4"
    write_mp4(path, smooth_frames(3, 16, 16), 8)
    assert decoded(path.read_bytes())[0].shape == (3, 16, 16, 3)


@pytest.mark.parametrize(("frames", "fps", "audio", "words"), [
    (np.zeros((0, 16, 16, 3), np.uint8), 8, None, "F >= 1"),
    (np.zeros((2, 16, 16, 3), np.float32), 8, None, "uint8"),
    (np.zeros((2, 16, 16), np.uint8), 8, None, "[F, H, W, 3]"),
    (np.zeros((2, 16, 16, 3), np.uint8), 0, None, "fps"),
    (np.zeros((2, 16, 16, 3), np.uint8), 8, np.zeros((3, 100), np.float32), "channels"),
])
def test_bad_input(frames, fps, audio, words) -> None:
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        encode_mp4(frames, fps, audio, 16000)
