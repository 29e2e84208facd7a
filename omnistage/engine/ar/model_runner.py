"""Turns a scheduled batch into packed tensors, runs the model, and returns logits.

Host-side bookkeeping (positions, slots, mask metadata) is built once per step from plain
lists; the model sees one packed row and the attention metadata.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omnistage.engine.ar.attention import AttentionMetadata, PagedKVCache
from omnistage.engine.ar.model import ARModel
from omnistage.engine.ar.sequence import Sequence


@dataclass
class StepResult:
    sample_rows: list[int]  # batch indices of the sequences that sample this step
    logits: torch.Tensor | None  # [len(sample_rows), vocab] float32
    hidden: dict[int, torch.Tensor]  # layer -> [T, hidden] for the whole packed step
    row_spans: list[tuple[int, int]]  # each sequence's rows in the packed step


class ModelRunner:
    def __init__(self, model: ARModel, num_blocks: int, block_size: int):
        self.model = model
        self.device = model.device
        self.block_size = block_size
        self.kv_cache = PagedKVCache(model.kv_spec, num_blocks, block_size, model.device)

    def _slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        bs, table = self.block_size, seq.block_table
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    @torch.inference_mode()
    def execute(
        self, batch: list[tuple[Sequence, int]], output_layers: tuple[int, ...] = ()
    ) -> StepResult:
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_seq: list[int] = []
        ctx_slots: list[int] = []
        ctx_pos: list[int] = []
        ctx_seq: list[int] = []
        embed_rows: list[int] = []
        embed_values: list[torch.Tensor] = []
        sample_rows: list[int] = []
        last_rows: list[int] = []
        row_spans: list[tuple[int, int]] = []
        for i, (seq, n) in enumerate(batch):
            start, end = seq.num_computed, seq.num_computed + n
            row = len(ids)
            for p in range(start, end):
                if p in seq.embeds:
                    embed_rows.append(row + p - start)
                    embed_values.append(seq.embeds[p])
            ids += seq.token_ids[start:end]
            positions += range(start, end)
            slots += self._slots(seq, start, end)
            query_seq += [i] * n
            ctx_slots += self._slots(seq, 0, end)
            ctx_pos += range(end)
            ctx_seq += [i] * end
            row_spans.append((row, row + n))
            if end == seq.num_tokens and seq.input_final:
                sample_rows.append(i)
                last_rows.append(row + n - 1)

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=self.device)

        meta = AttentionMetadata(
            kv_cache=self.kv_cache,
            slot_mapping=tensor(slots),
            query_pos=tensor(positions),
            query_seq=tensor(query_seq),
            context_slots=tensor(ctx_slots),
            context_pos=tensor(ctx_pos),
            context_seq=tensor(ctx_seq),
        )
        token_ids = tensor(ids)
        embeds = None
        if embed_rows:
            embeds = self.model.embed(token_ids)
            values = torch.stack(embed_values).to(device=self.device, dtype=embeds.dtype)
            embeds.index_copy_(0, tensor(embed_rows), values)
        hidden, layers = self.model.forward(token_ids, meta.query_pos, meta, embeds, output_layers)
        logits = self.model.compute_logits(hidden[tensor(last_rows)]) if last_rows else None
        return StepResult(sample_rows, logits, layers, row_spans)
