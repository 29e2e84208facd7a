"""Stages on a partition of the GPU's SMs (deploy `sm_count`, a CUDA green context): kernels launched on the
partition's streams, and kernels captured into graphs on them, run on its SMs only; without a GPU or a count
nothing changes."""

from __future__ import annotations

import time

import pytest
import torch

from omnistage import devices

CUDA = torch.cuda.is_available()


def test_no_partition_without_a_count_or_a_gpu() -> None:
    assert devices.sm_partition(torch.device("cpu"), 16) is None
    assert devices.sm_partition(torch.device("cuda:0"), None) is None
    with devices.within(None):  # no partition: nothing to enter
        pass


def _spin_ms(stream: torch.cuda.Stream, launch) -> float:
    """Milliseconds of `launch()` on `stream` (median of 3, after a warm-up)."""
    times = []
    with torch.cuda.stream(stream):
        for _ in range(4):
            torch.cuda.synchronize()
            start = time.perf_counter()
            launch()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    return 1000 * sorted(times[1:])[1]


@pytest.mark.skipif(not CUDA, reason="green contexts need a GPU")
def test_partition_streams_and_their_graphs_keep_to_its_sms() -> None:
    """Compute-bound matmuls take several times longer on 16 SMs than on all of them,
    launched directly and replayed from a graph captured on a stream `own_capture_stream` made in the partition
    (which is how stages capture theirs)."""
    from omnistage.engine.transfer import own_capture_stream

    device = torch.device("cuda", torch.cuda.current_device())
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    partition = devices.sm_partition(device, 16)
    assert partition is devices.sm_partition(device, 16)  # one per device and count
    assert 16 <= partition.sm_count < sms
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    out = torch.empty_like(a)

    def work() -> None:
        for _ in range(10):
            torch.mm(a, a, out=out)

    full = _spin_ms(torch.cuda.Stream(device), work)
    with devices.within(partition):
        stream = devices.new_stream(device)
        capture = own_capture_stream(device)
    assert _spin_ms(stream, work) > 3 * full
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(capture):
        work()
    with torch.cuda.graph(graph, stream=capture):
        work()
    assert _spin_ms(torch.cuda.Stream(device), graph.replay) > 3 * full  # replayed off the partition: still on it
    outside = devices.new_stream(device)  # outside `within`: a plain stream
    assert _spin_ms(outside, work) < 2 * full
