"""Deploy config: what a user edits to place, size and tune the stages of a pipeline.

Topology lives in the family's code; this file only says how to run it. Every field is validated
at start-up, and an unknown or ill-typed field fails with its path and the closest valid name.
"""

from __future__ import annotations

import copy
import difflib
from dataclasses import fields as dataclass_fields
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from omnistage.errors import ConfigError
from omnistage.sampling_params import SamplingParams


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class Advanced(_Strict):
    """Base of a stage kind's `advanced:` block: internal tuning whose defaults the engine or family chooses.

    Each stage kind subclasses it with its own fields (the AR engine: `ARAdvanced`; a family's stages: their own);
    the family checks every stage's block against its kind when the pipeline is built (`check_stages`). Values
    are taken as given (strict): `true` is no integer, `"8"` no number."""

    model_config = ConfigDict(extra="forbid", strict=True)
    tensor_parallel: ClassVar[bool] = False  # whether stages of this kind may set tensor_parallel_size > 1

    stream_priority: Literal["high", "normal"] | None = Field(
        None, description="inline stages on a GPU: their CUDA stream's priority, which the GPU's block scheduler "
        "favours when stages share it; None: high for autoregressive stages (a request waits on each short step), "
        "normal for the rest")


class StageConfig(_Strict):
    """Placement, sizing and defaults of one stage."""

    # placement
    devices: str | None = Field(None, description='Device ids, e.g. "0" or "1,2"; None: cuda:0 if present else cpu')
    replicas: int = Field(1, ge=1)
    tensor_parallel_size: int = Field(1, ge=1, description="AR stages: ranks (one process per device) that each "
                                      "hold a shard of the model; devices must name that many, or be \"cpu\"")
    # sizing
    max_num_seqs: int = Field(64, ge=1, description="Requests (or, for token2wav, windows) stepped together")
    max_num_batched_tokens: int = Field(2048, ge=16, description="Tokens one step may compute")
    max_model_len: int | None = Field(None, ge=16, description="Context length; None: the model's own")
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0, description="Share of the GPU for weights + KV")
    kv_cache_memory_gb: float | None = Field(None, gt=0.0, description="Explicit KV cache budget")
    num_kv_blocks: int | None = Field(None, ge=1, description="Exact number of KV blocks (overrides budgets)")
    block_size: int = Field(16, ge=1, description="Tokens per KV block")
    # precision
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="auto: float32 on the CPU; on a GPU the checkpoint's half precision (or bfloat16)")
    # caching
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    enforce_eager: bool = Field(False, description="No CUDA graphs (faster start-up, slower steps)")
    default_sampling_params: dict[str, Any] = Field(default_factory=dict)
    options: dict[str, Any] = Field(default_factory=dict, description="The stage's own settings, as its family "
                                    "documents them (Qwen2.5-Omni token2wav: window sizes)")
    advanced: dict[str, Any] = Field(default_factory=dict, description="Internal tuning with per-family defaults; "
                                     "checked against the stage's kind when the pipeline is built")

    @model_validator(mode="after")
    def _enough_devices(self) -> StageConfig:
        listed = [d for d in (self.devices or "").split(",") if d.strip()]
        if self.tensor_parallel_size > 1 and listed != ["cpu"] and 0 < len(listed) < self.tensor_parallel_size:
            raise ValueError(f"tensor_parallel_size {self.tensor_parallel_size} needs that many devices, but devices "
                             f"names {len(listed)} ({self.devices!r}); list one per rank, e.g. "
                             f"{','.join(map(str, range(self.tensor_parallel_size)))!r}, or \"cpu\"")
        return self

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

    @property
    def stream_priority(self) -> str | None:
        """`advanced.stream_priority` (checked by `check_stages`), for the worker that owns the stage's stream."""
        return self.advanced.get("stream_priority")


class ConnectorAdvanced(_Strict):
    inline_max_bytes: int = Field(
        64 * 1024, ge=0, description="Payloads with at most this many tensor bytes ride on the control channel"
    )


class ConnectorConfig(_Strict):
    """How payloads cross one edge between stage workers in different processes."""

    type: Literal["inprocess", "shm", "tcp"] = Field(
        "shm", description="inprocess: inline backend only; shm: processes on one host; tcp: across hosts"
    )
    options: dict[str, Any] = Field(default_factory=dict)
    advanced: ConnectorAdvanced = Field(default_factory=ConnectorAdvanced)

    @property
    def inline_max_bytes(self) -> int:
        return self.advanced.inline_max_bytes


M = TypeVar("M", bound=BaseModel)


def parse_section(model: type[M], values: dict[str, Any], where: str) -> M:
    """`values` checked as `model` (a stage's `options` or `advanced` block at path `where`): an unknown key
    fails naming the closest valid one, a bad value with the field's path."""
    try:
        return model(**values)
    except ValidationError as exc:
        lines = []
        for e in exc.errors():
            path = ".".join([where, *(str(p) for p in e["loc"])])
            if e["type"] == "extra_forbidden":
                valid = list(model.model_fields)
                lines.append(f"{path}: unknown field{did_you_mean(str(e['loc'][-1]), valid)} "
                             f"(valid: {', '.join(valid)})")
            else:
                lines.append(f"{path}: {e['msg']} (got {e.get('input')!r})")
        raise ConfigError("invalid deploy config: " + "; ".join(lines)) from None


def _default_backend() -> str:
    import torch

    return "process" if torch.cuda.is_available() else "inline"


class LimitsConfig(_Strict):
    """Request size limits the server enforces before any work is done; media limits are checked from each item's
    header before it is decoded (docs/media.md)."""

    max_request_bytes: int = Field(32 * 2**20, ge=1024)
    max_queued_requests: int = Field(256, ge=1, description="generations (prompts x n) the server holds admitted "
                                     "at once; beyond it a request gets 429 (`serve --max-queued-requests`)")
    max_media_bytes: int = Field(20 * 2**20, ge=1024, description="encoded size of one media item")
    max_media_parts: int = Field(16, ge=0, description="media parts (image, audio, video) in one request")
    max_media_total_bytes: int = Field(64 * 2**20, ge=1024, description="encoded size of all media in one request")
    max_image_pixels: int = Field(16 * 2**20, ge=1, description="pixels of one image or video frame")
    max_video_pixels: int = Field(128 * 2**20, ge=1, description="pixels of the frames sampled from one video, "
                                  "summed")
    max_video_seconds: float = Field(600.0, gt=0, description="length of one video")
    max_audio_seconds: float = Field(600.0, gt=0, description="length of one audio item (or a video's track)")
    max_speech_input_chars: int = Field(4096, ge=1, description="characters of text one /v1/audio/speech "
                                        "request may ask to speak")


class MediaConfig(_Strict):
    """Where media may come from. Remote fetches never reach loopback, private, link-local or metadata addresses."""

    remote_fetch: bool = Field(True, description="fetch http(s) image_url/audio_url/video_url parts")
    allowed_domains: list[str] = Field(default_factory=list, description="hosts media may be fetched from (each "
                                       "with its subdomains); empty: any public host")
    allowed_local_path: str | None = Field(None, description="a directory whose files file:// URLs may name; "
                                           "None: no local files")
    fetch_timeout_s: float = Field(10.0, gt=0, description="total time one fetch may take, redirects included")
    max_redirects: int = Field(3, ge=0, le=10)

    @field_validator("allowed_domains")
    @classmethod
    def _plain_hosts(cls, value: list[str]) -> list[str]:
        hosts = []
        for entry in value:
            host = entry.strip().lower().rstrip(".").removeprefix("*.")
            if not host or any(c in host for c in "/:@?#* "):
                raise ValueError(f"{entry!r} is not a host name (e.g. images.example.com)")
            hosts.append(host)
        return hosts

    @field_validator("allowed_local_path")
    @classmethod
    def _existing_dir(cls, value: str | None) -> str | None:
        if value is not None and not (Path(value).is_absolute() and Path(value).is_dir()):
            raise ValueError(f"{value!r} is not an absolute path to a directory")
        return value


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
    media: MediaConfig = Field(default_factory=MediaConfig)

    def stage(self, name: str) -> StageConfig:
        """Settings for one stage: "*" defaults overlaid with the stage's own explicit fields (its `options`,
        `advanced` and `default_sampling_params` key by key)."""
        merged: dict[str, Any] = {}
        for key in ("*", name):
            if key in self.stages:
                for field, value in self.stages[key].model_dump(exclude_unset=True).items():
                    if field in _KEYED and field in merged:
                        merged[field] = {**merged[field], **value}
                    else:
                        merged[field] = value
        return StageConfig(**merged)

    def check_stage_names(self, valid: list[str]) -> None:
        for name in self.stages:
            if name != "*" and name not in valid:
                raise ConfigError(
                    f"deploy config: stages.{name}: no such stage{did_you_mean(name, valid)} "
                    f"(this pipeline has: {', '.join(valid)})"
                )

    def check_stages(self, advanced: dict[str, type[Advanced]],
                     options: dict[str, type[BaseModel]] | None = None) -> None:
        """Every stage named exists (the keys of `advanced`), its `advanced` block fits its kind and its `options`
        its family's model (stages missing from `options` take none)."""
        self.check_stage_names(list(advanced))
        for name, kind in advanced.items():
            cfg = self.stage(name)
            parse_section(kind, cfg.advanced, f"stages.{name}.advanced")
            if cfg.tensor_parallel_size > 1 and not kind.tensor_parallel:
                raise ConfigError(f"invalid deploy config: stages.{name}.tensor_parallel_size: this stage is not "
                                  "autoregressive and runs on one device; set it to 1 (or scale it with replicas)")
            model = (options or {}).get(name)
            if model is not None:
                parse_section(model, cfg.options, f"stages.{name}.options")
            elif cfg.options:
                raise ConfigError(f"invalid deploy config: stages.{name}.options: this stage takes no options "
                                  f"(got {', '.join(cfg.options)}); internal tuning goes under advanced")


_KEYED = ("options", "advanced", "default_sampling_params")  # merged key by key over "*" and across layers


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
            if owner is StageConfig:
                hint += " (internal tuning goes under the stage's advanced block: see docs/deploy.md)"
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
    # Layers, each over the last: the family's defaults, the file, the overrides. A field a layer sets for every
    # stage ("*") replaces what the layers below set for single stages; within one layer a stage's own wins.
    merged = _deep_merge(_without_star_fields(base or {}, raw), raw)
    merged = _without_star_fields(merged, apply_overrides({}, overrides or {}))
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


def _without_star_fields(lower: dict[str, Any], upper: dict[str, Any]) -> dict[str, Any]:
    """`lower` without the single-stage fields that `upper`'s "*" stage sets (keys of keyed fields one by one)."""
    star = (upper.get("stages") or {}).get("*")
    if not isinstance(star, dict) or not isinstance(lower.get("stages"), dict):
        return lower
    out = copy.deepcopy(lower)
    for name, stage in out["stages"].items():
        if name == "*" or not isinstance(stage, dict):
            continue
        for field, value in star.items():
            if field in _KEYED and isinstance(value, dict) and isinstance(stage.get(field), dict):
                for key in value:
                    stage[field].pop(key, None)
            else:
                stage.pop(field, None)
    return out
