"""Stable Audio's parts as the diffusion engine drives them: the T5 text encoder, the projection model (text
projection and the seconds_start / seconds_total conditioners), `StableAudioDiTModel` and the `AutoencoderOobleck`
VAE, loaded from diffusers' `StableAudioPipeline` directory layout.

What `diffusers.StableAudioPipeline` computes, row by row:
- a prompt is padded to the tokenizer's `model_max_length`; its T5 states are projected and zeroed at the padding
  (the DiT still attends to those zero rows: it gets no text mask);
- the clip's start and end seconds each become one projected token: the cross-attention input is [text, start,
  end], and the DiT's global input is [start | end] (concatenated features);
- noise [C, window] is drawn for the DiT's whole latent window (`sample_size`), scaled by the scheduler's
  init_noise_sigma; the decoded waveform is cut to [int(start * rate), int(end * rate)) samples;
- CFG runs when guidance_scale > 1 as uncond + scale * (cond - uncond). The negative branch encodes the negative
  prompt with the same seconds tokens; with no negative prompt its cross-attention input is all zeros (seconds
  tokens included) and its global input the positive one;
- the scheduler (`CosineDPMSolverMultistepScheduler` in the released checkpoint) is an SDE solver whose Brownian
  noise is seeded by the generator's initial seed: each request gets its own instance and its own generator.

Latents stay float32 between steps (the modules run in the stage's dtype); on float32 that is diffusers' run.
The latent window is one shape for every request, so any two requests could share a forward; the batch key is the
output's sample span, because the engine decodes a batch's finished rows into one tensor.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import torch

from omnistage.engine.diffusion.params import DiffusionParams
from omnistage.engine.schedulers.diffusers_sampler import DiffusersSampler
from omnistage.families.base import TRANSFORMERS_LOAD
from omnistage.families.diffusion import component_config

StableAudioKey = tuple[int, int]  # the output's [start, end) samples within the decoded window
# The solver asks its Brownian tree for noise at sigma_max rounded up in float32 and at the final sigma 0, just
# outside the tree's [sigma_min, sigma_max]; torchsde warns each time (as under diffusers) and answers correctly.
warnings.filterwarnings("ignore", message="Should have t[ab]", category=UserWarning, module="torchsde")


def audio_config(path: Path) -> dict[str, Any]:
    """What the checkpoint's configs say about its clips, without loading weights: the sample rate, the channels,
    the VAE's hop (samples per latent frame), the DiT's latent window and the seconds conditioners' range."""
    from diffusers import AutoencoderOobleck, StableAudioDiTModel

    vae = component_config(AutoencoderOobleck, path / "vae")
    dit = component_config(StableAudioDiTModel, path / "transformer")
    projection = json.loads((path / "projection_model" / "config.json").read_text())
    hop = 1
    for ratio in vae["downsampling_ratios"]:
        hop *= ratio
    rate, window = int(vae["sampling_rate"]), int(dit["sample_size"])
    return {"sample_rate": rate, "channels": int(vae["audio_channels"]), "hop": hop, "window": window,
            "max_seconds": window * hop / rate, "min_value": projection["min_value"],
            "max_value": projection["max_value"], "latent_channels": int(dit["in_channels"])}


def sample_span(params: DiffusionParams, rate: int) -> StableAudioKey:
    """The clip's samples in the decoded window, as diffusers cuts them."""
    return int(params.audio_start * rate), int((params.audio_start + params.audio_length) * rate)


class StableAudioModel:
    output_name = "audio"  # decoded rows: [rows, channels, samples] float32

    def __init__(self, path: Path, device: torch.device, dtype: torch.dtype, parts: str = "all"):
        """`parts` (families.diffusion.Parts): "encoders" loads the tokenizer, T5 and the projection model only,
        "dit" the DiT and VAE only, "all" both."""
        import diffusers
        from diffusers import AutoencoderOobleck, StableAudioDiTModel, StableAudioProjectionModel
        from diffusers.models.embeddings import get_1d_rotary_pos_embed
        from transformers import AutoTokenizer, T5EncoderModel

        self.device, self.dtype, self.compute_dtype = device, torch.float32, dtype
        self.config = audio_config(path)
        if parts != "dit":
            self.tokenizer = AutoTokenizer.from_pretrained(path / "tokenizer")
            self.text_encoder = T5EncoderModel.from_pretrained(path / "text_encoder", dtype=dtype,
                                                               **TRANSFORMERS_LOAD).to(device).eval()
            self.projection = StableAudioProjectionModel.from_pretrained(path / "projection_model", torch_dtype=dtype)
            self.projection = self.projection.to(device).eval()
        if parts != "encoders":
            self.transformer = StableAudioDiTModel.from_pretrained(path / "transformer", torch_dtype=dtype)
            self.transformer = self.transformer.to(device).eval()
            self.vae = AutoencoderOobleck.from_pretrained(path / "vae", torch_dtype=dtype).to(device).eval()
            # One rotary table for every forward: the window's latent frames plus the global token.
            head = self.transformer.config.attention_head_dim
            cos, sin = get_1d_rotary_pos_embed(head // 2, self.config["window"] + 1, use_real=True,
                                               repeat_interleave_real=False)
            self.rotary = (cos.to(device), sin.to(device))  # moved again per forward under cpu_offload
        self.scheduler_config = json.loads((path / "scheduler" / "scheduler_config.json").read_text())
        self.scheduler_class = getattr(diffusers, self.scheduler_config["_class_name"])

    # ---- shapes and schedule ----------------------------------------------------------------

    def batch_key(self, params: DiffusionParams) -> StableAudioKey:
        return sample_span(params, self.config["sample_rate"])

    def noise_shape(self, params: DiffusionParams) -> tuple[int, ...]:
        return self.config["latent_channels"], self.config["window"]

    def schedule(self, params: DiffusionParams) -> DiffusersSampler:
        # A fresh solver per request: its history and its Brownian tree (seeded by the generator's initial seed,
        # as diffusers seeds it from the pipeline's generator) are this request's alone.
        generator = torch.Generator("cpu").manual_seed(params.seed)
        return DiffusersSampler(self.scheduler_class.from_config(self.scheduler_config), params.num_inference_steps,
                                generator)

    def cfg_scale(self, params: DiffusionParams) -> float | None:
        return params.guidance_scale if params.guidance_scale > 1 else None

    def pack(self, noise: torch.Tensor, key: Hashable) -> torch.Tensor:
        return noise  # the DiT takes [C, frames] as it is

    # ---- the three calls of the loop --------------------------------------------------------

    def encode(self, prompts: list[str], params: list[DiffusionParams], inputs: list[dict[str, torch.Tensor]]
               ) -> dict[str, torch.Tensor]:
        """Per prompt: `text` [P, L + 2, D] (projected T5 states, then the start and end tokens), `global` [P, 1, 2D]
        and `text_mask` [P, L] (1 at real tokens, for usage). The encoder lists a request's positive prompt before
        its negative one, so a row whose request was seen before is its negative branch; with no negative prompt
        that row is diffusers' null conditioning (zero `text`)."""
        tokens = self.tokenizer(prompts, padding="max_length", max_length=self.tokenizer.model_max_length,
                                truncation=True, return_tensors="pt")
        ids, mask = tokens.input_ids.to(self.device), tokens.attention_mask.to(self.device)
        hidden = self.text_encoder(ids, attention_mask=mask)[0]
        text = self.projection(text_hidden_states=hidden).text_hidden_states * mask[..., None].to(hidden.dtype)
        starts = torch.tensor([float(p.audio_start) for p in params], device=self.device)
        ends = torch.tensor([float(p.audio_start + p.audio_length) for p in params], device=self.device)
        seconds = self.projection(start_seconds=starts, end_seconds=ends)
        start, end = seconds.seconds_start_hidden_states, seconds.seconds_end_hidden_states
        text = torch.cat([text, start, end], dim=1)
        seen: set[int] = set()
        for row, p in enumerate(params):
            if id(p) in seen and p.negative_prompt is None:
                text[row] = 0
                mask[row] = 0
            seen.add(id(p))
        return {"text": text, "global": torch.cat([start, end], dim=2), "text_mask": mask}

    def prompt_tokens(self, params: DiffusionParams, cond: dict[str, torch.Tensor]) -> int:
        """The prompt's real T5 tokens (the padding the DiT also sees is zeros)."""
        return int(cond["text_mask"].sum())

    def velocity(self, latents: torch.Tensor, timesteps: torch.Tensor, cond: dict[str, torch.Tensor],
                 key: StableAudioKey) -> torch.Tensor:
        """The DiT's v-prediction per row, in float32 (the scheduler's update turns it into the next latents)."""
        rotary = tuple(r.to(latents.device) for r in self.rotary)
        out = self.transformer(latents.to(self.compute_dtype), timesteps, encoder_hidden_states=cond["text"],
                               global_hidden_states=cond["global"], rotary_embedding=rotary, return_dict=False)[0]
        return out.float()

    def decode(self, latents: torch.Tensor, key: StableAudioKey) -> torch.Tensor:
        start, end = key
        audio = self.vae.decode(latents.to(self.vae.dtype)).sample
        return audio[:, :, start:end].float().cpu()
