"""Checks that code launches GPU work without waiting for the device (CUDA's sync debug mode)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import wraps
from typing import Any

import torch


@contextmanager
def device_waits_raise() -> Iterator[None]:
    """Inside, any host wait on the device (a pageable copy, `.item()`, a synchronize) raises RuntimeError."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def recording_device_waits(fn: Callable[..., Any], waits: list[str]) -> Callable[..., Any]:
    """`fn`, raising on (and recording in `waits`) any wait for the device during a call."""
    @wraps(fn)
    def checked(*args: Any, **kwargs: Any) -> Any:
        with device_waits_raise():
            try:
                return fn(*args, **kwargs)
            except RuntimeError as exc:
                waits.append(str(exc))
                raise

    return checked


def recording_queue_drains(fn: Callable[..., Any], drains: list[str], sleep_cycles: int = 100_000_000
                           ) -> Callable[..., Any]:
    """`fn`, called behind a long queued GPU spin (`sleep_cycles`) on the current stream; a call that returns
    only after the spin ended waited for the device, and is recorded in `drains`. This sees waits the sync debug
    mode does not: an asynchronous call the driver may finish only once the stream has drained (CUDA allows it
    for a copy from pageable memory, such as the pageable temporary PyTorch copies a strided slice of a pinned
    buffer through, though a driver need not make a small copy wait)."""
    @wraps(fn)
    def checked(*args: Any, **kwargs: Any) -> Any:
        torch.cuda._sleep(sleep_cycles)
        spun = torch.cuda.Event()
        spun.record()
        out = fn(*args, **kwargs)
        if spun.query():
            drains.append(getattr(fn, "__name__", "call"))
        return out

    return checked
