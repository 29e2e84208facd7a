"""Qwen-Image (text to image), Qwen-Image-Edit (one input image) and Qwen-Image-Edit-Plus (several input images):
one diffusion stage, `dit`, holding the Qwen2.5-VL text encoder, the MMDiT and the VAE, which produces images.

Detected from a diffusers `QwenImagePipeline` / `QwenImageEditPipeline` / `QwenImageEditPlusPipeline` directory
(model_index.json); the stage's plumbing is the shared `ImagePipeline` (families/diffusion.py). Request defaults
follow the pipelines' `__call__`: 50 steps, text length 512, size 128 x the VAE's scale factor per side for
text-to-image; edit models size the output to about 1024x1024 pixels with the aspect ratio of the first (Edit) or
last (Edit-Plus) input image. True CFG runs only with a negative prompt and `true_cfg_scale` > 1.
Width and height must be multiples of the VAE's scale factor x 2 (latents are 2x2-packed): 16.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

import torch

from omnistage.config.deploy import DeployConfig
from omnistage.engine.diffusion import DiffusionOptions, DiffusionParams
from omnistage.errors import RequestError
from omnistage.families.base import CheckpointInfo
from omnistage.families.diffusion import STAGE, ImagePipeline, Parts

MAX_SEQUENCE_LENGTH = 1024  # the pipelines' limit
EDIT_PLUS_MAX_IMAGES = 4  # Edit-Plus (2509) is trained for 1 to 3 input images; a few more still fit one prompt


class QwenImageOptions(DiffusionOptions):
    """`stages.dit.options`."""


class QwenImageImagePipeline(ImagePipeline):
    variant: ClassVar[str] = "t2i"
    options_class = QwenImageOptions

    def resolve(self, params: DiffusionParams, images: list[Any]) -> DiffusionParams:
        from omnistage.families.qwen_image.model import VAE_AREA, fit_area

        defaults = dict(self.defaults)
        if images:  # diffusers sizes an edit's output from its first (Edit) or last (Edit-Plus) image
            image = images[0] if self.variant == "edit" else images[-1]
            defaults["width"], defaults["height"] = fit_area(VAE_AREA, *image.size)
        params = params.with_defaults(**defaults)
        if params.max_sequence_length > MAX_SEQUENCE_LENGTH:
            raise RequestError(f"max_sequence_length must be at most {MAX_SEQUENCE_LENGTH}", "max_sequence_length")
        return params

    def input_image_tokens(self, images: list[Any]) -> int:
        """Each input image's VAE latents join the DiT's sequence at about `VAE_AREA` pixels (the model's
        `_condition`)."""
        from omnistage.families.qwen_image.model import VAE_AREA, fit_area

        return sum(self.image_tokens(*fit_area(VAE_AREA, *image.size)) for image in images)

    def load_model(self, device: torch.device, dtype: torch.dtype, parts: Parts = "all") -> Any:
        from omnistage.families.qwen_image.model import QwenImageModel

        return QwenImageModel(self.model_path, device, dtype, parts)


class QwenImageEditImagePipeline(QwenImageImagePipeline):
    variant = "edit"
    input_modalities = ("text", "image")
    min_input_images = 1
    max_input_images = 1


class QwenImageEditPlusImagePipeline(QwenImageEditImagePipeline):
    variant = "edit-plus"
    max_input_images = EDIT_PLUS_MAX_IMAGES


PIPELINES = {"QwenImagePipeline": QwenImageImagePipeline, "QwenImageEditPipeline": QwenImageEditImagePipeline,
             "QwenImageEditPlusPipeline": QwenImageEditPlusImagePipeline}


class QwenImageFamily:
    name = "qwen_image"

    def matches(self, info: CheckpointInfo) -> bool:
        return info.class_name in PIPELINES

    def default_deploy(self, info: CheckpointInfo) -> dict[str, Any]:
        # A forward's activations grow with images x tokens (4096 per 1024x1024 image, twice that for an edit):
        # a few images per batch.
        return {"stages": {STAGE: {"max_num_seqs": 4}}}

    def pipeline(self, info: CheckpointInfo, deploy: DeployConfig) -> QwenImageImagePipeline:
        pipeline = PIPELINES[info.class_name].build(info, deploy)
        vae = json.loads((info.path / "vae" / "config.json").read_text())
        vae_scale_factor = 2 ** len(vae.get("temperal_downsample", [False, True, True]))
        pipeline.size_multiple = vae_scale_factor * 2  # 2x2-packed latents
        side = 128 * vae_scale_factor
        # true_cfg_scale 4.0 is diffusers' default; it only applies where a request leaves the scale unset.
        pipeline.defaults = {"width": side, "height": side, "num_inference_steps": 50, "true_cfg_scale": 4.0,
                             "max_sequence_length": 512}
        return pipeline
