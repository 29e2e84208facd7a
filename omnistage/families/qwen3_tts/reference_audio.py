"""Qwen3-TTS Base ICL: reference audio -> codes [T, Q] with the speech tokenizer's encoder (a Mimi encoder).

As the reference package's `Qwen3TTSTokenizer.encode` for one 24 kHz mono waveform: the Mimi encoder's codes, the
first `encoder_valid_num_quantizers` codebooks, `ceil(samples / encode_downsample_rate)` frames, transposed to
[T, Q]. The checkpoint stores the encoder under transformers-4 names (SEANet at `encoder.encoder.`, the transformer
at `encoder.encoder_transformer.`, `encoder.downsample.`); transformers 5's MimiModel nests them under
`encoder.encoder_seanet.` etc., so names are mapped on load. The decoder half of Mimi is not in the checkpoint (the
package drops it) and is not used by `encode`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

_V4_TO_V5 = {"encoder.": "encoder.encoder_seanet.", "encoder_transformer.": "encoder.encoder_transformer.",
             "downsample.": "encoder.downsample."}
_DECODER_PARTS = ("upsample.", "decoder_transformer.", "decoder.")


def _v5_name(name: str) -> str:
    for old, new in _V4_TO_V5.items():
        if name.startswith(old):
            return new + name[len(old):]
    return name


class ReferenceEncoder:
    """The speech tokenizer's encoder, from a checkpoint's `speech_tokenizer/` directory."""

    def __init__(self, root: str | Path, device: torch.device | str = "cpu") -> None:
        from transformers import MimiConfig, MimiModel

        root = Path(root)
        config = json.loads((root / "config.json").read_text(encoding="utf-8"))
        self.valid_quantizers = int(config.get("encoder_valid_num_quantizers", 16))
        self.downsample = int(config.get("encode_downsample_rate", 1920))
        self.sample_rate = int(config.get("input_sample_rate", 24000))
        self.model = MimiModel(MimiConfig(**config["encoder_config"]))
        state: dict[str, torch.Tensor] = {}
        for file in sorted(root.glob("*.safetensors")):
            with safe_open(str(file), "pt") as f:
                state |= {_v5_name(k[len("encoder."):]): f.get_tensor(k) for k in f.keys() if k.startswith("encoder.")}
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        missing = [k for k in missing if not k.startswith(_DECODER_PARTS)]
        if missing or unexpected:
            raise ValueError(f"speech tokenizer encoder weights do not match: missing {missing[:5]}, "
                             f"unused {unexpected[:5]}")
        self.model = self.model.to(device).eval().requires_grad_(False)

    @torch.inference_mode()
    def encode(self, audio: np.ndarray | torch.Tensor) -> torch.Tensor:
        """Codes [T, Q] int64 (CPU) of mono audio at the tokenizer's rate."""
        p = next(self.model.parameters())
        wav = torch.as_tensor(np.asarray(audio, dtype=np.float32)).to(p.device, p.dtype)
        codes = self.model.encode(wav[None, None], return_dict=True).audio_codes[0, : self.valid_quantizers]
        return codes[:, : math.ceil(wav.shape[0] / self.downsample)].T.long().cpu()
