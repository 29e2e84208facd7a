"""CUDA graphs of an AR model's steps: decode steps per batch-size bucket, decode bursts (several steps drawn
on the device per launch), one sequence's prompt step per token bucket, and a model's `after_sample` hook per
batch-size bucket (HookGraphs).

Inputs live in static device buffers filled from pinned host buffers; padded rows decode into the runner's
spare KV block and belong to no sequence, so attention never reads them. With `eager` (the stage's
`enforce_eager`) nothing is captured: each "graph" is the same function on the same static buffers, run from
Python on every replay. Eager steps then launch exactly the kernels a replay would, at the same padded
shapes (the same GEMM tilings, the same decode-attention splits, which depend on the block table's width),
so greedy tokens do not depend on whether graphs are on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from omnistage.engine.ar.attention import AttentionMetadata
from omnistage.engine.ar.model import ARModel, SampleExtras
from omnistage.engine.ar.sequence import Sequence
from omnistage.engine.transfer import own_capture_stream, to_device

if TYPE_CHECKING:
    from omnistage.engine.ar.model_runner import DecodeLaunch, ModelRunner, _Packed

logger = logging.getLogger(__name__)

# a captured graph and its outputs: logits, their argmax, the hidden layers kept, the final hidden states the logits
# came from (what an `after_sample` hook reads)
_Graph = tuple[Any, torch.Tensor, torch.Tensor, dict[int, torch.Tensor], torch.Tensor]

# Prompt-graph buckets (tokens): at most half of a replay's rows are padding, and each size costs start-up time.
PROMPT_BUCKETS = (16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)


def bucket_sizes(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sizes + [max_batch]


def burst_positions(tables: torch.Tensor, pos: torch.Tensor, rope: torch.Tensor, ahead: torch.Tensor,
                    block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode burst's per-step cache slots, context lengths and rotary positions, [steps, rows] each, for rows
    at positions `pos` (rotary `rope`) before the burst, block tables `tables` [rows, width], `ahead` = [steps, 1]
    steps past the first: all steps' in a few kernels rather than a few kernels per step."""
    at = pos[None] + ahead
    slots = tables.gather(1, (at // block_size).t()).t().long() * block_size + at % block_size
    return slots.contiguous(), at + 1, rope[None] + ahead


def _copy_into(static: Any, fresh: Any) -> None:
    if isinstance(static, torch.Tensor):
        static.copy_(fresh)
    elif isinstance(static, (tuple, list)):
        for s, f in zip(static, fresh, strict=True):
            _copy_into(s, f)
    elif isinstance(static, dict):
        for key, s in static.items():
            _copy_into(s, fresh[key])


class EagerReplay:
    """A graph's stand-in under `enforce_eager`: `replay()` runs the captured function again and leaves its
    results in the first run's output tensors, where a graph replay leaves them."""

    def __init__(self, run: Callable[[], Any], outputs: Any):
        self.run, self.outputs = run, outputs

    def replay(self) -> None:
        _copy_into(self.outputs, self.run())


def eager_capture(run: Callable[[], Any]) -> tuple[EagerReplay, Any]:
    """`run` once; its stand-in replays it into those first outputs (what `enforce_eager` captures)."""
    out = run()
    return EagerReplay(run, out), out


class CUDACapture:
    """Captures graphs into one memory pool (they replay one at a time) on a stream of their own: `run` once
    eagerly (the allocator settles, state sized on first use is allocated outside the pool), then captured."""

    def __init__(self, device: torch.device):
        self.pool, self.stream = None, own_capture_stream(device)

    def __call__(self, run: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
        with torch.no_grad():
            run()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
                out = run()
        self.pool = graph.pool()
        return graph, out


class StepGraphs:
    """The captured (or, with `eager`, replayed-eagerly) steps of one ModelRunner."""

    def __init__(self, runner: ModelRunner, eager: bool = False):
        self.runner = runner
        self.eager = eager
        self.model, self.device = runner.model, runner.device
        self.block_size, self.max_num_seqs = runner.block_size, runner.max_num_seqs
        self.max_blocks_per_seq, self.graph_layers = runner.max_blocks_per_seq, runner.graph_layers
        self.burst_steps, self.prompt_graph_tokens = runner.burst_steps, runner.prompt_graph_tokens
        self.graphs: dict[int, _Graph] = {}
        self.burst_graphs: dict[int, Any] = {}
        self.prompt_graphs: dict[int, _Graph] = {}
        self.num_prompt_replays = 0
        self._dev_adds: torch.Tensor | None = None  # per-row embedding additions, when the model takes them
        self._input_slot = 0
        self._graph_pool = None

    @property
    def _verb(self) -> str:
        return "prepared eager stand-ins for" if self.eager else "captured"

    def release(self) -> None:
        self.graphs.clear()
        self.burst_graphs.clear()
        self.prompt_graphs.clear()
        self._graph_pool = None

    def burst_graph_fits(self, seqs: list[Sequence], steps: int) -> bool:
        """A captured burst replays these `steps` for `seqs`: a graph for their count, and any rows they add to
        their input embeddings have a place in it (only models declaring `graph_embed_adds` capture one)."""
        return (
            steps == self.burst_steps and bool(self.burst_graphs) and len(seqs) <= max(self.burst_graphs)
            and (self._dev_adds is not None or all(s.embed_adds is None for s in seqs))
        )

    def _capture(self, run: Callable[[], Any], stream: torch.cuda.Stream,
                 generator: torch.Generator | None = None) -> tuple[Any, Any]:
        """`run` once eagerly (Triton compiles, the allocator settles), then captured on `stream` into the
        runner's one memory pool (its graphs replay one at a time); returns the graph and what the captured
        call returned (its static outputs). `generator`'s state advances with every replay. Runs without
        autograd: a model whose weights still require grad would otherwise record (and refuse in-place ops).
        With `eager`, `run` runs once (the same warm-up) and its outputs become the stand-in's."""
        with torch.no_grad():
            if self.eager:
                return eager_capture(run)
            out = run()
            graph = torch.cuda.CUDAGraph()
            if generator is not None:
                graph.register_generator_state(generator)
            with torch.cuda.graph(graph, pool=self._graph_pool, stream=stream, capture_error_mode="thread_local"):
                out = run()
        self._graph_pool = graph.pool()
        return graph, out

    def capture_decode(self, num_blocks: int) -> None:
        """Capture one graph per batch-size bucket, sharing one memory pool. Inputs live in static
        device buffers filled from pinned host buffers with two async copies per step."""
        started = time.perf_counter()
        sizes = bucket_sizes(self.max_num_seqs)
        n, width = sizes[-1], self.max_blocks_per_seq
        self.pad_block = num_blocks
        # rows: token ids, positions, cache slots, context lengths. Two host copies: the one a step in
        # flight may still be reading and the one being filled.
        self._host_long_pair = [torch.zeros(4, n, dtype=torch.long).pin_memory() for _ in range(2)]
        self._host_tables_pair = [torch.zeros(n, width, dtype=torch.int32).pin_memory() for _ in range(2)]
        self._host_long, self._host_tables = self._host_long_pair[0], self._host_tables_pair[0]
        self._dev_long = torch.zeros(4, n, dtype=torch.long, device=self.device)
        self._dev_tables = torch.zeros(n, width, dtype=torch.int32, device=self.device)
        self._cu_q = torch.arange(n + 1, dtype=torch.int32, device=self.device)
        self._fill_padding(0, n)
        self._dev_long.copy_(self._host_long)
        self._dev_tables.copy_(self._host_tables)
        ids, positions, slots, seq_lens = self._dev_long
        if getattr(self.model, "graph_embed_adds", False):
            width = self.model.embed(ids[:1]).shape[-1]
            self._dev_adds = torch.zeros(n, width, dtype=self.model.kv_spec.dtype, device=self.device)
        capture_stream = own_capture_stream(self.device)
        for size in reversed(sizes):
            meta = AttentionMetadata(
                kv_cache=self.runner.kv_cache, slot_mapping=slots[:size], block_tables=self._dev_tables[:size],
                seq_lens=seq_lens[:size], cu_seqlens_q=self._cu_q[: size + 1], max_query_len=1,
            )

            def forward(size: int = size, meta: AttentionMetadata = meta) -> tuple[torch.Tensor, ...]:
                adds = self._dev_adds
                embeds = self.model.embed(ids[:size]) + adds[:size] if adds is not None else None
                hidden, layers = self.model.forward(ids[:size], positions[:size], meta, embeds, self.graph_layers)
                logits = self.model.compute_logits(hidden)
                return logits, logits.argmax(dim=-1), layers, hidden

            graph, (logits, argmax, layers, hidden) = self._capture(forward, capture_stream)
            self.graphs[size] = (graph, logits, argmax, layers, hidden)
        torch.cuda.synchronize(self.device)
        logger.info("%s %d decode CUDA graphs (batch sizes %s) in %.1fs",
                    self._verb, len(sizes), sizes, time.perf_counter() - started)

    def capture_after_sample(self) -> HookGraphs:
        """The model's `after_sample_graph` per decode bucket (after `capture_decode`), in the decode graphs' pool."""
        stream = own_capture_stream(self.device)
        hidden = self.graphs[max(self.graphs)][4]
        return HookGraphs(self.model, sorted(self.graphs), hidden, lambda run: self._capture(run, stream))

    def capture_bursts(self, draw: Callable[[torch.Tensor], torch.Tensor], generator: torch.Generator | None
                       ) -> None:
        """Capture a `burst_steps`-step decode graph per batch-size bucket (after `allocate_kv_cache`). `draw`
        (logits [size, vocab] -> ids [size]) is captured with it: it must read only static buffers and draw its
        noise from `generator` (registered with each graph, so replays advance it as eager draws do)."""
        if not self.graphs or self.burst_steps < 2:
            return
        started = time.perf_counter()
        sizes, steps, bs = sorted(self.graphs), self.burst_steps, self.block_size
        n = sizes[-1]
        self._burst_host_pair = [torch.zeros(3, n, dtype=torch.long).pin_memory() for _ in range(2)]  # ids, rope, pos
        self._burst_inputs = torch.zeros(3, n, dtype=torch.long, device=self.device)
        self._burst_tokens = torch.zeros(steps, n, dtype=torch.long, device=self.device)
        if self._dev_adds is not None:
            self._burst_adds = torch.zeros(steps, n, self._dev_adds.shape[1], dtype=self._dev_adds.dtype,
                                           device=self.device)
        self._pad_columns = -(-steps // bs)  # table columns a padded row's positions 0..steps-1 reach
        self._host_tables[:, : self._pad_columns] = self.pad_block
        self._dev_tables.copy_(self._host_tables)
        # a burst's steps past its first position (an attribute: the graphs read it on every replay)
        self._burst_ahead = ahead = torch.arange(steps, device=self.device)[:, None]
        rotary_tables = getattr(self.model, "rotary_tables", None)
        capture_stream = own_capture_stream(self.device)
        rng_state = generator.get_state() if generator is not None else None  # warm-ups and captures draw
        for size in reversed(sizes):
            def burst(size: int = size) -> None:
                ids, rope, pos = self._burst_inputs[:, :size]
                tables = self._dev_tables[:size]
                # every step's slots, lengths, positions and rotary tables at once, not a few kernels per step
                slots, lens, ropes = burst_positions(tables, pos, rope, ahead, bs)
                rotary = rotary_tables(ropes.flatten()) if rotary_tables is not None else None
                for j in range(steps):
                    meta = AttentionMetadata(kv_cache=self.runner.kv_cache, slot_mapping=slots[j], block_tables=tables,
                                             seq_lens=lens[j], cu_seqlens_q=self._cu_q[: size + 1], max_query_len=1)
                    if rotary is not None:
                        meta.rotary = tuple(t[j * size : (j + 1) * size] for t in rotary)
                    embeds = self.model.embed(ids) + self._burst_adds[j, :size] if self._dev_adds is not None else None
                    hidden, _ = self.model.forward(ids, ropes[j], meta, embeds)
                    ids = draw(self.model.compute_logits(hidden))
                    self._burst_tokens[j, :size].copy_(ids)

            # its warm-up touches padding rows only: the spare block, the spare history row
            self.burst_graphs[size], _ = self._capture(burst, capture_stream, generator)
        torch.cuda.synchronize(self.device)
        if rng_state is not None:  # serving draws the same noise with or without burst graphs
            generator.set_state(rng_state)
        logger.info("%s %d %d-step decode burst graphs in %.1fs", self._verb, len(sizes), steps,
                    time.perf_counter() - started)

    def replay_burst(self, batch: list[tuple[Sequence, int]], p: _Packed, previous: DecodeLaunch | None,
                      pending: list[tuple[int, int]]) -> torch.Tensor:
        n = len(batch)
        size = next(b for b in sorted(self.burst_graphs) if b >= n)
        self._input_slot ^= 1
        host_long = self._burst_host_pair[self._input_slot]
        self._host_tables = self._host_tables_pair[self._input_slot]
        host = host_long.numpy()
        host[0, :n], host[1, :n], host[2, :n] = p.ids, p.rope, p.positions
        host[:, n:size] = 0  # padded rows: positions 0.. of the spare block
        width = max(max(len(t) for t in p.tables), self._pad_columns)
        self._host_tables[:n, :width] = torch.from_numpy(self.runner._block_table_array(p.tables, n, width))
        self._host_tables[n:size, : self._pad_columns] = self.pad_block
        self._burst_inputs[:, :size].copy_(host_long[:, :size], non_blocking=True)
        self._dev_tables[:size, :width].copy_(self._host_tables[:size, :width], non_blocking=True)
        self.runner._take_previous(self._burst_inputs[0], previous, pending)
        if self._dev_adds is not None:
            self._load_burst_adds(batch, size)
        self.burst_graphs[size].replay()
        return self._burst_tokens[:, :n]

    def _load_burst_adds(self, batch: list[tuple[Sequence, int]], size: int) -> None:
        """Each step's added rows into the burst's [steps, size, D] buffer (rows without one add zero). The
        common case, every row's default for the whole burst (a talker after the reply), is one broadcast copy."""
        steps, n = self.burst_steps, len(batch)
        adds = [[seq.embed_add(seq.num_computed + j) for j in range(steps)] for seq, _ in batch]
        buffer = self._burst_adds[:, :size]
        if all(row[0] is not None and all(a is row[0] for a in row) for row in adds):
            rows = self.runner._stacked_adds([row[0] for row in adds]).to(device=self.device, dtype=buffer.dtype)
            buffer[:, :n].copy_(rows[None].expand(steps, -1, -1))
            return
        buffer.zero_()
        width = self._burst_adds.shape[1]
        where = [j * width + i for i, row in enumerate(adds) for j, a in enumerate(row) if a is not None]
        values = [a for row in adds for a in row if a is not None]
        if values:
            self._burst_adds.view(-1, buffer.shape[-1]).index_copy_(
                0, self.runner._tensor(where),
                self.runner._stacked_adds(values).to(device=self.device, dtype=buffer.dtype))

    def _fill_padding(self, start: int, end: int) -> None:
        """Padded rows decode into the spare block and attend only to themselves."""
        self._host_long[:2, start:end] = 0
        self._host_long[2, start:end] = self.runner.pad_slot
        self._host_long[3, start:end] = 1
        self._host_tables[start:end, 0] = self.pad_block

    def replay(
        self, p: _Packed, previous: DecodeLaunch | None = None, pending: list[tuple[int, int]] = ()
    ) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor], torch.Tensor]:
        """The decode graph of the smallest bucket holding the step: its logits, argmax and final hidden states for
        the step's rows, and the kept layers (padded); all in the graph's buffers, which the next replay overwrites."""
        n = len(p.ids)
        size = next(b for b in sorted(self.graphs) if b >= n)
        self._input_slot ^= 1
        self._host_long = self._host_long_pair[self._input_slot]
        self._host_tables = self._host_tables_pair[self._input_slot]
        host = self._host_long.numpy()
        host[0, :n], host[1, :n], host[2, :n], host[3, :n] = p.ids, p.rope, p.slots, p.seq_lens
        width = max(len(t) for t in p.tables)
        self._host_tables[:n, :width] = torch.from_numpy(self.runner._block_table_array(p.tables, n, width))
        self._fill_padding(n, size)
        self._dev_long[:, :size].copy_(self._host_long[:, :size], non_blocking=True)
        self._dev_tables[:size, :width].copy_(self._host_tables[:size, :width], non_blocking=True)
        self.runner._take_previous(self._dev_long[0], previous, list(pending))
        if self._dev_adds is not None:  # rows without an addition add zero, exactly
            self._dev_adds[:size].zero_()
            if p.add_rows:
                values = self.runner._stacked_adds(p.add_values).to(device=self.device, dtype=self._dev_adds.dtype)
                self._dev_adds.index_copy_(0, self.runner._tensor(p.add_rows), values)
        graph, logits, argmax, layers, hidden = self.graphs[size]
        graph.replay()
        return logits[:n], argmax[:n], layers, hidden[:n]

    # ---- CUDA graphs for prompts -----------------------------------------------------------

    def capture_prompts(self) -> None:
        """One graph per token bucket up to `prompt_graph_tokens`: the decoder and the head over one sequence's
        padded prompt step. Its input embeddings (replacements and additions applied) are computed eagerly into
        a static buffer; positions, slots, the block table and lengths come from pinned host buffers. Padded
        rows write into the spare block and belong to no sequence (attention stops at the sequence's rows)."""
        sizes = [b for b in PROMPT_BUCKETS if b <= self.prompt_graph_tokens]
        if not sizes:
            return
        started = time.perf_counter()
        n, width = sizes[-1], self.max_blocks_per_seq
        # rows: token ids, rotary positions, cache slots; then cu_seqlens_q (2), the context length, the last
        # row, the block table
        self._prompt_host_pair = [(torch.zeros(3, n, dtype=torch.long).pin_memory(),
                                   torch.zeros(4 + width, dtype=torch.int32).pin_memory()) for _ in range(2)]
        self._prompt_copied: list[torch.cuda.Event | None] = [None, None]  # each pair's last copy to the device
        self._prompt_slot = 0
        self._prompt_long = torch.zeros(3, n, dtype=torch.long, device=self.device)
        self._prompt_long[2] = self.runner.pad_slot
        self._prompt_ints = torch.zeros(4 + width, dtype=torch.int32, device=self.device)  # cu_seqlens_q [0, 0]
        ids, rope, slots = self._prompt_long
        self._prompt_embeds = torch.zeros_like(self.model.embed(ids))
        cu, seq_len, last, table = (self._prompt_ints[:2], self._prompt_ints[2:3], self._prompt_ints[3:4],
                                    self._prompt_ints[4:].view(1, width))
        capture_stream = own_capture_stream(self.device)
        for size in reversed(sizes):
            def forward(size: int = size) -> tuple[torch.Tensor, ...]:
                meta = AttentionMetadata(kv_cache=self.runner.kv_cache, slot_mapping=slots[:size], block_tables=table,
                                         seq_lens=seq_len, cu_seqlens_q=cu, max_query_len=size)
                hidden, layers = self.model.forward(ids[:size], rope[:size], meta, self._prompt_embeds[:size],
                                                    self.graph_layers)
                hidden = hidden.index_select(0, last)
                logits = self.model.compute_logits(hidden)
                return logits, logits.argmax(dim=-1), layers, hidden

            # its warm-up has no sequence: attention reads nothing
            graph, (logits, argmax, layers, hidden) = self._capture(forward, capture_stream)
            self.prompt_graphs[size] = (graph, logits, argmax, layers, hidden)
        torch.cuda.synchronize(self.device)
        logger.info("%s %d prompt CUDA graphs (up to %d tokens) in %.1fs", self._verb, len(sizes), n,
                    time.perf_counter() - started)

    def replay_prompt(self, p: _Packed) -> tuple[torch.Tensor | None, torch.Tensor | None, dict[int, torch.Tensor],
                                                 torch.Tensor | None]:
        """Replay the smallest prompt graph that holds the step: (logits, argmax and final hidden state of the last
        row, or None where the sequence does not sample yet; the graph's layers, padded)."""
        t = len(p.ids)
        size = next(b for b in sorted(self.prompt_graphs) if b >= t)
        self._prompt_slot ^= 1
        if (copied := self._prompt_copied[self._prompt_slot]) is not None:
            copied.synchronize()  # long passed, unless chunks of a prompt follow each other without a sample
        host_long, host_ints = self._prompt_host_pair[self._prompt_slot]
        long, ints = host_long.numpy(), host_ints.numpy()
        long[0, :t], long[1, :t], long[2, :t] = p.ids, p.rope, p.slots
        long[:2, t:size], long[2, t:size] = 0, self.runner.pad_slot
        table = p.tables[0]
        ints[:4] = 0, t, p.seq_lens[0], t - 1
        ints[4 : 4 + len(table)] = table
        self._prompt_long[:, :size].copy_(host_long[:, :size], non_blocking=True)
        self._prompt_ints[: 4 + len(table)].copy_(host_ints[: 4 + len(table)], non_blocking=True)
        self._prompt_copied[self._prompt_slot] = copied = torch.cuda.Event()
        copied.record()
        ids = self._prompt_long[0, :t]
        embeds = self.runner._input_embeds(p, ids)
        self._prompt_embeds[:t].copy_(embeds if embeds is not None else self.model.embed(ids))
        graph, logits, argmax, layers, hidden = self.prompt_graphs[size]
        graph.replay()
        self.num_prompt_replays += 1
        return (logits, argmax, layers, hidden) if p.last_rows else (None, None, layers, None)


class HookGraphs:
    """A model's `after_sample` hook per batch-size bucket: its `after_sample_graph` (ARModel) run over static
    buffers (the rows' final hidden states, sampled tokens and parameter rows) and captured by `capture(run) ->
    (graph, run's outputs)`: a CUDA graph capture, or `eager_capture` (enforce_eager, and the CPU, where the
    stand-ins run the same function on the same buffers). The largest bucket goes first, so state the hook sizes on
    its first run (a scratch buffer the graphs then hold views of) fits every later capture.

    A step replays the smallest bucket that holds its rows, except a step with a row that draws from its own
    generator (a seeded request), which runs the model's eager `after_sample`: a replay's noise comes from the
    default generator only. Padded rows keep earlier rows' values: finite, computed, never read."""

    def __init__(self, model: ARModel, sizes: list[int], hidden: torch.Tensor,
                 capture: Callable[[Callable[[], Any]], tuple[Any, Any]] = eager_capture):
        self.model, self.sizes = model, sorted(sizes)
        n, device = self.sizes[-1], hidden.device
        self.hidden = torch.zeros(n, hidden.shape[-1], dtype=hidden.dtype, device=device)
        self.tokens = torch.zeros(n, dtype=torch.long, device=device)
        neutral = model.after_sample_rows([{}])  # a request without tensors: the model's defaults
        self.rows = neutral.to(device, torch.float32).expand(n, -1).contiguous()
        self.graphs: dict[int, tuple[Any, tuple[torch.Tensor, dict[str, torch.Tensor]]]] = {}
        self.num_replays = 0
        with torch.no_grad():
            for size in reversed(self.sizes):
                def run(size: int = size) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
                    extras = model.after_sample_graph(self.hidden[:size], self.tokens[:size], self.rows[:size])
                    return extras.next_adds, extras.outputs

                self.graphs[size] = capture(run)

    def replays(self, n: int, generators: list[torch.Generator | None]) -> bool:
        """Whether a step of `n` rows with these generators replays a bucket."""
        return n <= self.sizes[-1] and all(g is None for g in generators)

    @torch.no_grad()
    def run(self, hidden: torch.Tensor, tokens: torch.Tensor, inputs: list[dict[str, torch.Tensor]],
            generators: list[torch.Generator | None]) -> SampleExtras:
        """What `after_sample(hidden, tokens, inputs, generators)` returns, from a replay where one fits."""
        n = hidden.shape[0]
        if not self.replays(n, generators):
            return self.model.after_sample(hidden, tokens, inputs, generators)
        size = next(b for b in self.sizes if b >= n)
        self.rows[:n].copy_(to_device(self.model.after_sample_rows(inputs), self.rows.device))
        self.hidden[:n].copy_(hidden)
        self.tokens[:n].copy_(tokens)
        graph, (adds, outputs) = self.graphs[size]
        graph.replay()
        self.num_replays += 1
        # the next replay overwrites the graph's outputs; the engine keeps `next_adds` for the sequences' next steps
        return SampleExtras(adds[:n].clone(), {name: value[:n].clone() for name, value in outputs.items()})
