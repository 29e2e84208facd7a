"""Noise / flow-matching time grids and update rules shared by diffusion and generation stages."""

from omnistage.engine.schedulers.diffusers_sampler import DiffusersSampler
from omnistage.engine.schedulers.flow_match import FlowMatch, FlowMatchConfig, Schedule

__all__ = ["DiffusersSampler", "FlowMatch", "FlowMatchConfig", "Schedule"]
