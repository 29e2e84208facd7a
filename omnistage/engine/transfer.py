"""Copies between host and device that do not block the driver for other threads; the streams a stage runs and
captures its CUDA graphs on."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator

import torch

logger = logging.getLogger(__name__)


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` on `device`, copied asynchronously through pinned memory on CUDA. A copy from pageable memory
    returns only once the device has drained its queue up to it: a per-step round trip, and with stages
    time-sharing one GPU each such wait can last a whole time slice of another process. (The pinned block
    is reused only after the copy has run: PyTorch's host allocator records the stream.) A tensor already on a
    device is moved as usual."""
    if device.type != "cuda" or host.device.type != "cpu":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """`tensors` on the host, waited for once. From CUDA through pinned memory and an event: a copy into pageable
    memory waits inside the driver for its stream to get there, and other threads' CUDA calls on the device
    (another stage's event records and graph launches) can wait behind it all that time (run 12: the talker's
    steps stalled for whole flow-matching solves of token2wav, whose audio left that way). The results are
    ordinary host tensors: the pinned blocks go back to PyTorch's host cache."""
    if not any(t.device.type == "cuda" for t in tensors):
        return [t.cpu() for t in tensors]
    pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    for host, tensor in zip(pinned, tensors, strict=True):
        host.copy_(tensor, non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(next(t.device for t in tensors if t.device.type == "cuda")))
    done.synchronize()
    return [host.clone() for host in pinned]


def host_list(tensor: torch.Tensor) -> list:
    """`tensor.tolist()`, its copy to the host made as `to_host` makes it."""
    return to_host([tensor])[0].tolist()


_confined = threading.local()  # this thread's SM budget for the streams it creates (sm_share)
# (device index, SMs) -> green context, kept for the life of the process
_green_contexts: dict[tuple[int, int], object] = {}


@contextlib.contextmanager
def sm_share(num_sms: int | None) -> Iterator[None]:
    """Streams this thread creates in the block (`stage_stream`, `own_capture_stream`: a stage's own stream and
    its graphs' capture streams) run their kernels on at most `num_sms` of the GPU's multiprocessors, through
    a CUDA green context. A stage of long, compute-bound kernels (token2wav's solves) confined this way leaves
    the other SMs to stages of short, bandwidth-bound decode steps sharing the GPU: otherwise each of their
    kernels waits for free SMs behind the wide ones. The other stages' streams still use every SM. None: no
    limit."""
    before = getattr(_confined, "num_sms", None)
    _confined.num_sms = num_sms
    try:
        yield
    finally:
        _confined.num_sms = before


def _green_context(device: torch.device, num_sms: int) -> object | None:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if num_sms >= torch.cuda.get_device_properties(index).multi_processor_count:
        return None
    key = (index, num_sms)
    if key not in _green_contexts:
        try:
            from torch.cuda.green_contexts import GreenContext

            _green_contexts[key] = GreenContext.create(num_sms=num_sms, device_id=index)
        except (ImportError, RuntimeError, TypeError, AttributeError) as exc:  # older torch, driver or GPU
            logger.warning("cannot confine a stage to %d SMs of cuda:%d (%s); it uses every SM", num_sms, index, exc)
            _green_contexts[key] = None
    return _green_contexts[key]


def stage_stream(device: torch.device | str, priority: int = 0) -> torch.cuda.Stream:
    """A new stream on `device`, confined to the SMs `sm_share` allows this thread (green-context streams have
    the default priority)."""
    device = torch.device(device)
    num_sms = getattr(_confined, "num_sms", None)
    context = _green_context(device, num_sms) if num_sms and device.type == "cuda" else None
    if context is not None and hasattr(context, "Stream"):
        return context.Stream()
    return torch.cuda.Stream(device, priority=priority)


def own_capture_stream(device: torch.device | None = None) -> torch.cuda.Stream:
    """A stream to capture one component's CUDA graphs on. cuBLAS keeps a workspace per (handle, stream) and
    a graph keeps the one it was captured with: graphs captured on torch's shared default capture stream
    would share it, and stages replaying theirs at once in one process (inline workers, each on its own
    stream) would race on it (split matmuls synchronise through it: a hang, not just wrong numbers). Under
    `sm_share` the graphs keep the SM budget of the stream they were captured on."""
    return stage_stream(device if device is not None else torch.device("cuda"))
