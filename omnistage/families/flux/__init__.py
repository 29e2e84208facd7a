"""FLUX.1 (dev: guidance-distilled, with a guidance embedding; schnell: timestep-distilled, no guidance): one
diffusion stage, `dit`, holding both text encoders, the MMDiT and the VAE, which produces images.

Detected from a diffusers `FluxPipeline` directory (model_index.json). A request's `DiffusionParams` travel in
`OmniRequest.options["diffusion"]` (per-stage params are sampling params). Request defaults follow diffusers'
`FluxPipeline.__call__` (size 128 x the VAE's scale factor per side, guidance 3.5, T5 length 512), except the
steps: 28 for dev as diffusers has them, 4 for schnell, the count it was distilled for.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import torch

from omnistage.config.deploy import Advanced, DeployConfig
from omnistage.devices import resolve_device
from omnistage.engine.diffusion import DiffusionEngine, DiffusionOptions, DiffusionParams
from omnistage.errors import RequestError
from omnistage.families.base import CheckpointInfo, Pipeline, StageSpec
from omnistage.types import OmniOutput, OmniRequest, StageInput, StageOutput

STAGE = "dit"
MAX_SEQUENCE_LENGTH = 512  # T5's limit in FLUX (its position buckets were trained to it)


class FluxOptions(DiffusionOptions):
    """`stages.dit.options`."""


def prompt_of(request: OmniRequest) -> str:
    """The prompt, or the text of the last user message of a chat request."""
    if request.prompt is not None:
        return request.prompt
    for message in reversed(request.messages or []):
        if message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, str):
                return content
            return " ".join(p.get("text", "") for p in content or [] if p.get("type") == "text")
    raise RequestError("an image request needs a prompt", "prompt")


class FluxImagePipeline(Pipeline):
    vae_scale_factor: int = 8
    guidance_embeds: bool = True
    defaults: dict[str, Any]

    def preprocess(self, request: OmniRequest) -> StageInput:
        params = request.options.get("diffusion")
        if not isinstance(params, DiffusionParams):  # e.g. a chat request: only its sampling params' seed counts
            sampling = request.stage_params.get(STAGE) or request.stage_params.get("*")
            params = DiffusionParams(seed=getattr(sampling, "seed", None))
        params = replace(params, prompt=prompt_of(request)).with_defaults(**self.defaults).check()
        multiple = self.vae_scale_factor * 2
        for name in ("width", "height"):
            if getattr(params, name) % multiple:
                raise RequestError(f"{name} must be a multiple of {multiple} for this model "
                                   f"(got {getattr(params, name)})", name)
        if params.max_sequence_length > MAX_SEQUENCE_LENGTH:
            raise RequestError(f"max_sequence_length must be at most {MAX_SEQUENCE_LENGTH}", "max_sequence_length")
        return StageInput(request.request_id, params=params.as_wire())

    def build_engine(self, stage: str, device: str | None = None) -> DiffusionEngine:
        from omnistage.families.flux.model import FluxModel

        cfg = self.stage_config(stage)
        dev = resolve_device(device or cfg.devices)
        # FLUX.1 is released in bfloat16; float32 on the CPU, where half precision is slow and less exact.
        dtype = getattr(torch, cfg.dtype) if cfg.dtype != "auto" else (
            torch.float32 if dev.type == "cpu" else torch.bfloat16)
        return DiffusionEngine.from_stage(stage, FluxModel(self.model_path, dev, dtype), cfg)

    def to_output(self, stage: str, out: StageOutput) -> OmniOutput:
        """Progress as `num_output_tokens` (steps done); the images, on the last delta, as PIL images."""
        from PIL import Image

        images = out.tensors.get("images")
        pil = [] if images is None else [Image.fromarray(a) for a in (images * 255).round().to(torch.uint8).numpy()]
        return OmniOutput(out.request_id, images=pil, num_output_tokens=out.num_output_tokens)


class FluxFamily:
    name = "flux"

    def matches(self, info: CheckpointInfo) -> bool:
        return info.class_name == "FluxPipeline"

    def default_deploy(self, info: CheckpointInfo) -> dict[str, Any]:
        # A forward's activations grow with images x tokens (4096 per 1024x1024 image): a few images per batch.
        return {"stages": {STAGE: {"max_num_seqs": 4}}}

    def pipeline(self, info: CheckpointInfo, deploy: DeployConfig) -> FluxImagePipeline:
        deploy.check_stages({STAGE: Advanced}, options={STAGE: FluxOptions})
        pipeline = FluxImagePipeline(info.path, deploy, [StageSpec(STAGE, "diffusion", outputs=("image",))])
        vae = json.loads((info.path / "vae" / "config.json").read_text())
        transformer = json.loads((info.path / "transformer" / "config.json").read_text())
        pipeline.vae_scale_factor = 2 ** (len(vae["block_out_channels"]) - 1)
        pipeline.guidance_embeds = bool(transformer.get("guidance_embeds"))
        side = 128 * pipeline.vae_scale_factor
        pipeline.defaults = {"width": side, "height": side, "guidance_scale": 3.5,
                             "num_inference_steps": 28 if pipeline.guidance_embeds else 4,
                             "max_sequence_length": MAX_SEQUENCE_LENGTH}
        return pipeline
