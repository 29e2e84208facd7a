"""Z-Image and Z-Image-Turbo: one diffusion stage, `dit`, holding the Qwen3 text encoder, the single-stream DiT and
the VAE, which produces images.

Detected from a diffusers `ZImagePipeline` directory (model_index.json); the stage's plumbing is the shared
`ImagePipeline` (families/diffusion.py). Both checkpoints have the same pipeline class and architecture; they differ
in the scheduler's static shift (Turbo 3.0, Z-Image 6.0), so the request defaults follow a `preset`:
- "base": diffusers' `ZImagePipeline.__call__` defaults (1024 x 1024, 50 steps, CFG guidance 5.0, text length 512);
- "turbo": the distilled model as its authors run it (9 steps, guidance 0: no CFG branch), the rest as "base".
`stages.dit.options.preset` "auto" (the default) picks "turbo" for a scheduler shift of 3.0, else "base".
"""

from __future__ import annotations

import json
from typing import Any, Literal

import torch
from pydantic import Field

from omnistage.config.deploy import DeployConfig, parse_section
from omnistage.engine.diffusion import DiffusionOptions
from omnistage.families.base import CheckpointInfo
from omnistage.families.diffusion import STAGE, ImagePipeline, Parts

TURBO_SHIFT = 3.0  # Z-Image-Turbo's released scheduler_config.json shift (Z-Image's is 6.0)
BASE_DEFAULTS = {"width": 1024, "height": 1024, "num_inference_steps": 50, "guidance_scale": 5.0,
                 "max_sequence_length": 512}
TURBO_DEFAULTS = {**BASE_DEFAULTS, "num_inference_steps": 9, "guidance_scale": 0.0}


class ZImageOptions(DiffusionOptions):
    """`stages.dit.options`."""

    preset: Literal["auto", "base", "turbo"] = Field("auto", description=(
        "request defaults: base (diffusers' ZImagePipeline defaults: 50 steps, CFG 5.0) or turbo (the distilled "
        "Z-Image-Turbo: 9 steps, no CFG); auto: turbo when the scheduler's shift is Turbo's 3.0"))


class ZImageImagePipeline(ImagePipeline):
    options_class = ZImageOptions

    def load_model(self, device: torch.device, dtype: torch.dtype, parts: Parts = "all") -> Any:
        from omnistage.families.z_image.model import ZImageModel

        return ZImageModel(self.model_path, device, dtype, parts)


def is_turbo(info: CheckpointInfo, preset: str) -> bool:
    """Whether the checkpoint takes Turbo's defaults: as the preset says, or (auto) by its scheduler's shift."""
    if preset != "auto":
        return preset == "turbo"
    scheduler = json.loads((info.path / "scheduler" / "scheduler_config.json").read_text())
    return not scheduler.get("use_dynamic_shifting") and scheduler.get("shift") == TURBO_SHIFT


class ZImageFamily:
    name = "z_image"

    def matches(self, info: CheckpointInfo) -> bool:
        return info.class_name == "ZImagePipeline"

    def default_deploy(self, info: CheckpointInfo) -> dict[str, Any]:
        # A forward's activations grow with images x tokens (4096 per 1024x1024 image): a few images per batch.
        return {"stages": {STAGE: {"max_num_seqs": 4}}}

    def pipeline(self, info: CheckpointInfo, deploy: DeployConfig) -> ZImageImagePipeline:
        pipeline = ZImageImagePipeline.build(info, deploy)
        options = parse_section(ZImageOptions, deploy.stage(STAGE).options, f"stages.{STAGE}.options")
        vae = json.loads((info.path / "vae" / "config.json").read_text())
        pipeline.size_multiple = 2 ** (len(vae["block_out_channels"]) - 1) * 2  # the DiT's 2x2 patches
        pipeline.defaults = dict(TURBO_DEFAULTS if is_turbo(info, options.preset) else BASE_DEFAULTS)
        return pipeline
