"""Programmatic dependent launch (PDL) for the decode step's Triton kernels, on Hopper and later.

A batch-1 decode step is a chain of ~200 short kernels, and every link costs time whatever the
kernel does: the next kernel is launched only once the previous one has drained. With PDL the next kernel is
launched while the previous one still runs and executes `griddepcontrol.wait` before it reads anything an
earlier kernel wrote, so its launch overlaps the previous kernel's tail.

The rule every kernel launched with `launch_pdl` follows: call `wait_for_inputs(PDL)` before any load or
store of what the previous kernel may write; `launch_next(PDL)` only after it, early in a short kernel, after
the main loop in a long one. So when a kernel launches, every kernel before the previous one has finished and
its writes are visible: weights, the step's metadata and tables, and cache entries of earlier steps may be
read before the wait (small GEMMs' whole weight tiles, decode attention's older keys), never the previous
kernel's outputs. A kernel that follows one launched without PDL (torch's, cuBLAS's) finds its wait already
met. Only a small GEMM reads its weights before the wait (its whole tile); for a large one, prefetching
(into L2, or a K loop's first tile into registers) does not pay.
Off on CPU, before Hopper, and after `set_enabled(False)` (benchmarks compare with it off).
"""

from __future__ import annotations

from functools import cache

import torch

from omnistage import envs

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is needed only on CUDA
    triton = None


_forced_off = False  # set_enabled(False) (tests, benchmarks)


def set_enabled(on: bool) -> None:
    """Turn PDL off (False) or back on where supported (True), for the launches that follow. Kernels compile
    for both settings, and a CUDA graph keeps the launches it captured."""
    global _forced_off
    _forced_off = not on


@cache
def _supported(device_index: int) -> bool:
    if envs.TRITON_INTERPRET.get():
        return False
    if torch.version.hip is not None:  # ROCm's "cuda" devices: no griddepcontrol
        return False
    from triton.backends.nvidia.compiler import CUDAOptions

    return torch.cuda.get_device_capability(device_index)[0] >= 9 and "launch_pdl" in CUDAOptions.__dataclass_fields__


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL (pass it as the kernels' PDL constexpr)."""
    if _forced_off or triton is None or device.type != "cuda":
        return False
    return _supported(device.index if device.index is not None else torch.cuda.current_device())


def launch_options(pdl: bool) -> dict:
    """The launch keyword for a kernel whose PDL constexpr is `pdl` (none at all when off, for the interpreter)."""
    return {"launch_pdl": True} if pdl else {}


def kernel_args(device: torch.device) -> dict:
    """What a launch on `device` spreads into its arguments: the kernel's PDL constexpr and the launch keyword."""
    on = enabled(device)
    return {"PDL": on, **launch_options(on)}


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
