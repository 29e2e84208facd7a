"""Checks that code launches GPU work without waiting for the device (CUDA's sync debug mode)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
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
    def checked(*args: Any, **kwargs: Any) -> Any:
        with device_waits_raise():
            try:
                return fn(*args, **kwargs)
            except RuntimeError as exc:
                waits.append(str(exc))
                raise

    return checked
