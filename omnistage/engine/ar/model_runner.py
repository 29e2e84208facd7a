"""Turns a scheduled batch into packed tensors, runs the model, and returns logits.

Host-side bookkeeping (positions, slots, block tables) is built once per step from plain lists.
On CUDA, steps where every sequence decodes one token replay a captured CUDA graph of the whole
forward (plus the LM head) for the smallest batch-size bucket that fits; other steps run eagerly.
The graphs also keep the hidden layers the engine may hand on (`graph_layers`) and, for models that
declare `graph_embed_adds`, take per-row additions to the input embeddings (a talker's side input).

A step that prefills one sequence's prompt (or a chunk of it) of up to `prompt_graph_tokens` tokens replays a
"prompt graph" captured for the smallest token bucket that fits: padded rows write into the spare cache block and
belong to no sequence, so attention never reads them. Eagerly such a step is hundreds of kernel launches from
Python (a 156-token prompt of a 7B model: ~17 ms of host work for ~5 ms of GPU work on an H200), and the whole
request waits for its first token.

A decode burst (`burst_steps` > 1) runs several decode steps per launch, each step's tokens drawn on the
device and fed to the next: one graph replay (and one host round trip) per burst instead of per token, for
small models whose step is shorter than the host's work for it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from omnistage.engine.ar.attention import AttentionMetadata, PagedKVCache
from omnistage.engine.ar.model import ARModel
from omnistage.engine.ar.sequence import Sequence
from omnistage.engine.transfer import own_capture_stream, to_device

logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    sample_rows: list[int]  # batch indices of the sequences that sample this step
    logits: torch.Tensor | None  # [len(sample_rows), vocab] float32
    hidden: dict[int, torch.Tensor]  # layer -> [T, hidden] for the whole packed step
    row_spans: list[tuple[int, int]]  # each sequence's rows in the packed step
    argmax: torch.Tensor | None = None  # argmax of `logits`, when the step computed it on the way


@dataclass
class DecodeLaunch:
    """A decode step handed to the device whose tokens the host has not read yet."""

    seqs: list[Sequence]
    tokens: torch.Tensor  # [n] chosen ids, on the device
    positions: list[int]  # the position each sequence computed
    hidden: dict[int, torch.Tensor]  # layer -> [n, hidden] for the computed positions (when asked for)
    all_tokens: torch.Tensor | None = None  # [steps, n]: every step's ids (a burst); `tokens` is the last row
    host_tokens: torch.Tensor | None = None  # pinned copy of `all_tokens`, filled asynchronously (CUDA)
    done: torch.cuda.Event | None = None

    @property
    def steps(self) -> int:
        return 1 if self.all_tokens is None else self.all_tokens.shape[0]


@dataclass
class _Packed:
    """One step's inputs as host lists."""

    ids: list[int]
    positions: list[int]  # token index in its sequence (cache slots, causal order)
    rope: list[int]  # rotary position (index + delta); rows in `rope_explicit` are multi-axis instead
    slots: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    tables: list[list[int]]
    embed_rows: list[int]
    embed_values: list[torch.Tensor]
    add_rows: list[int]
    add_values: list[torch.Tensor]
    rope_explicit: list[tuple[int, torch.Tensor]]
    sample_rows: list[int]
    last_rows: list[int]
    row_spans: list[tuple[int, int]]


def burst_positions(tables: torch.Tensor, pos: torch.Tensor, rope: torch.Tensor, ahead: torch.Tensor,
                    block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode burst's per-step cache slots, context lengths and rotary positions, [steps, rows] each, for rows
    at positions `pos` (rotary `rope`) before the burst, block tables `tables` [rows, width], `ahead` = [steps, 1]
    steps past the first: all steps' in a few kernels rather than a few kernels per step."""
    at = pos[None] + ahead
    slots = tables.gather(1, (at // block_size).t()).t().long() * block_size + at % block_size
    return slots.contiguous(), at + 1, rope[None] + ahead


# a captured graph and its outputs: logits, their argmax, the hidden layers kept
_Graph = tuple["torch.cuda.CUDAGraph", torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]

# Prompt-graph buckets (tokens): at most half of a replay's rows are padding, and a graph per size is ~0.3 s of
# start-up for a 7B model.
PROMPT_BUCKETS = (16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)


def _bucket_sizes(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sizes + [max_batch]


class ModelRunner:
    def __init__(
        self, model: ARModel, block_size: int, max_num_seqs: int, max_model_len: int, enforce_eager: bool = False,
        graph_layers: tuple[int, ...] = (), burst_steps: int = 1, prompt_graph_tokens: int = 0,
    ):
        self.model = model
        self.device = model.device
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.use_triton = self.device.type == "cuda"
        self.use_graphs = self.use_triton and not enforce_eager and getattr(model, "graph_safe", False)
        self.kv_cache: PagedKVCache | None = None
        self.pad_slot = 0
        self.graph_layers = graph_layers
        self.graphs: dict[int, _Graph] = {}
        self._dev_adds: torch.Tensor | None = None  # per-row embedding additions, when the model takes them
        self._input_slot = self._token_slot = 0
        self.burst_steps = max(1, burst_steps)
        self.burst_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.prompt_graph_tokens = prompt_graph_tokens
        self.prompt_graphs: dict[int, _Graph] = {}
        self.num_prompt_replays = 0
        self._graph_pool = None

    # ---- memory ---------------------------------------------------------------------------

    @torch.inference_mode()
    def profile(self, num_tokens: int) -> int:
        """Run the largest step once; returns its peak activation bytes, so the KV cache can take
        the rest of the stage's memory share."""
        if self.device.type != "cuda":
            return 0
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        blocks = -(-num_tokens // self.block_size)
        self.kv_cache = PagedKVCache(self.model.kv_spec, blocks, self.block_size, self.device)
        seqs = [Sequence("profile", [0] * num_tokens, None, max_tokens=1, arrival=0)]  # type: ignore[arg-type]
        seqs[0].block_table = list(range(blocks))
        self.execute([(seqs[0], num_tokens)], ())
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        self.kv_cache = None
        torch.cuda.empty_cache()
        return peak - before

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Allocate `num_blocks` usable blocks plus one that padded graph rows write into."""
        self.kv_cache = PagedKVCache(self.model.kv_spec, num_blocks + 1, self.block_size, self.device)
        self.pad_slot = num_blocks * self.block_size
        if self.device.type == "cuda":  # two of each host buffer: one step may be in flight
            self._host_tokens = [torch.zeros(self.burst_steps * self.max_num_seqs, dtype=torch.long).pin_memory()
                                 for _ in range(2)]
        if self.use_graphs:
            self._capture_graphs(num_blocks)
            self._capture_prompt_graphs()

    def release(self) -> None:
        """Drop the KV cache and captured graphs (their memory pool) so the device memory returns."""
        self.graphs.clear()
        self.burst_graphs.clear()
        self.prompt_graphs.clear()
        self._graph_pool = None
        self.kv_cache = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ---- one step -------------------------------------------------------------------------

    def _pack(self, batch: list[tuple[Sequence, int]], ahead: int = 0) -> _Packed:
        """`ahead`: the rows of a burst's later step (positions that many past `num_computed`)."""
        bs = self.block_size
        p = _Packed([], [], [], [], [], [], [], [], [], [], [], [], [], [], [])
        for i, (seq, n) in enumerate(batch):
            start = seq.num_computed + ahead
            end = start + n
            row = len(p.ids)
            plain = seq.cacheable  # no per-position extras: the common case stays a list extend
            for pos in range(start, end) if not plain else ():
                if pos in seq.embeds:
                    p.embed_rows.append(row + pos - start)
                    p.embed_values.append(seq.embeds[pos])
                elif (add := seq.embed_add(pos)) is not None:
                    p.add_rows.append(row + pos - start)
                    p.add_values.append(add)
            p.rope += range(start + seq.rope_delta, end + seq.rope_delta)
            if seq.rope_positions is not None and start < seq.rope_positions.shape[1]:
                self._explicit_rope(p, seq.rope_positions[:, start:end], row)
            table = seq.block_table
            known = seq.token_ids[start:end]
            p.ids += known + [0] * (n - len(known))  # a token still on the device: filled in there
            p.positions += range(start, end)
            p.slots += [table[pos // bs] * bs + pos % bs for pos in range(start, end)]
            p.query_lens.append(n)
            p.seq_lens.append(end)
            p.tables.append(table)
            p.row_spans.append((row, row + n))
            if end == seq.num_tokens and seq.input_final:
                p.sample_rows.append(i)
                p.last_rows.append(row + n - 1)
        return p

    @staticmethod
    def _explicit_rope(p: _Packed, block: torch.Tensor, row: int) -> None:
        """A sequence's multi-axis rotary positions [axes, n] for its rows from `row` on: where every axis
        agrees (text: a multi-axis rotary then equals the plain one) they are plain positions, the rest stay
        explicit (`_rope` writes them over the plain ones). One look at the block rather than one per position."""
        p.rope[row : row + block.shape[1]] = block[0].tolist()
        differ = (block != block[:1]).any(dim=0).nonzero()[:, 0].tolist()
        p.rope_explicit += [(row + j, block[:, j]) for j in differ]

    def _tensor(self, values: list[int], dtype: torch.dtype = torch.long) -> torch.Tensor:
        return to_device(torch.tensor(values, dtype=dtype), self.device)

    def _block_table_array(self, tables: list[list[int]], rows: int, width: int) -> np.ndarray:
        array = np.zeros((rows, width), dtype=np.int32)
        for i, table in enumerate(tables):
            array[i, : len(table)] = table
        return array

    def _metadata(self, p: _Packed) -> AttentionMetadata:
        meta = AttentionMetadata(kv_cache=self.kv_cache, slot_mapping=self._tensor(p.slots))
        if self.use_triton:
            width = max(len(t) for t in p.tables)
            meta.block_tables = to_device(torch.from_numpy(self._block_table_array(p.tables, len(p.tables), width)),
                                          self.device)
            meta.seq_lens = self._tensor(p.seq_lens, torch.int32)
            meta.cu_seqlens_q = self._tensor([0, *np.cumsum(p.query_lens).tolist()], torch.int32)
            meta.max_query_len = max(p.query_lens)
            return meta
        bs = self.block_size
        ctx_slots, ctx_pos, ctx_seq, query_seq = [], [], [], []
        for i, (table, end, n) in enumerate(zip(p.tables, p.seq_lens, p.query_lens, strict=True)):
            ctx_slots += [table[pos // bs] * bs + pos % bs for pos in range(end)]
            ctx_pos += range(end)
            ctx_seq += [i] * end
            query_seq += [i] * n
        meta.query_pos = self._tensor(p.positions)
        meta.query_seq = self._tensor(query_seq)
        meta.context_slots = self._tensor(ctx_slots)
        meta.context_pos = self._tensor(ctx_pos)
        meta.context_seq = self._tensor(ctx_seq)
        return meta

    @torch.inference_mode()
    def execute(self, batch: list[tuple[Sequence, int]], output_layers: tuple[int, ...] = ()) -> StepResult:
        p = self._pack(batch)
        if self._graph_fits(p, len(batch)) and set(output_layers) <= set(self.graph_layers):
            logits, argmax, layers = self._replay(p)
            hidden = {i: layers[i][: len(batch)].clone() for i in output_layers}  # the next replay overwrites
            if len(p.sample_rows) != len(batch):
                rows = self._tensor(p.sample_rows)
                logits, argmax = logits[rows], argmax[rows]
            return StepResult(p.sample_rows, logits if p.sample_rows else None, hidden, p.row_spans, argmax)
        if self._prompt_graph_fits(p, len(batch)) and set(output_layers) <= set(self.graph_layers):
            logits, argmax, layers = self._replay_prompt(p)
            hidden = {i: layers[i][: len(p.ids)].clone() for i in output_layers}  # the next replay overwrites
            return StepResult(p.sample_rows, logits, hidden, p.row_spans, argmax)
        token_ids = self._tensor(p.ids)
        embeds = self._input_embeds(p, token_ids)
        hidden, layers = self.model.forward(token_ids, self._rope(p), self._metadata(p), embeds, output_layers)
        logits = self.model.compute_logits(hidden[self._tensor(p.last_rows)]) if p.last_rows else None
        return StepResult(p.sample_rows, logits, layers, p.row_spans)

    def _graph_fits(self, p: _Packed, num_seqs: int) -> bool:
        """A step a captured graph can run: one token per sequence, no replaced embeddings or explicit
        multi-axis positions, additions only where the graphs take them."""
        return (
            bool(self.graphs) and len(p.ids) == num_seqs <= self.max_num_seqs
            and not p.embed_rows and not p.rope_explicit and (not p.add_rows or self._dev_adds is not None)
        )

    def _prompt_graph_fits(self, p: _Packed, num_seqs: int) -> bool:
        """A step a prompt graph can run: one sequence's tokens (more than one: a single token is a decode
        step's), no more than the largest bucket, plain rotary positions."""
        return bool(self.prompt_graphs) and num_seqs == 1 and 1 < len(p.ids) <= max(self.prompt_graphs) \
            and not p.rope_explicit

    def _input_embeds(self, p: _Packed, token_ids: torch.Tensor) -> torch.Tensor | None:
        """Token embeddings with per-position replacements and additions, or None if there are none."""
        if not (p.embed_rows or p.add_rows):
            return None
        embeds = self.model.embed(token_ids)
        if p.embed_rows:
            embeds.index_copy_(0, self._tensor(p.embed_rows),
                               torch.stack(p.embed_values).to(device=self.device, dtype=embeds.dtype))
        if p.add_rows:
            embeds.index_add_(0, self._tensor(p.add_rows),
                              self._stacked_adds(p.add_values).to(device=self.device, dtype=embeds.dtype))
        return embeds

    @staticmethod
    def _stacked_adds(values: list[torch.Tensor | tuple[torch.Tensor, ...]]) -> torch.Tensor:
        """A step's added rows ([1, D] each, Sequence.embed_adds) as one tensor; rows given as parts (a tuple)
        are summed here, a few kernels for the whole step rather than one per request."""
        parts = [v if isinstance(v, tuple) else (v,) for v in values]
        out = torch.cat([p[0] for p in parts])
        for k in range(1, max(len(p) for p in parts)):
            rows = [i for i, p in enumerate(parts) if len(p) > k]
            more = torch.cat([parts[i][k] for i in rows])
            if len(rows) == len(parts):
                out += more
            else:
                out.index_add_(0, torch.tensor(rows, device=out.device), more)
        return out

    def _rope(self, p: _Packed) -> torch.Tensor:
        """Rotary positions: [T], or [axes, T] when some token has explicit multi-axis positions."""
        rope = self._tensor(p.rope)
        if not p.rope_explicit:
            return rope
        rows, values = zip(*p.rope_explicit, strict=True)
        multi = rope.expand(values[0].shape[0], -1).clone()
        explicit = to_device(torch.stack(values, dim=1), self.device)  # host-computed positions: asynchronously
        multi[:, self._tensor(list(rows))] = explicit.to(multi.dtype)
        return multi

    @torch.inference_mode()
    def launch_decode(self, seqs: list[Sequence], previous: DecodeLaunch | None = None,
                      sample: Callable[[torch.Tensor], torch.Tensor] | None = None,
                      output_layers: tuple[int, ...] = ()) -> DecodeLaunch:
        """Decode one token for each sequence (at position `num_computed`) without waiting for the device:
        the argmax, or `sample(logits)` (ids left on the device); with `output_layers`, those layers' rows
        too. A sequence whose input token is still `previous`'s output takes it on the device."""
        p = self._pack([(s, 1) for s in seqs])
        where = {id(s): i for i, s in enumerate(previous.seqs)} if previous else {}
        pending = [(i, where[id(s)]) for i, s in enumerate(seqs) if s.num_computed >= s.num_tokens]
        if self._graph_fits(p, len(seqs)) and set(output_layers) <= set(self.graph_layers):
            logits, argmax, layers = self._replay(p, previous, pending)
            hidden = {i: layers[i][: len(seqs)].clone() for i in output_layers}  # the next replay overwrites
        else:
            ids = self._tensor(p.ids)
            self._take_previous(ids, previous, pending)
            last, hidden = self.model.forward(ids, self._rope(p), self._metadata(p), self._input_embeds(p, ids),
                                              output_layers)
            logits = self.model.compute_logits(last)
            argmax = logits.argmax(dim=-1) if sample is None else None
        tokens = argmax if sample is None else sample(logits)
        return self._launched(DecodeLaunch(seqs, tokens, p.positions, hidden))

    def _launched(self, launch: DecodeLaunch) -> DecodeLaunch:
        """Start the launch's tokens on their way to the host (CUDA: a pinned buffer and an event)."""
        if self.device.type == "cuda":
            self._token_slot ^= 1
            rows = launch.tokens[None] if launch.all_tokens is None else launch.all_tokens
            launch.host_tokens = self._host_tokens[self._token_slot][: rows.numel()].view(rows.shape)  # contiguous
            launch.host_tokens.copy_(rows, non_blocking=True)
            launch.done = torch.cuda.Event()
            launch.done.record()
        return launch

    @staticmethod
    def read_tokens(launch: DecodeLaunch) -> list[list[int]]:
        """Wait for that one launch (not for any launched after it) and return its tokens, one list per step."""
        if launch.done is None:
            rows = launch.tokens[None] if launch.all_tokens is None else launch.all_tokens
            return rows.tolist()
        launch.done.synchronize()
        return launch.host_tokens.tolist()

    # ---- decode bursts ---------------------------------------------------------------------

    def burst_graph_fits(self, seqs: list[Sequence], steps: int) -> bool:
        """A captured burst replays these `steps` for `seqs`: a graph for their count, and any rows they add to
        their input embeddings have a place in it (only models declaring `graph_embed_adds` capture one)."""
        return (
            steps == self.burst_steps and bool(self.burst_graphs) and len(seqs) <= max(self.burst_graphs)
            and (self._dev_adds is not None or all(s.embed_adds is None for s in seqs))
        )

    @torch.inference_mode()
    def launch_burst(self, seqs: list[Sequence], steps: int, draw: Callable[[torch.Tensor], torch.Tensor],
                     previous: DecodeLaunch | None = None) -> DecodeLaunch:
        """`steps` decode steps for each sequence (positions `num_computed` on, blocks already allocated), each
        step's tokens drawn by `draw(logits)` on the device and fed to the next, without waiting for the device.
        With a captured burst graph (`steps == burst_steps`) the whole burst is one replay and `draw` is the one
        captured in it (its inputs loaded beforehand); otherwise the steps run eagerly."""
        batch = [(s, 1) for s in seqs]
        p = self._pack(batch)
        where = {id(s): i for i, s in enumerate(previous.seqs)} if previous else {}
        pending = [(i, where[id(s)]) for i, s in enumerate(seqs) if s.num_computed >= s.num_tokens]
        if self.burst_graph_fits(seqs, steps):
            all_tokens = self._replay_burst(batch, p, previous, pending)
        else:
            ids = self._tensor(p.ids)
            self._take_previous(ids, previous, pending)
            drawn = []
            for j in range(steps):
                pj = p if j == 0 else self._pack(batch, ahead=j)
                last, _ = self.model.forward(ids, self._rope(pj), self._metadata(pj), self._input_embeds(pj, ids))
                ids = draw(self.model.compute_logits(last))
                drawn.append(ids)
            all_tokens = torch.stack(drawn)
        return self._launched(DecodeLaunch(seqs, all_tokens[-1], p.positions, {}, all_tokens))

    def _take_previous(self, ids: torch.Tensor, previous: DecodeLaunch | None, pending: list[tuple[int, int]]) -> None:
        """Copy the still-unread tokens of `previous` into this step's input ids, on the device."""
        if not pending:
            return
        rows, sources = (list(x) for x in zip(*pending, strict=True))
        if rows == sources == list(range(len(rows))):
            ids[: len(rows)].copy_(previous.tokens[: len(rows)])
        else:
            ids.index_copy_(0, self._tensor(rows), previous.tokens.index_select(0, self._tensor(sources)))

    # ---- CUDA graphs for decode steps ------------------------------------------------------

    def _capture(self, run: Callable[[], Any], stream: torch.cuda.Stream,
                 generator: torch.Generator | None = None) -> tuple[torch.cuda.CUDAGraph, Any]:
        """`run` once eagerly (Triton compiles, the allocator settles), then captured on `stream` into the
        runner's one memory pool (its graphs replay one at a time); returns the graph and what the captured
        call returned (its static outputs). `generator`'s state advances with every replay. Runs without
        autograd: a model whose weights still require grad would otherwise record (and refuse in-place ops)."""
        with torch.no_grad():
            run()
            graph = torch.cuda.CUDAGraph()
            if generator is not None:
                graph.register_generator_state(generator)
            with torch.cuda.graph(graph, pool=self._graph_pool, stream=stream, capture_error_mode="thread_local"):
                out = run()
        self._graph_pool = graph.pool()
        return graph, out

    def _capture_graphs(self, num_blocks: int) -> None:
        """Capture one graph per batch-size bucket, sharing one memory pool. Inputs live in static
        device buffers filled from pinned host buffers with two async copies per step."""
        started = time.perf_counter()
        sizes = _bucket_sizes(self.max_num_seqs)
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
                kv_cache=self.kv_cache, slot_mapping=slots[:size], block_tables=self._dev_tables[:size],
                seq_lens=seq_lens[:size], cu_seqlens_q=self._cu_q[: size + 1], max_query_len=1,
            )

            def forward(size: int = size, meta: AttentionMetadata = meta) -> tuple[torch.Tensor, ...]:
                adds = self._dev_adds
                embeds = self.model.embed(ids[:size]) + adds[:size] if adds is not None else None
                hidden, layers = self.model.forward(ids[:size], positions[:size], meta, embeds, self.graph_layers)
                logits = self.model.compute_logits(hidden)
                return logits, logits.argmax(dim=-1), layers

            graph, (logits, argmax, layers) = self._capture(forward, capture_stream)
            self.graphs[size] = (graph, logits, argmax, layers)
        torch.cuda.synchronize(self.device)
        logger.info("captured %d decode CUDA graphs (batch sizes %s) in %.1fs",
                    len(sizes), sizes, time.perf_counter() - started)

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
                    meta = AttentionMetadata(kv_cache=self.kv_cache, slot_mapping=slots[j], block_tables=tables,
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
        logger.info("captured %d %d-step decode burst graphs in %.1fs", len(sizes), steps,
                    time.perf_counter() - started)

    def _replay_burst(self, batch: list[tuple[Sequence, int]], p: _Packed, previous: DecodeLaunch | None,
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
        self._host_tables[:n, :width] = torch.from_numpy(self._block_table_array(p.tables, n, width))
        self._host_tables[n:size, : self._pad_columns] = self.pad_block
        self._burst_inputs[:, :size].copy_(host_long[:, :size], non_blocking=True)
        self._dev_tables[:size, :width].copy_(self._host_tables[:size, :width], non_blocking=True)
        self._take_previous(self._burst_inputs[0], previous, pending)
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
            rows = self._stacked_adds([row[0] for row in adds]).to(device=self.device, dtype=buffer.dtype)
            buffer[:, :n].copy_(rows[None].expand(steps, -1, -1))
            return
        buffer.zero_()
        width = self._burst_adds.shape[1]
        where = [j * width + i for i, row in enumerate(adds) for j, a in enumerate(row) if a is not None]
        values = [a for row in adds for a in row if a is not None]
        if values:
            self._burst_adds.view(-1, buffer.shape[-1]).index_copy_(
                0, self._tensor(where), self._stacked_adds(values).to(device=self.device, dtype=buffer.dtype))

    def _fill_padding(self, start: int, end: int) -> None:
        """Padded rows decode into the spare block and attend only to themselves."""
        self._host_long[:2, start:end] = 0
        self._host_long[2, start:end] = self.pad_slot
        self._host_long[3, start:end] = 1
        self._host_tables[start:end, 0] = self.pad_block

    def _replay(
        self, p: _Packed, previous: DecodeLaunch | None = None, pending: list[tuple[int, int]] = ()
    ) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
        n = len(p.ids)
        size = next(b for b in sorted(self.graphs) if b >= n)
        self._input_slot ^= 1
        self._host_long = self._host_long_pair[self._input_slot]
        self._host_tables = self._host_tables_pair[self._input_slot]
        host = self._host_long.numpy()
        host[0, :n], host[1, :n], host[2, :n], host[3, :n] = p.ids, p.rope, p.slots, p.seq_lens
        width = max(len(t) for t in p.tables)
        self._host_tables[:n, :width] = torch.from_numpy(self._block_table_array(p.tables, n, width))
        self._fill_padding(n, size)
        self._dev_long[:, :size].copy_(self._host_long[:, :size], non_blocking=True)
        self._dev_tables[:size, :width].copy_(self._host_tables[:size, :width], non_blocking=True)
        self._take_previous(self._dev_long[0], previous, list(pending))
        if self._dev_adds is not None:  # rows without an addition add zero, exactly
            self._dev_adds[:size].zero_()
            if p.add_rows:
                values = self._stacked_adds(p.add_values).to(device=self.device, dtype=self._dev_adds.dtype)
                self._dev_adds.index_copy_(0, self._tensor(p.add_rows), values)
        graph, logits, argmax, layers = self.graphs[size]
        graph.replay()
        return logits[:n], argmax[:n], layers

    # ---- CUDA graphs for prompts -----------------------------------------------------------

    def _capture_prompt_graphs(self) -> None:
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
        self._prompt_long[2] = self.pad_slot
        self._prompt_ints = torch.zeros(4 + width, dtype=torch.int32, device=self.device)  # cu_seqlens_q [0, 0]
        ids, rope, slots = self._prompt_long
        self._prompt_embeds = torch.zeros_like(self.model.embed(ids))
        cu, seq_len, last, table = (self._prompt_ints[:2], self._prompt_ints[2:3], self._prompt_ints[3:4],
                                    self._prompt_ints[4:].view(1, width))
        capture_stream = own_capture_stream(self.device)
        for size in reversed(sizes):
            def forward(size: int = size) -> tuple[torch.Tensor, ...]:
                meta = AttentionMetadata(kv_cache=self.kv_cache, slot_mapping=slots[:size], block_tables=table,
                                         seq_lens=seq_len, cu_seqlens_q=cu, max_query_len=size)
                hidden, layers = self.model.forward(ids[:size], rope[:size], meta, self._prompt_embeds[:size],
                                                    self.graph_layers)
                logits = self.model.compute_logits(hidden.index_select(0, last))
                return logits, logits.argmax(dim=-1), layers

            # its warm-up has no sequence: attention reads nothing
            graph, (logits, argmax, layers) = self._capture(forward, capture_stream)
            self.prompt_graphs[size] = (graph, logits, argmax, layers)
        torch.cuda.synchronize(self.device)
        logger.info("captured %d prompt CUDA graphs (up to %d tokens) in %.1fs", len(sizes), n,
                    time.perf_counter() - started)

    def _replay_prompt(self, p: _Packed) -> tuple[torch.Tensor | None, torch.Tensor | None, dict[int, torch.Tensor]]:
        """Replay the smallest prompt graph that holds the step: (logits and argmax of the last row, or None
        where the sequence does not sample yet; the graph's layers, padded)."""
        t = len(p.ids)
        size = next(b for b in sorted(self.prompt_graphs) if b >= t)
        self._prompt_slot ^= 1
        if (copied := self._prompt_copied[self._prompt_slot]) is not None:
            copied.synchronize()  # long passed, unless chunks of a prompt follow each other without a sample
        host_long, host_ints = self._prompt_host_pair[self._prompt_slot]
        long, ints = host_long.numpy(), host_ints.numpy()
        long[0, :t], long[1, :t], long[2, :t] = p.ids, p.rope, p.slots
        long[:2, t:size], long[2, t:size] = 0, self.pad_slot
        table = p.tables[0]
        ints[:4] = 0, t, p.seq_lens[0], t - 1
        ints[4 : 4 + len(table)] = table
        self._prompt_long[:, :size].copy_(host_long[:, :size], non_blocking=True)
        self._prompt_ints[: 4 + len(table)].copy_(host_ints[: 4 + len(table)], non_blocking=True)
        self._prompt_copied[self._prompt_slot] = copied = torch.cuda.Event()
        copied.record()
        ids = self._prompt_long[0, :t]
        embeds = self._input_embeds(p, ids)
        self._prompt_embeds[:t].copy_(embeds if embeds is not None else self.model.embed(ids))
        graph, logits, argmax, layers = self.prompt_graphs[size]
        graph.replay()
        self.num_prompt_replays += 1
        return (logits, argmax, layers) if p.last_rows else (None, None, layers)
