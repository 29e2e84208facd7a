"""From a model path and a deploy config to a running orchestrator with its stage workers.

Backends: `inline` (engine threads in this process), `process` (one spawned process per stage
replica, pinned to its devices), `ray` (one Ray actor per replica). Out-of-process replicas
exchange payloads with the orchestrator over links whose connector is chosen per edge: inputs
of a stage use the connector of the edge into it, outputs the connector of the edge out of it
(`connectors: {"src->dst": {type: shm}}`, `"*"` for every edge).
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from omnistage import envs
from omnistage.config.deploy import ConnectorConfig, did_you_mean
from omnistage.devices import on_device, resolve_device
from omnistage.errors import ConfigError, StageError
from omnistage.families.base import Pipeline
from omnistage.runtime import control
from omnistage.runtime.connector import curve_key
from omnistage.runtime.orchestrator import Orchestrator
from omnistage.runtime.process import ProcessStageWorker, RayActor, Subprocess, new_link
from omnistage.runtime.worker import ExitCallback, InlineStageWorker, OutputCallback, log_ready

DEFAULT_CONNECTOR = {"process": "shm", "ray": "tcp"}


# The loader's former name here, still imported by tests and benchmarks outside the runtime.


def start_orchestrator(pipeline: Pipeline, on_progress: Callable[[str], None] | None = None) -> Orchestrator:
    """`on_progress` hears "loading stage 'talker' (2 of 3)" as each stage replica starts loading (inline: one
    after the other; process and ray: all at once)."""
    backend = pipeline.deploy.worker_backend
    links = connector_choice(pipeline)
    check_devices(pipeline)
    names = [s.name for s in pipeline.stages]

    def report(stage: str) -> None:
        if on_progress is not None:
            on_progress(f"loading stage {stage!r} ({names.index(stage) + 1} of {len(names)})")

    if backend == "inline":
        def make_worker(stage: str, replica: int, on_outputs: OutputCallback, on_exit: ExitCallback):
            report(stage)
            # built with its device current: Triton kernels and graph captures at start-up run on the current
            # device, which for this loading thread is otherwise cuda:0 (a stage on cuda:1 would fail there)
            started = time.monotonic()
            with on_device(resolve_device(pipeline.stage_config(stage).devices)):
                engine = pipeline.build_engine(stage)
            log_ready(stage, engine, started)
            return InlineStageWorker(stage, replica, engine, on_outputs, on_exit,
                                     pipeline.stage_config(stage).stream_priority)

        return Orchestrator(pipeline, make_worker)

    deploy = pipeline.deploy.model_dump(mode="json", exclude_unset=True)
    key = curve_key()  # secures every TCP socket of this deployment (connector.py)
    group, shares, release = None, {}, None
    if backend == "ray":
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not ray.is_initialized():
            ray.init(address=envs.RAY_ADDRESS.get(), log_to_driver=False)
        bind_host = ray.util.get_node_ip_address()
        cluster_gpus = ray.cluster_resources().get("GPU", 0)
        bundles, shares = ray_gpu_shares(pipeline, has_gpus=cluster_gpus > 0)
        if bundles:
            group, release = _reserve_gpus(ray, bundles, shares, cluster_gpus, pipeline.deploy.startup_timeout_s)
    else:
        bind_host = None

    def make_worker(stage: str, replica: int, on_outputs: OutputCallback, on_exit: ExitCallback):
        report(stage)
        cfg = pipeline.stage_config(stage)
        inbox, outbox = (links[stage][d] for d in ("in", "out"))
        spec = control.WorkerSpec(
            model=str(pipeline.model_path), deploy=deploy, stage=stage, replica=replica, devices=None,
            command_address="", event_address="",  # the ProcessStageWorker picks them
            inbox=_worker_end(inbox, key), outbox=_worker_end(outbox, key), curve_key=key,
            inline_max_bytes=min(inbox.inline_max_bytes, outbox.inline_max_bytes),
            parent_pid=os.getpid() if backend == "process" else 0,
            sys_path=[p for p in sys.path if p], env=_plugin_env(),
        )
        if backend == "process":
            ids = _device_ids(cfg.devices)
            if ids:  # the child sees only its devices, renumbered from 0
                spec.env["CUDA_VISIBLE_DEVICES"] = ",".join(ids)
                spec.devices = ",".join(str(i) for i in range(len(ids)))
            else:
                spec.devices = cfg.devices
            launch = Subprocess
        elif (stage, replica) in shares:  # Ray makes its GPU (or its share of one) the actor's only one
            bundle, fraction = shares[(stage, replica)]
            spec.devices = "0"
            strategy = PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=bundle)
            launch = lambda s: RayActor(s, num_gpus=fraction, num_cpus=1, scheduling=strategy)
        else:
            spec.devices = "cpu"
            launch = lambda s: RayActor(s, num_gpus=0, num_cpus=1)
        return ProcessStageWorker(stage, replica, spec, launch, on_outputs, on_exit, bind_host)

    return Orchestrator(pipeline, make_worker, on_shutdown=release)


def check_devices(pipeline: Pipeline) -> None:
    """A stage placed on GPUs this machine lacks fails here, naming it, not deep inside model loading. (On Ray,
    device ids describe a layout, not this machine: ray_gpu_shares.)"""
    import torch

    if pipeline.deploy.worker_backend == "ray":
        return
    have = torch.cuda.device_count()
    for spec in pipeline.stages:
        devices = pipeline.stage_config(spec.name).devices
        ids = [int(d) for d in _device_ids(devices) if d.isdigit()]
        if ids and max(ids) >= have:
            machine = f"{have} CUDA GPU{'s' if have != 1 else ''}" if have else "no CUDA GPU"
            raise ConfigError(f"deploy config: stage {spec.name!r} is on devices {devices!r} but this machine has "
                              f"{machine}; use a deploy config for this machine (or --set 'stages.*.devices=cpu')")


GpuShares = dict[tuple[str, int], tuple[int, float]]


def ray_gpu_shares(pipeline: Pipeline, has_gpus: bool) -> tuple[list[tuple[str, int]], GpuShares]:
    """Where each stage replica runs on a Ray cluster. A deploy config's device ids describe one copy of the
    layout, not a node's GPUs: replica r of every stage whose devices start with the same id shares one GPU in
    equal fractions (the one-GPU configs put three stages on "0"), and replica r+1 gets GPUs of its own, so
    replicas spread over the cluster. A stage runs on the first GPU it lists (engines use one device).
    Returns the GPUs to reserve, as (device id, replica), and per (stage, replica) on a GPU: its index in that
    list and its fraction of the GPU (Ray counts fractions in steps of 1e-4). Stages on the CPU are absent;
    devices unset means GPU "0" where the cluster has GPUs, else the CPU."""
    users: dict[tuple[str, int], list[tuple[str, int]]] = {}
    for spec in pipeline.stages:
        cfg = pipeline.stage_config(spec.name)
        ids = _device_ids(cfg.devices) if cfg.devices is not None else (["0"] if has_gpus else [])
        for replica in range(cfg.replicas if ids else 0):
            users.setdefault((ids[0], replica), []).append((spec.name, replica))
    bundles = list(users)
    shares = {user: (index, math.floor(10_000 / len(users[gpu])) / 10_000)
              for index, gpu in enumerate(bundles) for user in users[gpu]}
    return bundles, shares


def _reserve_gpus(ray: Any, bundles: list[tuple[str, int]], shares: GpuShares, cluster_gpus: float,
                  timeout_s: float) -> tuple[Any, Callable[[], None]]:
    """One placement group with a bundle per GPU of the layout (packed onto as few nodes as hold it), so stages
    meant to share a GPU land on the same one; returns it and what gives it back. Fails at once, naming the
    layout, when the cluster has fewer GPUs than the layout, and after `timeout_s` when Ray cannot place it."""
    from ray.exceptions import GetTimeoutError
    from ray.util.placement_group import placement_group, remove_placement_group

    layout = "; ".join(f"GPU {i} (device {d!r}, replica {r}): " + ", ".join(
        stage for (stage, _), (b, _) in shares.items() if b == i) for i, (d, r) in enumerate(bundles))
    if len(bundles) > cluster_gpus:
        raise ConfigError(f"deploy config: on Ray, its stage replicas need {len(bundles)} GPU"
                          f"{'s' if len(bundles) > 1 else ''} ({layout}) but the cluster has {cluster_gpus:g}; "
                          "put stages that may share a GPU on the same device id, or use fewer replicas")
    actors = [sum(b == i for b, _ in shares.values()) for i in range(len(bundles))]
    group = placement_group([{"GPU": 1, "CPU": n} for n in actors], strategy="PACK")
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except GetTimeoutError:
        remove_placement_group(group)
        raise StageError(f"Ray could not reserve {len(bundles)} GPUs with {sum(actors)} CPUs beside them in "
                         f"{timeout_s:g} s ({layout})") from None
    return group, lambda: remove_placement_group(group)


def connector_choice(pipeline: Pipeline) -> dict[str, dict[str, ConnectorConfig]]:
    """Per stage, the connector of its inputs ("in") and of its outputs ("out"). The inline
    backend hands objects over directly, so it only checks the edge names."""
    deploy = pipeline.deploy
    edge_names = [f"{e.src}->{e.dst}" for e in pipeline.edges]
    for key in deploy.connectors:
        if key != "*" and key not in edge_names:
            raise ConfigError(f"deploy config: connectors.{key}: no such edge{did_you_mean(key, edge_names)} "
                              f"(this pipeline has: {', '.join(edge_names) or 'no edges'}; '*' means every edge)")
    if deploy.worker_backend == "inline":
        return {}
    default = deploy.connectors.get("*") or ConnectorConfig(type=DEFAULT_CONNECTOR[deploy.worker_backend])
    out: dict[str, dict[str, ConnectorConfig]] = {}
    for spec in pipeline.stages:
        out[spec.name] = {}
        for direction, edges in (("in", [e for e in pipeline.edges if e.dst == spec.name]),
                                 ("out", [e for e in pipeline.edges if e.src == spec.name])):
            chosen = {f"{e.src}->{e.dst}": deploy.connectors.get(f"{e.src}->{e.dst}", default) for e in edges}
            if len({c.type for c in chosen.values()}) > 1:
                raise ConfigError(f"deploy config: connectors {sorted(chosen)} all carry stage {spec.name!r}'s "
                                  f"{'inputs' if direction == 'in' else 'outputs'}; give them one type")
            cfg = next(iter(chosen.values()), default)
            if cfg.type == "inprocess":
                raise ConfigError(f"deploy config: connector 'inprocess' cannot link processes "
                                  f"(worker_backend {deploy.worker_backend!r}); use 'shm' (one host) or 'tcp'")
            out[spec.name][direction] = cfg
    return out


def _worker_end(cfg: ConnectorConfig, key: str) -> Any:
    return new_link(cfg.type, host="auto", key=key)  # tcp: the worker binds on its address toward us


def _device_ids(devices: str | None) -> list[str]:
    if devices is None or devices.strip() == "cpu":
        return []
    return [d.strip() for d in devices.split(",") if d.strip()]


def _plugin_env() -> dict[str, str]:
    value = envs.FAMILY_PLUGINS.get()
    return {envs.FAMILY_PLUGINS.name: value} if value else {}
