"""A diffusers scheduler as one request's sampler (the diffusion engine's `Sampler` contract).

Multistep solvers (UniPC, DPM-Solver) keep a history of model outputs, and SDE solvers draw noise between steps:
both are state of ONE denoising run. So each request gets its own scheduler instance, made from the checkpoint's
scheduler config, and steps only its own rows; the engine still runs one batched forward for every request.
Its timesteps, update and noise are exactly those of the diffusers pipeline that uses the same scheduler.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch


class DiffusersSampler:
    def __init__(self, scheduler: Any, num_steps: int, generator: torch.Generator | None = None,
                 **set_timesteps: Any):
        """`scheduler`: a fresh instance (never shared between requests); `generator`: the noise source of
        stochastic steps, as the pipeline's `generator` is; `set_timesteps`: extra arguments of its
        `set_timesteps` (e.g. `sigmas`)."""
        scheduler.set_timesteps(num_steps, device="cpu", **set_timesteps)
        self.scheduler = scheduler
        self.timesteps: torch.Tensor = scheduler.timesteps
        self.init_noise_sigma = float(scheduler.init_noise_sigma)
        takes = inspect.signature(scheduler.step).parameters
        self._step_kwargs = {"generator": generator} if "generator" in takes else {}

    @property
    def num_steps(self) -> int:
        return len(self.timesteps)

    def model_input(self, latents: torch.Tensor, index: int) -> torch.Tensor:
        return self.scheduler.scale_model_input(latents, self.timesteps[index])

    def step(self, velocity: torch.Tensor, index: int, latents: torch.Tensor) -> torch.Tensor:
        return self.scheduler.step(velocity, self.timesteps[index], latents, return_dict=False,
                                   **self._step_kwargs)[0]
