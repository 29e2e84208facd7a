"""What one grid-wide dependency costs on the GPU: a link in a chain of kernels (with and without programmatic
dependent launch) against a software barrier inside one persistent kernel.

A batch-1 decode layer is ~8 dependent steps, each a few µs; the question this answers is whether a persistent
kernel (one launch, the steps separated by barriers on a counter in global memory) could make each step cheaper
than a kernel boundary under PDL does. Every step of both forms does the same small work: each program reads the
value another program wrote in the previous step, adds one and writes it, so a broken dependency shows up as a
wrong final count (checked).

    python benchmarks/sync_cost.py --out sync.jsonl      # GPU (Hopper for the PDL rows)
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from graph_timing import time_graph
from recording import recorder

from omnistage.kernels import pdl


@triton.jit
def _link_kernel(Src, Dst, programs, PDL: tl.constexpr):
    """One step as a kernel: read the next program's value from the previous kernel, write it plus one."""
    pid = tl.program_id(0)
    pdl.wait_for_inputs(PDL)
    pdl.launch_next(PDL)
    tl.store(Dst + pid, tl.load(Src + (pid + 1) % programs) + 1)


@triton.jit
def _persistent_kernel(Buf, Counter, programs, steps, ORDERED: tl.constexpr, BARRIER: tl.constexpr):
    """`steps` steps in one launch, each ended by a barrier: every program adds one to the counter, reads it
    until all `programs` have arrived at this step, then (ORDERED) acquires; ORDERED also makes the arrival a
    release. Without ORDERED the atomics are relaxed (timing only: nothing orders the data). Without BARRIER the
    steps run back to back (the loop's own cost). Buf holds two rows, read and written in turn."""
    pid = tl.program_id(0)
    for step in range(steps):
        src, dst = Buf + (step % 2) * programs, Buf + ((step + 1) % 2) * programs
        tl.store(dst + pid, tl.load(src + (pid + 1) % programs, volatile=True) + 1)
        if BARRIER:
            if ORDERED:
                tl.atomic_add(Counter, 1, sem="release", scope="gpu")
            else:
                tl.atomic_add(Counter, 1, sem="relaxed", scope="gpu")
            target = programs * (step + 1)
            arrived = tl.load(Counter, volatile=True)
            while arrived < target:  # plain reads of L2 while waiting (no atomics contending with the arrivals)
                arrived = tl.load(Counter, volatile=True)
            if ORDERED:
                tl.atomic_add(Counter, 0, sem="acquire", scope="gpu")  # then the others' writes are visible


def chain_us(programs: int, use_pdl: bool, links: int = 200) -> float:
    bufs = [torch.zeros(programs, dtype=torch.int32, device="cuda") for _ in range(2)]
    options = pdl.launch_options(use_pdl)

    def link(i: int):
        return lambda: _link_kernel[(programs,)](bufs[i % 2], bufs[(i + 1) % 2], programs, PDL=use_pdl, **options)

    return time_graph([link(i) for i in range(links)])


def persistent_us(programs: int, ordered: bool = True, barrier: bool = True, steps: int = 2000) -> float:
    buf = torch.zeros(2, programs, dtype=torch.int32, device="cuda")
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    for _ in range(2):  # compiled for these very arguments (Triton specialises on a count's divisibility)
        buf.zero_()
        counter.zero_()
        _persistent_kernel[(programs,)](buf, counter, programs, steps, ordered, barrier)
    buf.zero_()
    counter.zero_()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    _persistent_kernel[(programs,)](buf, counter, programs, steps, ordered, barrier)
    end.record()
    torch.cuda.synchronize()
    expected = torch.full((programs,), steps, dtype=torch.int32, device="cuda")
    if ordered and barrier and not torch.equal(buf[steps % 2], expected):
        raise AssertionError(f"barrier broke a dependency: {buf[steps % 2][:8].tolist()} != {steps}")
    return start.elapsed_time(end) * 1000 / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--programs", default="1,32,132")
    ap.add_argument("--out")
    args = ap.parse_args()
    record = recorder(args.out)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for programs in (int(p) for p in args.programs.split(",")):
        if programs > sms:
            continue  # a persistent grid must fit at once
        for use_pdl in (False, True):
            record(part="sync_cost", form="kernel chain", pdl=use_pdl, programs=programs,
                   us_per_step=round(chain_us(programs, use_pdl), 3))
        for form, ordered, barrier in (("persistent kernel, barrier with release/acquire", True, True),
                                       ("persistent kernel, barrier with relaxed atomics", False, True),
                                       ("persistent kernel, no barrier", False, False)):
            record(part="sync_cost", form=form, programs=programs,
                   us_per_step=round(persistent_us(programs, ordered, barrier), 3))


if __name__ == "__main__":
    main()
