"""Which torch device a stage runs on, from its deploy config's `devices`, and making it current in a thread; how
many of its multiprocessors the stage's decode kernels are sized for (`sm_budget`)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

_budget = threading.local()


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


@contextlib.contextmanager
def sm_budget(limit: int | None) -> Iterator[None]:
    """Kernels launched (or captured into CUDA graphs) in this thread inside the block size their one-wave grids
    for at most `limit` multiprocessors (`budgeted_sms`); None: all of them. A stage's deploy option `max_sms`:
    beside a stage whose matmuls leave that many SMs free (token2wav's `cublas_sm_carveout`), its batch-1 decode
    kernels then fit in them instead of waiting for SMs the other stage's programs hold."""
    before = getattr(_budget, "limit", None)
    _budget.limit = limit
    try:
        yield
    finally:
        _budget.limit = before


def budgeted_sms(count: int) -> int:
    """A device's `count` multiprocessors, or this thread's `sm_budget` if that is smaller."""
    limit = getattr(_budget, "limit", None)
    return count if limit is None else max(1, min(count, limit))
