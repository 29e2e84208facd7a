"""DiffusersSampler steps one request exactly as a diffusers pipeline loop steps its scheduler, and two requests'
samplers made from one config keep their multistep histories apart."""

import torch
from diffusers import UniPCMultistepScheduler

from omnistage.engine.schedulers import DiffusersSampler

CONFIG = dict(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0, solver_order=2)


def _output(latents: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return torch.tanh(latents) * (t.float() / 1000) - 0.3 * latents  # stands in for a DiT: depends on both


def _diffusers_loop(latents: torch.Tensor, steps: int) -> torch.Tensor:
    scheduler = UniPCMultistepScheduler(**CONFIG)
    scheduler.set_timesteps(steps, device="cpu")
    for t in scheduler.timesteps:
        latents = scheduler.step(_output(latents, t), t, latents, return_dict=False)[0]
    return latents


def test_unipc_matches_the_pipeline_loop_and_requests_stay_apart() -> None:
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(1, 4, 3, 3, generator=g), torch.randn(2, 4, 3, 3, generator=g)
    sa = DiffusersSampler(UniPCMultistepScheduler(**CONFIG), 6)
    sb = DiffusersSampler(UniPCMultistepScheduler(**CONFIG), 9)
    xa, xb = a, b
    for i in range(9):  # interleaved, as the engine steps requests of one batch
        if i < sa.num_steps:
            xa = sa.step(_output(sa.model_input(xa, i), sa.timesteps[i]), i, xa)
        xb = sb.step(_output(sb.model_input(xb, i), sb.timesteps[i]), i, xb)
    assert torch.equal(xa, _diffusers_loop(a, 6))
    assert torch.equal(xb, _diffusers_loop(b, 9))
    assert sa.init_noise_sigma == 1.0
