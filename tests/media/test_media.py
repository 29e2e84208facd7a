"""Decoding OpenAI media parts (data URLs, base64, http URLs from a local server) into images, audio and video,
limits and errors, and encoding audio. Every file is real: made in the test with soundfile, Pillow and PyAV."""

from __future__ import annotations

import base64
import io
import sys

import numpy as np
import pytest

for _module in ("soundfile", "soxr", "av", "PIL"):
    pytest.importorskip(_module, reason="media tests need the omni extra (pip install 'omnistage[omni]')")

from omnistage.errors import RequestError  # noqa: E402
from omnistage.media import (  # noqa: E402
    MediaLimits,
    RemotePolicy,
    aload_part,
    decode_audio,
    encodable_formats,
    encode_audio,
    load_part,
)
from omnistage.testing.media_files import Image, make_video, png_bytes, sf, sound_file, tone  # noqa: E402

# The test server is on 127.0.0.1, which the default policy refuses.
LOCAL = RemotePolicy(allow_internal=frozenset({"127.0.0.1"}))


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def audio_part(data: bytes, fmt: str = "wav") -> dict:
    return {"type": "input_audio", "input_audio": {"data": b64(data), "format": fmt}}


@pytest.fixture(scope="module")
def picture():
    pixels = (np.random.RandomState(0).rand(24, 32, 3) * 255).astype(np.uint8)
    return Image.fromarray(pixels)


@pytest.fixture(scope="module")
def stereo_wav() -> tuple[bytes, np.ndarray]:
    samples = np.stack([tone(440, 1.0, 44100), tone(660, 1.0, 44100, 0.2)], axis=1)
    return sound_file(samples, 44100, "WAV"), samples


@pytest.fixture(scope="module")
def video_with_audio() -> bytes:
    return make_video(frames=30, fps=10, audio_rate=16000)


def test_image_from_data_url_base64_and_http(picture, media_server) -> None:
    data = png_bytes(picture)
    media_server.files["pic.png"] = data
    expected = np.asarray(picture)
    for source in (f"data:image/png;base64,{b64(data)}", b64(data), media_server.url("files/pic.png"),
                   media_server.url("stream/pic.png")):
        item = load_part(image_part(source), "messages[0].content[0]", policy=LOCAL)
        assert item.kind == "image" and item.value.mode == "RGB"
        assert np.array_equal(np.asarray(item.value), expected)
    # The bare-string form some clients send.
    assert load_part({"type": "image_url", "image_url": b64(data)}).value.size == picture.size


def test_transparent_image_lands_on_white() -> None:
    rgba = Image.new("RGBA", (4, 4), (0, 0, 0, 0))
    rgba.putpixel((0, 0), (10, 20, 30, 255))
    image = load_part(image_part(b64(png_bytes(rgba)))).value
    assert image.mode == "RGB" and image.getpixel((0, 0)) == (10, 20, 30) and image.getpixel((3, 3)) == (255,) * 3


def test_image_errors_name_the_part(picture) -> None:
    with pytest.raises(RequestError) as err:
        load_part(image_part(b64(b"this is not an image")), "messages[1].content[2]")
    assert err.value.status == 400 and "messages[1].content[2]" in err.value.message and "image" in err.value.message
    with pytest.raises(RequestError) as err:
        load_part(image_part("data:image/png;base64,@@@not-base64@@@"), "p")
    assert err.value.status == 400 and "base64" in err.value.message
    data = png_bytes(picture)
    with pytest.raises(RequestError) as err:
        load_part(image_part(b64(data)), "p", MediaLimits(max_bytes=len(data) - 1))
    assert err.value.status == 413
    with pytest.raises(RequestError) as err:
        load_part(image_part(b64(data)), "p", MediaLimits(max_pixels=32 * 24 - 1))
    assert err.value.status == 413
    with pytest.raises(RequestError) as err:
        load_part({"type": "image_url", "image_url": {}}, "p")
    assert err.value.status == 400 and "url" in err.value.message
    with pytest.raises(RequestError) as err:
        load_part({"type": "file", "file": {}}, "p")
    assert err.value.status == 400 and "image_url" in err.value.message


def test_audio_equals_hf_loader(stereo_wav, tmp_path) -> None:
    """Downmix + soxr resampling give exactly the samples transformers' own loader feeds its feature extractors."""
    audio_utils = pytest.importorskip("transformers.audio_utils")
    data, samples = stereo_wav
    flac = sound_file(samples, 44100, "FLAC")
    for name, raw in (("a.wav", data), ("a.flac", flac)):
        (tmp_path / name).write_bytes(raw)
        ours = load_part(audio_part(raw, name.split(".")[1]), "p", audio_rate=16000).value
        reference = audio_utils.load_audio(str(tmp_path / name), sampling_rate=16000, backend="soundfile")
        assert ours.dtype == np.float32 and ours.shape == (16000,)
        np.testing.assert_array_equal(ours, reference)


def test_audio_sources_and_rates(stereo_wav, media_server) -> None:
    data, samples = stereo_wav
    media_server.files["a.wav"] = data
    mono = samples.mean(axis=1)
    at_source = load_part(audio_part(data), audio_rate=44100).value
    np.testing.assert_allclose(at_source, mono, atol=1 / 32768)  # 16-bit quantisation only
    by_url = load_part({"type": "audio_url", "audio_url": {"url": media_server.url("files/a.wav")}}, audio_rate=24000,
                       policy=LOCAL)
    assert by_url.kind == "audio" and by_url.value.shape == (24000,)
    data_url = load_part({"type": "audio_url", "audio_url": {"url": f"data:audio/wav;base64,{b64(data)}"}})
    assert data_url.value.shape == (16000,)
    pcm = (tone(440, 0.5, 24000) * 32767).astype("<i2").tobytes()
    raw = load_part(audio_part(pcm, "pcm16"), audio_rate=24000).value
    np.testing.assert_allclose(raw, tone(440, 0.5, 24000), atol=1e-4)


def test_audio_errors(stereo_wav) -> None:
    data, _ = stereo_wav
    with pytest.raises(RequestError) as err:
        load_part(audio_part(b"RIFF....WAVEgarbage"), "messages[0].content[1]")
    assert err.value.status == 400 and "messages[0].content[1]" in err.value.message and "audio" in err.value.message
    with pytest.raises(RequestError) as err:
        load_part(audio_part(data), "p", MediaLimits(max_bytes=1024))
    assert err.value.status == 413 and "1024" in err.value.message
    with pytest.raises(RequestError) as err:
        load_part(audio_part(data), "p", MediaLimits(max_audio_seconds=0.5))
    assert err.value.status == 413
    with pytest.raises(RequestError) as err:
        load_part({"type": "input_audio", "input_audio": {"format": "wav"}}, "p")
    assert err.value.status == 400 and "data" in err.value.message
    with pytest.raises(RequestError) as err:
        decode_audio(b"\x00" * 3, 16000, "p", "pcm16")
    assert err.value.status == 400


def test_encode_audio_round_trips() -> None:
    samples = tone(440, 1.0, 24000)
    assert set(encodable_formats()) >= {"wav", "flac", "pcm16"}
    for fmt in ("wav", "flac"):
        decoded, rate = sf.read(io.BytesIO(encode_audio(samples, 24000, fmt)), dtype="float32")
        assert rate == 24000
        np.testing.assert_allclose(decoded, samples, atol=1 / 32767)
    pcm = np.frombuffer(encode_audio(samples, 24000, "pcm16"), dtype="<i2")
    np.testing.assert_array_equal(pcm, np.round(samples * 32767).astype(np.int16))
    clipped = np.frombuffer(encode_audio(np.array([2.0, -2.0], np.float32), 24000, "pcm16"), dtype="<i2")
    assert clipped.tolist() == [32767, -32767]
    for fmt in ("mp3", "opus"):  # lossy: decode again and compare the tone's shape, not the samples
        if fmt not in encodable_formats():
            continue
        decoded = decode_audio(encode_audio(samples, 24000, fmt), 24000, "p", fmt)
        assert abs(len(decoded) - len(samples)) < 0.1 * len(samples)
        n = min(len(decoded), len(samples))
        best = max(abs(np.corrcoef(decoded[s : n], samples[: n - s])[0, 1]) for s in range(0, 2000, 1))
        assert best > 0.9, (fmt, best)
    with pytest.raises(RequestError) as err:
        encode_audio(samples, 24000, "aac")
    assert err.value.status == 400 and "wav" in err.value.message


def test_streamed_speech_needs_no_soundfile(monkeypatch) -> None:
    """Streamed audio is pcm16, which numpy writes: a server without soundfile (the base install) still streams
    speech, and asking it for a container format is a 400 naming what works."""
    monkeypatch.setitem(sys.modules, "soundfile", None)  # `import soundfile` now raises ImportError
    samples = tone(440, 0.1, 24000)
    assert encodable_formats() == ("pcm16",)
    pcm = np.frombuffer(encode_audio(samples, 24000, "pcm16"), dtype="<i2")
    np.testing.assert_array_equal(pcm, np.round(samples * 32767).astype(np.int16))
    with pytest.raises(RequestError) as err:
        encode_audio(samples, 24000, "wav")
    assert err.value.status == 400 and "use one of: pcm16" in err.value.message


def test_video_frames_and_audio_track(video_with_audio, media_server) -> None:
    media_server.files["v.mp4"] = video_with_audio
    item = load_part({"type": "video_url", "video_url": {"url": media_server.url("files/v.mp4")}}, "p",
                     use_audio_in_video=True, audio_rate=16000, policy=LOCAL)
    video = item.value
    assert item.kind == "video"
    assert video.frames.dtype == np.uint8 and video.frames.shape == (6, 48, 64, 3)  # 3 s at 2 frames per second
    assert abs(video.duration - 3.0) < 0.15 and abs(video.fps - 2.0) < 0.1
    reds = video.frames[:, 24, 32, 0].astype(int)
    assert (np.diff(reds) > 0).all() and reds[0] < 16 and reds[-1] > 8 * 25  # evenly spread, first to last
    assert video.audio_rate == 16000 and abs(len(video.audio) - 48000) < 2048
    segment = video.audio[4000:20000]
    assert abs(np.argmax(np.abs(np.fft.rfft(segment))) * 16000 / len(segment) - 440) < 5  # the tone survived AAC
    silent_ok = load_part({"type": "video_url", "video_url": {"url": f"data:video/mp4;base64,{b64(video_with_audio)}"}})
    assert silent_ok.value.audio is None and silent_ok.value.frames.shape[0] == 6


def test_video_errors() -> None:
    mute = make_video(frames=8, fps=4, audio_rate=None)
    part = {"type": "video_url", "video_url": {"url": b64(mute)}}
    assert load_part(part).value.frames.shape[0] == 4  # 2 s at 2 fps
    with pytest.raises(RequestError) as err:
        load_part(part, "messages[0].content[0]", use_audio_in_video=True)
    assert err.value.status == 400 and "audio track" in err.value.message
    assert "messages[0].content[0]" in err.value.message
    with pytest.raises(RequestError) as err:
        load_part({"type": "video_url", "video_url": {"url": b64(b"\x00\x01 not a video" * 50)}}, "p")
    assert err.value.status == 400 and "video" in err.value.message
    with pytest.raises(RequestError) as err:
        load_part(part, "p", MediaLimits(max_video_seconds=1.0))
    assert err.value.status == 413
    with pytest.raises(RequestError) as err:
        load_part(part, "p", MediaLimits(max_pixels=100))
    assert err.value.status == 413


def test_url_limits_and_failures(media_server, stereo_wav) -> None:
    data, _ = stereo_wav
    media_server.files["big.wav"] = data
    limits = MediaLimits(max_bytes=10_000)
    for path in ("files/big.wav", "stream/big.wav"):  # announced length, and streamed without one
        with pytest.raises(RequestError) as err:
            load_part({"type": "audio_url", "audio_url": {"url": media_server.url(path)}}, "p", limits, policy=LOCAL)
        assert err.value.status == 413
    with pytest.raises(RequestError) as err:  # the status stays in the log: the client learns nothing of the target
        load_part(image_part(media_server.url("files/missing.png")), "p", policy=LOCAL)
    assert err.value.status == 400 and err.value.message == "could not fetch the media at p"
    with pytest.raises(RequestError) as err:
        load_part(image_part(media_server.url("slow/x")), "p", policy=RemotePolicy(fetch_timeout_s=0.3,
                                                                                    allow_internal=LOCAL.allow_internal))
    assert err.value.status == 400 and err.value.message == "could not fetch the media at p"
    with pytest.raises(RequestError) as err:
        load_part(image_part("ftp://example.com/a.png"), "p")
    assert err.value.status == 400 and "http" in err.value.message
    with pytest.raises(RequestError) as err:
        load_part(image_part("file:///etc/passwd"), "p")
    assert err.value.status == 403 and "local media files" in err.value.message


async def test_async_load(media_server, picture, stereo_wav) -> None:
    media_server.files["pic2.png"] = png_bytes(picture)
    item = await aload_part(image_part(media_server.url("stream/pic2.png")), "p", policy=LOCAL)
    assert np.array_equal(np.asarray(item.value), np.asarray(picture))
    audio = await aload_part(audio_part(stereo_wav[0]), "p")
    assert audio.value.shape == (16000,)
    with pytest.raises(RequestError) as err:
        await aload_part(image_part(media_server.url("stream/pic2.png")), "p", MediaLimits(max_bytes=100), policy=LOCAL)
    assert err.value.status == 413
