"""What every image-generation family shares: one diffusion stage (`dit`) holding its text encoders, DiT and
VAE, entered by a prompt (plus input images for edit models) and leaving as PIL images.

A family subclasses `ImagePipeline`: it sets `defaults` (diffusers' `__call__` defaults for the checkpoint),
`size_multiple`, and `input_modalities` / `max_input_images` for edit models, and implements `load_model`.
A request's `DiffusionParams` travel in `OmniRequest.options["diffusion"]`; input images in
`OmniRequest.media["image"]` (PIL images, in the caller's order) and reach the engine as `StageInput.tensors`
"image_0", "image_1", ... (uint8 [H, W, 3]).
"""

from __future__ import annotations

import functools
import json
from dataclasses import replace
from typing import Any, ClassVar

import numpy as np
import torch

from omnistage.devices import resolve_device
from omnistage.engine.diffusion import DiffusionEngine, DiffusionModel, DiffusionOptions, DiffusionParams
from omnistage.errors import RequestError
from omnistage.families.base import Pipeline
from omnistage.types import OmniOutput, OmniRequest, StageInput, StageOutput

STAGE = "dit"
MASK_REFUSED = ("this model does not take a mask: it edits the whole image from the prompt; "
                "leave 'mask' out of the request")


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


def image_tensor(image: Any) -> torch.Tensor:
    """A PIL image (any mode) -> uint8 [H, W, 3] RGB."""
    return torch.from_numpy(np.asarray(image.convert("RGB"), dtype=np.uint8).copy())


class ImagePipeline(Pipeline):
    """One `dit` stage that outputs images. Subclasses set the class attributes and `load_model`."""

    size_multiple: int = 16  # width and height must be multiples of it
    defaults: dict[str, Any]  # per checkpoint, set by the family
    max_input_images: ClassVar[int] = 0  # edit models: how many images a request may bring
    min_input_images: ClassVar[int] = 0
    # Whether the family reads an edit mask (`OmniRequest.media["mask"]`); none does yet, so a mask is refused
    # with a 400 rather than ignored.
    accepts_mask: ClassVar[bool] = False
    options_class: ClassVar[type[DiffusionOptions]] = DiffusionOptions  # `stages.dit.options`

    def load_model(self, device: torch.device, dtype: torch.dtype) -> DiffusionModel:
        raise NotImplementedError

    @functools.cached_property
    def token_pixels(self) -> int:
        """The side in pixels of one image token of the DiT: the VAE's downsampling (read from its config, as
        diffusers derives `vae_scale_factor`) times the 2x2 latent patch every family here packs."""
        config = json.loads((self.model_path / "vae" / "config.json").read_text())
        if "temperal_downsample" in config:  # the Wan-style video VAE of Qwen-Image
            return 2 ** len(config["temperal_downsample"]) * 2
        return 2 ** (len(config["block_out_channels"]) - 1) * 2

    def image_tokens(self, width: int, height: int) -> int:
        """The DiT's image tokens for an image of width x height (a multiple of `size_multiple`)."""
        return (width // self.token_pixels) * (height // self.token_pixels)

    def input_image_tokens(self, images: list[Any]) -> int:
        """The tokens the DiT's sequence holds for a request's input images (edit families override it)."""
        return 0

    def resolve(self, params: DiffusionParams, images: list[Any]) -> DiffusionParams:
        """The request's params with the checkpoint's defaults filled in (an edit family may size the output from
        its input images here)."""
        return params.with_defaults(**self.defaults)

    def preprocess(self, request: OmniRequest) -> StageInput:
        params = request.options.get("diffusion")
        if not isinstance(params, DiffusionParams):  # e.g. a chat request: only its sampling params' seed counts
            sampling = request.stage_params.get(STAGE) or request.stage_params.get("*")
            params = DiffusionParams(seed=getattr(sampling, "seed", None))
        images = list(request.media.get("image", []))
        if len(images) > self.max_input_images:
            raise RequestError("this model does not take input images; serve an edit model to edit images"
                               if not self.max_input_images else
                               f"this model takes at most {self.max_input_images} input images (got {len(images)})",
                               "image")
        if request.media.get("mask") and not self.accepts_mask:
            raise RequestError(MASK_REFUSED, "mask")
        if len(images) < self.min_input_images:
            raise RequestError(f"this model edits images: send at least {self.min_input_images} input image", "image")
        params = self.resolve(replace(params, prompt=prompt_of(request)), images).check()
        for name in ("width", "height"):
            if getattr(params, name) % self.size_multiple:
                raise RequestError(f"{name} must be a multiple of {self.size_multiple} for this model "
                                   f"(got {getattr(params, name)})", name)
        tensors = {f"image_{i}": image_tensor(image) for i, image in enumerate(images)}
        return StageInput(request.request_id, params=params.as_wire(), tensors=tensors)

    def build_engine(self, stage: str, device: str | None = None) -> DiffusionEngine:
        cfg = self.stage_config(stage)
        dev = resolve_device(device or cfg.devices)
        # Image DiTs are released in bfloat16; float32 on the CPU, where half precision is slow and less exact.
        dtype = getattr(torch, cfg.dtype) if cfg.dtype != "auto" else (
            torch.float32 if dev.type == "cpu" else torch.bfloat16)
        # Offloaded weights are loaded into CPU memory; the engine streams them to `dev` as they run.
        offload = bool(cfg.options.get("cpu_offload")) and dev.type != "cpu"
        model = self.load_model(torch.device("cpu") if offload else dev, dtype)
        model.device = dev
        if getattr(model, "pipeline_class", None) is None:  # the diffusers class that reads its LoRA files
            model.pipeline_class = json.loads((self.model_path / "model_index.json").read_text())["_class_name"]
        return DiffusionEngine.from_stage(stage, model, cfg, self.options_class)

    def to_output(self, stage: str, out: StageOutput) -> OmniOutput:
        """Progress as `progress` (steps done, steps) and `num_output_tokens` (steps done); the images, on the last
        delta, as PIL images."""
        from PIL import Image

        images = out.tensors.get("images")
        pil = [] if images is None else [Image.fromarray(a) for a in (images * 255).round().to(torch.uint8).numpy()]
        progress = out.tensors.get("progress")
        steps = None if progress is None else (int(progress[-1, 0]), int(progress[-1, 1]))
        return OmniOutput(out.request_id, images=pil, num_output_tokens=out.num_output_tokens, progress=steps,
                          num_prompt_tokens=out.num_prompt_tokens)
