"""Device time of a decode-step-like sequence of kernel launches: captured once in a CUDA graph, replayed."""

from __future__ import annotations

from collections.abc import Callable

import torch


def time_graph(fns: list[Callable[[], object]], replays: int = 20) -> float:
    """Microseconds per call, over `replays` replays of one graph calling each of `fns` in turn (pass the same
    callable several times, or ones over distinct weight copies so no call finds the last one's in L2)."""
    for fn in fns:  # compiles and warms up outside the capture
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (replays * len(fns))
