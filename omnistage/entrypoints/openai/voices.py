"""Uploaded TTS voices: `GET /v1/audio/voices`, `POST /v1/audio/voices`, `DELETE /v1/audio/voices/{name}`.

A voice is one safetensors file `<name>.safetensors` in the voices directory (`serve --voices-dir`, env
OMNISTAGE_VOICES_DIR, default ~/.cache/omnistage/voices): the decoded 24 kHz mono sample ("audio") and the clone
features the pipeline computed from it at upload ("feature.<key>", exactly `clone_features`' dict), with ref_text,
consent and created in the metadata. Features are computed at upload, so a sample the model cannot use fails the
upload, and a request naming the voice sends them as `voice_features` (+ `ref_text`) without re-encoding.
Files survive restarts; names are safe characters only, so a name is always a plain file name.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException

from omnistage import envs
from omnistage.errors import RequestError
from omnistage.media import decode_audio

__all__ = ["MAX_SAMPLE_BYTES", "Voice", "VoiceStore", "router", "voices_dir"]

router = APIRouter()
MAX_SAMPLE_BYTES = 10 * 2**20
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_FEATURE = "feature."


class VoiceNotFound(RequestError):
    status = 404


def voices_dir() -> Path:
    configured = envs.VOICES_DIR.get()
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "omnistage" / "voices"


@dataclass
class Voice:
    name: str
    ref_text: str | None
    consent: str
    created: int
    features: dict[str, torch.Tensor] = field(repr=False)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "kind": "uploaded", "ref_text": self.ref_text, "consent": self.consent,
                "created_at": self.created}


class VoiceStore:
    """The voices directory, read once at start and written through; a lock guards the in-memory index (uploads
    run in worker threads)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.lock = threading.Lock()
        self.voices: dict[str, Voice] = {}
        if directory.is_dir():
            for file in sorted(directory.glob("*.safetensors")):
                voice = self._read(file)
                if voice is not None:
                    self.voices[voice.name.lower()] = voice

    @staticmethod
    def _read(file: Path) -> Voice | None:
        from safetensors import safe_open

        try:
            with safe_open(str(file), framework="pt") as f:
                meta = f.metadata() or {}
                features = {k[len(_FEATURE):]: f.get_tensor(k) for k in f.keys() if k.startswith(_FEATURE)}
        except Exception:  # a broken file is skipped, not fatal to the server
            return None
        return Voice(file.stem, meta.get("ref_text") or None, meta.get("consent", ""), int(meta.get("created", 0)),
                     features)

    def names(self) -> list[str]:
        with self.lock:
            return [v.name for v in self.voices.values()]

    def get(self, name: str) -> Voice | None:
        with self.lock:
            return self.voices.get(name.lower())

    def add(self, name: str, audio: np.ndarray, features: dict[str, torch.Tensor], ref_text: str | None,
            consent: str) -> Voice:
        from safetensors.torch import save_file

        voice = Voice(name, ref_text, consent, int(time.time()), {k: v.detach().cpu() for k, v in features.items()})
        tensors = {"audio": torch.from_numpy(np.ascontiguousarray(audio, dtype=np.float32)),
                   **{_FEATURE + k: v.contiguous() for k, v in voice.features.items()}}
        meta = {"ref_text": ref_text or "", "consent": consent, "created": str(voice.created), "sample_rate": "24000"}
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = self.directory / f".{name}.tmp"
        save_file(tensors, str(tmp), metadata=meta)
        tmp.replace(self.directory / f"{name}.safetensors")  # atomic: a crash leaves the old file or the new one
        with self.lock:
            self.voices[name.lower()] = voice
        return voice

    def delete(self, name: str) -> bool:
        with self.lock:
            voice = self.voices.pop(name.lower(), None)
        if voice is None:
            return False
        (self.directory / f"{voice.name}.safetensors").unlink(missing_ok=True)
        return True


def store_of(app: Any) -> VoiceStore:
    """The app's store, opened on first use (the voices directory is read when it is first needed)."""
    store = getattr(app.state, "voices", None)
    if store is None:
        store = app.state.voices = VoiceStore(voices_dir())
    return store


@router.get("/v1/audio/voices")
async def list_voices(request: Request) -> JSONResponse:
    from omnistage.entrypoints.openai.speech import speakers_of, tts_pipeline

    pipeline = tts_pipeline(request.app.state.engine)
    listed = [{"name": s, "kind": "speaker"} for s in speakers_of(pipeline)]
    uploaded = [v.describe() for v in store_of(request.app).voices.values()]
    return JSONResponse({"object": "list", "voices": [v["name"] for v in listed + uploaded],
                         "data": listed + uploaded})


def _field(form: Any, name: str) -> str | None:
    value = form.get(name)
    if value is not None and not isinstance(value, str):
        raise RequestError(f"'{name}' must be a text field", name)
    return value.strip() if value else None


@router.post("/v1/audio/voices")
async def upload_voice(request: Request) -> JSONResponse:
    from omnistage.entrypoints.openai.speech import can_clone, speakers_of, tts_pipeline

    pipeline = tts_pipeline(request.app.state.engine)
    if not can_clone(pipeline):
        raise RequestError("this model does not clone voices, so it takes no uploaded voice; serve a Qwen3-TTS Base "
                           "checkpoint to upload one", "audio_sample")
    if not request.headers.get("content-type", "").lower().startswith("multipart/form-data"):
        raise RequestError("send multipart/form-data: audio_sample (file), name, consent, ref_text", "audio_sample")
    try:
        form = await request.form(max_files=2, max_fields=16)
    except StarletteHTTPException as exc:
        raise RequestError(f"could not read the multipart form: {exc.detail}", "audio_sample") from None
    try:
        name, consent, ref_text = _field(form, "name"), _field(form, "consent"), _field(form, "ref_text")
        upload = form.get("audio_sample")
        if not name or not NAME.match(name):
            raise RequestError("'name' must be 1-64 characters of letters, digits, '_', '-' and '.', starting with "
                               f"a letter or digit (got {name!r})", "name")
        if name.lower() in (s.lower() for s in speakers_of(pipeline)):
            raise RequestError(f"{name!r} is a speaker of this checkpoint; pick another name", "name")
        if not consent:
            raise RequestError("'consent' is required: a statement or id recording the speaker's consent to "
                               "clone their voice", "consent")
        if not isinstance(upload, UploadFile):
            raise RequestError("'audio_sample' must be a file upload (curl -F audio_sample=@voice.wav)",
                               "audio_sample")
        data = await upload.read(MAX_SAMPLE_BYTES + 1)
        if len(data) > MAX_SAMPLE_BYTES:
            raise RequestError(f"audio_sample is over {MAX_SAMPLE_BYTES // 2**20} MB; send a shorter sample",
                               "audio_sample", status=413)
    finally:
        await form.close()
    limits = pipeline.deploy.limits
    audio = await asyncio.to_thread(decode_audio, data, pipeline.audio_sample_rate, "audio_sample", None,
                                    limits.max_audio_seconds)
    features = await asyncio.to_thread(pipeline.clone_features, audio, ref_text, not ref_text)
    voice = await asyncio.to_thread(store_of(request.app).add, name, audio, features, ref_text, consent)
    return JSONResponse(voice.describe())


@router.delete("/v1/audio/voices/{name}")
async def delete_voice(name: str, request: Request) -> JSONResponse:
    if not await asyncio.to_thread(store_of(request.app).delete, name):
        raise VoiceNotFound(f"no uploaded voice {name!r}; GET /v1/audio/voices lists them", "name")
    return JSONResponse({"name": name, "object": "voice", "deleted": True})
