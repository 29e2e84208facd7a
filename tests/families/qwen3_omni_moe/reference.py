"""transformers' Qwen3-Omni run on the tiny checkpoint: the reference omnistage's stages are compared with.

`run_hf` runs `Qwen3OmniMoeForConditionalGeneration.generate` greedily (thinker and talker, whose code predictor
then decodes greedily too) and returns the thinker's reply tokens, the talker's codes [Q, frames] (what generate
hands to code2wav, caught on their way in) and the waveform. transformers' talker emits one frame fewer than
its `max_new_tokens`: a frame's codebooks 1.. are drawn when its first code is fed back, and the last one never is.

transformers 5.25's talker cannot place audio input on its rotary axes (`get_rope_index` reads
`config.audio_config.n_window`, which only the thinker's config has): `run_hf` lends the talker the thinker's
audio config, as omnistage's talker does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# code2wav's float32 waveforms across window and batch shapes: within 1e-5 on the CPU; on a GPU cuDNN picks its
# convolution algorithms per shape and runs them in TF32 (torch's default for convolutions), so TF32's bound.
AUDIO_ATOL = 1e-5 if DEVICE == "cpu" else 2e-4


@dataclass
class HFReference:
    thinker_tokens: list[int]
    codes: torch.Tensor  # [Q, frames]
    wav: torch.Tensor  # [samples] float32


def media_inputs(messages: list[dict[str, Any]]) -> dict[str, list]:
    """The processor's `images` / `audio` lists from decoded parts ({"type": "image", "image": PIL image}, ...)."""
    media: dict[str, list] = {}
    for message in messages:
        for part in message["content"] if isinstance(message["content"], list) else []:
            for kind, key in (("image", "images"), ("audio", "audio")):
                if part.get("type") == kind:
                    media.setdefault(key, []).append(part[kind])
    return media


def run_hf(path: str, messages: list[dict[str, Any]], thinker_tokens: int, frames: int, voice: str,
           media: dict[str, Any] | None = None, use_audio_in_video: bool = False,
           device: str = DEVICE) -> HFReference:
    """`media`: the processor's media arguments (default: the messages' decoded parts). `device`: where
    transformers runs: by default where omnistage's stages run by default, since transformers' own greedy codes
    on the tiny checkpoint differ between CPU and GPU (float32 on both)."""
    from transformers import Qwen3OmniMoeForConditionalGeneration, Qwen3OmniMoeProcessor

    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(path, dtype=torch.float32).to(device).eval()
    processor = Qwen3OmniMoeProcessor.from_pretrained(path)
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    batch = processor(text=[text], return_tensors="pt", padding=False,
                      **(media if media is not None else media_inputs(messages))).to(device)
    caught: list[torch.Tensor] = []
    decode = model.code2wav.chunked_decode

    def catch(codes: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        caught.append(codes.clone())
        return decode(codes, **kwargs)

    model.code2wav.chunked_decode = catch
    model.talker.config.audio_config = model.config.thinker_config.audio_config  # see the module doc
    eos = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    with torch.no_grad():
        sequences, wav = model.generate(
            **batch, speaker=voice, thinker_max_new_tokens=thinker_tokens, thinker_min_new_tokens=thinker_tokens,
            thinker_do_sample=False, thinker_eos_token_id=eos, talker_do_sample=False,
            talker_max_new_tokens=frames + 1, use_audio_in_video=use_audio_in_video)
    (codes,) = caught
    return HFReference(sequences[0, batch["input_ids"].shape[1] :].tolist(), codes[0].cpu(),
                       wav.reshape(-1).float().cpu())


def tone(seconds: float, hz: float, rate: int = 16000) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * hz * t)).astype(np.float32)
