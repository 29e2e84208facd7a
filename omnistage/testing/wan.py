"""Tiny random-weight Wan2.2 checkpoints in diffusers' layouts (model_index.json + one subfolder per component),
built locally: a UMT5 text encoder with a T5 (unigram) tokenizer trained on the bundled corpus, the video DiT
(`WanTransformer3DModel`), the causal video VAE (`AutoencoderKLWan`) and the flow UniPC scheduler, weights saved as
safetensors by `save_pretrained`. The variants follow the released checkpoints' structure:

- "t2v" (Wan2.2-T2V-A14B): `WanPipeline` with two experts, `transformer` (high noise) and `transformer_2` (low
  noise), switched at `boundary_ratio` 0.875; the Wan2.1 VAE (8x spatial, 16 latent channels);
- "i2v" (Wan2.2-I2V-A14B): `WanImageToVideoPipeline`, two experts switched at 0.9, whose DiT input is the noise
  (16 channels) beside the first-frame mask (4) and the image's latent condition (16); no CLIP image encoder;
- "ti2v" (Wan2.2-TI2V-5B): `WanPipeline` with one DiT, `expand_timesteps` (per-token timesteps, the first frame
  kept when an image is given) and the Wan2.2 VAE (residual, 2x2 patchified pixels: 16x spatial, 48 channels).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

# Bump whenever the produced files change, so stale cached checkpoints are not reused.
FACTORY_VERSION = 1
VARIANTS = ("t2v", "i2v", "ti2v")
ARCHS = {"t2v": "wan2_2_t2v", "i2v": "wan2_2_i2v", "ti2v": "wan2_2_ti2v"}  # the factory's layout names
BOUNDARY = {"t2v": 0.875, "i2v": 0.9}  # the released model_index.json boundary ratios
FLOW_SHIFT = {"t2v": 12.0, "i2v": 5.0, "ti2v": 5.0}  # the authors' sample shifts

_TEXT_DIM = 32  # the text encoder's width, the DiT's text_dim


def _vae(variant: str):
    from diffusers import AutoencoderKLWan

    if variant != "ti2v":  # the Wan2.1 VAE: 3 spatial and 2 temporal downsamplings, 16 channels (default stats)
        return AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=1, attn_scales=[],
                                temperal_downsample=[False, True, True])
    # The Wan2.2 VAE: residual blocks over 2x2-patchified pixels (12 channels), 48 latent channels with their own
    # normalization statistics (made up here, of the released magnitudes).
    stats = torch.Generator().manual_seed(48)
    mean = (torch.rand(48, generator=stats) * 0.6 - 0.3).round(decimals=4).tolist()
    std = (torch.rand(48, generator=stats) * 0.5 + 0.4).round(decimals=4).tolist()
    return AutoencoderKLWan(base_dim=8, decoder_base_dim=12, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
                            attn_scales=[], temperal_downsample=[False, True, True], is_residual=True,
                            in_channels=12, out_channels=12, patch_size=2, scale_factor_spatial=16,
                            scale_factor_temporal=4, latents_mean=mean, latents_std=std)


def _transformer(in_channels: int, out_channels: int):
    from diffusers import WanTransformer3DModel

    # attention_head_dim 12: the 3-D rotary embedding splits it 4/4/4 over frames, rows and columns.
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                                 in_channels=in_channels, out_channels=out_channels, text_dim=_TEXT_DIM, freq_dim=32,
                                 ffn_dim=48, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                                 eps=1e-6, rope_max_seq_len=64)


def make_tiny_wan(out_dir: str | Path, variant: str = "t2v", seed: int = 0) -> Path:
    """Write a tiny Wan2.2 pipeline directory of `variant` ("t2v", "i2v", "ti2v") to `out_dir`."""
    from diffusers import UniPCMultistepScheduler, WanImageToVideoPipeline, WanPipeline
    from transformers import T5TokenizerFast, UMT5Config, UMT5EncoderModel

    from omnistage.testing.flux import _t5_tokenizer

    if variant not in VARIANTS:
        raise ValueError(f"unknown Wan2.2 variant {variant!r}; expected one of {list(VARIANTS)}")
    out = Path(out_dir)
    with tempfile.TemporaryDirectory() as tmp:
        size = _t5_tokenizer(Path(tmp))
        tokenizer = T5TokenizerFast.from_pretrained(tmp)
    with torch.random.fork_rng(devices=[]):  # don't disturb the caller's RNG stream
        torch.manual_seed(seed)
        text_encoder = UMT5EncoderModel(UMT5Config(
            vocab_size=size, d_model=_TEXT_DIM, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
            relative_attention_num_buckets=8, relative_attention_max_distance=32, feed_forward_proj="gated-gelu",
            dropout_rate=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)).eval()
        vae = _vae(variant)
        z = vae.config.z_dim
        # I2V's DiT sees the noise, the first-frame mask (one channel per frame of a latent frame) and the
        # image's latents; T2V and TI2V see the latents alone (TI2V writes its image into the first frame).
        channels = 2 * z + vae.config.scale_factor_temporal if variant == "i2v" else z
        transformer = _transformer(channels, z)
        transformer_2 = _transformer(channels, z) if variant in BOUNDARY else None
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                        num_train_timesteps=1000, flow_shift=FLOW_SHIFT[variant], solver_order=2,
                                        solver_type="bh2", final_sigmas_type="zero")
    parts = dict(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler,
                 transformer=transformer, transformer_2=transformer_2, boundary_ratio=BOUNDARY.get(variant),
                 expand_timesteps=variant == "ti2v")
    pipe = WanImageToVideoPipeline(**parts) if variant == "i2v" else WanPipeline(**parts)
    pipe.save_pretrained(out, safe_serialization=True)
    return out


make_tiny = make_tiny_wan  # the factory's entry point (testing/factory.py DIFFUSERS_LAYOUTS)


def tiny_wan(variant: str = "t2v", seed: int = 0) -> Path:
    """A cached tiny Wan2.2 checkpoint dir: `tiny_checkpoint("wan2_2_t2v")` (or "wan2_2_i2v", "wan2_2_ti2v")."""
    from omnistage.testing.factory import tiny_checkpoint

    return tiny_checkpoint(ARCHS[variant], seed)
