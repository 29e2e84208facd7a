"""The authors' `qwen-tts` package as a parity reference, run in its own venv (.venvs/qwen-tts) by subprocess.

JSON in/out through files; arrays as .npy in a temp dir. Tests call `require_reference_venv()`, which builds
the venv with tools/reference_venvs/qwen_tts.sh and skips (with the reason) only when that build fails."""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[3]
VENV_PY = ROOT / ".venvs" / "qwen-tts" / "bin" / "python"
_WORKER = Path(__file__).with_name("_ref_worker.py")


def require_reference_venv() -> Path:
    """Build the venv if needed; skip the calling test only if it cannot be built."""
    probe = [str(VENV_PY), "-c", "import qwen_tts"]
    usable = VENV_PY.exists() and subprocess.run(probe, capture_output=True).returncode == 0
    if usable:
        return VENV_PY  # usable as it is (the build script's marker may be missing after a partial build)
    build = subprocess.run(["bash", str(ROOT / "tools/reference_venvs/qwen_tts.sh")], capture_output=True, text=True)
    if build.returncode != 0 or not VENV_PY.exists():
        pytest.skip(f"qwen-tts reference venv could not be built: {build.stderr[-500:]}")
    return VENV_PY


def call(op: str, **request: Any) -> dict:
    """Run one worker op in the reference venv; raises with its stderr on failure."""
    with tempfile.TemporaryDirectory() as tmp:
        req, rep = Path(tmp, "req.json"), Path(tmp, "rep.json")
        req.write_text(json.dumps({"op": op, **request}))
        proc = subprocess.run([str(VENV_PY), str(_WORKER), str(req), str(rep)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"reference {op} failed:\n{proc.stderr[-3000:]}")
        return json.loads(rep.read_text())


def make_speech_tokenizer(out: Path, encoder_config: dict, decoder_config: dict, seed: int = 0) -> Path:
    call("make_speech_tokenizer", out=str(out), encoder_config=encoder_config, decoder_config=decoder_config,
         seed=seed)
    return out


def decode(speech_tokenizer_dir: Path, codes: np.ndarray, one_shot: bool = True) -> np.ndarray:
    """The package decoder's waveform [B, T * 1920] for codes [B, Q, T] (one-shot or its chunked_decode)."""
    with tempfile.TemporaryDirectory() as tmp:
        c, w = Path(tmp, "codes.npy"), Path(tmp, "wav.npy")
        np.save(c, codes.astype(np.int64))
        call("decode", dir=str(speech_tokenizer_dir), codes=str(c), wav=str(w), one_shot=one_shot)
        return np.load(w)


def generate(checkpoint: Path, items: list[dict], non_streaming_mode: bool = True, **params: Any
             ) -> tuple[list[np.ndarray], list[list[int]]]:
    """The package's codes per item ({"text", "speaker"?, "instruct"?, "language"?}), each generated alone in
    the given text mode: frames [T, Q] (eos excluded), and the text ids it tokenized. `params`: generate kwargs
    (do_sample, max_new_tokens ...)."""
    with tempfile.TemporaryDirectory() as tmp:
        reply = call("generate", dir=str(checkpoint), items=items, params=params, out=tmp,
                     non_streaming_mode=non_streaming_mode)
        codes = [np.load(Path(tmp, f"codes{i}.npy")) for i in range(len(items))]
    return codes, [reply["input_ids"][str(i)] for i in range(len(items))]


def clone(checkpoint: Path, items: list[dict], **params: Any) -> list[dict[str, np.ndarray]]:
    """The package's voice clone per item ({"text", "audio" (24 kHz float32), "ref_text"?, "x_vector_only_mode"?,
    "non_streaming_mode"?, "language"?}), each alone: {"x_vector", "ref_codes"? [T, Q], "codes" [T, Q] (eos
    excluded), "wav" (generate_voice_clone's output)}."""
    with tempfile.TemporaryDirectory() as tmp:
        sent = []
        for i, item in enumerate(items):
            np.save(Path(tmp, f"audio{i}.npy"), np.asarray(item["audio"], dtype=np.float32))
            sent.append({**{k: v for k, v in item.items() if k != "audio"}, "audio": str(Path(tmp, f"audio{i}.npy"))})
        call("clone", dir=str(checkpoint), items=sent, params=params, out=tmp)
        out = []
        for i in range(len(items)):
            got = {"x_vector": np.load(Path(tmp, f"xvec{i}.npy")), "codes": np.load(Path(tmp, f"codes{i}.npy")),
                   "wav": np.load(Path(tmp, f"wav{i}.npy"))}
            if Path(tmp, f"ref{i}.npy").exists():
                got["ref_codes"] = np.load(Path(tmp, f"ref{i}.npy"))
            out.append(got)
        return out
