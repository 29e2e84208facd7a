"""CUDA graphs for a generation model's batch function at power-of-two batch sizes.

A generation step (a whole flow-matching solve, a vocoder pass) is tens of thousands of small kernels:
at small batches launching them costs more than running them, and in a server process the launching
holds the interpreter from the other stages. Captured once per (batch, length) shape, a call replays
the batch in power-of-two slices (13 = 8 + 4 + 1), so a few graphs serve every batch size.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import torch

from omnistage.engine.transfer import own_capture_stream

logger = logging.getLogger(__name__)


Outputs = torch.Tensor | tuple[torch.Tensor, ...]


class BatchGraphs:
    """`fn(*inputs) -> output` (a tensor or a tuple of tensors), all batch-first, replayed from graphs where
    (1, length) was captured.

    `length` is each call's `inputs[key_input].shape[-1]`. One length's graphs read their inputs from one set of
    buffers sized for the largest batch (smaller batches capture views of them: inputs can be large, e.g.
    token2wav's kept contexts). Graphs share one memory pool (`pool`, maybe shared with other BatchGraphs
    replayed on the same stream) and outputs are copied out before the next replay. `context(batch)` is entered
    around each batch's capture and eager call (settings a graph keeps from its capture, such as a carveout).
    """

    def __init__(self, fn: Callable[..., Outputs], max_batch: int, key_input: int = 0,
                 context: Callable[[int], contextlib.AbstractContextManager] = lambda batch: contextlib.nullcontext(),
                 pool: tuple | None = None):
        self.fn, self.key_input, self.context = fn, key_input, context
        self.batches = [1 << i for i in range(max(1, max_batch).bit_length())]  # 1, 2, 4, ... <= max_batch
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, list[torch.Tensor], Outputs]] = {}
        self.pool = pool
        self.stream: torch.cuda.Stream | None = None  # captures run on it (see own_capture_stream)

    def capture(self, *inputs: torch.Tensor) -> bool:
        """Graphs for every batch size from one example row (`inputs` with batch 1). False if `fn` cannot be
        captured (an op that syncs with the host, say): this length then runs eagerly, with a warning."""
        self.stream = self.stream or own_capture_stream(inputs[0].device)
        length = inputs[self.key_input].shape[-1]
        buffers = [x.expand(self.batches[-1], *x.shape[1:]).clone() for x in inputs]
        try:
            for batch in self.batches:
                static_inputs = [x[:batch] for x in buffers]
                with self.context(batch):
                    if not self.graphs:
                        self.fn(*static_inputs)  # warm-up outside a capture (lazy initialisation, allocator)
                    graph = torch.cuda.CUDAGraph()
                    # thread_local: stages in other threads may keep running (and syncing) while this one captures
                    with torch.cuda.graph(graph, pool=self.pool, stream=self.stream,
                                          capture_error_mode="thread_local"):
                        static_out = self.fn(*static_inputs)
                self.pool = self.pool or graph.pool()
                self.graphs[(batch, length)] = (graph, static_inputs, static_out)
        except RuntimeError:
            logger.warning("could not capture %s as a CUDA graph; length %d runs eagerly",
                           getattr(self.fn, "__qualname__", self.fn), length, exc_info=True)
            for batch in self.batches:
                self.graphs.pop((batch, length), None)
            return False
        return True

    def __call__(self, *inputs: torch.Tensor) -> Outputs:
        batch, length = inputs[self.key_input].shape[0], inputs[self.key_input].shape[-1]
        if (1, length) not in self.graphs:
            with self.context(batch):
                return self.fn(*inputs)
        outs, at = [], 0
        for size in reversed(self.batches):
            while batch - at >= size:
                graph, static_inputs, static_out = self.graphs[(size, length)]
                for static, x in zip(static_inputs, inputs, strict=True):
                    static.copy_(x[at : at + size])
                graph.replay()
                # the next replay overwrites the outputs
                outs.append(tuple(x.clone() for x in static_out) if isinstance(static_out, tuple)
                            else static_out.clone())
                at += size
        if isinstance(outs[0], tuple):
            return tuple(torch.cat(parts) for parts in zip(*outs, strict=True))
        return torch.cat(outs)
