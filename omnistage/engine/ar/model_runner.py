"""Turns a scheduled batch into packed tensors, runs the model, and returns logits.

Host-side bookkeeping (positions, slots, block tables) is built once per step from plain lists.
On CUDA, steps where every sequence decodes one token replay a captured CUDA graph of the whole
forward (plus the LM head) for the smallest batch-size bucket that fits; other steps run eagerly.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from omnistage.engine.ar.attention import AttentionMetadata, PagedKVCache
from omnistage.engine.ar.model import ARModel
from omnistage.engine.ar.sequence import Sequence

logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    sample_rows: list[int]  # batch indices of the sequences that sample this step
    logits: torch.Tensor | None  # [len(sample_rows), vocab] float32
    hidden: dict[int, torch.Tensor]  # layer -> [T, hidden] for the whole packed step
    row_spans: list[tuple[int, int]]  # each sequence's rows in the packed step


@dataclass
class _Packed:
    """One step's inputs as host lists."""

    ids: list[int]
    positions: list[int]
    slots: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    tables: list[list[int]]
    embed_rows: list[int]
    embed_values: list[torch.Tensor]
    sample_rows: list[int]
    last_rows: list[int]
    row_spans: list[tuple[int, int]]


def _bucket_sizes(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sizes + [max_batch]


class ModelRunner:
    def __init__(
        self, model: ARModel, block_size: int, max_num_seqs: int, max_model_len: int, enforce_eager: bool = False
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
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

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
        if self.use_graphs:
            self._capture_graphs(num_blocks)

    # ---- one step -------------------------------------------------------------------------

    def _pack(self, batch: list[tuple[Sequence, int]]) -> _Packed:
        bs = self.block_size
        p = _Packed([], [], [], [], [], [], [], [], [], [], [])
        for i, (seq, n) in enumerate(batch):
            start, end = seq.num_computed, seq.num_computed + n
            row = len(p.ids)
            for pos in range(start, end):
                if pos in seq.embeds:
                    p.embed_rows.append(row + pos - start)
                    p.embed_values.append(seq.embeds[pos])
            table = seq.block_table
            p.ids += seq.token_ids[start:end]
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

    def _tensor(self, values: list[int], dtype: torch.dtype = torch.long) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    def _block_table_array(self, tables: list[list[int]], rows: int, width: int) -> np.ndarray:
        array = np.zeros((rows, width), dtype=np.int32)
        for i, table in enumerate(tables):
            array[i, : len(table)] = table
        return array

    def _metadata(self, p: _Packed) -> AttentionMetadata:
        meta = AttentionMetadata(kv_cache=self.kv_cache, slot_mapping=self._tensor(p.slots))
        if self.use_triton:
            width = max(len(t) for t in p.tables)
            meta.block_tables = torch.from_numpy(self._block_table_array(p.tables, len(p.tables), width)).to(
                self.device
            )
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
        decode_only = len(p.ids) == len(batch)
        if self.graphs and decode_only and not output_layers and not p.embed_rows and len(batch) <= self.max_num_seqs:
            logits = self._replay(p)
            return StepResult(p.sample_rows, logits[p.sample_rows] if p.sample_rows else None, {}, p.row_spans)
        meta = self._metadata(p)
        token_ids = self._tensor(p.ids)
        embeds = None
        if p.embed_rows:
            embeds = self.model.embed(token_ids)
            values = torch.stack(p.embed_values).to(device=self.device, dtype=embeds.dtype)
            embeds.index_copy_(0, self._tensor(p.embed_rows), values)
        hidden, layers = self.model.forward(token_ids, self._tensor(p.positions), meta, embeds, output_layers)
        logits = self.model.compute_logits(hidden[self._tensor(p.last_rows)]) if p.last_rows else None
        return StepResult(p.sample_rows, logits, layers, p.row_spans)

    # ---- CUDA graphs for decode steps ------------------------------------------------------

    def _capture_graphs(self, num_blocks: int) -> None:
        started = time.perf_counter()
        sizes = _bucket_sizes(self.max_num_seqs)
        n = sizes[-1]
        width = self.max_blocks_per_seq
        self._static = {
            "ids": torch.zeros(n, dtype=torch.long, device=self.device),
            "positions": torch.zeros(n, dtype=torch.long, device=self.device),
            "slots": torch.full((n,), self.pad_slot, dtype=torch.long, device=self.device),
            "tables": torch.full((n, width), num_blocks, dtype=torch.int32, device=self.device),
            "seq_lens": torch.ones(n, dtype=torch.int32, device=self.device),
            "cu_q": torch.arange(n + 1, dtype=torch.int32, device=self.device),
        }
        s = self._static
        pool = None
        for size in reversed(sizes):
            meta = AttentionMetadata(
                kv_cache=self.kv_cache, slot_mapping=s["slots"][:size], block_tables=s["tables"][:size],
                seq_lens=s["seq_lens"][:size], cu_seqlens_q=s["cu_q"][: size + 1], max_query_len=1,
            )

            def forward(size: int = size, meta: AttentionMetadata = meta) -> torch.Tensor:
                hidden, _ = self.model.forward(s["ids"][:size], s["positions"][:size], meta)
                return self.model.compute_logits(hidden)

            forward()  # warm up (Triton compiles, allocator settles) outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = forward()
            pool = graph.pool()
            self.graphs[size] = (graph, logits)
        torch.cuda.synchronize(self.device)
        logger.info("captured %d decode CUDA graphs (batch sizes %s) in %.1fs",
                    len(sizes), sizes, time.perf_counter() - started)

    def _replay(self, p: _Packed) -> torch.Tensor:
        n = len(p.ids)
        size = next(b for b in sorted(self.graphs) if b >= n)
        s = self._static
        width = max(len(t) for t in p.tables)
        host = torch.tensor([p.ids, p.positions, p.slots, p.seq_lens], dtype=torch.long)
        s["ids"][:n].copy_(host[0], non_blocking=True)
        s["positions"][:n].copy_(host[1], non_blocking=True)
        s["slots"][:n].copy_(host[2], non_blocking=True)
        s["seq_lens"][:n].copy_(host[3], non_blocking=True)
        s["tables"][:n, :width].copy_(torch.from_numpy(self._block_table_array(p.tables, n, width)), non_blocking=True)
        if n < size:  # padded rows decode into the spare block, attending only to themselves
            s["slots"][n:size].fill_(self.pad_slot)
            s["seq_lens"][n:size].fill_(1)
            s["tables"][n:size, 0].fill_(self.pad_slot // self.block_size)
        graph, logits = self.graphs[size]
        graph.replay()
        return logits[:n]
