"""A tiny random-weight Qwen2.5-Omni checkpoint (thinker -> talker -> token2wav), built offline.

The checkpoint is a real `Qwen2_5OmniForConditionalGeneration` with every part shrunk (thinker text model,
audio and vision encoders, talker, DiT and BigVGAN), plus what `Qwen2_5OmniProcessor.from_pretrained` needs
(tokenizer with the multimodal special tokens, chat template, Whisper feature extractor, image and video
processors) and a `spk_dict.pt` with two voices, "Chelsie" and "Ethan", laid out as in the released checkpoint.

Ids in the tiny vocabularies (the released model's in brackets):

- text vocabulary: the tokenizer's ids (512, all real tokens and the special tokens), then reserved rows that
  no tokenizer string maps to: tts_text_pad/start/end [151859/151860/151861] and the two voices' text bos
  tokens [151870, 151872]; `vocab_size` is rounded up to a multiple of 64.
- codec vocabulary (talker): codes 0..NUM_CODES-1 are what token2wav decodes (its DiT codec embedding has
  NUM_CODES + 1 rows [8193 + 1]); the talker's special codec tokens sit above them: pad, bos (start), eos
  (end), mask [8292, 8293, 8294, 8296]; `vocab_size` = 320 [8448].

Random weights are shaped for useful behaviour: the thinker is rescaled like the causal-LM factory's models
(greedy output varies, top-1 logits well separated) and its special/reserved tokens are made unlikely, so
greedy generation runs to the length limit; the talker's codec head has zero rows for every id >= NUM_CODES,
so neither greedy decoding nor HF's default talker sampling (top-k 40) ever emits a special codec token or a
code token2wav cannot embed, and generation runs to `talker_max_new_tokens`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from omnistage.families.qwen2_5_omni.models import thinker_ids_unflagged
from omnistage.testing.factory import SPECIAL_TOKENS, make_tokenizer

# Bump whenever the produced files change, so stale cached checkpoints are not reused.
OMNI_FACTORY_VERSION = 1

OMNI_SPECIAL_TOKENS = (
    "<|AUDIO|>",
    "<|audio_bos|>",
    "<|audio_eos|>",
    "<|vision_bos|>",
    "<|vision_eos|>",
    "<|vision_pad|>",
    "<|IMAGE|>",
    "<|VIDEO|>",
)
# Tokenizer attributes Qwen2_5OmniProcessor reads (tokenizer.image_token, .audio_bos_token, ...).
NAMED_SPECIAL_TOKENS = {
    "audio_token": "<|AUDIO|>",
    "audio_bos_token": "<|audio_bos|>",
    "audio_eos_token": "<|audio_eos|>",
    "image_token": "<|IMAGE|>",
    "video_token": "<|VIDEO|>",
    "vision_bos_token": "<|vision_bos|>",
    "vision_eos_token": "<|vision_eos|>",
}
VOICES = ("Chelsie", "Ethan")
NUM_CODES = 256  # codec codes token2wav decodes: 0..NUM_CODES-1
CODEC_VOCAB = 320
CODEC_PAD, CODEC_BOS, CODEC_EOS, CODEC_MASK = 300, 301, 302, 304
SAMPLE_RATE = 24000  # token2wav output rate: 2 mel frames per code, 240 samples per mel frame
AUDIO_IN_RATE = 16000  # what the Whisper feature extractor takes

# Weight shaping (multipliers on the default std-0.02 init). Thinker and talker: as in factory.py, scaled
# blocks make each layer move the residual stream (varied greedy output) and a scaled final norm spreads the
# logits (top-1 well separated). The thinker's attention is sharper than the text-only models' (q/k x10), or a
# prompt dominated by audio/image features makes greedy decoding repeat one token. Encoders: the audio tower's
# output projection is scaled down so its features are about as large as token embeddings. DiT: timestep
# embedding and adaLN modulation scaled so the transformer blocks matter (their gates are ~0 otherwise: the
# mel would not depend on attention), codec embedding and output projection scaled so codes and the velocity
# field matter. BigVGAN: output conv scaled for audible amplitude (std ~0.05 instead of ~5e-5).
_THINKER_QK, _THINKER_LAYER, _THINKER_NORM, _ROW_NORM_SIGMA = 10.0, 8.0, 20.0, 0.2
_TALKER_QK, _TALKER_LAYER, _TALKER_NORM = 5.0, 8.0, 20.0
_AUDIO_LAYER, _AUDIO_PROJ = 2.0, 0.5
_DIT_TIME, _DIT_ADA, _DIT_LAYER, _DIT_CODE, _DIT_OUT = 5.0, 10.0, 8.0, 10.0, 20.0
_VOCODER_GAIN = 1000.0


def _token_ids(tokenizer: Any) -> dict[str, int]:
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (*SPECIAL_TOKENS, *OMNI_SPECIAL_TOKENS)}
    base = len(tokenizer)
    reserved = ["tts_text_pad", "tts_text_start", "tts_text_end", *(f"voice_{v}" for v in VOICES)]
    ids.update({name: base + i for i, name in enumerate(reserved)})
    return ids


def tiny_config(tokenizer: Any) -> Any:
    """The tiny Qwen2_5OmniConfig for `tokenizer` (built by `make_omni_tokenizer`)."""
    from transformers import Qwen2_5OmniConfig

    ids = _token_ids(tokenizer)
    vocab = -(-(max(ids.values()) + 1) // 64) * 64
    hidden = 64
    mrope = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]}  # head_dim 16
    media_ids = dict(
        audio_token_index=ids["<|AUDIO|>"],
        image_token_index=ids["<|IMAGE|>"],
        video_token_index=ids["<|VIDEO|>"],
        audio_start_token_id=ids["<|audio_bos|>"],
        audio_end_token_id=ids["<|audio_eos|>"],
        vision_start_token_id=ids["<|vision_bos|>"],
        vision_end_token_id=ids["<|vision_eos|>"],
        position_id_per_seconds=25,
        seconds_per_chunk=2,
    )
    thinker = dict(
        text_config=dict(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            rope_parameters=mrope,
            tie_word_embeddings=False,
            bos_token_id=ids["<|endoftext|>"],
            eos_token_id=ids["<|im_end|>"],
            pad_token_id=ids["<|endoftext|>"],
        ),
        audio_config=dict(
            num_mel_bins=128,
            encoder_layers=2,
            encoder_attention_heads=2,
            encoder_ffn_dim=64,
            d_model=32,
            max_source_positions=1500,
            n_window=100,
            output_dim=hidden,
        ),
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=112,
            fullatt_block_indexes=[1],
            out_hidden_size=hidden,
        ),
        user_token_id=tokenizer.encode("user")[0],  # unused by transformers; "user" is several tokens here
        tie_word_embeddings=False,
        **media_ids,
    )
    talker = dict(
        vocab_size=CODEC_VOCAB,
        embedding_size=hidden,  # the talker reads thinker embeddings/hidden states
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=4096,
        rope_parameters=mrope,
        tts_text_start_token_id=ids["tts_text_start"],
        tts_text_end_token_id=ids["tts_text_end"],
        tts_text_pad_token_id=ids["tts_text_pad"],
        tts_codec_start_token_id=CODEC_BOS,
        tts_codec_end_token_id=CODEC_EOS,
        tts_codec_pad_token_id=CODEC_PAD,
        tts_codec_mask_token_id=CODEC_MASK,
        spatial_merge_size=2,
        **media_ids,
    )
    token2wav = dict(
        dit_config=dict(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            head_dim=16,
            ff_mult=2,
            emb_dim=32,
            num_embeds=NUM_CODES + 1,
            mel_dim=80,
            repeats=2,
            block_size=24,
            look_ahead_layers=[1],
            look_backward_layers=[0],
            enc_emb_dim=32,
            enc_dim=32,
            enc_channels=[32, 32, 32, 32, 96],
            enc_attention_channels=16,
            enc_se_channels=16,
            enc_res2net_scale=2,
            dropout=0.0,
        ),
        bigvgan_config=dict(
            mel_dim=80,
            upsample_initial_channel=32,
            resblock_kernel_sizes=[3],
            resblock_dilation_sizes=[[1, 3, 5]],
            upsample_rates=[8, 6, 5],  # 240 samples per mel frame, as in the released model
            upsample_kernel_sizes=[16, 12, 11],
        ),
    )
    return Qwen2_5OmniConfig(thinker_config=thinker, talker_config=talker, token2wav_config=token2wav)


def make_omni_tokenizer(out_dir: str | Path) -> Path:
    return make_tokenizer(
        out_dir,
        extra_special_tokens=OMNI_SPECIAL_TOKENS,
        named_special_tokens=NAMED_SPECIAL_TOKENS,
        chat_template="qwen2_5_omni_chat_template.jinja",
        model_max_length=4096,
    )


def save_processor(out_dir: Path) -> None:
    """Processor files next to the tokenizer: feature extractor, image and video processors, chat template."""
    from transformers import AutoTokenizer, Qwen2_5OmniProcessor, WhisperFeatureExtractor
    from transformers.models.qwen2_vl import Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    # Few vision tokens per image / frame pair (one token per 28x28 pixels), short audio padding (30 s).
    pixels = dict(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 64)
    processor = Qwen2_5OmniProcessor(
        image_processor=Qwen2VLImageProcessor(patch_size=14, temporal_patch_size=2, merge_size=2, **pixels),
        video_processor=Qwen2VLVideoProcessor(patch_size=14, temporal_patch_size=2, merge_size=2, **pixels),
        feature_extractor=WhisperFeatureExtractor(
            feature_size=128, sampling_rate=AUDIO_IN_RATE, hop_length=160, chunk_length=30, n_fft=400,
            return_attention_mask=True,
        ),
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
    )
    processor.save_pretrained(out_dir)
    # save_pretrained echoes how the tokenizer was loaded; those keys describe no checkpoint.
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    for key in ("is_local", "local_files_only"):
        cfg.pop(key, None)
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _scale_blocks(module: torch.nn.Module, layer: float, qk: float = 1.0, skip: tuple[str, ...] = ()) -> None:
    for name, p in module.named_parameters():
        if p.ndim >= 2 and not any(s in name for s in skip):
            p.mul_(qk if name.endswith(("q_proj.weight", "k_proj.weight")) else layer)


@torch.no_grad()
def _shape_weights(model: Any, ids: dict[str, int]) -> None:
    thinker_lm = model.thinker.model.language_model
    _scale_blocks(thinker_lm.layers, _THINKER_LAYER, _THINKER_QK)
    thinker_lm.norm.weight.mul_(_THINKER_NORM)
    head = model.thinker.lm_head.weight
    head.mul_(torch.exp(_ROW_NORM_SIGMA * torch.randn(head.shape[0], 1)))
    # Special and reserved tokens (and the unused rows past them) stay out of greedy thinker output.
    unlikely = [i for name, i in ids.items() if name.startswith(("<|", "tts_", "voice_"))]
    head[unlikely] *= 0.1
    head[max(ids.values()) + 1 :] *= 0.1

    audio = model.thinker.model.audio_tower
    _scale_blocks(audio.layers, _AUDIO_LAYER)
    for conv in (audio.conv1, audio.conv2):
        conv.weight.mul_(_AUDIO_LAYER)
    audio.proj.weight.mul_(_AUDIO_PROJ)
    audio.proj.bias.mul_(_AUDIO_PROJ)

    talker = model.talker
    _scale_blocks(talker.model.layers, _TALKER_LAYER, _TALKER_QK)
    talker.model.norm.weight.mul_(_TALKER_NORM)
    # The talker emits only codes token2wav can embed: zero logits for the special codec ids and above.
    talker.codec_head.weight[NUM_CODES:] = 0.0

    dit = model.token2wav.code2wav_dit_model
    for i in (0, 2):
        dit.time_embed.time_mlp[i].weight.mul_(_DIT_TIME)
    _scale_blocks(dit.transformer_blocks, _DIT_LAYER, skip=("attn_norm.",))
    for block in dit.transformer_blocks:
        block.attn_norm.linear.weight.mul_(_DIT_ADA)
    dit.norm_out.linear.weight.mul_(_DIT_ADA)
    dit.text_embed.codec_embed.weight.mul_(_DIT_CODE)
    dit.proj_out.weight.mul_(_DIT_OUT)
    model.token2wav.code2wav_bigvgan_model.conv_post.weight.mul_(_VOCODER_GAIN)


def _speakers(config: Any, ids: dict[str, int], seed: int) -> dict[str, dict[str, Any]]:
    dit = config.token2wav_config.dit_config
    gen = torch.Generator().manual_seed(seed + 1)
    return {
        voice: {
            "bos_token": ids[f"voice_{voice}"],
            "cond": torch.randn(1, dit.enc_emb_dim, generator=gen),
            "ref_mel": torch.randn(1, 60, dit.mel_dim, generator=gen),
        }
        for voice in VOICES
    }


def make_tiny_qwen2_5_omni(out_dir: str | Path, seed: int = 0) -> Path:
    """Write a tiny Qwen2.5-Omni checkpoint to `out_dir`; identical bytes for identical arguments."""
    from transformers import AutoTokenizer, GenerationConfig, Qwen2_5OmniForConditionalGeneration

    out = make_omni_tokenizer(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = _token_ids(tokenizer)
    with thinker_ids_unflagged():  # the configs are built here, and again as the model is made and saved
        config = tiny_config(tokenizer)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = Qwen2_5OmniForConditionalGeneration(config).float().eval()
            _shape_weights(model, ids)
        model.generation_config = GenerationConfig(
            bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"]
        )
        model.save_pretrained(out)
    torch.save(_speakers(config, ids, seed), out / "spk_dict.pt")
    save_processor(out)
    return out
