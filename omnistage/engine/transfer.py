"""Host-to-device copies that do not wait for the device; streams to capture CUDA graphs on."""

from __future__ import annotations

import torch


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` on `device`, copied asynchronously through pinned memory on CUDA. A copy from pageable memory
    returns only once the device has drained its queue up to it: a per-step round trip, and with stages
    time-sharing one GPU each such wait can last a whole time slice of another process. (The pinned block
    is reused only after the copy has run: PyTorch's host allocator records the stream.) A tensor already on a
    device is moved as usual."""
    if device.type != "cuda" or host.device.type != "cpu":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def own_capture_stream(device: torch.device | None = None) -> torch.cuda.Stream:
    """A stream to capture one component's CUDA graphs on. cuBLAS keeps a workspace per (handle, stream) and
    a graph keeps the one it was captured with: graphs captured on torch's shared default capture stream
    would share it, and stages replaying theirs at once in one process (inline workers, each on its own
    stream) would race on it (split matmuls synchronise through it: a hang, not just wrong numbers)."""
    return torch.cuda.Stream(device)
