"""The voices API over the real server: a CustomVoice checkpoint lists its speakers and refuses uploads; a Base
checkpoint (voice clone) takes an upload, lists it, speaks with it, still has it after a restart, and deletes it.
The Base tests need the family's Base support (`clone_features`); they skip until the checkpoint loads."""

from __future__ import annotations

import io
import os
import wave
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from openai_helpers import assert_openai_error

from omnistage.entrypoints.openai.server import BackgroundServer
from omnistage.entrypoints.openai.voices import VoiceStore
from omnistage.testing.qwen3_tts import make_tiny_qwen3_tts

DEPLOY = {"stages": {"talker": {"default_sampling_params": {"temperature": 0.0}}, "*": {"dtype": "float32"}}}


def wav_bytes(seconds: float = 1.0, rate: int = 24000) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    samples = 0.3 * np.sin(2 * np.pi * 180 * t) + np.random.default_rng(0).normal(0, 0.02, t.shape)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes())
    return buf.getvalue()


MAX_AUDIO_S = 2.0


class Served:
    def __init__(self, checkpoint: Path) -> None:
        from omnistage.entrypoints.async_omni import AsyncOmni

        deploy = {**DEPLOY, "limits": {"max_audio_seconds": MAX_AUDIO_S},
                  "media": {"allowed_local_path": str(checkpoint.parent)}}
        self.engine = AsyncOmni.from_model(str(checkpoint), deploy, served_model_name="tts")
        self.server = BackgroundServer(self.engine, served_model_names=["tts"]).start()
        self.http = httpx.Client(base_url=self.server.url, timeout=60)

    def close(self) -> None:
        self.http.close()
        self.server.stop()
        self.engine.shutdown()


@pytest.fixture(scope="module")
def voices_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    directory = tmp_path_factory.mktemp("voices")
    old = os.environ.get("OMNISTAGE_VOICES_DIR")
    os.environ["OMNISTAGE_VOICES_DIR"] = str(directory)
    yield directory
    if old is None:
        os.environ.pop("OMNISTAGE_VOICES_DIR", None)
    else:
        os.environ["OMNISTAGE_VOICES_DIR"] = old


@pytest.fixture(scope="module")
def custom(tmp_path_factory: pytest.TempPathFactory, voices_env: Path) -> Iterator[Served]:
    served = Served(make_tiny_qwen3_tts(tmp_path_factory.mktemp("cv"), "custom_voice"))
    yield served
    served.close()


@pytest.fixture(scope="module")
def base_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen3_tts(tmp_path_factory.mktemp("base"), "base")


@pytest.fixture(scope="module")
def base(base_checkpoint: Path, voices_env: Path) -> Iterator[Served]:
    served = Served(base_checkpoint)
    assert served.engine.pipeline.can_clone
    yield served
    served.close()


def upload(http: httpx.Client, name: str, consent: str | None = "speaker-consent-1", **extra: str) -> httpx.Response:
    data = {"name": name, **({"consent": consent} if consent else {}), **extra}
    return http.post("/v1/audio/voices", data=data, files={"audio_sample": ("voice.wav", wav_bytes(), "audio/wav")})


def test_custom_voice_lists_speakers_and_refuses_uploads(custom: Served) -> None:
    listed = custom.http.get("/v1/audio/voices").json()
    assert {"name": "vivian", "kind": "speaker"} in listed["data"]
    assert {"vivian", "ryan", "eric"} <= set(listed["voices"])
    assert_openai_error(upload(custom.http, "mine"), 400, "does not clone")
    assert_openai_error(custom.http.delete("/v1/audio/voices/nobody"), 404, "nobody")


def test_store_persists(tmp_path: Path) -> None:
    """The store on its own: a voice written is read back by a new store (a restart), tensors and metadata."""
    features = {"x_vector": torch.randn(8), "ref_codes": torch.randint(0, 16, (5, 4))}
    store = VoiceStore(tmp_path)
    store.add("Alice", np.zeros(2400, np.float32), features, "hello", "ok-1")
    again = VoiceStore(tmp_path)
    voice = again.get("alice")
    assert voice is not None and voice.name == "Alice" and voice.ref_text == "hello" and voice.consent == "ok-1"
    assert torch.equal(voice.features["x_vector"], features["x_vector"])
    assert torch.equal(voice.features["ref_codes"], features["ref_codes"])
    assert again.delete("ALICE") and VoiceStore(tmp_path).names() == []


@pytest.mark.parametrize(("name", "consent", "words"), [
    ("../evil", "yes", ("name",)),
    ("ok-name", None, ("consent",)),
])
def test_bad_uploads(base: Served, name: str, consent: str | None, words: tuple[str, ...]) -> None:
    assert_openai_error(upload(base.http, name, consent), 400, *words)


def test_bad_sample(base: Served) -> None:
    resp = base.http.post("/v1/audio/voices", data={"name": "junk", "consent": "yes"},
                          files={"audio_sample": ("voice.wav", b"not audio at all", "audio/wav")})
    assert_openai_error(resp, 400, "audio_sample")


def test_ref_audio_inline(base: Served) -> None:
    import base64

    data_url = "data:audio/wav;base64," + base64.b64encode(wav_bytes(0.5)).decode()
    for body in ({"ref_audio": data_url, "ref_text": "Hello."}, {"ref_audio": data_url, "x_vector_only_mode": True}):
        resp = base.http.post("/v1/audio/speech", json={"input": "Hi.", "response_format": "wav",
                                                        "max_new_tokens": 6, **body})
        assert resp.status_code == 200, resp.text
    assert_openai_error(base.http.post("/v1/audio/speech", json={"input": "Hi.", "ref_audio": "bm90IGF1ZGlv"}),
                        400, "ref_audio")
    too_long = base64.b64encode(wav_bytes(MAX_AUDIO_S + 1)).decode()
    resp = base.http.post("/v1/audio/speech", json={"input": "Hi.", "ref_audio": too_long})
    assert 400 <= resp.status_code < 500 and "ref_audio" in resp.json()["error"]["message"], resp.text


def test_ref_audio_local_path(base: Served, base_checkpoint: Path) -> None:
    """A path under media.allowed_local_path is read; one outside it is refused."""
    path = base_checkpoint.parent / "ref.wav"
    path.write_bytes(wav_bytes(0.5))
    resp = base.http.post("/v1/audio/speech", json={"input": "Hi.", "ref_audio": str(path), "x_vector_only_mode": True,
                                                    "response_format": "wav", "max_new_tokens": 6})
    assert resp.status_code == 200, resp.text
    resp = base.http.post("/v1/audio/speech", json={"input": "Hi.", "ref_audio": "/etc/hostname"})
    assert 400 <= resp.status_code < 500, resp.text


# last: it restarts the Base server, so the module's `base` fixture is closed after it
def test_upload_use_restart_delete(base: Served, base_checkpoint: Path, voices_env: Path) -> None:
    resp = upload(base.http, "clone-1", ref_text="Hello there.")
    assert resp.status_code == 200, resp.text
    assert (voices_env / "clone-1.safetensors").is_file()
    assert "clone-1" in base.http.get("/v1/audio/voices").json()["voices"]
    speech = base.http.post("/v1/audio/speech", json={"input": "Hi.", "voice": "clone-1", "response_format": "wav",
                                                      "max_new_tokens": 8, "subtalker_dosample": False})
    assert speech.status_code == 200, speech.text
    assert_openai_error(base.http.post("/v1/audio/speech", json={"input": "Hi.", "voice": "nope"}), 400,
                        "unknown voice", "clone-1")
    base.close()
    restarted = Served(base_checkpoint)  # same voices directory
    try:
        assert "clone-1" in restarted.http.get("/v1/audio/voices").json()["voices"]
        assert restarted.http.delete("/v1/audio/voices/clone-1").status_code == 200
        assert "clone-1" not in restarted.http.get("/v1/audio/voices").json()["voices"]
        assert not (voices_env / "clone-1.safetensors").exists()
    finally:
        restarted.close()
        base.close = lambda: None  # type: ignore[method-assign]  # closed above
