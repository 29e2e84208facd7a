"""From a model path and a deploy config to a running orchestrator with its stage workers.

Backends: `inline` (engine threads in this process), `process` (one spawned process per stage
replica, pinned to its devices), `ray` (one Ray actor per replica). Out-of-process replicas
exchange payloads with the orchestrator over links whose connector is chosen per edge: inputs
of a stage use the connector of the edge into it, outputs the connector of the edge out of it
(`connectors: {"src->dst": {type: shm}}`, `"*"` for every edge).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from omnistage.config.deploy import ConnectorConfig, DeployConfig, did_you_mean, load_deploy_config
from omnistage.devices import on_device, resolve_device
from omnistage.errors import ConfigError
from omnistage.families.base import Pipeline
from omnistage.families.registry import PLUGINS_ENV, detect_family
from omnistage.runtime import control
from omnistage.runtime.connector import curve_key
from omnistage.runtime.orchestrator import Orchestrator
from omnistage.runtime.process import ProcessStageWorker, RayActor, Subprocess, new_link
from omnistage.runtime.worker import ExitCallback, InlineStageWorker, OutputCallback

DEFAULT_CONNECTOR = {"process": "shm", "ray": "tcp"}


def build_pipeline(
    model: str | Path,
    deploy_config: str | Path | dict[str, Any] | DeployConfig | None = None,
    overrides: dict[str, Any] | None = None,
) -> Pipeline:
    family, info = detect_family(model)
    deploy = load_deploy_config(deploy_config, overrides, base=family.default_deploy(info))
    return family.pipeline(info, deploy)


def start_orchestrator(pipeline: Pipeline) -> Orchestrator:
    backend = pipeline.deploy.worker_backend
    links = connector_choice(pipeline)
    if backend == "inline":
        def make_worker(stage: str, replica: int, on_outputs: OutputCallback, on_exit: ExitCallback):
            # built with its device current: Triton kernels and graph captures at start-up run on the current
            # device, which for this loading thread is otherwise cuda:0 (a stage on cuda:1 would fail there)
            with on_device(resolve_device(pipeline.stage_config(stage).devices)):
                engine = pipeline.build_engine(stage)
            return InlineStageWorker(stage, replica, engine, on_outputs, on_exit,
                                     pipeline.stage_config(stage).stream_priority)

        return Orchestrator(pipeline, make_worker)

    deploy = pipeline.deploy.model_dump(mode="json", exclude_unset=True)
    key = curve_key()  # secures every TCP socket of this deployment (connector.py)
    if backend == "ray":
        import ray

        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=False)
        bind_host = ray.util.get_node_ip_address()
        has_gpus = ray.cluster_resources().get("GPU", 0) > 0
    else:
        bind_host, has_gpus = None, False

    def make_worker(stage: str, replica: int, on_outputs: OutputCallback, on_exit: ExitCallback):
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
        ids = _device_ids(cfg.devices)
        if backend == "process":
            if ids:  # the child sees only its devices, renumbered from 0
                spec.env["CUDA_VISIBLE_DEVICES"] = ",".join(ids)
                spec.devices = ",".join(str(i) for i in range(len(ids)))
            else:
                spec.devices = cfg.devices
            launch = Subprocess
        else:
            gpus = len(ids) if ids else (0 if cfg.devices == "cpu" or not has_gpus else 1)
            spec.devices = ",".join(str(i) for i in range(gpus)) if gpus else "cpu"
            launch = lambda s: RayActor(s, num_gpus=gpus, num_cpus=1)
        return ProcessStageWorker(stage, replica, spec, launch, on_outputs, on_exit, bind_host)

    return Orchestrator(pipeline, make_worker)


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
    value = os.environ.get(PLUGINS_ENV)
    return {PLUGINS_ENV: value} if value else {}
