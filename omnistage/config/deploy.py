"""Deploy config: what a user edits to place, size and tune the stages of a pipeline.

Topology lives in the family's code; this file only says how to run it. Every field is validated
at start-up, and an unknown or ill-typed field fails with its path and the closest valid name.
"""

from __future__ import annotations

import copy
import difflib
from dataclasses import fields as dataclass_fields
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from omnistage.errors import ConfigError
from omnistage.sampling_params import SamplingParams


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class StageConfig(_Strict):
    """Placement, sizing and defaults of one stage."""

    devices: str | None = Field(None, description='Device ids, e.g. "0" or "1,2"; None: cuda:0 if present else cpu')
    replicas: int = Field(1, ge=1)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=16)
    max_model_len: int | None = Field(None, ge=16)
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
    kv_cache_memory_gb: float | None = Field(None, gt=0.0, description="Explicit KV cache budget")
    num_kv_blocks: int | None = Field(None, ge=1, description="Exact number of KV blocks (overrides budgets)")
    block_size: int = Field(16, ge=1)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    overlap_decode: bool = Field(True, description="Keep a greedy decode step in flight while the host reads the last")
    overlap_sampled: bool = Field(
        False, description="Also keep sampled (or penalised) decode steps in flight, drawing tokens on the device "
        "(the same tokens). On for the Qwen2.5-Omni talker (its RTF for one request on an H200: 0.161 vs 0.184)")
    decode_burst: int = Field(
        1, ge=1, le=64, description="Decode steps per launch when every running sequence can take them (tokens "
        "drawn on the device, one CUDA graph replay per burst; needs overlap_decode, and overlap_sampled for "
        "sampled requests). Frees the host (and the interpreter other stages' threads share) from per-token work: "
        "on for the Qwen2.5-Omni talker (32 requests on an H200: first audio 1.33 -> 0.73 s, RTF 0.486 -> 0.470)")
    prompt_graph_tokens: int = Field(
        512, ge=0, description="On CUDA, a step that prefills one sequence's prompt (or a chunk of it) of up to this "
        "many tokens replays a CUDA graph captured for the next token bucket (16, 32, 64, 96, ...) instead of "
        "launching its kernels one by one (~17 ms of host work for ~5 ms of GPU work for a 156-token prompt to a 7B "
        "model on an H200; replayed, 7 ms). 0: prompts always run eagerly (less start-up time and graph memory)")
    enforce_eager: bool = False
    stream_priority: Literal["high", "normal"] | None = Field(
        None, description="inline stages on a GPU: their CUDA stream's priority, which the GPU's block scheduler "
        "favours when stages share it; None: high for autoregressive stages (short steps a request waits on), "
        "normal for the rest")
    default_sampling_params: dict[str, Any] = Field(default_factory=dict)
    options: dict[str, Any] = Field(default_factory=dict, description="Stage-specific knobs its family documents")

    @field_validator("default_sampling_params")
    @classmethod
    def _known_sampling_fields(cls, value: dict[str, Any]) -> dict[str, Any]:
        valid = [f.name for f in dataclass_fields(SamplingParams)]
        for key in value:
            if key not in valid:
                raise ValueError(f"unknown sampling param {key!r}{did_you_mean(key, valid)}")
        SamplingParams(**value)  # range checks
        return value

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(**self.default_sampling_params)


class ConnectorConfig(_Strict):
    """How payloads cross one edge between stage workers in different processes."""

    type: Literal["inprocess", "shm", "tcp"] = Field(
        "shm", description="inprocess: inline backend only; shm: processes on one host; tcp: across hosts"
    )
    inline_max_bytes: int = Field(
        64 * 1024, ge=0, description="Payloads with at most this many tensor bytes ride on the control channel"
    )
    options: dict[str, Any] = Field(default_factory=dict)


def _default_backend() -> str:
    import torch

    return "process" if torch.cuda.is_available() else "inline"


class LimitsConfig(_Strict):
    """Request size limits the server enforces before any work is done."""

    max_request_bytes: int = Field(32 * 2**20, ge=1024)
    max_media_bytes: int = Field(20 * 2**20, ge=1024)


class DeployConfig(_Strict):
    # inline: engines in threads of the server process; process: one process per stage replica
    # (the default with GPUs); ray: one Ray actor per stage replica.
    worker_backend: Literal["inline", "process", "ray"] = Field(default_factory=_default_backend)
    async_chunk: bool = False
    startup_timeout_s: float = Field(600.0, gt=0, description="How long a stage replica may take to load")
    max_restarts: int = Field(3, ge=0, description="Automatic restarts per replica after it dies; 0: never")
    # Per-stage settings by stage name. The key "*" holds defaults applied to every stage.
    stages: dict[str, StageConfig] = Field(default_factory=dict)
    # Per-edge connectors, keyed "src->dst".
    connectors: dict[str, ConnectorConfig] = Field(default_factory=dict)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)

    def stage(self, name: str) -> StageConfig:
        """Settings for one stage: "*" defaults overlaid with the stage's own explicit fields."""
        merged: dict[str, Any] = {}
        for key in ("*", name):
            if key in self.stages:
                merged.update(self.stages[key].model_dump(exclude_unset=True))
        return StageConfig(**merged)

    def check_stage_names(self, valid: list[str]) -> None:
        for name in self.stages:
            if name != "*" and name not in valid:
                raise ConfigError(
                    f"deploy config: stages.{name}: no such stage{did_you_mean(name, valid)} "
                    f"(this pipeline has: {', '.join(valid)})"
                )


def did_you_mean(name: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.5)
    return f"; did you mean {close[0]!r}?" if close else ""


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The pydantic model class that owns the field at `loc` (for 'did you mean' hints)."""
    model: type[BaseModel] | None = DeployConfig
    for part in loc[:-1]:
        if model is None:
            return None
        if isinstance(part, str) and part in model.model_fields:
            annotation = model.model_fields[part].annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                model = annotation
            elif part in ("stages",):
                model = StageConfig
            elif part in ("connectors",):
                model = ConnectorConfig
            else:
                return None
        elif isinstance(part, str) and model in (StageConfig, ConnectorConfig):
            continue  # a dict key (stage or edge name)
        else:
            return None
    return model


def _explain(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        path = ".".join(str(p) for p in loc)
        if e["type"] == "extra_forbidden":
            owner = _model_at(loc)
            hint = did_you_mean(str(loc[-1]), list(owner.model_fields)) if owner else ""
            lines.append(f"{path}: unknown field{hint}")
        else:
            got = e.get("input")
            got_text = "" if isinstance(got, dict) else f" (got {got!r})"
            lines.append(f"{path}: {e['msg']}{got_text}")
    return "invalid deploy config: " + "; ".join(lines)


def apply_overrides(raw: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Apply dotted overrides such as {"stages.*.max_num_seqs": 8} to a raw config dict."""
    out = copy.deepcopy(raw)
    for dotted, value in overrides.items():
        node = out
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {dotted!r}: {part!r} is not a section")
        node[leaf] = value
    return out


def load_deploy_config(
    source: str | Path | dict[str, Any] | DeployConfig | None = None,
    overrides: dict[str, Any] | None = None,
    base: dict[str, Any] | None = None,
) -> DeployConfig:
    """Build a validated DeployConfig from a YAML path / dict / object, a family's `base`
    defaults, and CLI-style dotted overrides (applied last)."""
    if isinstance(source, DeployConfig):
        raw = source.model_dump(exclude_unset=True)
    elif isinstance(source, dict):
        raw = source
    elif source is None:
        raw = {}
    else:
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"deploy config {str(path)!r} does not exist")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"deploy config {str(path)!r} is not valid YAML: {exc}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"deploy config {str(path)!r} must be a mapping at the top level")
    merged = _deep_merge(base or {}, raw)
    merged = apply_overrides(merged, overrides or {})
    try:
        return DeployConfig(**merged)
    except ValidationError as exc:
        raise ConfigError(_explain(exc)) from None


def _deep_merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(a)
    for key, value in b.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out
