"""A tiny random-weight Qwen3-Omni checkpoint (thinker -> talker + code predictor -> code2wav), built offline.

The checkpoint is a real `Qwen3OmniMoeForConditionalGeneration` (config.json with thinker_config / talker_config /
code2wav_config, `thinker.*`, `talker.*`, `code2wav.*` safetensors) with every part shrunk: MoE text decoders of 4
experts, top-2 (the released thinker: 128, top-8; 3 thinker layers, DeepStack after the first, the talker reading
the second's output), audio and vision encoders, a code predictor for 4 codebooks
[16], and the causal codec decoder at the released upsampling (1920 samples per code frame, 12.5 frames a second
of 24 kHz audio). Beside it, what `Qwen3OmniMoeProcessor.from_pretrained` needs: a tokenizer with the released
placeholder tokens, the chat template, the Whisper feature extractor and the image / video processors.

Ids (the released model's in brackets):

- text vocabulary: the tokenizer's ids (the BPE's 512 plus the role words `system`, `user`, `assistant` as single
  tokens, which the talker's prompt split needs), then reserved rows no string maps to: tts_pad / tts_bos / tts_eos
  [151671-151673]; `vocab_size` rounded up to a multiple of 64.
- codec vocabulary (talker): codes 0..CODEBOOK-1 are what code2wav decodes; the last 1024 ids are control ids,
  never sampled except eos (as transformers' generate suppresses them): pad, bos, eos, nothink, think bos / eos
  and the two speakers "Ethan", "Chelsie" sit there, as in the released vocabulary.

Weights are shaped as the other tiny factories' (scaled blocks: varied greedy output, well separated top-1 logits;
special text tokens unlikely, so greedy thinker output runs to its length limit) and the talker's codec head has
zero rows for every control id, eos included, so greedy speech runs to the talker's `max_new_tokens`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from omnistage.testing.factory import SPECIAL_TOKENS, make_tokenizer

FACTORY_VERSION = 1  # bump whenever the produced files change, so stale cached checkpoints are not reused

OMNI_SPECIAL_TOKENS = (
    "<|audio_start|>", "<|audio_end|>", "<|audio_pad|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
    "<|video_pad|>",
)
ROLE_TOKENS = ("system", "user", "assistant")
NAMED_SPECIAL_TOKENS = {  # tokenizer attributes Qwen3OmniMoeProcessor reads
    "audio_token": "<|audio_pad|>", "audio_bos_token": "<|audio_start|>", "audio_eos_token": "<|audio_end|>",
    "image_token": "<|image_pad|>", "video_token": "<|video_pad|>", "vision_bos_token": "<|vision_start|>",
    "vision_eos_token": "<|vision_end|>",
}
SPEAKERS = {"ethan": 1100, "chelsie": 1101}
CODEBOOK = 64  # code2wav's codebook size: codes 0..63
CODEC_VOCAB = CODEBOOK + 1024 + 64  # the control ids fill [vocab - 1024, vocab)
CODEC_PAD, CODEC_BOS, CODEC_EOS = 1090, 1091, 1092
CODEC_NOTHINK, CODEC_THINK_BOS, CODEC_THINK_EOS = 1095, 1096, 1097
NUM_CODE_GROUPS = 4
AUDIO_IN_RATE = 16000

# Weight shaping (multipliers on the default std-0.02 init), as in testing/qwen2_5_omni.py.
_QK, _LAYER, _NORM, _ROW_NORM_SIGMA = 10.0, 8.0, 20.0, 0.2
_TALKER_QK, _TALKER_LAYER, _TALKER_NORM = 5.0, 8.0, 20.0
_AUDIO_LAYER, _AUDIO_PROJ = 2.0, 0.5
# The DeepStack mergers' output scaled so their additions after the first thinker layer move its (scaled) residual
# stream: the visual rows' later states, which the talker reads (`accept_hidden_layer` 2 of 3), depend on them.
_DEEPSTACK = 50.0
# code2wav: code embedding scaled so codes matter, first conv, each decoder block's upsampling conv and the output
# conv scaled for audible amplitude (std ~0.05 instead of ~1e-7).
_CODE2WAV_EMBED, _CODE2WAV_IN, _CODE2WAV_UP, _CODE2WAV_OUT = 20.0, 4.0, 8.0, 20.0


def _token_ids(tokenizer: Any) -> dict[str, int]:
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (*SPECIAL_TOKENS, *OMNI_SPECIAL_TOKENS, *ROLE_TOKENS)}
    base = len(tokenizer)
    ids.update({name: base + i for i, name in enumerate(("tts_pad", "tts_bos", "tts_eos"))})
    return ids


def tiny_config(tokenizer: Any, speaks: bool = True) -> Any:
    """The tiny Qwen3OmniMoeConfig for `tokenizer` (built by `make_omni_tokenizer`); `speaks` False: a thinker-only
    checkpoint (the released Thinking and Captioner models: `enable_audio_output` false, no talker weights)."""
    from transformers import Qwen3OmniMoeConfig

    ids = _token_ids(tokenizer)
    vocab = -(-(max(ids.values()) + 1) // 64) * 64
    hidden = 64
    mrope = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3], "interleaved": True}
    media = dict(audio_token_id=ids["<|audio_pad|>"], image_token_id=ids["<|image_pad|>"],
                 video_token_id=ids["<|video_pad|>"], audio_start_token_id=ids["<|audio_start|>"],
                 position_id_per_seconds=13)
    moe = dict(num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[])
    thinker = dict(
        text_config=dict(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=128, moe_intermediate_size=32,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=4096, rope_parameters=mrope, norm_topk_prob=True, tie_word_embeddings=False,
            bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
            **moe,
        ),
        audio_config=dict(
            num_mel_bins=128, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64, d_model=32,
            max_source_positions=1500, n_window=50, n_window_infer=100, conv_chunksize=500,
            downsample_hidden_size=16, output_dim=hidden,
        ),
        vision_config=dict(
            depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, spatial_merge_size=2,
            temporal_patch_size=2, out_hidden_size=hidden, num_position_embeddings=64, deepstack_visual_indexes=[0],
        ),
        user_token_id=ids["user"], vision_start_token_id=ids["<|vision_start|>"], tie_word_embeddings=False,
        **media,
    )
    talker = dict(
        text_config=dict(
            vocab_size=CODEC_VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            head_dim=16, max_position_embeddings=4096, rope_parameters=mrope, norm_topk_prob=False,
            tie_word_embeddings=False, **moe,
        ),
        code_predictor_config=dict(
            vocab_size=CODEBOOK, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, max_position_embeddings=64, num_code_groups=NUM_CODE_GROUPS,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
        num_code_groups=NUM_CODE_GROUPS, thinker_hidden_size=hidden, accept_hidden_layer=2,
        codec_eos_token_id=CODEC_EOS, codec_nothink_id=CODEC_NOTHINK, codec_think_bos_id=CODEC_THINK_BOS,
        codec_think_eos_id=CODEC_THINK_EOS, codec_pad_id=CODEC_PAD, codec_bos_id=CODEC_BOS, speaker_id=SPEAKERS,
        vision_start_token_id=ids["<|vision_start|>"], spatial_merge_size=2, **media,
    )
    code2wav = dict(
        codebook_size=CODEBOOK, hidden_size=32, max_position_embeddings=8000, num_attention_heads=2,
        num_key_value_heads=2, sliding_window=8, intermediate_size=64, num_hidden_layers=2,
        num_quantizers=NUM_CODE_GROUPS, upsample_rates=[8, 5, 4, 3], upsampling_ratios=[2, 2], decoder_dim=64,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    return Qwen3OmniMoeConfig(
        thinker_config=thinker, talker_config=talker, code2wav_config=code2wav, enable_audio_output=speaks,
        im_start_token_id=ids["<|im_start|>"], im_end_token_id=ids["<|im_end|>"], tts_pad_token_id=ids["tts_pad"],
        tts_bos_token_id=ids["tts_bos"], tts_eos_token_id=ids["tts_eos"], system_token_id=ids["system"],
        user_token_id=ids["user"], assistant_token_id=ids["assistant"],
    )


def make_omni_tokenizer(out_dir: str | Path) -> Path:
    return make_tokenizer(out_dir, extra_special_tokens=(*OMNI_SPECIAL_TOKENS, *ROLE_TOKENS),
                          named_special_tokens=NAMED_SPECIAL_TOKENS,
                          chat_template="qwen3_omni_moe_chat_template.jinja", model_max_length=4096)


def save_processor(out_dir: Path) -> None:
    """Processor files next to the tokenizer: feature extractor, image and video processors, chat template."""
    from transformers import AutoTokenizer, Qwen3OmniMoeProcessor, WhisperFeatureExtractor
    from transformers.models.qwen2_vl import Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    # Few vision tokens per image / frame pair (one per 32x32 pixels), short audio padding.
    pixels = dict(min_pixels=32 * 32 * 4, max_pixels=32 * 32 * 64)
    processor = Qwen3OmniMoeProcessor(
        image_processor=Qwen2VLImageProcessor(patch_size=16, temporal_patch_size=2, merge_size=2, **pixels),
        video_processor=Qwen2VLVideoProcessor(patch_size=16, temporal_patch_size=2, merge_size=2, **pixels),
        feature_extractor=WhisperFeatureExtractor(feature_size=128, sampling_rate=AUDIO_IN_RATE, hop_length=160,
                                                  chunk_length=30, n_fft=400, return_attention_mask=True),
        tokenizer=tokenizer, chat_template=tokenizer.chat_template,
    )
    processor.save_pretrained(out_dir)
    cfg_path = out_dir / "tokenizer_config.json"  # save_pretrained echoes how the tokenizer was loaded: dropped
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    for key in ("is_local", "local_files_only"):
        cfg.pop(key, None)
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _scale_blocks(module: torch.nn.Module, layer: float, qk: float) -> None:
    for name, p in module.named_parameters():
        if p.ndim >= 2 and "gate.weight" not in name:  # routers keep their init: varied expert choice
            p.mul_(qk if name.endswith(("q_proj.weight", "k_proj.weight")) else layer)


def _init_experts(module: torch.nn.Module, gen: torch.Generator) -> None:
    """The fused expert tensors (`gate_up_proj`, `down_proj`, created empty) get the default std-0.02 init."""
    for name, p in module.named_parameters():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)


@torch.no_grad()
def _shape_weights(model: Any, ids: dict[str, int], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed + 7)
    _init_experts(model, gen)
    lm = model.thinker.model.language_model
    _scale_blocks(lm.layers, _LAYER, _QK)
    lm.norm.weight.mul_(_NORM)
    head = model.thinker.lm_head.weight
    head.mul_(torch.exp(_ROW_NORM_SIGMA * torch.randn(head.shape[0], 1, generator=gen)))
    unlikely = [i for name, i in ids.items() if name.startswith(("<|", "tts_")) or name in ROLE_TOKENS]
    head[unlikely] *= 0.1
    head[max(ids.values()) + 1 :] *= 0.1

    for merger in model.thinker.model.visual.merger_list:
        merger.mlp[2].weight.mul_(_DEEPSTACK)
        merger.mlp[2].bias.mul_(_DEEPSTACK)

    audio = model.thinker.model.audio_tower
    _scale_blocks(audio.layers, _AUDIO_LAYER, _AUDIO_LAYER)
    audio.proj2.weight.mul_(_AUDIO_PROJ)

    if not hasattr(model, "talker"):
        return
    talker = model.talker
    _scale_blocks(talker.model.layers, _TALKER_LAYER, _TALKER_QK)
    talker.model.norm.weight.mul_(_TALKER_NORM)
    talker.codec_head.weight[CODEBOOK:] = 0.0  # control ids (eos too) never win: speech runs to its length limit
    predictor = talker.code_predictor
    _scale_blocks(predictor.model.layers, _TALKER_LAYER, _TALKER_QK)
    predictor.model.norm.weight.mul_(_TALKER_NORM)
    code2wav = model.code2wav
    code2wav.code_embedding.weight.mul_(_CODE2WAV_EMBED)
    code2wav.decoder[0].conv.weight.mul_(_CODE2WAV_IN)
    for block in code2wav.decoder[1:-2]:
        block.block[1].conv.weight.mul_(_CODE2WAV_UP)
    code2wav.decoder[-1].conv.weight.mul_(_CODE2WAV_OUT)


VARIANTS = ("instruct", "thinking")  # thinking: thinker only, as the released Thinking and Captioner checkpoints


def make_tiny_qwen3_omni_moe(out_dir: str | Path, seed: int = 0, variant: str = "instruct") -> Path:
    """Write a tiny Qwen3-Omni checkpoint to `out_dir`; identical bytes for identical arguments."""
    from transformers import AutoTokenizer, GenerationConfig, Qwen3OmniMoeForConditionalGeneration

    out = make_omni_tokenizer(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = _token_ids(tokenizer)
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; expected one of {list(VARIANTS)}")
    config = tiny_config(tokenizer, speaks=variant == "instruct")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3OmniMoeForConditionalGeneration(config).float().eval()
        _shape_weights(model, ids, seed)
    model.generation_config = GenerationConfig(
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"]
    )
    model.save_pretrained(out)
    save_processor(out)
    return out
