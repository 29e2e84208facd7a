"""The process group of a multi-rank stage, model-agnostic: rank 0 in the stage's worker, ranks 1.. as followers.

Rank 0 runs the engine; a follower only serves the model calls rank 0 announces. Each call is a small header over
a pipe (op, the tensors' names, shapes and dtypes, picklable extras), then its tensors are broadcast from rank 0
in name order; the follower's `serve` loop (engine-specific: AR tensor parallelism in engine/ar/parallel.py,
CFG-parallel diffusion in engine/diffusion/parallel.py) runs its part, and the ranks' collectives line up because
every rank makes the same calls in the same order. Backends: gloo on the CPU, NCCL on CUDA; each stage's group
is built from a TCP store of its own, so stages (and tests) in one process never share torch's default group.

A dead follower is noticed before each call (its process is gone) or by a collective failing or timing out
(`TIMEOUT_S`): the call raises `GroupLost`, which engines let through, so the stage's worker dies and is
restarted (deploy `max_restarts`) with a fresh group rather than hanging.
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

TIMEOUT_S = 300.0  # a collective (or a follower's start-up) taking longer than this is an error
Call = tuple[str, dict[str, torch.Tensor], dict[str, Any]]  # op, tensors by name, extras
# A follower's loop: (its model, its group, its pipe to rank 0); returns when rank 0 stops it or is gone.
Serve = Callable[[Any, "RankGroup", Any], None]


class GroupLost(RuntimeError):
    """A rank of the group is gone (or a collective failed): the group cannot run another step, so the engine lets
    this through and the stage's worker dies and is restarted with a fresh group."""


class RankGroup:
    """The collectives of one stage's process group (gloo on the CPU and NCCL both implement each of them)."""

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

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `t` (all of one shape) concatenated along `dim`, in rank order."""
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.world)]
        self.pg.allgather([parts], [t]).wait()
        return torch.cat(parts, dim=dim)

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        self.pg.broadcast(t, 0).wait()
        return t


class Followers:
    """Rank 0's handle on ranks 1..: their processes and pipes, to announce calls to and to stop. `what` names the
    kind of group in errors ("tensor-parallel", "cfg-parallel")."""

    def __init__(self, group: RankGroup, procs: list[tuple[mp.Process, Any]], store: dist.Store, what: str):
        self.group, self.procs, self.what = group, procs, what
        self._store = store  # the followers' store connections live as long as the group

    def send(self, op: str, tensors: dict[str, torch.Tensor], extra: dict[str, Any]) -> None:
        """Announce a call to every follower, then broadcast its tensors; raises GroupLost if a rank is gone."""
        specs = {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}
        for rank, (proc, conn) in enumerate(self.procs, start=1):
            try:
                if not proc.is_alive():
                    raise BrokenPipeError
                conn.send((op, specs, extra))
            except (BrokenPipeError, OSError):
                raise GroupLost(f"{self.what} rank {rank} exited (code {proc.exitcode})") from None
        self.collective(lambda: [self.group.broadcast(tensors[name].contiguous()) for name in sorted(tensors)])

    def collective(self, run: Callable[[], Any]) -> Any:
        """`run()`, a collective of the group, with its failure (a follower died or hung) as GroupLost."""
        try:
            return run()
        except RuntimeError as exc:
            raise GroupLost(f"{self.what} collective failed (a follower died or hung): {exc}") from None

    def wait_ready(self) -> None:
        for rank, (proc, conn) in enumerate(self.procs, start=1):
            expect(conn, proc, rank, "ready", self.what)

    def close(self) -> None:
        stop(self.procs, ("stop", {}, {}))
        self.procs = []

    def kill(self) -> None:
        for proc, _ in self.procs:
            proc.kill()


def start(build: Callable[[RankGroup], Any], serve: Serve, devices: list[torch.device], what: str) -> Followers:
    """Start ranks 1.. of a group over `devices` (one each) as spawned processes that build their model with
    `build(group)` (picklable) and then run `serve`, and join as rank 0. The caller builds rank 0's model and
    then calls `wait_ready()` (rank 0 loads while the followers do); on any failure it calls `kill()`."""
    world = len(devices)
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, timeout=timedelta(seconds=TIMEOUT_S),
                          wait_for_workers=False)
    ctx = mp.get_context("spawn")  # CUDA cannot be used in a forked child; the environment is inherited
    procs = []
    for rank in range(1, world):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_follower_main,
                           args=(build, serve, rank, world, store.port, str(devices[rank]), child, what),
                           name=f"omnistage-{what}-rank{rank}", daemon=True)
        proc.start()
        child.close()
        procs.append((proc, parent))
    try:
        for rank, (proc, conn) in enumerate(procs, start=1):
            expect(conn, proc, rank, "started", what)  # a follower that cannot start fails here, not in the rendezvous
        return Followers(RankGroup(0, world, store, devices[0]), procs, store, what)
    except BaseException:
        for proc, _ in procs:
            proc.kill()
        raise


def receive(group: RankGroup, conn: Any) -> Call | None:
    """A follower's next call from rank 0, its tensors received; None on `stop` or when rank 0 is gone."""
    try:
        op, specs, extra = conn.recv()
    except (EOFError, OSError):
        return None
    if op == "stop":
        return None
    tensors = {name: group.broadcast(torch.empty(shape, dtype=dtype, device=group.device))
               for name, (shape, dtype) in sorted(specs.items())}
    return op, tensors, extra


def stop(procs: list[tuple[mp.Process, Any]], message: Any) -> None:
    """Ask each rank process to leave its loop (`message` on its pipe) and exit; one that does not within a few
    seconds is killed."""
    for _, conn in procs:
        try:
            conn.send(message)
        except (BrokenPipeError, OSError):
            pass
    for proc, conn in procs:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join()
        conn.close()


def expect(conn: Any, proc: mp.Process, rank: int, status: str, what: str) -> Any:
    """Wait for a rank's `status` message and return its detail, failing early if its process ends first."""
    waited = 0.0
    while not conn.poll(0.5):
        waited += 0.5
        if not proc.is_alive():
            raise RuntimeError(f"{what} rank {rank} exited (code {proc.exitcode}) before it was {status}; "
                               "a script that starts one needs the `if __name__ == \"__main__\":` guard")
        if waited > TIMEOUT_S:
            raise RuntimeError(f"{what} rank {rank} was not {status} within {TIMEOUT_S:.0f}s")
    got, detail = conn.recv()
    if got != status:
        raise RuntimeError(f"{what} rank {rank} failed to load: {detail}")
    return detail


def _follower_main(build: Callable[[RankGroup], Any], serve: Serve, rank: int, world: int, port: int, device: str,
                   conn: Any, what: str) -> None:
    device_ = torch.device(device)
    if device_.type == "cuda":
        torch.cuda.set_device(device_)
    conn.send(("started", None))
    try:
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=TIMEOUT_S))
        group = RankGroup(rank, world, store, device_)
        model = build(group)
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", None))
    with torch.inference_mode():
        serve(model, group, conn)
