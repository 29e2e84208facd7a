"""Wan2.2's parts as the diffusion engine drives them: the UMT5 text encoder, one or two video DiTs
(`WanTransformer3DModel`: `transformer`, and for A14B the low-noise expert `transformer_2`) and the causal video VAE
(`AutoencoderKLWan`), loaded from diffusers' `WanPipeline` / `WanImageToVideoPipeline` directory layouts.

What diffusers' Wan pipelines compute, row by row:
- a prompt is cleaned (ftfy when installed, HTML unescaped, whitespace collapsed), tokenized to exactly
  max_sequence_length tokens, and its UMT5 features are zeroed past its real tokens: a fixed [L, D] per prompt
  (the DiT's cross-attention has no mask, so the zeros are attended to and L is part of the batch key);
- noise is drawn in float32 as [z_dim, (frames - 1) // 4 + 1, H / s, W / s] for the VAE's spatial factor s, and
  latents stay float32 between steps (the DiTs run in their own dtype);
- two experts: the high-noise `transformer` runs the steps with timestep >= boundary_ratio x train timesteps,
  guided by guidance_scale, the low-noise `transformer_2` the rest, guided by guidance_scale_2; CFG runs when
  guidance_scale > 1, as neg + scale * (pos - neg);
- I2V (A14B): the DiT's input is the noise beside a first-frame mask (4 channels: one per frame of a latent frame)
  and the VAE latents of the image followed by black frames;
- TI2V (`expand_timesteps`): the timestep is given per token; with an image, the first latent frame is the image's
  latents (timestep 0 there) at every step and in the decoded video.

Rows of one forward may be on both sides of their boundaries (requests at different steps): each expert runs on
its own rows (`velocity`). The boundary travels per row in the conditioning, so requests of different
boundary_ratio share forwards. TI2V requests with and without an image share forwards too: a row without an image
has an all-ones first-frame mask, which gives exactly the text-to-video input and timesteps.
"""

from __future__ import annotations

import html
import json
import re
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omnistage.engine.diffusion.params import DiffusionParams
from omnistage.engine.schedulers.diffusers_sampler import DiffusersSampler
from omnistage.families.base import TRANSFORMERS_LOAD
from omnistage.families.diffusion import component_config

WanKey = tuple[int, int, int, int]  # (latent frames, latent height, latent width, text length)


def clean_prompt(text: str) -> str:
    """Wan's prompt cleaning: ftfy's text fixes (when installed), HTML entities decoded twice, whitespace runs
    collapsed."""
    try:
        import ftfy

        text = ftfy.fix_text(text)
    except ImportError:
        pass
    return re.sub(r"\s+", " ", html.unescape(html.unescape(text)).strip()).strip()


class WanModel:
    def __init__(self, path: Path, device: torch.device, dtype: torch.dtype, parts: str = "all",
                 offload_idle_expert: bool = False):
        """`parts` (families.diffusion.Parts): "encoders" loads the tokenizer, text encoder and (for image input)
        the VAE, "dit" the DiTs and VAE, "all" everything. `offload_idle_expert`: of two experts only the one
        running is on `device`, the other waits in CPU memory."""
        from diffusers import AutoencoderKLWan, WanTransformer3DModel
        from transformers import AutoTokenizer, UMT5EncoderModel

        index = json.loads((path / "model_index.json").read_text())
        self.image_input = index["_class_name"] == "WanImageToVideoPipeline"  # A14B I2V: the image is required
        self.expand_timesteps = bool(index.get("expand_timesteps"))  # TI2V: the image is optional
        self.two_experts = (index.get("transformer_2") or [None])[0] is not None
        self.scheduler_config = json.loads((path / "scheduler" / "scheduler_config.json").read_text())
        # `dtype` is the latents' (diffusers draws and steps them in float32); the DiTs run in `compute_dtype`.
        self.device, self.dtype, self.compute_dtype = device, torch.float32, dtype
        self.offload_idle_expert = offload_idle_expert and self.two_experts
        if parts != "dit":
            self.tokenizer = AutoTokenizer.from_pretrained(path / "tokenizer")
            self.text_encoder = UMT5EncoderModel.from_pretrained(path / "text_encoder", dtype=dtype,
                                                                 **TRANSFORMERS_LOAD).to(device).eval()
        if parts != "encoders" or self.image_input or self.expand_timesteps:
            # The Wan VAE runs in float32, as its authors and diffusers' examples run it.
            self.vae = AutoencoderKLWan.from_pretrained(path / "vae", torch_dtype=torch.float32).to(device).eval()
        if parts != "encoders":
            def load(name: str, on: torch.device) -> Any:
                model = WanTransformer3DModel.from_pretrained(path / name, torch_dtype=dtype)
                return model.to(on).eval()

            self.transformer = load("transformer", device)
            if self.two_experts:
                self.transformer_2 = load("transformer_2", torch.device("cpu") if self.offload_idle_expert else device)
        vae = component_config(AutoencoderKLWan, path / "vae")  # the class defaults under the file's fields
        self.z_dim, self.scale_spatial, self.scale_temporal = (
            vae["z_dim"], vae["scale_factor_spatial"], vae["scale_factor_temporal"])
        self.latents_mean = torch.tensor(vae["latents_mean"]).view(1, -1, 1, 1, 1)
        self.latents_std = torch.tensor(vae["latents_std"]).view(1, -1, 1, 1, 1)
        self.patch = tuple(component_config(WanTransformer3DModel, path / "transformer")["patch_size"])
        self._processor = None

    @property
    def transformers(self) -> list[torch.nn.Module]:
        """The DiTs (experts) the acceleration switches apply to."""
        return [m for m in (getattr(self, "transformer", None), getattr(self, "transformer_2", None)) if m is not None]

    @property
    def num_train_timesteps(self) -> int:
        return self.scheduler_config.get("num_train_timesteps", 1000)

    # ---- shapes and schedule ----------------------------------------------------------------

    def batch_key(self, params: DiffusionParams) -> WanKey:
        frames = (params.num_frames - 1) // self.scale_temporal + 1
        return (frames, params.height // self.scale_spatial, params.width // self.scale_spatial,
                params.max_sequence_length)

    def noise_shape(self, params: DiffusionParams) -> tuple[int, ...]:
        return (self.z_dim, *self.batch_key(params)[:3])

    def schedule(self, params: DiffusionParams) -> DiffusersSampler:
        from diffusers import UniPCMultistepScheduler

        scheduler = UniPCMultistepScheduler.from_config(self.scheduler_config, flow_shift=params.flow_shift)
        sampler = DiffusersSampler(scheduler, params.num_inference_steps)
        scheduler.set_begin_index(0)  # as the pipeline does: step i is timestep i even where timesteps repeat
        return sampler

    def cfg_scale(self, params: DiffusionParams) -> float | None:
        return params.guidance_scale if params.guidance_scale > 1 else None

    def boundary(self, params: DiffusionParams) -> float | None:
        """The timestep at and above which the high-noise expert runs (None: one DiT)."""
        return None if not self.two_experts else params.boundary_ratio * self.num_train_timesteps

    def cfg_scale_at(self, params: DiffusionParams, timestep: float) -> float:
        """The CFG scale of the step at `timestep`: that of the expert running it."""
        boundary = self.boundary(params)
        return params.guidance_scale if boundary is None or timestep >= boundary else params.guidance_scale_2

    def pack(self, noise: torch.Tensor, key: Hashable) -> torch.Tensor:
        return noise  # the DiT takes the latent video as it is

    # ---- the three calls of the loop --------------------------------------------------------

    def encode(self, prompts: list[str], params: list[DiffusionParams], inputs: list[dict[str, torch.Tensor]]
               ) -> dict[str, torch.Tensor]:
        """Per prompt: `prompt_embeds` [P, L, D] (zero past its tokens), `prompt_lens` [P]; for two experts the
        row's `boundary` timestep [P] (float64: compared with integer timesteps as diffusers compares them); with
        image input its VAE `condition` (and for TI2V `keep_first` [P], 1 where the first frame is the image)."""
        length = params[0].max_sequence_length  # one batch key: one text length
        text = self.tokenizer([clean_prompt(p) for p in prompts], padding="max_length", max_length=length,
                              truncation=True, add_special_tokens=True, return_attention_mask=True,
                              return_tensors="pt")
        ids, mask = text.input_ids.to(self.device), text.attention_mask.to(self.device)
        hidden = self.text_encoder(ids, mask).last_hidden_state.to(self.compute_dtype)
        lens = mask.gt(0).sum(dim=1)
        keep = torch.arange(length, device=self.device)[None, :] < lens[:, None]
        out = {"prompt_embeds": hidden * keep[..., None].to(hidden.dtype), "prompt_lens": lens}
        if self.two_experts:
            out["boundary"] = torch.tensor([self.boundary(p) for p in params], dtype=torch.float64,
                                           device=self.device)
        if self.image_input or self.expand_timesteps:
            conditions: dict[int, torch.Tensor] = {}  # a request's two branches share one encoding
            for p, tensors in zip(params, inputs, strict=True):
                if id(tensors) not in conditions:
                    conditions[id(tensors)] = self._condition(p, tensors.get("image_0"))
            out["condition"] = torch.cat([conditions[id(t)] for t in inputs])
            if self.expand_timesteps:
                out["keep_first"] = torch.tensor([float("image_0" in t) for t in inputs], device=self.device)
        return out

    def _normalize(self, latents: torch.Tensor) -> torch.Tensor:
        mean, std = self.latents_mean.to(latents), self.latents_std.to(latents)
        return (latents - mean) * (1.0 / std)

    def _condition(self, params: DiffusionParams, image: torch.Tensor | None) -> torch.Tensor:
        """The image's conditioning [1, C, frames, h, w] float32: I2V's first-frame mask beside the latents of the
        image followed by black frames; TI2V's latents of the image alone (zeros without one, then unused)."""
        frames, h, w, _ = self.batch_key(params)
        if image is None:  # TI2V text-to-video: the mask keeps no frame of it
            return torch.zeros(1, self.z_dim, 1, h, w, device=self.device)
        from PIL import Image

        if self._processor is None:
            from diffusers.video_processor import VideoProcessor

            self._processor = VideoProcessor(vae_scale_factor=self.scale_spatial)
        pixels = self._processor.preprocess(Image.fromarray(image.cpu().numpy().astype(np.uint8)),
                                            height=params.height, width=params.width)
        pixels = pixels.to(self.device, torch.float32).unsqueeze(2)  # [1, 3, 1, H, W]
        if self.expand_timesteps:
            video = pixels
        else:
            video = torch.cat([pixels, pixels.new_zeros(1, 3, params.num_frames - 1, params.height, params.width)],
                              dim=2)
        latents = self._normalize(self.vae.encode(video.to(self.vae.dtype)).latent_dist.mode().float())
        if self.expand_timesteps:
            return latents
        # One mask channel per video frame of a latent frame: the first latent frame stands for the image
        # repeated over the VAE's temporal factor, the others for frames to generate.
        mask = torch.zeros(1, 1, params.num_frames + self.scale_temporal - 1, h, w, device=self.device)
        mask[:, :, :self.scale_temporal] = 1
        mask = mask.view(1, frames, self.scale_temporal, h, w).transpose(1, 2)
        return torch.cat([mask, latents], dim=1)

    def _first_frame_mask(self, cond: dict[str, torch.Tensor], latents: torch.Tensor) -> torch.Tensor:
        """TI2V: [rows, 1, frames, h, w], 0 at the first latent frame of rows that keep their image, else 1."""
        mask = torch.ones_like(latents[:, :1])
        mask[:, :, 0] = (1 - cond["keep_first"]).view(-1, 1, 1, 1).to(mask)
        return mask

    def velocity(self, latents: torch.Tensor, timesteps: torch.Tensor, cond: dict[str, torch.Tensor],
                 key: WanKey) -> torch.Tensor:
        """The flow velocity per row, in float32; each row through the expert of its timestep."""
        if self.expand_timesteps:
            mask = self._first_frame_mask(cond, latents)
            x = (1 - mask) * cond["condition"] + mask * latents
            # per token (1 x p_h x p_w patches): timestep 0 where the image is kept
            t = (mask[:, 0, :, ::self.patch[1], ::self.patch[2]] * timesteps.view(-1, 1, 1, 1)).flatten(1)
        elif self.image_input:
            x, t = torch.cat([latents, cond["condition"]], dim=1), timesteps
        else:
            x, t = latents, timesteps
        x, embeds = x.to(self.compute_dtype), cond["prompt_embeds"]
        if not self.two_experts:
            return self._forward(self.transformer, x, t, embeds)
        high = timesteps >= cond["boundary"]
        out = torch.empty_like(latents)
        for expert, rows in ((self.transformer, high), (self.transformer_2, ~high)):
            if rows.all():
                return self._forward(expert, x, t, embeds)
            if rows.any():
                out[rows] = self._forward(expert, x[rows], t[rows], embeds[rows])
        return out

    def _forward(self, expert: torch.nn.Module, x: torch.Tensor, t: torch.Tensor, embeds: torch.Tensor
                 ) -> torch.Tensor:
        if self.offload_idle_expert and self.device.type != "cpu":
            for other in self.transformers:
                if other is not expert:
                    other.to("cpu")
            expert.to(self.device)
        return expert(hidden_states=x, timestep=t, encoder_hidden_states=embeds, return_dict=False)[0].float()

    def prompt_tokens(self, params: DiffusionParams, cond: dict[str, torch.Tensor]) -> int:
        """The prompt's UMT5 tokens (the DiT attends to them and to the zero padding after them)."""
        return int(cond["prompt_lens"].sum())

    def final_latents(self, latents: torch.Tensor, cond: dict[str, torch.Tensor]) -> torch.Tensor:
        """The latents to decode: TI2V's first frame is its image's wherever the request brought one."""
        if not self.expand_timesteps:
            return latents
        mask = self._first_frame_mask(cond, latents)
        return (1 - mask) * cond["condition"] + mask * latents

    def decode(self, latents: torch.Tensor, key: WanKey) -> torch.Tensor:
        """Latent rows -> videos [rows, frames, H, W, 3] float32 in [0, 1] on the CPU."""
        z = latents.to(self.vae.dtype)
        z = z / (1.0 / self.latents_std.to(z)) + self.latents_mean.to(z)
        video = self.vae.decode(z, return_dict=False)[0]  # [rows, 3, frames, H, W] in [-1, 1]
        return (video / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 4, 1).float().cpu()

    output_name = "video"
