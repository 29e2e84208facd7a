"""Paged attention over token-packed batches.

A step's tokens from every sequence are packed into one row. Each layer writes the new tokens'
K/V into cache slots (or its caller already has, fused with rotary: kernels/fused.py), then attends
over each sequence's whole context read back from its blocks. Two backends share one cache layout:
on CUDA a Triton kernel walks each sequence's block table (kernels/paged_attention.py; small decode
batches split each context's keys over several programs); elsewhere torch SDPA runs over the
gathered contexts with a block-diagonal causal mask, one call per layer for the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

try:
    from omnistage.kernels.paged_attention import paged_attention_triton
except ImportError:  # Triton is needed only for the CUDA backend
    paged_attention_triton = None


@dataclass
class KVSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def bytes_per_block(self, block_size: int) -> int:
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize


class PagedKVCache:
    """K and V for every layer, as [num_blocks * block_size, kv_heads, head_dim] slot arrays."""

    def __init__(self, spec: KVSpec, num_blocks: int, block_size: int, device: torch.device):
        shape = (2, spec.num_layers, num_blocks * block_size, spec.num_kv_heads, spec.head_dim)
        self.data = torch.empty(shape, dtype=spec.dtype, device=device)
        self.num_blocks, self.block_size = num_blocks, block_size

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[0, layer_idx], self.data[1, layer_idx]


@dataclass
class AttentionMetadata:
    """Where a packed step's tokens live in the cache and which context each query may see.
    The Triton backend reads the block tables; the SDPA backend the flattened contexts."""

    kv_cache: PagedKVCache
    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    # Triton backend
    block_tables: torch.Tensor | None = None  # [B, max_blocks] int32
    seq_lens: torch.Tensor | None = None  # [B] int32: context length after this step
    cu_seqlens_q: torch.Tensor | None = None  # [B + 1] int32: each sequence's rows in the packed step
    max_query_len: int = 0
    # rotary tables (cos, sin) [T, head_dim] computed ahead (a decode burst's, once for all its steps) by the
    # model's `rotary_tables`; None: the forward computes them from the positions
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None
    # SDPA backend
    query_pos: torch.Tensor | None = None  # [T] absolute position of each new token
    query_seq: torch.Tensor | None = None  # [T] index of its sequence in the batch
    context_slots: torch.Tensor | None = None  # [C] slots of every sequence's whole context, concatenated
    context_pos: torch.Tensor | None = None  # [C]
    context_seq: torch.Tensor | None = None  # [C]
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        """[T, C] bool: same sequence, causal, and (optionally) inside the sliding window."""
        if sliding_window not in self._masks:
            distance = self.query_pos[:, None] - self.context_pos[None, :]
            allowed = (self.query_seq[:, None] == self.context_seq[None, :]) & (distance >= 0)
            if sliding_window is not None:
                allowed &= distance < sliding_window
            self._masks[sliding_window] = allowed
        return self._masks[sliding_window]


def paged_attention(
    layer_idx: int,
    query: torch.Tensor,  # [T, H, D]
    key: torch.Tensor | None,  # [T, KVH, D]; None when `kv_written`
    value: torch.Tensor | None,
    meta: AttentionMetadata,
    scale: float | None = None,
    sliding_window: int | None = None,
    kv_written: bool = False,
) -> torch.Tensor:
    """Store this step's K/V (unless the caller already has: `kv_written`, e.g. fused with rotary, in
    which case key/value are not read), then attend over the cached contexts. Returns [T, H, D]."""
    k_cache, v_cache = meta.kv_cache.layer(layer_idx)
    if not kv_written:
        k_cache.index_copy_(0, meta.slot_mapping, key.to(k_cache.dtype))
        v_cache.index_copy_(0, meta.slot_mapping, value.to(v_cache.dtype))
    scale = scale if scale is not None else query.shape[-1] ** -0.5
    if meta.block_tables is not None:
        return paged_attention_triton(
            query, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q,
            meta.max_query_len, meta.kv_cache.block_size, scale, sliding_window,
        )
    k = k_cache.index_select(0, meta.context_slots).transpose(0, 1)
    v = v_cache.index_select(0, meta.context_slots).transpose(0, 1)
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1), k.to(query.dtype), v.to(query.dtype),
        attn_mask=meta.mask(sliding_window), scale=scale, enable_gqa=True,
    )
    return out.transpose(0, 1)
