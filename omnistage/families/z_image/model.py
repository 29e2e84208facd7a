"""Z-Image's parts as the diffusion engine drives them: the Qwen3 text encoder, the single-stream DiT
(`ZImageTransformer2DModel`) and the VAE, loaded from diffusers' `ZImagePipeline` directory layout.

What `diffusers.ZImagePipeline` computes, row by row:
- a prompt is wrapped in the tokenizer's chat template (one user turn, generation prompt, thinking enabled), and its
  caption features are the encoder's second-to-last hidden states at the prompt's real (unmasked) tokens: a
  variable-length [L_i, D] per prompt;
- noise is drawn in float32 as [C, 2*(H // 16), 2*(W // 16)] for a VAE of scale 8, and latents stay float32 between
  steps (the DiT runs in its own dtype);
- the DiT takes per-row lists (latent [C, 1, h, w], caption features [L_i, D]) and is conditioned on
  (1000 - t) / 1000; the flow velocity is the negated prediction;
- sigmas are linspace(1, 1/steps, steps) before the scheduler's shift;
- CFG runs whenever guidance_scale > 0 (negative prompt "" by default) as pos + scale * (pos - neg).

Batch invariance: caption features are right-padded with a mask (`collate`), and the DiT selects each row's real
tokens from the mask, so a row sees exactly its own caption; the text encoder is causal and right-padded, so the
features of a prompt's tokens do not depend on the longer prompts it was encoded with.
"""

from __future__ import annotations

import json
from collections.abc import Hashable
from pathlib import Path

import torch

from omnistage.engine.diffusion.params import DiffusionParams
from omnistage.engine.schedulers.flow_match import FlowMatch, FlowMatchConfig, Schedule
from omnistage.families.base import TRANSFORMERS_LOAD
from omnistage.families.diffusion import component_config

ZImageKey = tuple[int, int]  # (latent height, latent width); caption lengths are padded per batch


def _pad_cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Stack [rows, L_i, ...] tensors along rows, zero-padding dim 1 to the longest."""
    length = max(t.shape[1] for t in tensors)
    return torch.cat([torch.nn.functional.pad(t, (0, 0) * (t.ndim - 2) + (0, length - t.shape[1])) for t in tensors])


class ZImageModel:
    def __init__(self, path: Path, device: torch.device, dtype: torch.dtype, parts: str = "all"):
        """`parts` (families.diffusion.Parts): "encoders" loads the tokenizer and text encoder only, "dit" the DiT
        and VAE only, "all" both."""
        from diffusers import AutoencoderKL, ZImageTransformer2DModel
        from transformers import AutoModel, AutoTokenizer

        # `dtype` is the latents' (diffusers draws and steps them in float32); the modules run in `compute_dtype`.
        self.device, self.dtype, self.compute_dtype = device, torch.float32, dtype
        if parts != "dit":
            self.tokenizer = AutoTokenizer.from_pretrained(path / "tokenizer")
            self.text_encoder = AutoModel.from_pretrained(path / "text_encoder", dtype=dtype,
                                                          **TRANSFORMERS_LOAD).to(device).eval()
        if parts != "encoders":
            self.transformer = ZImageTransformer2DModel.from_pretrained(path / "transformer", torch_dtype=dtype)
            self.transformer = self.transformer.to(device).eval()
            self.vae = AutoencoderKL.from_pretrained(path / "vae", torch_dtype=dtype).to(device).eval()
        self.scheduler = FlowMatch(FlowMatchConfig.from_diffusers(
            json.loads((path / "scheduler" / "scheduler_config.json").read_text())))
        vae = component_config(AutoencoderKL, path / "vae")
        self.vae_scale_factor = 2 ** (len(vae["block_out_channels"]) - 1)
        self.latent_channels = component_config(ZImageTransformer2DModel, path / "transformer")["in_channels"]

    # ---- shapes and schedule ----------------------------------------------------------------

    def batch_key(self, params: DiffusionParams) -> ZImageKey:
        # The DiT patchifies 2x2: the VAE's grid rounded down to even sizes, as diffusers rounds it.
        f = self.vae_scale_factor * 2
        return 2 * (params.height // f), 2 * (params.width // f)

    def noise_shape(self, params: DiffusionParams) -> tuple[int, ...]:
        return (self.latent_channels, *self.batch_key(params))

    def schedule(self, params: DiffusionParams) -> Schedule:
        h, w = self.batch_key(params)
        steps = params.num_inference_steps
        # diffusers passes these sigmas (torch's float32 linspace), which the scheduler then shifts.
        sigmas = torch.linspace(1.0, 1 / steps, steps).tolist()
        return self.scheduler.schedule(steps, image_seq_len=(h // 2) * (w // 2), sigmas=sigmas)

    def cfg_scale(self, params: DiffusionParams) -> float | None:
        return params.guidance_scale if params.guidance_scale > 0 else None

    @staticmethod
    def combine(pos: torch.Tensor, neg: torch.Tensor, scale: float) -> torch.Tensor:
        return pos + scale * (pos - neg)

    def pack(self, noise: torch.Tensor, key: Hashable) -> torch.Tensor:
        return noise  # the DiT takes the latent grid as it is

    # ---- the three calls of the loop --------------------------------------------------------

    def encode(self, prompts: list[str], params: list[DiffusionParams], inputs: list[dict[str, torch.Tensor]]
               ) -> dict[str, torch.Tensor]:
        """Caption features per prompt, right-padded to the longest: `prompt_embeds` [P, L, D] and `prompt_mask`
        [P, L] (True at real tokens). Each prompt is truncated to its own request's max_sequence_length."""
        texts = [self.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                    add_generation_prompt=True, enable_thinking=True)
                 for p in prompts]
        ids = [self.tokenizer(t, truncation=True, max_length=p.max_sequence_length).input_ids
               for t, p in zip(texts, params, strict=True)]
        length = max(len(i) for i in ids)
        pad = self.tokenizer.pad_token_id
        input_ids = torch.tensor([i + [pad] * (length - len(i)) for i in ids], device=self.device)
        mask = torch.tensor([[True] * len(i) + [False] * (length - len(i)) for i in ids], device=self.device)
        hidden = self.text_encoder(input_ids=input_ids, attention_mask=mask, output_hidden_states=True).hidden_states
        embeds = hidden[-2].to(self.compute_dtype) * mask[..., None]
        return {"prompt_embeds": embeds, "prompt_mask": mask}

    def collate(self, conds: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return {k: _pad_cat([c[k] for c in conds]) for k in conds[0]}

    def velocity(self, latents: torch.Tensor, timesteps: torch.Tensor, cond: dict[str, torch.Tensor],
                 key: ZImageKey) -> torch.Tensor:
        """The flow velocity per row, in float32 (the latents' dtype)."""
        x = list(latents.to(self.compute_dtype).unsqueeze(2).unbind(0))
        caps = [e[m] for e, m in zip(cond["prompt_embeds"], cond["prompt_mask"], strict=True)]
        out = self.transformer(x, (1000 - timesteps) / 1000, caps, return_dict=False)[0]
        return -torch.stack([o.float() for o in out]).squeeze(2)

    def prompt_tokens(self, params: DiffusionParams, cond: dict[str, torch.Tensor]) -> int:
        """The text-encoder tokens the DiT attends to for the prompt (`prompt_mask`'s real tokens)."""
        return int(cond["prompt_mask"].sum())

    def decode(self, latents: torch.Tensor, key: ZImageKey) -> torch.Tensor:
        config = self.vae.config
        z = latents.to(self.vae.dtype) / config.scaling_factor + config.shift_factor
        image = self.vae.decode(z, return_dict=False)[0]
        return (image * 0.5 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).float().cpu()
