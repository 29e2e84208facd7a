"""A tiny random-weight Qwen3-TTS-12Hz checkpoint (talker + code predictor + speech tokenizer), built offline.

The layout is the released one (docs/families/qwen3_tts.md): `config.json` (`model_type: qwen3_tts`, a
`talker_config` with its `code_predictor_config`, speakers in `spk_id`), `generation_config.json`, a Qwen2
tokenizer with the TTS text special tokens, `model.safetensors` with `talker.*` weights, and `speech_tokenizer/`
(12 Hz codec: Mimi encoder + this model's decoder, `preprocessor_config.json`). The reference package loads it
with `Qwen3TTSModel.from_pretrained` (no missing or unused weights). Variants: "custom_voice" (three speakers, one
a dialect speaker), "voice_design" (no speakers: the voice is an instruction) and "base" (voice clone: a tiny
ECAPA-TDNN `speaker_encoder.*`; the speech tokenizer's Mimi encoder gives ICL reference codes).

Ids in the tiny vocabularies (the released model's in brackets):

- text: the tokenizer's 512 ids plus the special tokens added here (`<|tts_pad|>` ...; "assistant" is one token,
  as in Qwen's vocabulary, so the prompt's role prefix is 3 tokens); `text_vocab_size` = len(tokenizer).
- codec (talker): codes 0..CODEBOOK-1 [2048], then the control ids, all inside `[vocab - 1024, vocab)` (the
  range the talker's sampler suppresses, eos excepted) as in the released model; `vocab_size` = CODEBOOK + 1024.

Weights are scaled like the causal-LM factory's (unit-gain layers, a scaled final norm) so greedy codes vary and
top-1 logits are well separated; the codec head's eos row is scaled so that greedy decoding of short texts ends
by eos for some texts (after ~10-50 frames) and runs past 60 frames for others.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from omnistage.testing.factory import make_tokenizer

# Bump whenever the produced files change, so stale cached checkpoints are not reused.
FACTORY_VERSION = 2

TTS_TOKENS = ("<|tts_pad|>", "<|tts_text_bos|>", "<|tts_text_eod|>", "assistant")
Q = 4  # codebooks per frame [16]
CODEBOOK = 32  # entries per codebook [2048]
CODEC_VOCAB = CODEBOOK + 1024  # [3072]
CODEC_IDS = dict(codec_pad_id=CODEBOOK + 8, codec_bos_id=CODEBOOK + 9, codec_eos_token_id=CODEBOOK + 10,
                 codec_think_id=CODEBOOK + 14, codec_nothink_id=CODEBOOK + 15, codec_think_bos_id=CODEBOOK + 16,
                 codec_think_eos_id=CODEBOOK + 17)
SPEAKERS = {"vivian": CODEBOOK + 30, "ryan": CODEBOOK + 31, "eric": CODEBOOK + 32}
SPEAKER_DIALECT = {"vivian": False, "ryan": False, "eric": "sichuan_dialect"}
LANGUAGES = {"english": CODEBOOK + 40, "chinese": CODEBOOK + 41, "sichuan_dialect": CODEBOOK + 42}

TALKER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, text_hidden_size=32, rope_theta=10000.0)
PREDICTOR = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16, rope_theta=10000.0)
# The speech tokenizer (as in tests/families/qwen3_tts/test_codec.py).
CODEC_DECODER = dict(
    codebook_size=CODEBOOK, codebook_dim=16, latent_dim=32, hidden_size=32, intermediate_size=64,
    num_attention_heads=2, num_key_value_heads=2, head_dim=8, num_hidden_layers=2, num_quantizers=Q, sliding_window=8,
    decoder_dim=32, upsample_rates=[8, 5, 4, 3], upsampling_ratios=[2, 2],
)
CODEC_ENCODER = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
    head_dim=16, num_filters=4, upsample_groups=32, codebook_dim=16, vector_quantization_hidden_dimension=16,
    num_quantizers=Q, codebook_size=CODEBOOK, upsampling_ratios=[8, 6, 5, 4],
)  # Mimi's codebooks are `codebook_dim` wide and its RVQ projects to `vector_quantization_hidden_dimension`: equal
# The Base variant's ECAPA-TDNN speaker encoder [channels 512,512,512,512,1536, Res2Net scale 8, SE 128, attention
# 128]; its output width is the talker's hidden size (the x-vector takes a codec-prefix position).
SPEAKER_ENCODER = dict(mel_dim=128, enc_dim=TALKER["hidden_size"], enc_channels=[16, 16, 16, 16, 48],
                       enc_kernel_sizes=[5, 3, 3, 3, 1], enc_dilations=[1, 2, 3, 4, 1], enc_attention_channels=8,
                       enc_res2net_scale=4, enc_se_channels=8, sample_rate=24000)
VARIANTS = ("custom_voice", "voice_design", "base")
_LOGIT_SCALE = 3.0  # final-norm gain: logits std ~3 with unit-gain heads
_EOS_GAIN = 1.5  # eos row of the codec head


def _decoder_weights(prefix: str, layers: int, hidden: int, inter: int, heads: int, kv_heads: int, head_dim: int,
                     g: torch.Generator) -> dict[str, torch.Tensor]:
    """Qwen3 decoder layers (q/k norm, SwiGLU) with unit-gain random projections, plus the final norm."""
    def lin(out: int, inp: int) -> torch.Tensor:
        return torch.randn(out, inp, generator=g) * inp ** -0.5

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    w: dict[str, torch.Tensor] = {}
    for i in range(layers):
        p = f"{prefix}.layers.{i}."
        w |= {p + "self_attn.q_proj.weight": lin(heads * head_dim, hidden),
              p + "self_attn.k_proj.weight": lin(kv_heads * head_dim, hidden),
              p + "self_attn.v_proj.weight": lin(kv_heads * head_dim, hidden),
              p + "self_attn.o_proj.weight": lin(hidden, heads * head_dim),
              p + "self_attn.q_norm.weight": 2.0 * norm(head_dim), p + "self_attn.k_norm.weight": 2.0 * norm(head_dim),
              p + "mlp.gate_proj.weight": lin(inter, hidden), p + "mlp.up_proj.weight": lin(inter, hidden),
              p + "mlp.down_proj.weight": lin(hidden, inter),
              p + "input_layernorm.weight": norm(hidden), p + "post_attention_layernorm.weight": norm(hidden)}
    w[f"{prefix}.norm.weight"] = _LOGIT_SCALE * norm(hidden)
    return w


def _talker_weights(text_vocab: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    t, p = TALKER, PREDICTOR
    h, th, ph = t["hidden_size"], t["text_hidden_size"], p["hidden_size"]
    w = _decoder_weights("talker.model", t["num_hidden_layers"], h, t["intermediate_size"], t["num_attention_heads"],
                         t["num_key_value_heads"], t["head_dim"], g)
    w |= _decoder_weights("talker.code_predictor.model", p["num_hidden_layers"], ph, p["intermediate_size"],
                          p["num_attention_heads"], p["num_key_value_heads"], p["head_dim"], g)
    w["talker.model.codec_embedding.weight"] = torch.randn(CODEC_VOCAB, h, generator=g)
    w["talker.model.text_embedding.weight"] = torch.randn(text_vocab, th, generator=g)
    w["talker.text_projection.linear_fc1.weight"] = torch.randn(th, th, generator=g) * th ** -0.5
    w["talker.text_projection.linear_fc1.bias"] = 0.1 * torch.randn(th, generator=g)
    w["talker.text_projection.linear_fc2.weight"] = torch.randn(h, th, generator=g) * th ** -0.5
    w["talker.text_projection.linear_fc2.bias"] = 0.1 * torch.randn(h, generator=g)
    head = torch.randn(CODEC_VOCAB, h, generator=g) * h ** -0.5
    head[CODEC_IDS["codec_eos_token_id"]] *= _EOS_GAIN
    w["talker.codec_head.weight"] = head
    for k in range(Q - 1):
        w[f"talker.code_predictor.model.codec_embedding.{k}.weight"] = torch.randn(CODEBOOK, h, generator=g)
        w[f"talker.code_predictor.lm_head.{k}.weight"] = torch.randn(CODEBOOK, ph, generator=g) * ph ** -0.5
    w["talker.code_predictor.small_to_mtp_projection.weight"] = torch.randn(ph, h, generator=g) * h ** -0.5
    w["talker.code_predictor.small_to_mtp_projection.bias"] = 0.1 * torch.randn(ph, generator=g)
    return {k: v.contiguous() for k, v in w.items()}


def _speaker_encoder_weights(g: torch.Generator) -> dict[str, torch.Tensor]:
    """Random `speaker_encoder.*` weights: unit-gain convolutions so the x-vector is not vanishingly small."""
    from omnistage.families.qwen3_tts.speaker import SpeakerEncoder

    enc = SpeakerEncoder(SPEAKER_ENCODER)
    with torch.no_grad():
        for p in enc.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (p[0].numel() ** -0.5 if p.ndim >= 2 else 0.1))
    return {f"speaker_encoder.{k}": v.contiguous() for k, v in enc.state_dict().items()}


def _configs(tokenizer, variant: str) -> tuple[dict, dict]:
    ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in
           (("tts_pad_token_id", "<|tts_pad|>"), ("tts_bos_token_id", "<|tts_text_bos|>"),
            ("tts_eos_token_id", "<|tts_text_eod|>"), ("im_start_token_id", "<|im_start|>"),
            ("im_end_token_id", "<|im_end|>"))}
    t, p = TALKER, PREDICTOR
    predictor = dict(p, vocab_size=CODEBOOK, num_code_groups=Q, hidden_act="silu", rms_norm_eps=1e-6,
                     max_position_embeddings=64, layer_types=["full_attention"] * p["num_hidden_layers"],
                     use_sliding_window=False)
    talker = dict(
        t, vocab_size=CODEC_VOCAB, text_vocab_size=len(tokenizer), num_code_groups=Q, hidden_act="silu",
        rms_norm_eps=1e-6, max_position_embeddings=1024,
        rope_scaling={"rope_type": "default", "mrope_section": [4, 2, 2], "interleaved": True},
        code_predictor_config=predictor, spk_id=SPEAKERS if variant == "custom_voice" else {},
        spk_is_dialect=SPEAKER_DIALECT if variant == "custom_voice" else {},
        codec_language_id=LANGUAGES, position_id_per_seconds=13, **CODEC_IDS,
    )
    return ids, talker


# transformers 5 nests Mimi's encoder parts under `encoder.`; the released checkpoint (saved with 4.x) has them at
# the top level, with the SEANet encoder as `encoder.`
_MIMI_V4_NAMES = {"encoder.encoder_seanet.": "encoder.", "encoder.encoder_transformer.": "encoder_transformer.",
                  "encoder.downsample.": "downsample."}


def _mimi_name(name: str) -> str:
    for new, old in _MIMI_V4_NAMES.items():
        if name.startswith(new):
            return old + name[len(new) :]
    return name


def _speech_tokenizer(out: Path, g: torch.Generator) -> None:
    """`speech_tokenizer/`: a random Mimi encoder (as the package's encoder keeps it: no decoder half) and a random
    decoder, gains set so the decoder makes a non-trivial signal (see the codec parity test)."""
    from transformers import EncodecFeatureExtractor, MimiConfig, MimiModel

    from omnistage.families.qwen3_tts.codec import CodecDecoder

    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=g)))
    encoder = MimiModel(MimiConfig(**CODEC_ENCODER))
    with torch.no_grad():  # Mimi initialises its codebooks to zeros: every frame would encode to code 0. The
        # global generator seeded above draws them, so `g`'s stream (the decoder's weights) is as before.
        for name, b in encoder.named_buffers():
            if name.endswith("embed_sum"):
                b.normal_(0.0, 1.0)
            elif name.endswith("cluster_usage"):
                b.uniform_(0.5, 2.0)
    weights = {f"encoder.{_mimi_name(k)}": v for k, v in encoder.state_dict().items()
               if not k.startswith(("upsample.", "decoder_transformer.", "decoder."))}
    decoder = CodecDecoder(CODEC_DECODER)
    with torch.no_grad():
        for name, p in decoder.named_parameters():
            if name.endswith("embedding_sum"):
                p.normal_(0.0, 1.0, generator=g)
            elif name.endswith("cluster_usage"):
                p.uniform_(0.5, 2.0, generator=g)
            elif p.ndim >= 2:
                p.normal_(0.0, p[0].numel() ** -0.5, generator=g)
            elif name.endswith((".scale", ".gamma")):
                p.fill_(0.5)
    weights |= {f"decoder.{k}": v for k, v in decoder.state_dict().items()}
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"))
    config = dict(model_type="qwen3_tts_tokenizer_12hz", architectures=["Qwen3TTSTokenizerV2Model"],
                  encoder_config=CODEC_ENCODER, decoder_config=CODEC_DECODER, encoder_valid_num_quantizers=Q,
                  input_sample_rate=24000, output_sample_rate=24000, decode_upsample_rate=1920,
                  encode_downsample_rate=1920)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    EncodecFeatureExtractor(feature_size=1, sampling_rate=24000).save_pretrained(out)


def make_tiny_qwen3_tts(out_dir: str | Path, variant: str = "custom_voice", seed: int = 0) -> Path:
    """Write the tiny checkpoint to `out_dir`; identical bytes for identical arguments. `variant`: "custom_voice"
    (speakers, the 0.6B size that ignores instructions), "voice_design" (no speakers; the voice is described by
    an instruction) or "base" (voice clone: no speakers, a `speaker_encoder.*` ECAPA-TDNN; the speech tokenizer's
    encoder gives the reference codes)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; one of {', '.join(VARIANTS)}")
    out = make_tokenizer(out_dir, extra_special_tokens=TTS_TOKENS)
    # transformers 5 writes the special tokens as a list under `extra_special_tokens`; the package's transformers
    # (4.57) reads that key as a dict of named tokens, and the list under `additional_special_tokens`.
    cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    tok_cfg["additional_special_tokens"] = tok_cfg.pop("extra_special_tokens")
    tok_cfg["tokenizer_class"] = "Qwen2Tokenizer"
    cfg_path.write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)
    text_ids, talker = _configs(tokenizer, variant)
    g = torch.Generator().manual_seed(seed)
    config = dict(model_type="qwen3_tts", architectures=["Qwen3TTSForConditionalGeneration"],
                  tts_model_type=variant, tts_model_size="1b7" if variant == "voice_design" else "0b6",
                  tokenizer_type="qwen3_tts_tokenizer_12hz",
                  talker_config=talker, dtype="float32",
                  speaker_encoder_config=SPEAKER_ENCODER if variant == "base" else {"enc_dim": TALKER["hidden_size"]},
                  **text_ids)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = dict(do_sample=True, top_k=50, top_p=1.0, temperature=0.9, repetition_penalty=1.05,
                      subtalker_dosample=True, subtalker_top_k=50, subtalker_top_p=1.0, subtalker_temperature=0.9,
                      max_new_tokens=2048)
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    weights = _talker_weights(len(tokenizer), g)
    if variant == "base":
        weights |= _speaker_encoder_weights(g)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    _speech_tokenizer(out / "speech_tokenizer", g)
    return out
