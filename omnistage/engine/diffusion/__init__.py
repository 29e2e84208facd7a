"""Diffusion stages: step-level batching of denoising loops over a family's encode / velocity / decode."""

from omnistage.engine.diffusion.engine import DiffusionEngine, DiffusionModel, cfg_combine
from omnistage.engine.diffusion.params import DiffusionOptions, DiffusionParams

__all__ = ["DiffusionEngine", "DiffusionModel", "DiffusionOptions", "DiffusionParams", "cfg_combine"]
