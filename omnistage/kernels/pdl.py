"""Programmatic dependent launch (PDL) for the decode step's Triton kernels, on Hopper and later.

A batch-1 decode step is a chain of ~200 kernels of a few µs each, and every link costs time whatever the
kernel does: the next kernel is launched only once the previous one has drained, and then waits a memory
round trip for its first weights. With PDL the next kernel is launched while the previous one still runs,
reads its first weights (which no kernel writes), and executes `griddepcontrol.wait` before it reads
anything an earlier kernel wrote; so its launch and its first weight reads overlap the previous kernel.

The rule every kernel launched with `launch_pdl` follows: call `wait_for_inputs(PDL)` before any load or
store of activations, caches or metadata; only reads of never-written data (weights) may come before it.
`launch_next(PDL)` says when the next kernel may launch: early in a short kernel, after the main loop in a
long one. A kernel that follows one launched without PDL (torch's, cuBLAS's) finds its wait already met.
Asking L2 for a GEMM's weights beyond its first tile (`cp.async.bulk.prefetch`) was slower on an H200.
Off on CPU, before Hopper, and with OMNISTAGE_PDL=0.
"""

from __future__ import annotations

import os
from functools import cache

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is needed only on CUDA
    triton = None


_forced: bool | None = None  # set_enabled's override (tests, benchmarks)


def set_enabled(value: bool | None) -> None:
    """Force PDL off (False) or back to the default (None: on where supported). Kernels compile for both, and
    a CUDA graph keeps the launches it captured."""
    global _forced
    _forced = None if value is None else bool(value)


@cache
def _supported(device_index: int) -> bool:
    if os.environ.get("OMNISTAGE_PDL", "1") == "0" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    from triton.backends.nvidia.compiler import CUDAOptions

    return torch.cuda.get_device_capability(device_index)[0] >= 9 and "launch_pdl" in CUDAOptions.__dataclass_fields__


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL (pass it as the kernels' PDL constexpr)."""
    if _forced is False or triton is None or device.type != "cuda":
        return False
    return _supported(device.index if device.index is not None else torch.cuda.current_device())


def launch_options(pdl: bool) -> dict:
    """The launch keyword for a kernel whose PDL constexpr is `pdl` (none at all when off, for the interpreter)."""
    return {"launch_pdl": True} if pdl else {}


if triton is not None:

    @triton.jit
    def wait_for_inputs(PDL: tl.constexpr):
        """Wait until the previous kernel in the stream has finished and its writes are visible. A no-op
        without PDL."""
        if PDL:
            tl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32, is_pure=False,
                                      pack=1)

    @triton.jit
    def launch_next(PDL: tl.constexpr):
        """Let the next kernel launch (it waits in turn before reading this one's results): early in a short
        kernel; after the main loop in a long one, so the next one's blocks take SMs only for the tail."""
        if PDL:
            tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=tl.int32,
                                      is_pure=False, pack=1)
