"""Which torch device a stage runs on, from its deploy config's `devices`, making it current in a thread, and the
streams a stage makes (on a partition of the GPU's SMs when its `sm_count` asks for one)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

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


class SMPartition:
    """`sm_count` SMs of one GPU as a CUDA green context. Kernels launched on its streams run on those SMs only,
    and so do kernels captured into a CUDA graph on them, whatever stream replays the graph. A stage whose long
    kernels would otherwise fill every SM (a flow-matching solve) then leaves the rest free for the
    latency-bound stages beside it: their short kernels start at once instead of waiting for SMs to drain.
    The driver rounds the count up to its partition granularity (`sm_count` is what it gave)."""

    def __init__(self, device: torch.device, sm_count: int):
        from cuda.bindings import driver  # ships with CUDA builds of torch (>= 2.9)

        self.device, self._driver = device, driver
        torch.zeros(1, device=device)  # the device's primary context exists: green contexts derive from it
        dev = _checked(driver.cuDeviceGet(device.index or 0))
        sms = _checked(driver.cuDeviceGetDevResource(dev, driver.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM))
        if not 0 < sm_count <= sms.sm.smCount:
            raise ValueError(f"sm_count {sm_count}: {device} has {sms.sm.smCount} SMs")
        groups, count, _ = _checked(driver.cuDevSmResourceSplitByCount(1, sms, 0, sm_count))
        if count != 1:
            raise RuntimeError(f"the driver could not set {sm_count} SMs of {device} apart")
        self.sm_count = groups[0].sm.smCount
        desc = _checked(driver.cuDevResourceGenerateDesc([groups[0]], 1))
        flags = driver.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM
        self._green = _checked(driver.cuGreenCtxCreate(desc, dev, flags))

    def stream(self, priority: int = 0) -> torch.cuda.Stream:
        """A new stream on this partition (non-blocking, like torch's own streams)."""
        driver = self._driver
        handle = _checked(driver.cuGreenCtxStreamCreate(self._green, driver.CUstream_flags.CU_STREAM_NON_BLOCKING,
                                                         priority))
        return torch.cuda.ExternalStream(int(handle), device=self.device)


def _indexed(device: torch.device) -> torch.device:
    """cuda -> cuda:N (the current device), so that one GPU has one name."""
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def _checked(result: tuple) -> Any:
    """A cuda.bindings call's result: raises on an error code, else its value (or values)."""
    error, *values = result
    if int(error) != 0:
        raise RuntimeError(f"CUDA driver call failed: {error!r}")
    return values[0] if len(values) == 1 else tuple(values)


_partitions: dict[tuple[torch.device, int], SMPartition] = {}
_local = threading.local()  # .partition: the SMPartition this thread's new streams come from


def sm_partition(device: torch.device | None, sm_count: int | None) -> SMPartition | None:
    """The partition of `sm_count` SMs of `device` (one per device and count in a process), or None when there is
    nothing to partition: no count, or not a GPU."""
    if not sm_count or device is None or device.type != "cuda":
        return None
    device = _indexed(device)
    key = (device, sm_count)
    if key not in _partitions:
        _partitions[key] = SMPartition(device, sm_count)
    return _partitions[key]


@contextlib.contextmanager
def within(partition: SMPartition | None) -> Iterator[None]:
    """Streams `new_stream` makes in this thread inside the block come from `partition` (None: no change)."""
    before = getattr(_local, "partition", None)
    _local.partition = partition if partition is not None else before
    try:
        yield
    finally:
        _local.partition = before


def new_stream(device: torch.device, priority: int = 0) -> torch.cuda.Stream:
    """A new CUDA stream for a stage's own use: on the thread's SM partition when it has one on `device`."""
    partition = getattr(_local, "partition", None)
    if partition is not None and partition.device == _indexed(torch.device(device)):
        return partition.stream(priority)
    return torch.cuda.Stream(device, priority=priority)
