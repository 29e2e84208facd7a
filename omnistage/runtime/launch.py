"""From a model path and a deploy config to a running orchestrator with its stage workers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omnistage.config.deploy import DeployConfig, load_deploy_config
from omnistage.errors import ConfigError
from omnistage.families.base import Pipeline
from omnistage.families.registry import detect_family
from omnistage.runtime.orchestrator import Orchestrator
from omnistage.runtime.worker import InlineStageWorker, OutputCallback


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
    if backend != "inline":
        raise ConfigError(f"worker_backend {backend!r} is not available yet; use 'inline'")

    def make_worker(stage: str, replica: int, on_outputs: OutputCallback) -> InlineStageWorker:
        return InlineStageWorker(stage, replica, pipeline.build_engine(stage), on_outputs)

    return Orchestrator(pipeline, make_worker)
