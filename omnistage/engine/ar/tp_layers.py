"""Sharded layers for tensor parallelism (parallel.py runs the group).

A column-parallel linear is a plain `nn.Linear` holding this rank's output rows (its heads, its slice of the
MLP's intermediate size): nothing to communicate, its consumer works on the slice. The layers here are the ones
that communicate: a row-parallel linear (this rank's input columns, partial sums all-reduced, bias added once
after), and the vocab-parallel embedding and LM head (this rank's rows of the vocabulary, padded to
`ceil(vocab / world)` each; the padded rows are zero and their logits are cut off).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.engine.ar.parallel import TPGroup


def vocab_shard(vocab_size: int, group: TPGroup) -> tuple[int, int]:
    """(first row, rows per rank) of this rank's vocabulary slice."""
    per = -(-vocab_size // group.world)
    return group.rank * per, per


class RowParallelLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, group: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(torch.empty(out_features, in_features // group.world, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.group.all_reduce(F.linear(x, self.weight))
        return out + self.bias if self.bias is not None else out


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, dim: int, group: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.group = group
        self.start, per = vocab_shard(vocab_size, group)
        self.weight = nn.Parameter(torch.empty(per, dim, dtype=dtype))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        return self.group.all_reduce(out.masked_fill(outside[..., None], 0))


class ParallelLMHead(nn.Module):
    """Every rank gets the full logits (only rank 0 samples, but the gather is one collective either way)."""

    def __init__(self, vocab_size: int, dim: int, group: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.group, self.vocab_size = group, vocab_size
        self.weight = nn.Parameter(torch.empty(vocab_shard(vocab_size, group)[1], dim, dtype=dtype))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.group.all_gather(F.linear(hidden, self.weight))[..., : self.vocab_size]
