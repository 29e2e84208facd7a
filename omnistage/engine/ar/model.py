"""What a family hands the AR engine: a model that runs token-packed batches on a paged cache."""

from __future__ import annotations

from typing import Protocol

import torch

from omnistage.engine.ar.attention import AttentionMetadata, KVSpec


class ARModel(Protocol):
    kv_spec: KVSpec
    device: torch.device
    vocab_size: int
    weight_bytes: int  # device memory held by the weights (for KV cache sizing)
    graph_safe: bool  # forward has no host syncs, so decode steps may be captured in CUDA graphs

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[T] ids -> [T, hidden] input embeddings."""
        ...

    def forward(
        self,
        token_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        attn: AttentionMetadata,
        embeds: torch.Tensor | None = None,  # [T, hidden]: replaces the token embeddings when given
        output_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Returns final hidden states [T, hidden] and the requested layers' hidden states
        (index 0 = embeddings, num_layers = final output)."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32 logits."""
        ...

    # Optional: `rotary_tables(positions [T]) -> (cos, sin) | None`: the tables `forward` would compute for those
    # positions, for `AttentionMetadata.rotary` (a decode burst computes all its steps' in one go).
    # Optional: `prepare_input(inp: StageInput, first: bool) -> StageInput` completes a request's input
    # (or a later chunk of it) before the engine takes it: media encoders, rotary positions, embeddings
    # composed from the model's own tables. It runs on the stage's worker.
