"""Wan2.2 video generation: one diffusion stage, `dit`, holding the UMT5 text encoder, the video DiT(s) and the
causal video VAE, which produces videos.

Detected from a diffusers `WanPipeline` or `WanImageToVideoPipeline` directory (model_index.json):
- Wan2.2-T2V-A14B (`WanPipeline`, two experts switched at `boundary_ratio`): text to video;
- Wan2.2-I2V-A14B (`WanImageToVideoPipeline`, two experts): an input image (the first frame) and text to video;
- Wan2.2-TI2V-5B (`WanPipeline` with `expand_timesteps`, one DiT): text to video, or text and image to video.
A request's input image (`OmniRequest.media["image"][0]`) is resized to the video's size; without a size the video
takes the image's aspect ratio at the default size's area. The request defaults are those the released model cards
run (steps, guidance, size, frames, fps), the scheduler's flow shift and the checkpoint's boundary; see `DEFAULTS`.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from typing import Any

import torch
from pydantic import Field

from omnistage.config.deploy import DeployConfig, parse_section
from omnistage.engine.diffusion import DiffusionOptions, DiffusionParams
from omnistage.errors import ConfigError, RequestError
from omnistage.families.base import CheckpointInfo
from omnistage.families.diffusion import STAGE, ImagePipeline, Parts
from omnistage.types import OmniOutput, OmniRequest, StageOutput

# Per kind of checkpoint: diffusers' `__call__` size for A14B (480p, the size the A14B cards also run) and the
# TI2V-5B card's 720p; the steps, guidance scales, frames and fps of the released model cards.
DEFAULTS: dict[str, dict[str, Any]] = {
    "t2v": {"width": 832, "height": 480, "num_frames": 81, "fps": 16, "num_inference_steps": 40,
            "guidance_scale": 4.0, "guidance_scale_2": 3.0, "max_sequence_length": 512},
    "i2v": {"width": 832, "height": 480, "num_frames": 81, "fps": 16, "num_inference_steps": 40,
            "guidance_scale": 3.5, "guidance_scale_2": 3.5, "max_sequence_length": 512},
    "ti2v": {"width": 1280, "height": 704, "num_frames": 121, "fps": 24, "num_inference_steps": 50,
             "guidance_scale": 5.0, "max_sequence_length": 512},
}


class WanOptions(DiffusionOptions):
    """`stages.dit.options`."""

    offload_idle_expert: bool = Field(False, description=(
        "two-expert checkpoints (A14B): keep only the expert that runs on the device and the other in CPU memory, "
        "moved over when its rows run (half the DiT memory; each switch copies one expert's weights). False: "
        "both experts stay resident"))


class WanVideoPipeline(ImagePipeline):
    options_class = WanOptions
    output_modality = "video"
    kind: str  # "t2v", "i2v" or "ti2v", set by the family
    boundary_ratio: float | None = None
    flow_shift: float = 1.0
    frame_multiple: int = 4  # the VAE's temporal factor m: frames are m k + 1 (the first frame, then groups of m)

    def load_model(self, device: torch.device, dtype: torch.dtype, parts: Parts = "all") -> Any:
        from omnistage.families.wan.model import WanModel

        options = parse_section(WanOptions, self.stage_config(STAGE).options, f"stages.{STAGE}.options")
        return WanModel(self.model_path, device, dtype, parts, options.offload_idle_expert)

    def resolve(self, params: DiffusionParams, images: list[Any]) -> DiffusionParams:
        if images and params.width is None and params.height is None:
            # the video takes the image's aspect ratio at the default size's area, as the model cards size it
            area, aspect = self.defaults["width"] * self.defaults["height"], images[0].height / images[0].width
            m = self.size_multiple
            params = replace(params, width=max(m, round(math.sqrt(area / aspect)) // m * m),
                             height=max(m, round(math.sqrt(area * aspect)) // m * m))
        params = params.with_defaults(**self.defaults)
        if self.boundary_ratio is None:
            if params.guidance_scale_2 is not None or params.boundary_ratio is not None:
                name = "guidance_scale_2" if params.guidance_scale_2 is not None else "boundary_ratio"
                raise RequestError(f"{name} applies to two-expert checkpoints (Wan2.2 A14B); this one has one DiT: "
                                   "leave it out", name)
            return params.with_defaults(flow_shift=self.flow_shift)
        # diffusers guides the low-noise expert like the high-noise one unless told otherwise
        return params.with_defaults(flow_shift=self.flow_shift, boundary_ratio=self.boundary_ratio,
                                    guidance_scale_2=params.guidance_scale)

    def request_params(self, request: OmniRequest) -> DiffusionParams:
        images = request.media.get("image", [])
        if self.kind == "t2v" and images:
            raise RequestError("this text-to-video checkpoint takes no input image; serve an image-to-video one "
                               "(Wan2.2-I2V-A14B or TI2V-5B) to animate an image", "image")
        if self.kind == "i2v" and not images:
            raise RequestError("this image-to-video checkpoint needs an input image (the video's first frame)",
                               "image")
        params = super().request_params(request)
        m = self.frame_multiple
        if (params.num_frames - 1) % m:
            k = (params.num_frames - 1) // m
            raise RequestError(f"num_frames must be {m}k+1 (e.g. {m * k + 1} or {m * (k + 1) + 1}) for this model's "
                               f"VAE (got {params.num_frames})", "num_frames")
        return params

    def to_output(self, stage: str, out: StageOutput) -> OmniOutput:
        """Progress as the image families give it; the videos, on the last delta, as uint8 [F, H, W, 3] arrays
        at the request's fps."""
        video = out.tensors.get("video")
        videos = [] if video is None else list((video * 255).round().to(torch.uint8).numpy())
        progress = out.tensors.get("progress")
        steps = None if progress is None else (int(progress[-1, 0]), int(progress[-1, 1]))
        fps = None if video is None else float(out.tensors["fps"]) if "fps" in out.tensors else None
        return OmniOutput(out.request_id, videos=videos, fps=fps, num_output_tokens=out.num_output_tokens,
                          progress=steps, num_prompt_tokens=out.num_prompt_tokens)


def kind_of(info: CheckpointInfo) -> str:
    index = info.model_index or {}
    if info.class_name == "WanImageToVideoPipeline":
        return "ti2v" if index.get("expand_timesteps") else "i2v"
    return "ti2v" if index.get("expand_timesteps") else "t2v"


class WanFamily:
    name = "wan"

    def matches(self, info: CheckpointInfo) -> bool:
        return info.class_name in ("WanPipeline", "WanImageToVideoPipeline")

    def default_deploy(self, info: CheckpointInfo) -> dict[str, Any]:
        # A video's tokens are frames x image tokens (tens of thousands at 720p): one video per forward.
        return {"stages": {STAGE: {"max_num_seqs": 1}}}

    def pipeline(self, info: CheckpointInfo, deploy: DeployConfig) -> WanVideoPipeline:
        index = info.model_index or {}
        if (index.get("image_encoder") or [None])[0] is not None:
            raise ConfigError(f"{str(info.path)!r}: Wan2.1 image-to-video checkpoints (with a CLIP image encoder) "
                              "are not supported; Wan2.2 I2V-A14B and TI2V-5B are")
        pipeline = WanVideoPipeline.build(info, deploy)
        options = parse_section(WanOptions, deploy.stage(STAGE).options, f"stages.{STAGE}.options")
        two_experts = (index.get("transformer_2") or [None])[0] is not None and index.get("boundary_ratio")
        if options.offload_idle_expert and not two_experts:
            raise ConfigError(f"stages.{STAGE}.options.offload_idle_expert: this checkpoint has one DiT; "
                              "the option is for two-expert (A14B) checkpoints")
        if options.offload_idle_expert and options.cpu_offload:
            raise ConfigError(f"stages.{STAGE}.options: offload_idle_expert and cpu_offload both move weights to "
                              "the CPU; choose one")
        pipeline.kind = kind_of(info)
        pipeline.boundary_ratio = index.get("boundary_ratio") if two_experts else None
        pipeline.flow_shift = json.loads((info.path / "scheduler" / "scheduler_config.json").read_text()).get(
            "flow_shift", 1.0)
        vae = json.loads((info.path / "vae" / "config.json").read_text())
        transformer = json.loads((info.path / "transformer" / "config.json").read_text())
        pipeline.size_multiple = vae.get("scale_factor_spatial", 8) * transformer.get("patch_size", [1, 2, 2])[1]
        pipeline.frame_multiple = vae.get("scale_factor_temporal", 4)
        pipeline.max_input_images = 0 if pipeline.kind == "t2v" else 1
        pipeline.min_input_images = 1 if pipeline.kind == "i2v" else 0
        pipeline.defaults = dict(DEFAULTS[pipeline.kind])
        return pipeline
