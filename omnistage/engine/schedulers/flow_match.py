"""Flow matching with Euler steps: the sampler of rectified-flow DiTs (FLUX.1, SD3, Qwen-Image, Wan).

A latent moves from noise (sigma 1) to data (sigma 0) along the model's velocity: x <- x + (sigma_next - sigma) * v.
The grid of sigmas is evenly spaced, then shifted towards the noisy end, by a fixed `shift` or, with dynamic
shifting, by `mu` interpolated from the image's token count (bigger images spend more steps at high noise).

The grid is computed with the same float32 operations in the same order as diffusers'
`FlowMatchEulerDiscreteScheduler` (as its pipelines call it), so a seed gives the same image in both. One
`FlowMatch` serves many requests: a `Schedule` is per request, and `step` takes per-row sigmas, so rows of one
batch may be at different steps of different schedules.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from omnistage.errors import ConfigError


@dataclass(frozen=True)
class FlowMatchConfig:
    num_train_timesteps: int = 1000
    shift: float = 1.0
    use_dynamic_shifting: bool = False
    base_shift: float = 0.5
    max_shift: float = 1.15
    base_image_seq_len: int = 256
    max_image_seq_len: int = 4096
    time_shift_type: Literal["exponential", "linear"] = "exponential"
    shift_terminal: float | None = None

    # Options of diffusers' scheduler config this implementation does not follow; a checkpoint setting one is
    # refused rather than sampled differently.
    _UNSUPPORTED = ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas", "invert_sigmas",
                    "stochastic_sampling")

    @classmethod
    def from_diffusers(cls, config: dict[str, Any]) -> FlowMatchConfig:
        """From a `FlowMatchEulerDiscreteScheduler` scheduler_config.json."""
        unsupported = [k for k in cls._UNSUPPORTED if config.get(k)]
        if unsupported:
            raise ConfigError(f"flow-match scheduler: {', '.join(unsupported)} not supported yet")
        known = {f: config[f] for f in cls.__dataclass_fields__ if f in config and config[f] is not None}
        return cls(**known)


@dataclass
class Schedule:
    """One request's grid: `sigmas` [steps + 1] ending in 0, `timesteps` [steps] (sigma x train timesteps, what
    the model is conditioned on), both float32 on the CPU."""

    sigmas: torch.Tensor
    timesteps: torch.Tensor

    @property
    def num_steps(self) -> int:
        return len(self.timesteps)

    def step(self, velocity: torch.Tensor, index: int, latents: torch.Tensor) -> torch.Tensor:
        """Step `index` of this grid for one request's rows (the engine's `Sampler` contract)."""
        return FlowMatch.step(latents, velocity, self.sigmas[index].expand(len(latents)),
                              self.sigmas[index + 1].expand(len(latents)))


class FlowMatch:
    def __init__(self, config: FlowMatchConfig):
        self.config = config

    def mu(self, image_seq_len: int) -> float:
        """Dynamic shift: linear in the token count through (base_len, base_shift) and (max_len, max_shift)."""
        c = self.config
        slope = (c.max_shift - c.base_shift) / (c.max_image_seq_len - c.base_image_seq_len)
        return image_seq_len * slope + (c.base_shift - slope * c.base_image_seq_len)

    def schedule(self, num_steps: int, image_seq_len: int | None = None, sigmas: list[float] | None = None) -> Schedule:
        """The grid for `num_steps`: evenly spaced sigmas from 1 to 1/num_steps (or the given `sigmas`), shifted."""
        c = self.config
        if sigmas is None:
            sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
        s = np.asarray(sigmas).astype(np.float32)
        if c.use_dynamic_shifting:
            if image_seq_len is None:
                raise ValueError("dynamic shifting needs the image's token count")
            mu = self.mu(image_seq_len)
            # sigma' = e^mu / (e^mu + (1/sigma - 1)); the linear type uses mu in place of e^mu.
            scale = math.exp(mu) if c.time_shift_type == "exponential" else mu
            s = scale / (scale + (1 / s - 1))
        else:
            s = c.shift * s / (1 + (c.shift - 1) * s)
        if c.shift_terminal:  # stretch so that the last sigma is shift_terminal
            one_minus = 1 - s
            s = 1 - one_minus / (one_minus[-1] / (1 - c.shift_terminal))
        grid = torch.from_numpy(s).to(torch.float32)
        timesteps = grid * c.num_train_timesteps
        return Schedule(torch.cat([grid, torch.zeros(1)]), timesteps)

    @staticmethod
    def step(latents: torch.Tensor, velocity: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor
             ) -> torch.Tensor:
        """One Euler step per row: `sigma`, `sigma_next` [rows] float32. The update is taken in float32 and the
        result stored in the velocity's dtype, as diffusers does."""
        dt = (sigma_next - sigma).to(device=velocity.device, dtype=velocity.dtype)
        dt = dt.view(-1, *([1] * (velocity.ndim - 1)))
        return (latents.to(torch.float32) + dt * velocity).to(velocity.dtype)
