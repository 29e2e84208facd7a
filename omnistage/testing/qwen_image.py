"""Tiny random-weight Qwen-Image checkpoints in diffusers' layouts (model_index.json + one subfolder per component),
built locally: real component classes with tiny configs, weights saved as safetensors by `save_pretrained`.

- `"t2i"`: `QwenImagePipeline` (Qwen2.5-VL text encoder, Qwen2 tokenizer, MMDiT, VAE, scheduler).
- `"edit"`: `QwenImageEditPipeline`, plus a `Qwen2VLProcessor` whose image processor turns each input image into
  a few vision tokens for the text encoder's (tiny) vision tower.
- `"edit-plus"`: `QwenImageEditPlusPipeline`, the same components (it takes several input images).

The tokenizer is the project's byte-level BPE (testing/factory.py) with Qwen2.5-VL's vision special tokens, which
the pipelines' prompt templates contain; the scheduler has Qwen-Image's released config (dynamic exponential
shift, shift_terminal 0.02).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

# Bump whenever the produced files change, so stale cached checkpoints are not reused.
FACTORY_VERSION = 1
VARIANTS = ("t2i", "edit", "edit-plus")

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
_TEXT_DIM = 32  # the text encoder's width: the DiT's joint attention input
_Z_DIM = 4  # VAE latent channels; packed 2x2 they are the DiT's 16 input channels
# Qwen-Image's released scheduler_config.json.
SCHEDULER_CONFIG = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5,
                        max_shift=0.9, base_image_seq_len=256, max_image_seq_len=8192, time_shift_type="exponential",
                        shift_terminal=0.02)


def _text_encoder(tokenizer) -> torch.nn.Module:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=_TEXT_DIM, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]},
                         bos_token_id=eot, eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                         pad_token_id=eot),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, window_size=112, out_hidden_size=_TEXT_DIM,
                           fullatt_block_indexes=[0]),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def _processor(tokenizer):
    from transformers import Qwen2VLProcessor
    from transformers.models.qwen2_vl import Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    # Few vision tokens per image (one per 28x28 pixels after resizing into this range).
    pixels = dict(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16)
    return Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(patch_size=14, temporal_patch_size=2, merge_size=2, **pixels),
        video_processor=Qwen2VLVideoProcessor(patch_size=14, temporal_patch_size=2, merge_size=2, **pixels),
        tokenizer=tokenizer, chat_template=tokenizer.chat_template)


def make_tiny_qwen_image(out_dir: str | Path, variant: str = "t2i", seed: int = 0) -> Path:
    """Write a tiny Qwen-Image pipeline directory of `variant` to `out_dir`."""
    import diffusers
    from transformers import Qwen2Tokenizer

    from omnistage.testing.factory import make_tokenizer

    if variant not in VARIANTS:
        raise ValueError(f"unknown Qwen-Image variant {variant!r}; expected one of {list(VARIANTS)}")
    out = Path(out_dir)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = Qwen2Tokenizer.from_pretrained(make_tokenizer(Path(tmp), extra_special_tokens=VISION_TOKENS))
    with torch.random.fork_rng(devices=[]):  # don't disturb the caller's RNG stream
        torch.manual_seed(seed)
        text_encoder = _text_encoder(tokenizer)
        transformer = diffusers.QwenImageTransformer2DModel(
            patch_size=2, in_channels=_Z_DIM * 4, out_channels=_Z_DIM, num_layers=2, attention_head_dim=16,
            num_attention_heads=1, joint_attention_dim=_TEXT_DIM, axes_dims_rope=(4, 6, 6))
        vae = diffusers.AutoencoderKLQwenImage(
            base_dim=8, z_dim=_Z_DIM, dim_mult=[1, 1, 1, 1], num_res_blocks=0, attn_scales=[],
            temperal_downsample=[False, True, True], latents_mean=[-0.2, 0.1, 0.3, -0.4],
            latents_std=[1.5, 2.0, 0.8, 1.2])
        # Random init leaves the DiT's output projection and adaLN at scale ~0.02 and its attention nearly uniform
        # over thousands of conditioning tokens: scale them (and sharpen attention through the q/k norms) so the
        # velocity, and so the image, clearly depends on the prompt, the timestep and each input image.
        with torch.no_grad():
            transformer.proj_out.weight.mul_(20.0)
            for block in transformer.transformer_blocks:
                block.img_mod[1].weight.mul_(10.0)
                block.txt_mod[1].weight.mul_(10.0)
                for norm in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
                    getattr(block.attn, norm).weight.mul_(3.0)
            vae.decoder.conv_out.weight.mul_(8.0)  # contrast: decoded images span more of [0, 1]
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG)
    parts = dict(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer)
    if variant == "t2i":
        pipe = diffusers.QwenImagePipeline(**parts)
    else:
        cls = diffusers.QwenImageEditPipeline if variant == "edit" else diffusers.QwenImageEditPlusPipeline
        pipe = cls(processor=_processor(tokenizer), **parts)
    pipe.save_pretrained(out, safe_serialization=True)
    return out


make_tiny = make_tiny_qwen_image  # the factory's entry point (testing/factory.py DIFFUSERS_LAYOUTS)


def tiny_qwen_image(variant: str = "t2i", seed: int = 0) -> Path:
    """A cached tiny Qwen-Image checkpoint dir: `tiny_checkpoint("qwen-image" / "qwen-image-edit" / ...)`."""
    from omnistage.testing.factory import tiny_checkpoint

    return tiny_checkpoint("qwen-image" if variant == "t2i" else f"qwen-image-{variant}", seed)
