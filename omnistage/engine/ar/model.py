"""What a family hands the AR engine: a model that runs token-packed batches on a paged cache."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from omnistage.engine.ar.attention import AttentionMetadata, KVSpec


@dataclass
class SampleExtras:
    """What a model's `after_sample` hook adds to a step, one row per sampled sequence (see ARModel)."""

    next_adds: torch.Tensor  # [n, hidden]: added to the input embedding of the row's sampled token's position
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [n, ...]: emitted with the token


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
    # Optional: `after_sample(hidden [n, hidden], tokens [n], inputs: list[dict[str, Tensor]], generators:
    # list[Generator | None]) -> SampleExtras`: a model whose step does more than one token (a talker's code
    # predictor: the frame's other codebooks) runs that here, batched over the step's sampled rows, after the engine
    # sampled their tokens. `hidden` are the final hidden states that produced the logits, `tokens` the sampled ids
    # (on the device), `inputs` each row's request tensors (`StageInput.tensors` after `prepare_input`),
    # `generators` each row's own noise source (a seeded request's; None: any), which the hook's draws continue, so
    # a seeded request's outputs do not depend on its batch. Contract, kept by the engine:
    # - `next_adds[i]` is added (on top of the token embedding and any `embed_adds` row) to the input embedding of
    #   the position holding `tokens[i]`, whenever it is computed: the next step, or again after a preemption;
    # - `outputs[name][i : i + 1]` goes to that step's `StageOutput.tensors[name]` (on the host; a request's
    #   outputs concatenate along dim 0), except with a token that stops the request (EOS / stop id): what the
    #   hook computed for a stop token is dropped with it;
    # - every step of such a model samples on the host path (no overlapped steps or bursts), so the hook sees each
    #   step's tokens before the next step is packed; its decode and prompt steps replay CUDA graphs as any
    #   graph-safe model's (they keep the final hidden states the hook reads).
    # Optional, with `after_sample`: its graph-safe form, which the engine captures on CUDA per decode batch-size
    # bucket (cuda_graphs.HookGraphs; `graph_safe` or not: it is the hook's own graph; with `enforce_eager` the same
    # function runs on the same buffers) and replays for a step whose rows all draw from the default generator (a
    # step with a seeded request's row calls `after_sample`):
    # - `after_sample_rows(inputs) -> Tensor [n, P]`: each row's parameters (`inputs` as above; `[{}]`, a request
    #   without tensors, gives the defaults the capture runs with) as float32 rows, on the host;
    # - `after_sample_graph(hidden [n, hidden], tokens [n], rows [n, P] on the device) -> SampleExtras`: what
    #   `after_sample` returns for those rows with no generators, computed from these static tensors alone: no host
    #   syncs or data-dependent shapes, noise from the default generator only (graph-safe: each replay draws anew);
    #   state it keeps between calls (a scratch buffer) is sized on its first call, the largest bucket's, and never
    #   reallocated (the graphs hold it). Greedy rows must give `after_sample`'s outputs, sampled rows draw from the
    #   same distribution.
