"""FLUX.1's parts as the diffusion engine drives them: CLIP (pooled) + T5 (sequence) text encoders, the MMDiT
(`FluxTransformer2DModel`) and the VAE, loaded from diffusers' `FluxPipeline` directory layout.

Each part computes what `diffusers.FluxPipeline` computes for the same inputs (same tokenization, packing, position
ids, timestep scaling and VAE post-processing), so images match it within the tolerance of batched kernels.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Hashable
from pathlib import Path

import torch

from omnistage.engine.diffusion.params import DiffusionParams
from omnistage.engine.schedulers.flow_match import FlowMatch, FlowMatchConfig, Schedule
from omnistage.families.diffusion import component_config

# Batch key: requests whose latents and text embeddings have the same shapes.
FluxKey = tuple[int, int, int]  # (latent height, latent width, T5 sequence length)


class FluxModel:
    def __init__(self, path: Path, device: torch.device, dtype: torch.dtype, parts: str = "all"):
        """`parts` (families.diffusion.Parts): "encoders" loads the tokenizers and text encoders only, "dit" the
        MMDiT and VAE only, "all" both."""
        from diffusers import AutoencoderKL, FluxTransformer2DModel
        from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5TokenizerFast

        self.device, self.dtype = device, dtype

        def load(cls: type, name: str, dtype_arg: str) -> torch.nn.Module:
            return cls.from_pretrained(path / name, **{dtype_arg: dtype}).to(device).eval()

        if parts != "dit":
            self.tokenizer = CLIPTokenizer.from_pretrained(path / "tokenizer")
            self.tokenizer_2 = T5TokenizerFast.from_pretrained(path / "tokenizer_2")
            self.text_encoder = load(CLIPTextModel, "text_encoder", "dtype")
            self.text_encoder_2 = load(T5EncoderModel, "text_encoder_2", "dtype")
        if parts != "encoders":
            self.transformer = load(FluxTransformer2DModel, "transformer", "torch_dtype")
            self.vae = load(AutoencoderKL, "vae", "torch_dtype")
        self.scheduler = FlowMatch(FlowMatchConfig.from_diffusers(
            json.loads((path / "scheduler" / "scheduler_config.json").read_text())))
        vae = component_config(AutoencoderKL, path / "vae")
        transformer = component_config(FluxTransformer2DModel, path / "transformer")
        self.vae_scale_factor = 2 ** (len(vae["block_out_channels"]) - 1)
        self.latent_channels = transformer["in_channels"] // 4  # packed as 2x2 patches
        self.guidance_embeds = bool(transformer.get("guidance_embeds"))

    # ---- shapes and schedule ----------------------------------------------------------------

    def batch_key(self, params: DiffusionParams) -> FluxKey:
        # Latents are 2x2-packed: the VAE's grid rounded down to even sizes, as diffusers rounds it.
        return (2 * (params.height // (self.vae_scale_factor * 2)), 2 * (params.width // (self.vae_scale_factor * 2)),
                params.max_sequence_length)

    def noise_shape(self, params: DiffusionParams) -> tuple[int, ...]:
        h, w, _ = self.batch_key(params)
        return (self.latent_channels, h, w)

    def schedule(self, params: DiffusionParams) -> Schedule:
        h, w, _ = self.batch_key(params)
        return self.scheduler.schedule(params.num_inference_steps, image_seq_len=(h // 2) * (w // 2))

    def cfg_scale(self, params: DiffusionParams) -> float | None:
        # diffusers' true CFG: only with a negative prompt and a scale above 1.
        return params.true_cfg_scale if params.true_cfg_scale > 1 and params.negative_prompt is not None else None

    def pack(self, noise: torch.Tensor, key: Hashable) -> torch.Tensor:
        """[n, C, h, w] -> [n, (h/2)(w/2), 4C]: each 2x2 patch of the latent grid is one token."""
        n, c, h, w = noise.shape
        patches = noise.view(n, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
        return patches.reshape(n, (h // 2) * (w // 2), c * 4)

    def unpack(self, latents: torch.Tensor, key: FluxKey) -> torch.Tensor:
        h, w, _ = key
        n, _, d = latents.shape
        grid = latents.view(n, h // 2, w // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
        return grid.reshape(n, d // 4, h, w)

    @functools.lru_cache(maxsize=16)  # noqa: B019 (one model per engine; keys are few)
    def _img_ids(self, h: int, w: int) -> torch.Tensor:
        """Rotary positions of the image tokens: (0, row, column) per 2x2 patch."""
        ids = torch.zeros(h // 2, w // 2, 3)
        ids[..., 1] = ids[..., 1] + torch.arange(h // 2)[:, None]
        ids[..., 2] = ids[..., 2] + torch.arange(w // 2)[None, :]
        return ids.reshape(-1, 3).to(device=self.device, dtype=self.dtype)

    @functools.lru_cache(maxsize=16)  # noqa: B019
    def _txt_ids(self, length: int) -> torch.Tensor:
        return torch.zeros(length, 3, device=self.device, dtype=self.dtype)

    # ---- the three calls of the loop --------------------------------------------------------

    def encode(self, prompts: list[str], params: list[DiffusionParams], inputs: list[dict[str, torch.Tensor]]
               ) -> dict[str, torch.Tensor]:
        """CLIP's pooled embedding and T5's padded sequence per prompt, plus the embedded guidance (FLUX.1-dev)."""
        clip_ids = self.tokenizer(prompts, padding="max_length", max_length=self.tokenizer.model_max_length,
                                  truncation=True, return_tensors="pt").input_ids
        t5_ids = self.tokenizer_2(prompts, padding="max_length", max_length=params[0].max_sequence_length,
                                  truncation=True, return_tensors="pt").input_ids
        pooled = self.text_encoder(clip_ids.to(self.device), output_hidden_states=False).pooler_output
        embeds = self.text_encoder_2(t5_ids.to(self.device), output_hidden_states=False)[0]
        cond = {"pooled_prompt_embeds": pooled.to(self.dtype), "prompt_embeds": embeds.to(self.dtype)}
        if self.guidance_embeds:
            cond["guidance"] = torch.tensor([p.guidance_scale for p in params], dtype=torch.float32,
                                            device=self.device)
        return cond

    def velocity(self, latents: torch.Tensor, timesteps: torch.Tensor, cond: dict[str, torch.Tensor],
                 key: FluxKey) -> torch.Tensor:
        h, w, length = key
        return self.transformer(
            hidden_states=latents,
            timestep=timesteps.to(latents.dtype) / 1000,  # FLUX is conditioned on sigma, in the latents' dtype
            guidance=cond.get("guidance"),
            pooled_projections=cond["pooled_prompt_embeds"],
            encoder_hidden_states=cond["prompt_embeds"],
            txt_ids=self._txt_ids(length),
            img_ids=self._img_ids(h, w),
            return_dict=False,
        )[0]

    def prompt_tokens(self, params: DiffusionParams, cond: dict[str, torch.Tensor]) -> int:
        """The prompt's T5 tokens (the sequence the DiT attends to; padding excluded)."""
        return len(self.tokenizer_2(params.prompt, truncation=True, max_length=params.max_sequence_length).input_ids)

    def decode(self, latents: torch.Tensor, key: FluxKey) -> torch.Tensor:
        config = self.vae.config
        z = self.unpack(latents, key) / config.scaling_factor + config.shift_factor
        image = self.vae.decode(z, return_dict=False)[0]
        return (image * 0.5 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).float().cpu()
