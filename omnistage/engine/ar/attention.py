"""Paged attention over token-packed batches.

A step's tokens from every sequence are packed into one row. Each layer writes the new tokens'
K/V into cache slots, then attends over each sequence's whole context read back from its blocks.
This is the portable backend (torch SDPA over gathered blocks, one call per layer for the whole
batch, a block-diagonal causal mask); GPU kernels plug in behind `paged_attention`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


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
    """Where a packed step's tokens live in the cache and which context each query may see."""

    kv_cache: PagedKVCache
    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    query_pos: torch.Tensor  # [T] absolute position of each new token
    query_seq: torch.Tensor  # [T] index of its sequence in the batch
    context_slots: torch.Tensor  # [C] slots of every sequence's whole context, concatenated
    context_pos: torch.Tensor  # [C]
    context_seq: torch.Tensor  # [C]
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
    key: torch.Tensor,  # [T, KVH, D]
    value: torch.Tensor,  # [T, KVH, D]
    meta: AttentionMetadata,
    scale: float | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Store this step's K/V, then attend over the cached contexts. Returns [T, H, D]."""
    k_cache, v_cache = meta.kv_cache.layer(layer_idx)
    k_cache.index_copy_(0, meta.slot_mapping, key.to(k_cache.dtype))
    v_cache.index_copy_(0, meta.slot_mapping, value.to(v_cache.dtype))
    k = k_cache.index_select(0, meta.context_slots).transpose(0, 1)
    v = v_cache.index_select(0, meta.context_slots).transpose(0, 1)
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1), k.to(query.dtype), v.to(query.dtype),
        attn_mask=meta.mask(sliding_window), scale=scale, enable_gqa=True,
    )
    return out.transpose(0, 1)
