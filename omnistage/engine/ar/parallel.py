"""Tensor parallelism for an AR stage: one process group per stage, rank 0 in the stage's worker.

Rank 0 keeps everything the engine does (scheduling, sampling, detokenizing) and sees the group as one
`ARModel` (`TPModel`). Each model call (embed, forward, logits) is sent to the followers as a small header over
a pipe, then its tensors (ids, positions, the attention metadata) are broadcast, and every rank runs its shard of
the same call: the shards' collectives (tp_layers.py) line up because every rank makes the same calls in the same
order. Followers never schedule; each holds its own paged KV cache with the same block layout as rank 0's, sized
by the header. Backends: gloo on the CPU, NCCL on CUDA; a separate group is built from a TCP store per stage, so
stages (and tests) in one process do not share torch's default group.

A dead follower is noticed before each call (its process is gone) or by the collective failing or timing out
(`TIMEOUT_S`): the call raises `GroupLost`, the step's requests fail, and the stage's worker dies and is
restarted (deploy `max_restarts`) with a fresh group rather than hanging.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from omnistage.engine.ar.attention import AttentionMetadata, PagedKVCache

logger = logging.getLogger(__name__)
TIMEOUT_S = 300.0  # a collective (or a follower's start-up) taking longer than this is an error
_META_FIELDS = ("slot_mapping", "block_tables", "seq_lens", "cu_seqlens_q", "query_pos", "query_seq",
                "context_slots", "context_pos", "context_seq")


class GroupLost(RuntimeError):
    """A rank of the group is gone (or a collective failed): the group cannot run another step, so the engine lets
    this through and the stage's worker dies and is restarted with a fresh group."""


class TPGroup:
    """The collectives the sharded layers need, on one stage's process group."""

    def __init__(self, rank: int, world: int, store: dist.Store, device: torch.device):
        self.rank, self.world, self.device = rank, world, device
        timeout = timedelta(seconds=TIMEOUT_S)
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(store, rank, world, options)
        else:
            self.pg = dist.ProcessGroupGloo(store, rank, world, timeout)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        self.pg.allreduce([t]).wait()
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's `t` concatenated along the last dim, in rank order."""
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.world)]
        self.pg.allgather([parts], [t]).wait()
        return torch.cat(parts, dim=-1)

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        self.pg.broadcast(t, 0).wait()
        return t


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

    def __init__(self, local: Any, group: TPGroup, followers: list[tuple[mp.Process, Any]]):
        self.local, self.group, self.followers = local, group, followers
        self.kv_spec = local.kv_spec  # this rank's share of the KV heads; every rank's is the same size
        self.device, self.vocab_size, self.weight_bytes = local.device, local.vocab_size, local.weight_bytes

    def _send(self, op: str, tensors: dict[str, torch.Tensor], extra: dict[str, Any]) -> None:
        specs = {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}
        for rank, (proc, conn) in enumerate(self.followers, start=1):
            try:
                if not proc.is_alive():
                    raise BrokenPipeError
                conn.send((op, specs, extra))
            except (BrokenPipeError, OSError):
                raise GroupLost(f"tensor-parallel rank {rank} exited (code {proc.exitcode})") from None
        try:
            for name in sorted(tensors):
                self.group.broadcast(tensors[name].contiguous())
        except RuntimeError as exc:
            raise GroupLost(f"tensor-parallel broadcast failed (a follower died or hung): {exc}") from None

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        self._send("embed", {"ids": token_ids}, {})
        return self.local.embed(token_ids)

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                embeds: torch.Tensor | None = None, output_layers: tuple[int, ...] = ()
                ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        cache = attn.kv_cache
        self._send("forward", _forward_tensors(token_ids, positions, embeds, attn), {
            "num_blocks": cache.num_blocks, "block_size": cache.block_size, "max_query_len": attn.max_query_len,
            "output_layers": tuple(output_layers)})
        return self.local.forward(token_ids, positions, attn, embeds, output_layers)

    def rotary_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.local.rotary_tables(positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self._send("logits", {"hidden": hidden}, {})
        return self.local.compute_logits(hidden)

    def close(self) -> None:
        """Stop the followers (each leaves its loop and exits); one that does not within a few seconds is killed."""
        for _, conn in self.followers:
            try:
                conn.send(("stop", {}, {}))
            except (BrokenPipeError, OSError):
                pass
        for proc, conn in self.followers:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()
            conn.close()
        self.followers = []


def launch(build: Callable[[TPGroup], Any], devices: list[torch.device]) -> TPModel:
    """Start ranks 1.. of a group over `devices` (one each) as spawned processes, join as rank 0, and build every
    rank's shard with `build(group)` (a picklable callable: the followers call it too). Raises if a follower
    fails to load or does not report within `TIMEOUT_S`."""
    world = len(devices)
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, timeout=timedelta(seconds=TIMEOUT_S),
                          wait_for_workers=False)
    ctx = mp.get_context("spawn")  # CUDA cannot be used in a forked child; the environment is inherited
    followers = []
    for rank in range(1, world):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_follower_main, args=(build, rank, world, store.port, str(devices[rank]), child),
                           name=f"omnistage-tp-rank{rank}", daemon=True)
        proc.start()
        child.close()
        followers.append((proc, parent))
    try:
        for rank, (proc, conn) in enumerate(followers, start=1):
            _expect(conn, proc, rank, "started")  # a follower that cannot start fails here, not in the rendezvous
        group = TPGroup(0, world, store, devices[0])
        model = TPModel(build(group), group, followers)
        for rank, (proc, conn) in enumerate(followers, start=1):
            _expect(conn, proc, rank, "ready")
    except BaseException:
        for proc, _ in followers:
            proc.kill()
        raise
    model._store = store  # the followers' store connections live as long as the group
    return model


def _expect(conn: Any, proc: mp.Process, rank: int, status: str) -> None:
    """Wait for a follower's `status` message, failing early if its process ends first."""
    waited = 0.0
    while not conn.poll(0.5):
        waited += 0.5
        if not proc.is_alive():
            raise RuntimeError(f"tensor-parallel rank {rank} exited (code {proc.exitcode}) before it was {status}; "
                               "a script that starts one needs the `if __name__ == \"__main__\":` guard")
        if waited > TIMEOUT_S:
            raise RuntimeError(f"tensor-parallel rank {rank} was not {status} within {TIMEOUT_S:.0f}s")
    got, detail = conn.recv()
    if got != status:
        raise RuntimeError(f"tensor-parallel rank {rank} failed to load: {detail}")


def _follower_main(build: Callable[[TPGroup], Any], rank: int, world: int, port: int, device: str, conn: Any) -> None:
    device_ = torch.device(device)
    if device_.type == "cuda":
        torch.cuda.set_device(device_)
    conn.send(("started", None))
    try:
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=TIMEOUT_S))
        group = TPGroup(rank, world, store, device_)
        model = build(group)
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", None))
    with torch.inference_mode():
        serve(model, group, conn)


def serve(model: Any, group: TPGroup, conn: Any) -> None:
    """A follower's loop: run each call rank 0 announces on this rank's shard, until `stop` or rank 0 is gone."""
    cache: PagedKVCache | None = None
    while True:
        try:
            op, specs, extra = conn.recv()
        except (EOFError, OSError):
            return
        if op == "stop":
            return
        t = {name: group.broadcast(torch.empty(shape, dtype=dtype, device=group.device))
             for name, (shape, dtype) in sorted(specs.items())}
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
