"""sm_share: a stage's streams, and graphs captured on them, run on at most the SMs it was given (GPU only).

Each program of a probe kernel writes the id of the multiprocessor it ran on; confined, the ids it reports
are few, unconfined they cover most of the GPU."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from omnistage.engine.transfer import own_capture_stream, sm_share, stage_stream

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@triton.jit
def _where(out, spin):
    pid = tl.program_id(0)
    acc = tl.load(out + pid)
    for _ in range(spin):  # long enough that the programs spread over every SM they may use
        acc = acc * 1.0001 + 1
    sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [acc.to(tl.int32)], dtype=tl.int32,
                                   is_pure=False, pack=1)
    tl.store(out + pid, sm.to(tl.float32))


def sm_ids(programs: int = 8192) -> torch.Tensor:
    out = torch.zeros(programs, device="cuda")
    _where[(programs,)](out, 2000)
    return out


def distinct(ids: torch.Tensor) -> int:
    return len(set(ids.int().tolist()))


def test_confined_streams_and_their_graphs_use_only_their_sms() -> None:
    total = torch.cuda.get_device_properties(0).multi_processor_count
    free = stage_stream("cuda")
    with torch.cuda.stream(free):
        unconfined = distinct(sm_ids())
    assert unconfined > total * 3 // 4

    budget = 16
    with sm_share(budget):
        stream, capture = stage_stream("cuda"), own_capture_stream(torch.device("cuda"))
    with torch.cuda.stream(stream):
        eager = distinct(sm_ids())
        sm_ids()  # compiled before capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=capture):
            out = sm_ids()
        graph.replay()
    torch.cuda.synchronize()
    # Green contexts round the SM count up to the GPU's partition granularity (a few SMs).
    assert eager <= budget + 8
    assert distinct(out) <= budget + 8
    # After the block, this thread's new streams use every SM again.
    with torch.cuda.stream(stage_stream("cuda")):
        assert distinct(sm_ids()) > total * 3 // 4
