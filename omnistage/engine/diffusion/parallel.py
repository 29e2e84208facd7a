"""CFG-parallel diffusion (`options.cfg_parallel`): two ranks share every DiT forward of a stage.

Rank 0 is the stage's process: its engine, text encoders and VAE run there, and it sees the group as one
`DiffusionModel` (`CFGParallelModel`, rank 0's own model with `velocity` split over the ranks). Rank 1, a
follower process (engine/parallel.py), holds the same DiT and serves velocity calls only.

Invariant: the rows of a `velocity` call are independent (a row's output depends on its own latents, timestep
and conditioning rows alone; the engine's batching relies on it too). So any batch splits: rank 0 runs rows
[0, k), rank 1 rows [k, n), k = ceil(n / 2), and rank 0 gathers the halves. When every request of the batch is
guided this is exactly the positive rows on rank 0 and the negative rows on rank 1 (the engine puts all negative
rows after all positive ones); a batch of one row runs on rank 0 alone. Rank 1's rows (latents, timesteps, every
conditioning tensor, row-sliced) go to it by broadcast, their shapes in the header.

Both ranks join every call's collectives even when their forward raised (a status all-reduce, then the gather),
so a failed forward fails its batch, as on one process; a dead rank raises `GroupLost` and the stage restarts.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Hashable
from typing import Any

import torch

from omnistage.engine.diffusion.accelerate import Accelerator
from omnistage.engine.diffusion.params import DiffusionOptions
from omnistage.engine.parallel import RankGroup, receive, start
from omnistage.errors import ConfigError

logger = logging.getLogger(__name__)
WHAT = "cfg-parallel"
_REFUSED = {  # options that act on rank 0's DiT alone, so rank 1's rows would not get them
    "compile": "rank 1's DiT would run uncompiled",
    "cache": "a step cache follows one DiT through every row of the steps",
    "cpu_offload": "offloading streams one process's weights",
    "lora_root": "adapters are loaded into rank 0's DiT only",
}


class RankedModel:
    """The stage's model with its `velocity` run by a group of ranks (`ranks`, closed with the model); every other
    attribute is the stage's own model's."""

    def __init__(self, local: Any, ranks: Any):
        self.local, self.ranks = local, ranks

    def __getattr__(self, name: str) -> Any:
        if name in ("local", "ranks"):  # not set yet (e.g. while unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.local, name)

    def close(self) -> None:
        self.ranks.close()


class CFGParallelModel(RankedModel):
    """Rank 0's model with its `velocity` split over the two ranks (`ranks`: the Followers of engine/parallel.py)."""

    def velocity(self, latents: torch.Tensor, timesteps: torch.Tensor, cond: dict[str, torch.Tensor],
                 key: Hashable) -> torch.Tensor:
        n = len(latents)
        if n < 2:
            return self.local.velocity(latents, timesteps, cond, key)
        k = (n + 1) // 2
        if any(len(t) != n for t in cond.values()):
            raise ValueError("cfg_parallel needs one conditioning row per latent row")
        share = {"latents": latents[k:], "timesteps": timesteps[k:]} | {f"cond.{c}": t[k:] for c, t in cond.items()}
        self.ranks.send("velocity", share, {"key": key, "rows": k})
        out, error = _run(self.local, latents[:k], timesteps[:k], {c: t[:k] for c, t in cond.items()}, key)
        group = self.ranks.group
        failed = self.ranks.collective(lambda: group.all_reduce(_status(error, group)))
        if error is not None:
            raise error
        if failed.item():
            raise RuntimeError(f"{WHAT} rank 1's forward failed (its log has the error)")
        both = self.ranks.collective(lambda: group.all_gather(out, dim=0))
        return both[:n]  # rank 1's share is padded to k rows


def _run(model: Any, latents: torch.Tensor, timesteps: torch.Tensor, cond: dict[str, torch.Tensor],
         key: Hashable) -> tuple[torch.Tensor | None, Exception | None]:
    try:
        return model.velocity(latents, timesteps, cond, key), None
    except Exception as exc:  # reported to the other rank before it is raised
        return None, exc


def _status(error: Exception | None, group: RankGroup) -> torch.Tensor:
    return torch.tensor([int(error is not None)], dtype=torch.int32, device=group.device)


def serve(model: Any, group: RankGroup, conn: Any) -> None:
    """Rank 1's loop: run its rows of each velocity call and hand them back, until `stop` or rank 0 is gone."""
    while (call := receive(group, conn)) is not None:
        _, t, extra = call
        cond = {name.removeprefix("cond."): v for name, v in t.items() if name.startswith("cond.")}
        out, error = _run(model, t["latents"], t["timesteps"], cond, extra["key"])
        if error is not None:
            logger.error("%s rank 1: velocity failed: %s", WHAT, error, exc_info=error)
        if group.all_reduce(_status(error, group)).item():
            continue
        pad = extra["rows"] - len(out)
        group.all_gather(torch.cat([out, out.new_zeros(pad, *out.shape[1:])]) if pad else out, dim=0)


def _follower(load: Callable[[torch.device], Any], options: DiffusionOptions, stage: str, group: RankGroup) -> Any:
    model = load(group.device)
    model.device = group.device
    Accelerator(model, options, stage)  # what rank 0's engine applies to its DiT (attention backend, fp8)
    return model


def rank_devices(devices: str | None, world: int, option: str) -> list[torch.device]:
    """One device per rank from a stage's `devices` (`world` GPU ids, or "cpu": every rank on the CPU); `option`
    (e.g. "stages.dit.options.cfg_parallel") names what asks for them in the errors."""
    listed = [d.strip() for d in (devices or "").split(",") if d.strip()]
    if listed == ["cpu"]:
        return [torch.device("cpu")] * world
    if len(listed) != world or "cpu" in listed:
        raise ConfigError(f"{option} needs exactly {world} devices, one per rank; devices is {devices!r}: set it "
                          f"to {world} GPU ids, e.g. {','.join(map(str, range(world)))!r}, or to \"cpu\"")
    if max(int(d) for d in listed) >= torch.cuda.device_count():
        raise ConfigError(f"{option}: devices {devices!r} names a GPU this host does not have "
                          f"({torch.cuda.device_count()} GPUs)")
    return [torch.device(f"cuda:{d}") for d in listed]


def check(options: DiffusionOptions, stage: str) -> None:
    """A ConfigError naming the option that cannot go with cfg_parallel."""
    for name, why in _REFUSED.items():
        if getattr(options, name) not in (None, False):
            raise ConfigError(f"stages.{stage}.options.cfg_parallel cannot be combined with options.{name}: {why}")


def launch(load_follower: Callable[[torch.device], Any], load_local: Callable[[torch.device], Any],
           devices: list[torch.device], options: DiffusionOptions, stage: str) -> CFGParallelModel:
    """Start rank 1 on `devices[1]`, which loads its model with `load_follower(device)` (picklable; only its DiT
    is used), load rank 0's with `load_local(devices[0])` meanwhile, and join them as one model."""
    check(options, stage)
    ranks = start(functools.partial(_follower, load_follower, options, stage), serve, devices, WHAT)
    try:
        local = load_local(devices[0])
        ranks.wait_ready()
    except BaseException:
        ranks.kill()
        raise
    return CFGParallelModel(local, ranks)
