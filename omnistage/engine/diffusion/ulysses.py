"""Ulysses sequence parallelism (`options.ulysses_degree: N`): every DiT forward of a stage runs on N ranks, each
on its slice of the sequence, the attention heads re-sharded by all-to-all (diffusers' context parallelism,
`ContextParallelConfig(ulysses_degree=N)` over the DiT's declared `_cp_plan`; nothing of it is re-implemented here).

What runs where: the stage's process keeps the engine, text encoders and VAE; its own DiTs are moved to the meta
device (no weights; kept so the model's structure reads as usual). The N ranks are all spawned processes, one per
device, each holding the DiT(s) and joining torch's default process group (diffusers' hooks need it), which is
safe because no other stage lives in them. `UlyssesModel.velocity` sends each call (latents, timesteps,
conditioning, the batch key) to every rank over its pipe (tensors travel as torch.multiprocessing shared tensors:
shared memory on the CPU, CUDA IPC on a GPU; the header is the pickled call itself), every rank runs the whole
batch on its sequence slice, and rank 0's output (gathered by diffusers' output hook) comes back.

Failures: a rank whose process is gone, or a call whose ranks disagree (some failed, some not: their collectives
no longer line up), raises `GroupLost`, so the stage restarts with fresh ranks; a call that fails on every rank
fails its batch only, as on one process.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing as mp
import time
from collections.abc import Callable, Hashable, Iterator
from datetime import timedelta
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist

from omnistage.engine.diffusion.accelerate import Accelerator
from omnistage.engine.diffusion.parallel import RankedModel
from omnistage.engine.diffusion.params import DiffusionOptions
from omnistage.engine.parallel import TIMEOUT_S, GroupLost, expect, stop
from omnistage.errors import ConfigError

logger = logging.getLogger(__name__)
WHAT = "ulysses"
DIT_FOLDERS = ("transformer", "transformer_2")  # diffusers' folders of a checkpoint's DiTs (two-expert: both)
_GRACE_S = 10.0  # once one rank failed a call, how long the others have to report that they failed too
_REFUSED = {
    "cfg_parallel": "both split the same forward over processes of their own; use one of them",
    "compile": "torch.compile of the DiT through diffusers' context-parallel hooks is not supported here",
    "cache": "a step cache decides per step from one process's block outputs, each rank would decide alone",
    "cpu_offload": "offloading streams one process's weights; each rank holds its DiT on its own device",
    "lora_root": "adapters are loaded by the stage's process, whose DiT holds no weights under ulysses_degree",
    "quantization": "fp8 DiTs through diffusers' context-parallel hooks are not supported here",
}


def check(options: DiffusionOptions, stage: str, model_path: Path) -> int:
    """The degree, after a ConfigError naming the option for what cannot run: a combined option, a DiT class
    without diffusers' `_cp_plan`, or a degree that does not divide the DiT's attention heads."""
    import diffusers

    degree = options.ulysses_degree
    name = f"stages.{stage}.options.ulysses_degree"
    for option, why in _REFUSED.items():
        if getattr(options, option) not in (None, False):
            raise ConfigError(f"{name} cannot be combined with options.{option}: {why}")
    for folder in DIT_FOLDERS:
        config_file = model_path / folder / "config.json"
        if not config_file.exists():
            continue
        config = json.loads(config_file.read_text())
        cls = getattr(diffusers, config.get("_class_name", ""), None)
        if getattr(cls, "_cp_plan", None) is None:
            raise ConfigError(f"{name}: not available for this model: its DiT ({config.get('_class_name')}) has no "
                              "context-parallel plan in diffusers")
        heads = config.get("num_attention_heads")
        if not isinstance(heads, int) or heads % degree:
            raise ConfigError(f"{name}: {degree} does not divide the DiT's {heads} attention heads")
    return degree


class UlyssesModel(RankedModel):
    """The stage's model with its `velocity` run by the ranks (`_Ranks`)."""

    def velocity(self, latents: torch.Tensor, timesteps: torch.Tensor, cond: dict[str, torch.Tensor],
                 key: Hashable) -> torch.Tensor:
        return self.ranks.call({"latents": latents, "timesteps": timesteps, "cond": cond}, key)


class _Ranks:
    """The stage's handle on its N rank processes: their pipes, the store they rendezvous on."""

    def __init__(self, procs: list[tuple[mp.Process, Any]], store: dist.Store):
        self.procs = procs
        self.degrees: list[dict[str, int]] = []  # per rank, each DiT's Ulysses degree as diffusers applied it
        self._store = store  # the ranks' store connections live as long as the group

    def call(self, tensors: dict[str, Any], key: Hashable) -> torch.Tensor:
        for rank, (proc, _) in enumerate(self.procs):  # before any rank starts a forward a peer cannot join
            if not proc.is_alive():
                raise GroupLost(f"{WHAT} rank {rank} exited (code {proc.exitcode})")
        for rank, (proc, conn) in enumerate(self.procs):
            try:
                conn.send(("velocity", tensors, key))
            except (BrokenPipeError, OSError):
                raise GroupLost(f"{WHAT} rank {rank} exited (code {proc.exitcode})") from None
        replies: dict[int, Any] = {}
        errors: dict[int, str] = {}
        pending, deadline = dict(enumerate(self.procs)), time.monotonic() + TIMEOUT_S
        while pending:
            ready = wait([c for _, c in pending.values()] + [p.sentinel for p, _ in pending.values()], timeout=1.0)
            for rank, (proc, conn) in list(pending.items()):
                if conn in ready:
                    try:
                        status, value = conn.recv()
                    except (EOFError, OSError):
                        raise GroupLost(f"{WHAT} rank {rank} exited (code {proc.exitcode})") from None
                    (replies if status == "ok" else errors)[rank] = value
                    del pending[rank]
                elif proc.sentinel in ready:
                    raise GroupLost(f"{WHAT} rank {rank} exited (code {proc.exitcode})")
            if errors and deadline > time.monotonic() + _GRACE_S:  # the first failure: the others have a grace
                deadline = time.monotonic() + _GRACE_S
            if pending and time.monotonic() > deadline:
                self.kill()
                raise GroupLost(f"{WHAT}: ranks {sorted(pending)} did not answer a DiT forward "
                                f"(errors: {errors or 'none'})")
        if errors and replies:  # some ranks left the call's collectives early: the group is out of step
            self.kill()
            raise GroupLost(f"{WHAT}: the DiT forward failed on ranks {sorted(errors)} only: {errors}")
        if errors:
            raise RuntimeError(f"{WHAT} DiT forward failed: {errors[0]}")
        return replies[0].clone()  # rank 0's gathered output, out of its shared buffer

    def wait(self, status: str) -> list[Any]:
        """Each rank's detail of its `status` message, in rank order."""
        return [expect(conn, proc, rank, status, WHAT) for rank, (proc, conn) in enumerate(self.procs)]

    def close(self) -> None:
        stop(self.procs, ("stop", None, None))
        self.procs = []

    def kill(self) -> None:
        for proc, _ in self.procs:
            proc.kill()


def launch(load_rank: Callable[[torch.device], Any], load_local: Callable[[torch.device], Any],
           devices: list[torch.device], options: DiffusionOptions, stage: str) -> UlyssesModel:
    """Start one rank per device, each loading its model with `load_rank(device)` (picklable; only its DiTs are
    used), load the stage's own model with `load_local(devices[0])` meanwhile, drop its DiTs' weights, and join
    them as one model."""
    world = len(devices)
    store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, timeout=timedelta(seconds=TIMEOUT_S),
                          wait_for_workers=False)
    ctx = mp.get_context("spawn")  # CUDA cannot be used in a forked child; the environment is inherited
    procs = []
    try:
        for rank, device in enumerate(devices):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_rank_main, args=(load_rank, options, stage, rank, world, store.port,
                                                        str(device), child),
                               name=f"omnistage-{WHAT}-rank{rank}", daemon=True)
            proc.start()
            child.close()
            procs.append((proc, parent))
        ranks = _Ranks(procs, store)
        ranks.wait("started")  # a rank that cannot start fails here, not in the rendezvous
        local = load_local(devices[0])
        for folder in DIT_FOLDERS:  # the ranks run the DiTs: no weights here
            if isinstance(getattr(local, folder, None), torch.nn.Module):
                getattr(local, folder).to("meta")
        ranks.degrees = ranks.wait("ready")
    except BaseException:
        for proc, _ in procs:
            proc.kill()
        raise
    return UlyssesModel(local, ranks)


@contextlib.contextmanager
def _cpu_device_count(device: torch.device) -> Iterator[None]:
    """diffusers' `_resolve_parallel_config` records a device it computes as `rank % accelerator device_count`,
    which divides by zero on a CPU-only host; it only records it (our mesh is passed in), so there it reads 1."""
    if device.type == "cpu" and torch.accelerator.device_count() == 0:
        with mock.patch.object(torch.accelerator, "device_count", return_value=1):
            yield
    else:
        yield


def _rank_main(load: Callable[[torch.device], Any], options: DiffusionOptions, stage: str, rank: int, world: int,
               port: int, device_name: str, conn: Any) -> None:
    from diffusers import ContextParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    conn.send(("started", None))
    try:
        store = dist.TCPStore("127.0.0.1", port, world + 1, is_master=False, timeout=timedelta(seconds=TIMEOUT_S))
        # A gloo backend for CPU tensors on a GPU too: diffusers gathers the ranks' sequence lengths on the device
        # type its group's backend string names for the CPU ("cpu:..."), else on the accelerator.
        dist.init_process_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "cpu:gloo", store=store, rank=rank,
                                world_size=world, timeout=timedelta(seconds=TIMEOUT_S))
        model = load(device)
        model.device = device
        Accelerator(model, options, stage)  # what the engine applies to a DiT (the attention backend)
        mesh = init_device_mesh(device.type, (1, world), mesh_dim_names=("ring", "ulysses"))
        degrees = {}
        for folder in DIT_FOLDERS:
            dit = getattr(model, folder, None)
            if dit is not None:
                # ulysses_anything: sequence lengths (text, frames) need not divide by N; heads do (checked).
                config = ContextParallelConfig(ulysses_degree=world, ulysses_anything=True, mesh=mesh)
                with _cpu_device_count(device):
                    dit.enable_parallelism(config=config)
                degrees[folder] = dit._parallel_config.context_parallel_config.ulysses_degree
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", degrees))
    with torch.inference_mode():
        _serve(model, rank, device, conn)
    dist.destroy_process_group()


def _serve(model: Any, rank: int, device: torch.device, conn: Any) -> None:
    """A rank's loop: run each velocity call on the whole batch; rank 0 sends back the output."""
    while True:
        try:
            op, t, key = conn.recv()
        except (EOFError, OSError):
            return
        if op == "stop":
            return
        try:
            cond = {name: v.to(device) for name, v in t["cond"].items()}
            out = model.velocity(t["latents"].to(device), t["timesteps"].to(device), cond, key)
            conn.send(("ok", out if rank == 0 else None))
        except Exception as exc:
            logger.error("%s rank %d: velocity failed: %s", WHAT, rank, exc, exc_info=exc)
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
