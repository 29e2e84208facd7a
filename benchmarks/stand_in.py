"""A stand-in for token2wav's flow-matching solve, to run beside a talker benchmark: the DiT's four matmuls a layer
(qkv, o, ff up, ff down) at a 48-code window's 240 rows, bfloat16 on cuBLAS, 22 layers a pass, PASSES passes in
one CUDA graph. A real solve is 36 passes with attention and norms between the matmuls (~28 ms alone, run 22b);
the matmuls are ~70% of it (run 23a) and, holding SMs in ~6 µs programs, what the talker's kernels meet."""

from __future__ import annotations

import torch

PASSES = 10
ROWS, WIDTH, LAYERS = 240, 1024, 22


def solve_graph(stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
    """PASSES passes of the matmuls, captured on `stream` (replay it there)."""
    dev, bf = torch.device("cuda"), torch.bfloat16
    x = torch.randn(ROWS, WIDTH, device=dev, dtype=bf)
    qkv, o, up, down = (torch.randn(n, k, device=dev, dtype=bf) * 0.02
                        for n, k in ((3 * WIDTH, WIDTH), (WIDTH, WIDTH), (2 * WIDTH, WIDTH), (WIDTH, 2 * WIDTH)))
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        x @ up.t()  # cuBLAS's handle and workspace for this stream, before the capture
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(PASSES * LAYERS):
                h = (x @ qkv.t())[:, :WIDTH] @ o.t()
                (h @ up.t()) @ down.t()
    graph.keep = (x, qkv, o, up, down)  # the captured addresses stay alive with the graph
    return graph


def replay(stream: torch.cuda.Stream, graph: torch.cuda.CUDAGraph, times: int
           ) -> tuple[torch.cuda.Event, list[torch.cuda.Event]]:
    """`times` replays queued on `stream`: a timing event before them and one after each."""
    start, ends = torch.cuda.Event(enable_timing=True), []
    with torch.cuda.stream(stream):
        start.record()
        for _ in range(times):
            graph.replay()
            ends.append(torch.cuda.Event(enable_timing=True))
            ends[-1].record()
    return start, ends


def passes_per_ms(start: torch.cuda.Event, ends: list[torch.cuda.Event], until_ms: float) -> float:
    """Passes a replay() run finished in its first `until_ms` (its events done and synchronised), per ms: the
    stand-in's pace while something else ran beside it for that long, not counting what ran after."""
    done = sum(start.elapsed_time(end) <= until_ms for end in ends)
    return done * PASSES / until_ms
