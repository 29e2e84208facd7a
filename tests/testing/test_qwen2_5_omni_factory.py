"""The tiny Qwen2.5-Omni checkpoint loads offline through HF's own classes, its processor turns chat messages with
image, audio and video into inputs the model accepts, and its random weights behave usefully."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("torchvision", reason="Qwen2.5-Omni's processor needs torchvision (pip install 'omnistage[omni]')")

from transformers import Qwen2_5OmniForConditionalGeneration, Qwen2_5OmniProcessor  # noqa: E402

from omnistage.testing.qwen2_5_omni import (  # noqa: E402
    CODEC_BOS,
    CODEC_EOS,
    CODEC_MASK,
    CODEC_PAD,
    NUM_CODES,
    OMNI_SPECIAL_TOKENS,
    make_tiny_qwen2_5_omni,
)

FILES = [
    "config.json", "generation_config.json", "model.safetensors", "spk_dict.pt", "tokenizer.json",
    "tokenizer_config.json", "processor_config.json", "chat_template.jinja",
]


@pytest.fixture(scope="module")
def model(tiny_qwen2_5_omni: str) -> Qwen2_5OmniForConditionalGeneration:
    return Qwen2_5OmniForConditionalGeneration.from_pretrained(tiny_qwen2_5_omni).eval()


@pytest.fixture(scope="module")
def processor(tiny_qwen2_5_omni: str) -> Qwen2_5OmniProcessor:
    return Qwen2_5OmniProcessor.from_pretrained(tiny_qwen2_5_omni)


def _image(seed: int) -> object:
    from PIL import Image

    return Image.fromarray((np.random.RandomState(seed).rand(64, 80, 3) * 255).astype(np.uint8))


def _tone(freq: float, seconds: float = 2.0, rate: int = 16000) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def _greedy_text(model, inputs: dict, n: int = 20) -> tuple[list[int], float]:
    inputs = dict(inputs)
    if "pixel_values" in inputs:  # HF's generate would hand pixel_values to the talker too; the thinker owns it
        inputs["thinker_pixel_values"] = inputs.pop("pixel_values")
    out = model.generate(
        **inputs, generation_mode="text", thinker_max_new_tokens=n, thinker_do_sample=False,
        thinker_output_scores=True, thinker_return_dict_in_generate=True,
    )
    top2 = torch.stack(out.scores)[:, 0].topk(2, dim=-1).values
    return out.sequences[0, inputs["input_ids"].shape[1] :].tolist(), (top2[:, 0] - top2[:, 1]).min().item()


def test_files_deterministic_and_seeded(tmp_path: Path) -> None:
    a = make_tiny_qwen2_5_omni(tmp_path / "a", seed=0)
    b = make_tiny_qwen2_5_omni(tmp_path / "b", seed=0)
    c = make_tiny_qwen2_5_omni(tmp_path / "c", seed=1)
    for name in FILES:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert (a / "spk_dict.pt").read_bytes() != (c / "spk_dict.pt").read_bytes()
    total = sum(f.stat().st_size for f in a.iterdir())
    assert total < 4 * 2**20, total


def test_loads_offline_with_voices(model, processor, tiny_qwen2_5_omni: str) -> None:
    assert set(model.speaker_map) == {"Chelsie", "Ethan"}
    dit = model.config.token2wav_config.dit_config
    for voice in model.speaker_map.values():
        assert set(voice) == {"bos_token", "cond", "ref_mel"}
        assert voice["cond"].shape == (1, dit.enc_emb_dim) and voice["ref_mel"].shape[-1] == dit.mel_dim
        assert len(processor.tokenizer) <= voice["bos_token"] < model.config.thinker_config.text_config.vocab_size
    assert model.token2wav.dtype == torch.float32
    tok = processor.tokenizer
    for token in OMNI_SPECIAL_TOKENS:  # each special token is one id, as the processor and get_rope_index need
        assert tok.encode(token) == [tok.convert_tokens_to_ids(token)]
    cfg = model.config.thinker_config
    assert (processor.image_token_id, processor.audio_token_id, processor.video_token_id) == (
        cfg.image_token_id, cfg.audio_token_id, cfg.video_token_id,
    )
    assert cfg.vision_start_token_id == tok.convert_tokens_to_ids("<|vision_bos|>")
    talker = model.config.talker_config
    assert max(CODEC_PAD, CODEC_BOS, CODEC_EOS, CODEC_MASK) < talker.vocab_size
    assert (talker.tts_codec_pad_token_id, talker.tts_codec_end_token_id) == (CODEC_PAD, CODEC_EOS)
    assert dit.num_embeds == NUM_CODES + 1


def test_chat_template_places_media_tokens(processor) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:,"}},
            {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}},
            {"type": "video"},
            {"type": "text", "text": "What is this?"},
        ]},
    ]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n<|vision_bos|><|IMAGE|><|vision_eos|><|audio_bos|><|AUDIO|><|audio_eos|>"
        "<|vision_bos|><|VIDEO|><|vision_eos|>What is this?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_processor_inputs_run_through_the_thinker(model, processor) -> None:
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "audio"}, {"type": "video"},
                                      {"type": "text", "text": "Describe."}]}],
        add_generation_prompt=True, tokenize=False,
    )
    frames = (np.random.RandomState(2).rand(4, 56, 56, 3) * 255).astype(np.uint8)
    inputs = processor(text=[text], images=[_image(0)], audio=[_tone(440)], videos=[frames], return_tensors="pt")
    ids = inputs["input_ids"][0]
    cfg = model.config.thinker_config
    merge = cfg.vision_config.spatial_merge_size ** 2
    assert (ids == cfg.image_token_id).sum() == inputs["image_grid_thw"].prod() // merge
    assert (ids == cfg.video_token_id).sum() == inputs["video_grid_thw"].prod() // merge
    assert (ids == cfg.audio_token_id).sum() == 50  # 2 s of 16 kHz audio: 200 mel frames -> 50 tokens
    with torch.no_grad():
        out = model.thinker(**inputs)
    assert out.logits.shape == (1, ids.numel(), cfg.text_config.vocab_size)
    assert torch.isfinite(out.logits).all()


def test_greedy_thinker_is_varied_peaky_and_reads_media(model, processor) -> None:
    for prompt in ["Tell me about the lighthouse.", "Write a poem about the sea and the wind."]:
        text = processor.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                             tokenize=False)
        tokens, margin = _greedy_text(model, processor(text=[text], return_tensors="pt"))
        assert len(tokens) == 20 and len(set(tokens)) >= 8, tokens  # special tokens unlikely: runs to the limit
        assert margin > 1e-3
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "audio"}, {"type": "text", "text": "What?"}]}],
        add_generation_prompt=True, tokenize=False,
    )
    base, margin = _greedy_text(model, processor(text=[text], images=[_image(0)], audio=[_tone(440)],
                                                 return_tensors="pt"))
    assert len(set(base)) >= 8 and margin > 1e-3, base
    other_image, _ = _greedy_text(model, processor(text=[text], images=[_image(5)], audio=[_tone(440)],
                                                   return_tensors="pt"))
    other_audio, _ = _greedy_text(model, processor(text=[text], images=[_image(0)], audio=[_tone(1000)],
                                                   return_tensors="pt"))
    assert other_image != base and other_audio != base  # image and audio features reach the output


def test_hf_generate_speaks_in_seconds(model, processor) -> None:
    text = processor.apply_chat_template([{"role": "user", "content": "Hi!"}], add_generation_prompt=True,
                                         tokenize=False)
    inputs = processor(text=[text], return_tensors="pt")
    codes: list[torch.Tensor] = []
    decode = model.token2wav.forward
    model.token2wav.forward = lambda code, *a, **k: codes.append(code) or decode(code, *a, **k)
    try:
        waves = {}
        start = time.perf_counter()
        for voice in ("Ethan", "Chelsie"):
            torch.manual_seed(0)
            _, waves[voice] = model.generate(**inputs, speaker=voice, thinker_max_new_tokens=12,
                                             talker_max_new_tokens=40, thinker_do_sample=False)  # HF's sampled talker
        elapsed = time.perf_counter() - start
    finally:
        del model.token2wav.forward
    assert elapsed < 20
    for code in codes:  # the talker ran to its limit and emitted only codes token2wav can embed
        assert code.shape == (1, 40) and int(code.max()) < NUM_CODES and len(set(code[0].tolist())) >= 8
    wav = waves["Ethan"]
    assert wav.ndim == 1 and wav.numel() == 40 * 2 * 240  # 2 mel frames per code, 240 samples per frame
    assert torch.isfinite(wav).all() and 0.01 < wav.std() and wav.abs().max() < 1.0
    assert not torch.equal(wav, waves["Chelsie"])
