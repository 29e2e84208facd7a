"""What every image-generation family shares: one diffusion stage (`dit`) holding its text encoders, DiT and
VAE, entered by a prompt (plus input images for edit models) and leaving as PIL images. A deploy config with a
`stages.encode` section splits the text encoders off into a stage of their own, `encode` (a generation stage that
batches the prompts of every ready request, on its own devices), whose conditioning tensors go to `dit` over the
edge's connector; the images are the same either way.

A family subclasses `ImagePipeline`: it sets `defaults` (diffusers' `__call__` defaults for the checkpoint),
`size_multiple`, and `input_modalities` / `max_input_images` for edit models, implements `load_model` (the parts
a stage holds: all, the text encoders, or the DiT and VAE), and builds it with `ImagePipeline.build`.
A request's `DiffusionParams` travel in `OmniRequest.options["diffusion"]`; input images in
`OmniRequest.media["image"]` (PIL images, in the caller's order) and reach the engine as `StageInput.tensors`
"image_0", "image_1", ... (uint8 [H, W, 3]).
"""

from __future__ import annotations

import functools
import inspect
import json
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
import torch

from omnistage.config.deploy import Advanced, DeployConfig, parse_section
from omnistage.devices import resolve_device
from omnistage.engine.base import Engine
from omnistage.engine.diffusion import DiffusionEngine, DiffusionModel, DiffusionOptions, DiffusionParams, ulysses
from omnistage.engine.diffusion import parallel as cfg_parallel
from omnistage.engine.diffusion.encoder import PromptEncoder
from omnistage.engine.generation.engine import GenerationEngine
from omnistage.errors import RequestError
from omnistage.families.base import CheckpointInfo, Edge, Pipeline, StageSpec
from omnistage.types import OmniOutput, OmniRequest, StageInput, StageOutput

STAGE = "dit"
ENCODE_STAGE = "encode"  # only when the deploy config has a `stages.encode` section
# What one stage's model holds: everything, only the text encoders (the encode stage, plus the VAE's encoder for
# edit models), or everything but the text encoders (the DiT stage after an encode stage).
Parts = Literal["all", "encoders", "dit"]
MASK_REFUSED = ("this model does not take a mask: it edits the whole image from the prompt; "
                "leave 'mask' out of the request")


def component_config(cls: type, folder: Path) -> dict[str, Any]:
    """A diffusers component's `config.json` over its class's defaults, as `.config` of the loaded module reads,
    without loading its weights (a stage that does not hold the module still needs its shapes)."""
    params = inspect.signature(cls.__init__).parameters
    defaults = {k: p.default for k, p in params.items() if p.default is not inspect.Parameter.empty}
    return {**defaults, **json.loads((folder / "config.json").read_text())}


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
    output_modality: ClassVar[str] = "image"  # what the `dit` stage delivers ("video" for video families)

    @classmethod
    def build(cls, info: CheckpointInfo, deploy: DeployConfig) -> ImagePipeline:
        """The pipeline of `info`'s checkpoint: `dit` alone, or `encode` -> `dit` when the deploy config has a
        `stages.encode` section (an empty one takes the stage defaults)."""
        split = ENCODE_STAGE in deploy.stages
        deploy.check_stages({ENCODE_STAGE: Advanced, STAGE: Advanced} if split else {STAGE: Advanced},
                            options={STAGE: cls.options_class})
        stages = [StageSpec(ENCODE_STAGE, "generation")] if split else []
        pipeline = cls(info.path, deploy, [*stages, StageSpec(STAGE, "diffusion", outputs=(cls.output_modality,))])
        if split:
            pipeline.edges = [Edge(ENCODE_STAGE, STAGE, pipeline.encoded, streamed=False)]
        return pipeline

    def load_model(self, device: torch.device, dtype: torch.dtype, parts: Parts = "all") -> DiffusionModel:
        raise NotImplementedError

    def encoded(self, request: OmniRequest, out: StageOutput) -> StageInput:
        """The handoff encode -> dit: the request's resolved params with the conditioning the encoder made."""
        return StageInput(request.request_id, params=self.request_params(request).as_wire(), tensors=out.tensors)

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
        params = self.request_params(request)
        tensors = {f"image_{i}": image_tensor(image) for i, image in enumerate(request.media.get("image", []))}
        return StageInput(request.request_id, params=params.as_wire(), tensors=tensors)

    def request_params(self, request: OmniRequest) -> DiffusionParams:
        """The request's params, checked and resolved against the checkpoint's defaults (RequestError names what to
        fix); a pure function of the request, so every stage of it resolves the same."""
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
        return params

    def build_engine(self, stage: str, device: str | None = None) -> Engine:
        cfg = self.stage_config(stage)
        dev = resolve_device(device or cfg.devices)
        # Image DiTs are released in bfloat16; float32 on the CPU, where half precision is slow and less exact.
        dtype = getattr(torch, cfg.dtype) if cfg.dtype != "auto" else (
            torch.float32 if dev.type == "cpu" else torch.bfloat16)
        if stage == ENCODE_STAGE:
            return GenerationEngine.from_stage(stage, PromptEncoder(self.load_model(dev, dtype, "encoders")), cfg)
        # Offloaded weights are loaded into CPU memory; the engine streams them to `dev` as they run.
        offload = bool(cfg.options.get("cpu_offload")) and dev.type != "cpu"
        parts = "dit" if len(self.stages) > 1 else "all"
        if cfg.options.get("ulysses_degree"):  # N rank processes run the DiT; see engine/diffusion/ulysses.py
            options = parse_section(self.options_class, cfg.options, f"stages.{stage}.options")
            degree = ulysses.check(options, stage, self.model_path)
            devices = cfg_parallel.rank_devices(device or cfg.devices, degree, f"stages.{stage}.options.ulysses_degree")
            model: Any = ulysses.launch(functools.partial(self.load_model, dtype=dtype, parts="dit"),
                                        functools.partial(self.load_model, dtype=dtype, parts=parts),
                                        devices, options, stage)
        elif cfg.options.get("cfg_parallel"):  # rank 1 holds the DiT (and VAE) only; see engine/diffusion/parallel.py
            options = parse_section(self.options_class, cfg.options, f"stages.{stage}.options")
            devices = cfg_parallel.rank_devices(device or cfg.devices, 2, f"stages.{stage}.options.cfg_parallel")
            model = cfg_parallel.launch(functools.partial(self.load_model, dtype=dtype, parts="dit"),
                                        functools.partial(self.load_model, dtype=dtype, parts=parts),
                                        devices, options, stage)
        else:
            model = self.load_model(torch.device("cpu") if offload else dev, dtype, parts)
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
