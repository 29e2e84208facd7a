"""A tiny random-weight Z-Image checkpoint in diffusers' `ZImagePipeline` layout (model_index.json + one subfolder
per component), built locally: a Qwen3 text encoder (`Qwen3Model`, as the released checkpoints name it) with the
project's byte-level Qwen2 tokenizer and chat template, the single-stream DiT (`ZImageTransformer2DModel`), a FLUX-style
`AutoencoderKL` and a `FlowMatchEulerDiscreteScheduler`, weights saved as safetensors by `save_pretrained`.

The two variants differ where the released checkpoints differ: the scheduler's static shift (Z-Image-Turbo 3.0,
Z-Image 6.0); the components' classes and architecture are the same.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

# Bump whenever the produced files change, so stale cached checkpoints are not reused.
FACTORY_VERSION = 1
VARIANTS = ("base", "turbo")
SHIFTS = {"base": 6.0, "turbo": 3.0}  # the released scheduler_config.json shifts

_TEXT_DIM = 32  # the text encoder's width: the DiT's caption feature input
_LATENT_CHANNELS = 4  # VAE latent channels, the DiT's input channels (it patchifies 2x2 itself)


def make_tiny_z_image(out_dir: str | Path, variant: str = "turbo", seed: int = 0) -> Path:
    """Write a tiny ZImagePipeline directory of `variant` to `out_dir`."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen2Tokenizer, Qwen3Config, Qwen3Model

    from omnistage.testing.factory import make_tokenizer

    if variant not in VARIANTS:
        raise ValueError(f"unknown Z-Image variant {variant!r}; expected one of {list(VARIANTS)}")
    out = Path(out_dir)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = Qwen2Tokenizer.from_pretrained(make_tokenizer(Path(tmp)))
    with torch.random.fork_rng(devices=[]):  # don't disturb the caller's RNG stream
        torch.manual_seed(seed)
        text_encoder = Qwen3Model(Qwen3Config(
            vocab_size=len(tokenizer), hidden_size=_TEXT_DIM, intermediate_size=64, num_hidden_layers=3,
            num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=1024,
            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)).eval()
        transformer = ZImageTransformer2DModel(
            in_channels=_LATENT_CHANNELS, dim=32, n_layers=2, n_refiner_layers=1, n_heads=2, n_kv_heads=2,
            cap_feat_dim=_TEXT_DIM, axes_dims=[4, 6, 6], axes_lens=[1024, 64, 64])
        vae = AutoencoderKL(
            in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
            latent_channels=_LATENT_CHANNELS, norm_num_groups=4, sample_size=32, scaling_factor=0.3611,
            shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False)
        # Random init leaves attention nearly uniform over the (mostly chat-template) caption tokens: sharpen it
        # through the q/k norms so the image clearly depends on the prompt.
        with torch.no_grad():
            for name, weight in transformer.named_parameters():
                if name.endswith(("norm_q.weight", "norm_k.weight")):
                    weight.mul_(3.0)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=SHIFTS[variant],
                                                use_dynamic_shifting=False)
    pipe = ZImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                          transformer=transformer)
    pipe.save_pretrained(out, safe_serialization=True)
    return out


make_tiny = make_tiny_z_image  # the factory's entry point (testing/factory.py DIFFUSERS_LAYOUTS)


def tiny_z_image(variant: str = "turbo", seed: int = 0) -> Path:
    """A cached tiny Z-Image checkpoint dir: `tiny_checkpoint("z-image")` / `tiny_checkpoint("z-image-turbo")`."""
    from omnistage.testing.factory import tiny_checkpoint

    return tiny_checkpoint("z-image-turbo" if variant == "turbo" else "z-image", seed)
