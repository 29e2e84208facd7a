"""The acceleration switches of a diffusion stage (`DiffusionOptions`), applied to the family's DiT once at
start-up. Each either takes effect or raises ConfigError saying why it cannot for this model or machine.

- compile: `torch.compile` of the DiT's repeated blocks (diffusers' `_repeated_blocks`), so one compiled
  block serves every layer and compilation stays short.
- cache: cache-dit's DBCache (optionally with TaylorSeer) on the DiT. Its cache is a property of ONE sequence
  of steps over ONE batch, so under it the engine batches in cohorts: requests that start together run to the
  end together, and the cache context is refreshed at each cohort's start (`begin`) and whenever the cohort's
  rows change (an abort).
- quantization fp8: torchao float8 weights with dynamic activation scales on the DiT's linear layers.
- cpu_offload: the model's modules stay in CPU memory and are streamed to the GPU block by block (diffusers'
  group offloading), for GPUs smaller than the model.
- attention_backend: diffusers' attention dispatcher backend for the DiT.

A model with several DiTs (two-expert video models) lists them as `transformers`; every switch applies to each of
them, or is refused: step caching is, since its cache follows one DiT through one sequence of steps.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from omnistage.engine.diffusion.params import DiffusionOptions
from omnistage.errors import ConfigError

logger = logging.getLogger(__name__)


def modules_of(model: Any) -> dict[str, torch.nn.Module]:
    """The model's torch modules (text encoders, DiT, VAE), by attribute name."""
    return {name: m for name, m in vars(model).items() if isinstance(m, torch.nn.Module)}


class Accelerator:
    def __init__(self, model: Any, options: DiffusionOptions, stage: str):
        self.model, self.options, self.stage = model, options, stage
        self.transformer: torch.nn.Module | None = getattr(model, "transformer", None)
        self.transformers: list[torch.nn.Module] = list(getattr(model, "transformers", None) or
                                                        ([self.transformer] if self.transformer is not None else []))
        self.cohorts = options.cache is not None  # see the module docstring
        device = torch.device(model.device)
        wanted = [name for name in ("compile", "cache", "quantization", "cpu_offload", "attention_backend")
                  if getattr(options, name) not in (None, False)]
        if wanted and self.transformer is None:
            raise self._refuse(", ".join(wanted), "this model exposes no DiT to accelerate")
        if options.quantization == "fp8":
            self._fp8(device)
        if options.attention_backend is not None:
            try:
                for transformer in self.transformers:
                    transformer.set_attention_backend(options.attention_backend)
            except Exception as exc:
                raise self._refuse("attention_backend", str(exc)) from None
        if options.cache is not None:
            if len(self.transformers) > 1:
                raise self._refuse("cache", f"this model has {len(self.transformers)} DiTs (experts) taking turns over "
                                   "the steps; step caching follows one DiT through all of them")
            self._cache(options.cache)
        if options.compile:
            for transformer in self.transformers:
                if not getattr(transformer, "_repeated_blocks", None):
                    raise self._refuse("compile", f"{type(transformer).__name__} declares no repeated blocks")
                transformer.compile_repeated_blocks(fullgraph=True)
        if options.cpu_offload:
            self._offload(device)

    def _refuse(self, switch: str, why: str) -> ConfigError:
        return ConfigError(f"stages.{self.stage}.options.{switch}: not available for this model here: {why}")

    def _fp8(self, device: torch.device) -> None:
        if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
            raise self._refuse("quantization", "fp8 needs a CUDA GPU with FP8 units (compute capability 8.9+)")
        try:
            from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_
        except ImportError:
            raise self._refuse("quantization", "fp8 needs torchao (pip install 'omnistage[accel]')") from None
        for transformer in self.transformers:
            quantize_(transformer, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))

    def _cache(self, config: dict[str, Any]) -> None:
        try:
            import cache_dit
        except ImportError:
            raise self._refuse("cache", "step caching needs cache-dit (pip install 'omnistage[accel]')") from None
        config = dict(config)
        taylorseer = config.pop("taylorseer", None)
        try:
            cache_config = cache_dit.DBCacheConfig(**config)
            calibrator = None if taylorseer is None else cache_dit.TaylorSeerCalibratorConfig(**taylorseer)
            cache_dit.enable_cache(self.transformer, cache_config=cache_config, calibrator_config=calibrator)
        except Exception as exc:  # an unknown field, or a DiT cache-dit has no adapter for
            raise self._refuse("cache", f"cache-dit: {exc}") from None

    def _offload(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise self._refuse("cpu_offload", "offloading streams weights to a GPU; this stage runs on the CPU")
        from diffusers.hooks import apply_group_offloading

        for module in modules_of(self.model).values():
            module.to("cpu")
            apply_group_offloading(module, onload_device=device, offload_type="leaf_level", use_stream=True)

    def begin(self, num_steps: int) -> None:
        """A cohort of `num_steps` steps starts (or its rows changed): the step cache starts afresh."""
        if self.cohorts:
            import cache_dit

            cache_dit.refresh_context(self.transformer, num_inference_steps=num_steps)
