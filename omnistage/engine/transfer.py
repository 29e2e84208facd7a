"""Copies between host and device that do not block the driver for other threads; streams to capture CUDA
graphs on."""

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


class Passed:
    """A mark in a device queue already passed (the work ran on the host): what a CUDA event is otherwise."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class HostCopy:
    """Copies of `tensors` to the host, launched on the current stream; `done` (a CUDA event) marks when they
    have landed, `wait()` returns them. From CUDA through pinned memory and an event: a copy into pageable
    memory waits inside the driver for its stream to get there, and other threads' CUDA calls on the device
    (another stage's event records and graph launches) can wait behind it all that time (the talker's steps
    would stall for whole flow-matching solves of token2wav if its audio left that way). The results are
    ordinary host tensors: the pinned blocks go back to PyTorch's host cache."""

    def __init__(self, tensors: list[torch.Tensor]):
        device = next((t.device for t in tensors if t.device.type == "cuda"), None)
        if device is None:
            self.host, self.done = [t.cpu() for t in tensors], Passed()
            return
        self.host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        for host, tensor in zip(self.host, tensors, strict=True):
            host.copy_(tensor, non_blocking=True)
        self.done = torch.cuda.Event()
        self.done.record(torch.cuda.current_stream(device))

    def wait(self) -> list[torch.Tensor]:
        self.done.synchronize()
        return self.host if isinstance(self.done, Passed) else [host.clone() for host in self.host]


def to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """`tensors` on the host, waited for once (see HostCopy)."""
    return HostCopy(tensors).wait()


def host_list(tensor: torch.Tensor) -> list:
    """`tensor.tolist()`, its copy to the host made as `to_host` makes it."""
    return to_host([tensor])[0].tolist()


def own_capture_stream(device: torch.device | None = None) -> torch.cuda.Stream:
    """A stream to capture one component's CUDA graphs on. cuBLAS keeps a workspace per (handle, stream) and
    a graph keeps the one it was captured with: graphs captured on torch's shared default capture stream
    would share it, and stages replaying theirs at once in one process (inline workers, each on its own
    stream) would race on it (split matmuls synchronise through it: a hang, not just wrong numbers)."""
    return torch.cuda.Stream(device)
