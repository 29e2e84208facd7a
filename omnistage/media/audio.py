"""Audio: encoded bytes -> mono float32 samples at a requested rate, and samples -> encoded bytes.

Decoding follows the steps of `librosa.load` (and transformers' `load_audio` with its soundfile backend):
libsndfile decodes (WAV, FLAC, MP3, OGG/Vorbis/Opus, AIFF, ...), channels are averaged, soxr resamples at
"HQ" quality and the result has exactly ceil(n * rate / source_rate) samples. So the samples equal what HF's
own loader feeds its feature extractors. Containers libsndfile cannot read (MP4/M4A/AAC, WebM, ...) are
decoded with PyAV (FFmpeg) and then take the same downmix and resampling.

Samples to encode are float32 [samples] (mono) or time-major [samples, channels] (e.g. stereo), so that a clip's
pieces concatenate along axis 0 whatever its channels.
"""

from __future__ import annotations

import io
import math
from typing import Any

import numpy as np

from omnistage.errors import RequestError
from omnistage.media.source import bad_media, over_limit

ENCODE_FORMATS = ("wav", "flac", "mp3", "opus", "pcm16")
PCM16_INPUT_RATE = 24000  # raw "pcm16" input carries no header: 16-bit little-endian mono at this rate (as OpenAI)
_OPUS_RATES = (8000, 12000, 16000, 24000, 48000)


def resample(samples: np.ndarray, source_rate: int, rate: int) -> np.ndarray:
    """Float32 `samples` ([n] mono or [n, channels]) from `source_rate` to `rate` (soxr HQ), exactly
    ceil(n * rate / source_rate) long."""
    samples = np.ascontiguousarray(samples, dtype=np.float32)
    if source_rate == rate:
        return samples
    import soxr

    length = math.ceil(samples.shape[0] * rate / source_rate)
    out = soxr.resample(samples, source_rate, rate, quality="soxr_hq")
    pad = [(0, max(0, length - len(out)))] + [(0, 0)] * (out.ndim - 1)
    return np.ascontiguousarray(np.pad(out, pad)[:length], dtype=np.float32)


def _downmix(samples: np.ndarray) -> np.ndarray:
    """[channels, n] -> [n] by averaging channels."""
    return samples.mean(axis=0) if samples.shape[0] > 1 else samples[0]


def too_long(part: str, seconds: float, limit: float, what: str = "audio") -> RequestError:
    return over_limit(part, f"the {what} is {seconds:.1f} s long, more than the limit of {limit:g} s",
                      f"max_{what}_seconds")


def _decode_soundfile(data: bytes, part: str, max_seconds: float | None) -> tuple[np.ndarray, int]:
    import soundfile as sf

    with sf.SoundFile(io.BytesIO(data)) as f:
        rate = f.samplerate
        frames = -1
        if max_seconds is not None and rate > 0:
            if f.frames / rate > max_seconds:  # the header's length: refused before decoding
                raise too_long(part, f.frames / rate, max_seconds)
            frames = int(max_seconds * rate) + 1  # and never more decoded than the limit, whatever the header said
        samples = f.read(frames, dtype="float32", always_2d=True).T
    if frames > 0 and samples.shape[-1] >= frames:
        raise too_long(part, samples.shape[-1] / rate, max_seconds)
    return _downmix(samples), rate


def stream_seconds(stream: Any, container: Any) -> float | None:
    """A PyAV stream's length from the container's headers, when they tell."""
    import av

    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return container.duration / av.time_base
    return None


def decode_audio_track(container: Any, part: str = "audio", max_seconds: float | None = None,
                       what: str = "audio") -> tuple[np.ndarray, int] | None:
    """The first audio stream of an open PyAV container as (mono float32, source rate); None if it has none.
    Longer than `max_seconds` (by the headers, else while decoding) is a 413."""
    import av

    if not container.streams.audio:
        return None
    stream = container.streams.audio[0]
    seconds = stream_seconds(stream, container)
    if max_seconds is not None and seconds is not None and seconds > max_seconds:
        raise too_long(part, seconds, max_seconds, what)
    resampler = av.AudioResampler(format="fltp")  # planar float, source layout and rate
    chunks: list[np.ndarray] = []
    rate = stream.codec_context.sample_rate or 0
    decoded = 0
    for frame in container.decode(stream):
        rate = frame.sample_rate or rate
        decoded += frame.samples
        if max_seconds is not None and rate and decoded / rate > max_seconds:
            raise too_long(part, decoded / rate, max_seconds, what)
        chunks.extend(out.to_ndarray() for out in resampler.resample(frame))
    chunks.extend(out.to_ndarray() for out in resampler.resample(None))
    if not chunks:
        return np.zeros(0, dtype=np.float32), int(rate)
    return _downmix(np.concatenate(chunks, axis=1).astype(np.float32, copy=False)), int(rate)


def _decode_pyav(data: bytes, part: str, max_seconds: float | None) -> tuple[np.ndarray, int]:
    import av

    with av.open(io.BytesIO(data), mode="r") as container:
        track = decode_audio_track(container, part, max_seconds)
    if track is None:
        raise bad_media(part, "could not decode the audio: the file has no audio stream")
    return track


def decode_audio(
    data: bytes,
    sample_rate: int,
    part: str = "audio",
    fmt: str | None = None,
    max_seconds: float | None = None,
) -> np.ndarray:
    """Decode `data` to mono float32 at `sample_rate`. `fmt` is the client's format hint ("wav", "mp3", ...);
    "pcm16" means headerless 16-bit little-endian mono at PCM16_INPUT_RATE. Longer than `max_seconds` is a 413;
    undecodable or empty audio is a 400."""
    fmt = (fmt or "").lower().strip() or None
    if fmt == "pcm16":
        if len(data) % 2:
            raise bad_media(part, "could not decode the audio: pcm16 data has an odd number of bytes")
        if max_seconds is not None and len(data) / 2 / PCM16_INPUT_RATE > max_seconds:
            raise too_long(part, len(data) / 2 / PCM16_INPUT_RATE, max_seconds)
        samples, rate = np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0, PCM16_INPUT_RATE
    else:
        try:
            samples, rate = _decode_soundfile(data, part, max_seconds)
        except RequestError:
            raise
        except Exception as sf_error:  # libsndfile cannot read it: let FFmpeg try
            try:
                samples, rate = _decode_pyav(data, part, max_seconds)
            except RequestError:
                raise
            except Exception:
                hint = f" (format {fmt!r})" if fmt else ""
                raise bad_media(part, f"could not decode the audio{hint}: {sf_error}") from None
    if samples.size == 0 or rate <= 0:
        raise bad_media(part, "could not decode the audio: it has no samples")
    if max_seconds is not None and samples.shape[-1] / rate > max_seconds:
        raise too_long(part, samples.shape[-1] / rate, max_seconds)
    if not np.isfinite(samples).all():
        raise bad_media(part, "could not decode the audio: it contains NaN or infinite samples")
    return resample(samples, rate, sample_rate)


def encodable_formats() -> tuple[str, ...]:
    """Formats `encode_audio` can write with the libsndfile found here (mp3 needs libsndfile >= 1.1); without
    soundfile (installed by the `audio` and `omni` extras) only pcm16, which is what streamed speech is sent as."""
    try:
        import soundfile as sf
    except ImportError:
        return ("pcm16",)
    have = sf.available_formats()
    usable = {"wav": "WAV", "flac": "FLAC", "mp3": "MP3", "opus": "OGG"}
    return tuple(f for f in ENCODE_FORMATS if f == "pcm16" or usable[f] in have)


def as_frames(samples: Any) -> np.ndarray:
    """float32 samples clipped to [-1, 1]: [n] for mono (any 1-channel shape), else time-major [n, channels]."""
    if hasattr(samples, "detach"):
        samples = samples.detach().float().cpu().numpy()
    samples = np.asarray(samples, dtype=np.float32)
    if samples.ndim != 2 or samples.shape[1] == 1:
        samples = samples.reshape(-1)
    return np.clip(samples, -1.0, 1.0)


def encode_audio(samples: Any, rate: int, fmt: str) -> bytes:
    """Encode float samples (mono [n] or [n, channels], clipped to [-1, 1]) as `fmt`: "wav" (16-bit PCM), "flac"
    (16-bit), "mp3", "opus" (Ogg Opus; resampled to 48 kHz unless `rate` is one Opus supports) or "pcm16"
    (headerless 16-bit little-endian, channels interleaved). An unknown or unavailable format is a 400 naming the
    ones that work."""
    fmt = (fmt or "").lower().strip()
    if fmt not in encodable_formats():
        raise RequestError(
            f"audio format {fmt!r} is not supported here; use one of: {', '.join(encodable_formats())}",
            "audio.format",
        )
    samples = as_frames(samples)
    if fmt == "pcm16":
        return np.round(samples * 32767.0).astype("<i2").tobytes()
    import soundfile as sf

    container, subtype = {
        "wav": ("WAV", "PCM_16"), "flac": ("FLAC", "PCM_16"), "mp3": ("MP3", "MPEG_LAYER_III"), "opus": ("OGG", "OPUS"),
    }[fmt]
    if fmt == "opus" and rate not in _OPUS_RATES:
        samples, rate = resample(samples, rate, 48000), 48000
    buffer = io.BytesIO()
    try:
        sf.write(buffer, samples, rate, format=container, subtype=subtype)
    except Exception as exc:  # e.g. an mp3 sample rate the encoder lacks
        raise RequestError(f"could not encode audio as {fmt} at {rate} Hz: {exc}", "audio.format") from None
    return buffer.getvalue()


def aac_encodable() -> bool:
    """Whether PyAV (FFmpeg) here has an AAC encoder (libsndfile has none)."""
    try:
        import av
    except ImportError:
        return False
    return "aac" in av.codecs_available


def encode_aac(samples: Any, rate: int) -> bytes:
    """ADTS AAC of float samples (mono [n] or [n, channels], clipped to [-1, 1]) through PyAV."""
    import av

    frames = as_frames(samples)
    planar = frames[None] if frames.ndim == 1 else np.ascontiguousarray(frames.T)  # [channels, n]
    layout = {1: "mono", 2: "stereo"}.get(planar.shape[0])
    if layout is None:
        raise RequestError(f"aac takes mono or stereo audio (got {planar.shape[0]} channels)", "response_format")
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="adts") as out:
        stream = out.add_stream("aac", rate=rate, layout=layout)
        frame = av.AudioFrame.from_ndarray(planar, format="fltp", layout=layout)
        frame.sample_rate = rate
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            out.mux(packet)
    return buffer.getvalue()
