"""A tiny random-weight FLUX.1 checkpoint in diffusers' `FluxPipeline` layout (model_index.json + one subfolder
per component), built locally: real component classes with tiny configs, CLIP (byte-level BPE) and T5 (unigram)
tokenizers trained on the bundled corpus, weights saved as safetensors by `save_pretrained`.

`variant="dev"` has the guidance embedding and FLUX.1-dev's dynamically shifted scheduler; `"schnell"` has
neither (static shift 1), as the released checkpoints do.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

# Bump whenever the produced files change, so stale cached checkpoints are not reused.
FACTORY_VERSION = 1
VARIANTS = ("dev", "schnell")

_CORPUS = Path(__file__).resolve().parent / "corpus.txt"
_CLIP_SPECIALS = ("<|startoftext|>", "<|endoftext|>")
_T5_SPECIALS = ("<pad>", "</s>", "<unk>")  # T5's fixed ids 0, 1, 2
_TEXT_DIM = 32  # both text encoders' width (the transformer's joint and pooled projection inputs)
# Packed latents: 4 VAE channels x 2x2 patches feed the transformer's 16 input channels; 2 VAE blocks: 2x down.
_LATENT_CHANNELS = 4


def _corpus_lines() -> list[str]:
    return _CORPUS.read_text(encoding="utf-8").splitlines(keepends=True)


def _clip_tokenizer(out: Path) -> int:
    """CLIP's pipeline (lower-cased, words end in </w>, byte-level) with merges trained here; returns its size."""
    from tokenizers import Tokenizer, models, trainers
    from transformers import CLIPTokenizer

    template = CLIPTokenizer()  # an empty tokenizer with CLIP's normalizer and pre-tokenizer to train under
    tok = Tokenizer(models.BPE(end_of_word_suffix="</w>", unk_token=_CLIP_SPECIALS[1]))
    tok.normalizer = template.backend_tokenizer.normalizer
    tok.pre_tokenizer = template.backend_tokenizer.pre_tokenizer
    from tokenizers import pre_tokenizers

    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=list(_CLIP_SPECIALS), end_of_word_suffix="</w>",
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus_lines(), trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    clip = CLIPTokenizer(vocab=model["vocab"], merges=merges, model_max_length=77)
    clip.save_pretrained(out)
    return len(clip)


def _t5_tokenizer(out: Path) -> int:
    """A unigram vocabulary trained under T5's metaspace pre-tokenizer; returns its size."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import T5TokenizerFast

    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=300, special_tokens=list(_T5_SPECIALS), unk_token="<unk>",
                                      show_progress=False)
    tok.train_from_iterator(_corpus_lines(), trainer=trainer)
    vocab = [(piece, score) for piece, score in json.loads(tok.to_str())["model"]["vocab"]]
    t5 = T5TokenizerFast(vocab=vocab, extra_ids=0, model_max_length=512)
    t5.save_pretrained(out)
    return len(t5)


def make_tiny_flux(out_dir: str | Path, variant: str = "dev", seed: int = 0) -> Path:
    """Write a tiny FluxPipeline directory to `out_dir`."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer, T5Config, T5EncoderModel, T5TokenizerFast

    if variant not in VARIANTS:
        raise ValueError(f"unknown FLUX variant {variant!r}; expected one of {list(VARIANTS)}")
    out = Path(out_dir)
    with tempfile.TemporaryDirectory() as tmp:
        clip_size = _clip_tokenizer(Path(tmp) / "clip")
        t5_size = _t5_tokenizer(Path(tmp) / "t5")
        tokenizer = CLIPTokenizer.from_pretrained(Path(tmp) / "clip")
        tokenizer_2 = T5TokenizerFast.from_pretrained(Path(tmp) / "t5")
    if variant == "dev":  # FLUX.1-dev's scheduler: the shift grows with the image's token count
        scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
                                                    max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096)
    else:
        scheduler = FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=False)
    with torch.random.fork_rng(devices=[]):  # don't disturb the caller's RNG stream
        torch.manual_seed(seed)
        text_encoder = CLIPTextModel(CLIPTextConfig(
            vocab_size=clip_size, hidden_size=_TEXT_DIM, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=77, projection_dim=_TEXT_DIM,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id))
        text_encoder_2 = T5EncoderModel(T5Config(
            vocab_size=t5_size, d_model=_TEXT_DIM, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
            relative_attention_num_buckets=8, relative_attention_max_distance=32, feed_forward_proj="gated-gelu",
            dropout_rate=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))
        transformer = FluxTransformer2DModel(
            patch_size=1, in_channels=_LATENT_CHANNELS * 4, num_layers=1, num_single_layers=1, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=_TEXT_DIM, pooled_projection_dim=_TEXT_DIM,
            guidance_embeds=variant == "dev", axes_dims_rope=(4, 6, 6))
        vae = AutoencoderKL(
            in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
            latent_channels=_LATENT_CHANNELS, norm_num_groups=4, sample_size=32, scaling_factor=0.3611,
            shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False)
    pipe = FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                        text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2, transformer=transformer)
    pipe.save_pretrained(out, safe_serialization=True)
    return out


make_tiny = make_tiny_flux  # the factory's entry point (testing/factory.py DIFFUSERS_LAYOUTS)


def tiny_flux(variant: str = "dev", seed: int = 0) -> Path:
    """A cached tiny FLUX checkpoint dir: `tiny_checkpoint("flux-<variant>")`."""
    from omnistage.testing.factory import tiny_checkpoint

    return tiny_checkpoint(f"flux-{variant}", seed)
