"""FLUX.1 (dev: guidance-distilled, with a guidance embedding; schnell: timestep-distilled, no guidance): one
diffusion stage, `dit`, holding both text encoders, the MMDiT and the VAE, which produces images.

Detected from a diffusers `FluxPipeline` directory (model_index.json); the stage's plumbing is the shared
`ImagePipeline` (families/diffusion.py). Request defaults follow diffusers'
`FluxPipeline.__call__` (size 128 x the VAE's scale factor per side, guidance 3.5, T5 length 512), except the
steps: 28 for dev as diffusers has them, 4 for schnell, the count it was distilled for.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from omnistage.config.deploy import DeployConfig
from omnistage.engine.diffusion import DiffusionOptions, DiffusionParams
from omnistage.errors import RequestError
from omnistage.families.base import CheckpointInfo
from omnistage.families.diffusion import STAGE, ImagePipeline, Parts

MAX_SEQUENCE_LENGTH = 512  # T5's limit in FLUX (its position buckets were trained to it)


class FluxOptions(DiffusionOptions):
    """`stages.dit.options`."""


class FluxImagePipeline(ImagePipeline):
    guidance_embeds: bool = True
    options_class = FluxOptions

    def resolve(self, params: DiffusionParams, images: list[Any]) -> DiffusionParams:
        params = params.with_defaults(**self.defaults)
        if params.max_sequence_length is not None and params.max_sequence_length > MAX_SEQUENCE_LENGTH:
            raise RequestError(f"max_sequence_length must be at most {MAX_SEQUENCE_LENGTH}", "max_sequence_length")
        return params

    def load_model(self, device: torch.device, dtype: torch.dtype, parts: Parts = "all") -> Any:
        from omnistage.families.flux.model import FluxModel

        return FluxModel(self.model_path, device, dtype, parts)


class FluxFamily:
    name = "flux"

    def matches(self, info: CheckpointInfo) -> bool:
        return info.class_name == "FluxPipeline"

    def default_deploy(self, info: CheckpointInfo) -> dict[str, Any]:
        # A forward's activations grow with images x tokens (4096 per 1024x1024 image): a few images per batch.
        return {"stages": {STAGE: {"max_num_seqs": 4}}}

    def pipeline(self, info: CheckpointInfo, deploy: DeployConfig) -> FluxImagePipeline:
        pipeline = FluxImagePipeline.build(info, deploy)
        vae = json.loads((info.path / "vae" / "config.json").read_text())
        transformer = json.loads((info.path / "transformer" / "config.json").read_text())
        vae_scale_factor = 2 ** (len(vae["block_out_channels"]) - 1)
        pipeline.size_multiple = vae_scale_factor * 2  # 2x2-packed latents
        pipeline.guidance_embeds = bool(transformer.get("guidance_embeds"))
        side = 128 * vae_scale_factor
        pipeline.defaults = {"width": side, "height": side, "guidance_scale": 3.5,
                             "num_inference_steps": 28 if pipeline.guidance_embeds else 4,
                             "max_sequence_length": MAX_SEQUENCE_LENGTH}
        return pipeline
