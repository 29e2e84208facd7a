"""Which torch device a stage runs on, from its deploy config's `devices`, and making it current in a thread."""

from __future__ import annotations

import contextlib

import torch


def resolve_device(devices: str | None) -> torch.device:
    """A stage's device from its `devices` ("0", "1,2", "cpu"; None: cuda:0 if there is one, else the CPU): the
    first one listed."""
    if devices is None:
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    first = devices.split(",")[0].strip()
    return torch.device("cpu" if first == "cpu" else f"cuda:{first}")


def on_device(device: torch.device | None) -> contextlib.AbstractContextManager:
    """`device` current in this thread inside the block when it is a GPU: Triton launches its kernels, and torch
    captures graphs, on the current device, which a new thread has as cuda:0. Otherwise no change."""
    if device is None or device.type != "cuda" or not torch.cuda.is_available():
        return contextlib.nullcontext()
    return torch.cuda.device(device)
