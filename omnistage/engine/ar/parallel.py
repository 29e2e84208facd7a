"""Tensor parallelism for an AR stage: one process group per stage (engine/parallel.py), rank 0 in the stage's
worker.

Rank 0 keeps everything the engine does (scheduling, sampling, detokenizing) and sees the group as one
`ARModel` (`TPModel`). Each model call (embed, forward, logits) is announced to the followers and its tensors
(ids, positions, the attention metadata) are broadcast, and every rank runs its shard of the same call: the
shards' collectives (tp_layers.py) line up because every rank makes the same calls in the same order. Followers
never schedule; each holds its own paged KV cache with the same block layout as rank 0's, sized by the header.
A dead follower makes the call raise `GroupLost` (see engine/parallel.py): the stage restarts with a fresh group.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from omnistage.engine.ar.attention import AttentionMetadata, PagedKVCache
from omnistage.engine.parallel import TIMEOUT_S, Followers, GroupLost, RankGroup, receive, start

__all__ = ["TIMEOUT_S", "GroupLost", "TPGroup", "TPModel", "launch", "serve"]
TPGroup = RankGroup  # the name the sharded layers (tp_layers.py) know the group by
_META_FIELDS = ("slot_mapping", "block_tables", "seq_lens", "cu_seqlens_q", "query_pos", "query_seq",
                "context_slots", "context_pos", "context_seq")


def _forward_tensors(ids: torch.Tensor, positions: torch.Tensor, embeds: torch.Tensor | None,
                     meta: AttentionMetadata) -> dict[str, torch.Tensor]:
    """A forward's tensors, flat by name (metadata fields that are unset are left out)."""
    out = {"ids": ids, "positions": positions} | ({"embeds": embeds} if embeds is not None else {})
    out |= {f: getattr(meta, f) for f in _META_FIELDS if getattr(meta, f) is not None}
    if meta.rotary is not None:
        out["rotary_cos"], out["rotary_sin"] = meta.rotary
    return out


class TPModel:
    """Rank 0's view of a tensor-parallel group as one ARModel. No CUDA graphs: a replay would run rank 0's
    kernels alone, so `graph_safe` is False and every step runs eagerly on every rank."""

    graph_safe = False

    def __init__(self, local: Any, ranks: Followers):
        self.local, self.ranks, self.group = local, ranks, ranks.group
        self.kv_spec = local.kv_spec  # this rank's share of the KV heads; every rank's is the same size
        self.device, self.vocab_size, self.weight_bytes = local.device, local.vocab_size, local.weight_bytes

    @property
    def followers(self) -> list[tuple[Any, Any]]:
        """The followers' (process, pipe), rank 1 first."""
        return self.ranks.procs

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        self.ranks.send("embed", {"ids": token_ids}, {})
        return self.local.embed(token_ids)

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                embeds: torch.Tensor | None = None, output_layers: tuple[int, ...] = ()
                ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        cache = attn.kv_cache
        self.ranks.send("forward", _forward_tensors(token_ids, positions, embeds, attn), {
            "num_blocks": cache.num_blocks, "block_size": cache.block_size, "max_query_len": attn.max_query_len,
            "output_layers": tuple(output_layers)})
        return self.local.forward(token_ids, positions, attn, embeds, output_layers)

    def rotary_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.local.rotary_tables(positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self.ranks.send("logits", {"hidden": hidden}, {})
        return self.local.compute_logits(hidden)

    def close(self) -> None:
        self.ranks.close()


def launch(build: Callable[[TPGroup], Any], devices: list[torch.device], view: type[TPModel] | None = None
           ) -> TPModel:
    """Start ranks 1.. of a group over `devices` (one each) as spawned processes, join as rank 0, and build every
    rank's shard with `build(group)` (a picklable callable: the followers call it too). `view`: rank 0's class for
    the group (a TPModel subclass adding what its model needs). Raises if a follower fails to load or does not
    report within `TIMEOUT_S`."""
    ranks = start(build, serve, devices, "tensor-parallel")
    try:
        model = (view or TPModel)(build(ranks.group), ranks)
        ranks.wait_ready()
    except BaseException:
        ranks.kill()
        raise
    return model


def serve(model: Any, group: TPGroup, conn: Any) -> None:
    """A follower's loop: run each call rank 0 announces on this rank's shard, until `stop` or rank 0 is gone."""
    cache: PagedKVCache | None = None
    while (call := receive(group, conn)) is not None:
        op, t, extra = call
        if op == "embed":
            model.embed(t["ids"])
        elif op == "logits":
            model.compute_logits(t["hidden"])
        elif op == "forward":
            if cache is None or (cache.num_blocks, cache.block_size) != (extra["num_blocks"], extra["block_size"]):
                cache = None  # the old cache's memory goes before the new one is allocated
                cache = PagedKVCache(model.kv_spec, extra["num_blocks"], extra["block_size"], group.device)
            meta = AttentionMetadata(kv_cache=cache, max_query_len=extra["max_query_len"],
                                     **{f: t[f] for f in _META_FIELDS if f in t})
            if "rotary_cos" in t:
                meta.rotary = (t["rotary_cos"], t["rotary_sin"])
            model.forward(t["ids"], t["positions"], meta, t.get("embeds"), extra["output_layers"])
