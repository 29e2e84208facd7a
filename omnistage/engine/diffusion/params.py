"""What a diffusion request asks for (`DiffusionParams`) and what a diffusion stage's deploy config may set
(`DiffusionOptions`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from omnistage.errors import RequestError


@dataclass
class DiffusionParams:
    """One text-to-image request. None: the family's default for the checkpoint (`Family.resolve`).

    `guidance_scale` is the model's own guidance: the embedded guidance of guidance-distilled models (FLUX.1-dev),
    the CFG scale of CFG models. `true_cfg_scale` > 1 with a `negative_prompt` runs a second, negative branch in
    the same forward and mixes the two (diffusers' true CFG). `n` images share one seed as diffusers'
    `num_images_per_prompt` with one generator does; `seed` None draws one.

    It crosses process boundaries as a plain dict (`as_wire` / `of`), which any stage worker can decode."""

    prompt: str = ""
    negative_prompt: str | None = None
    width: int | None = None
    height: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    true_cfg_scale: float | None = None  # None: the family's default (1.0, no true CFG, if it has none)
    n: int = 1
    seed: int | None = None
    max_sequence_length: int | None = None
    # A LoRA adapter of the DiT for this request: {"name": str, "path": str, "scale": float}; two-expert models
    # take path / scale for the first (high-noise) DiT and path_2 / scale_2 for the second, either or both.
    # Requests with different adapters (or scales) never share a forward.
    lora: dict[str, Any] | None = None
    # Decode the VAE image by image (slicing) or in overlapping tiles (tiling): less memory, same image.
    vae_use_slicing: bool = False
    vae_use_tiling: bool = False
    # Video models: frames and their rate; two-expert models (Wan2.2 A14B) switch from the high-noise to the
    # low-noise expert at timestep boundary_ratio x train timesteps, which guides with guidance_scale_2.
    num_frames: int | None = None
    fps: int | None = None
    guidance_scale_2: float | None = None
    boundary_ratio: float | None = None
    flow_shift: float | None = None  # the sampler's shift of its sigma grid (None: the scheduler config's)
    # Audio models: where the clip starts and how long it is, in seconds.
    audio_start: float | None = None
    audio_length: float | None = None

    def as_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def of(cls, value: DiffusionParams | dict[str, Any]) -> DiffusionParams:
        return value if isinstance(value, DiffusionParams) else cls(**value)

    def check(self) -> DiffusionParams:
        """Range checks that need no model (RequestError names the field); an unset true_cfg_scale becomes 1."""
        for name in ("width", "height", "num_inference_steps", "max_sequence_length", "num_frames", "fps"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise RequestError(f"{name} must be a positive integer (got {value!r})", name)
        if not isinstance(self.n, int) or self.n < 1:
            raise RequestError(f"n must be a positive integer (got {self.n!r})", "n")
        if self.true_cfg_scale is None:  # still unset once the family's defaults are in: no true CFG
            self.true_cfg_scale = 1.0
        if self.true_cfg_scale < 0 or (self.guidance_scale is not None and self.guidance_scale < 0):
            raise RequestError("guidance scales must not be negative", "guidance_scale")
        if self.guidance_scale_2 is not None and self.guidance_scale_2 < 0:
            raise RequestError("guidance scales must not be negative", "guidance_scale_2")
        if self.boundary_ratio is not None and not 0 <= self.boundary_ratio <= 1:
            raise RequestError(f"boundary_ratio must be in [0, 1] (got {self.boundary_ratio})", "boundary_ratio")
        for name in ("flow_shift", "audio_length"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise RequestError(f"{name} must be positive (got {value})", name)
        if self.audio_start is not None and self.audio_start < 0:
            raise RequestError(f"audio_start must not be negative (got {self.audio_start})", "audio_start")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise RequestError(f"seed must be in [0, 2**63) (got {self.seed})", "seed")
        if self.lora is not None:
            lora = self.lora
            paths = [lora.get(f) for f in ("path", "path_2") if isinstance(lora, dict) and lora.get(f) is not None]
            if not isinstance(lora, dict) or not isinstance(lora.get("name", ""), str) or not paths or \
                    not all(isinstance(p, str) for p in paths):
                raise RequestError("lora must be an object {name, path, scale} with a string path (two-expert "
                                   "models: path / scale for the high-noise expert, path_2 / scale_2 for the "
                                   "low-noise one, either or both)", "lora")
            for name in ("scale", "scale_2"):
                scale = lora.get(name, 1.0)
                if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not -10 <= scale <= 10:
                    raise RequestError(f"lora.{name} must be a number in [-10, 10] (got {scale!r})", f"lora.{name}")
            unknown = set(lora) - {"name", "path", "scale", "path_2", "scale_2"}
            if unknown:
                raise RequestError(f"lora takes name, path, scale, path_2 and scale_2 (got {sorted(unknown)})",
                                   "lora")
        return self

    def with_defaults(self, **defaults: Any) -> DiffusionParams:
        """These params, with each field that is None taken from `defaults`."""
        return replace(self, **{k: v for k, v in defaults.items() if getattr(self, k) is None})


class DiffusionOptions(BaseModel):
    """`stages.<diffusion stage>.options` of every diffusion family (a family may subclass it). Each switch either
    works for the family's DiT or is refused at start-up with the reason; none is ignored."""

    model_config = ConfigDict(extra="forbid", strict=True)

    compile: bool = Field(False, description=(
        "torch.compile the DiT's repeated blocks (regional compilation: one compiled block reused by every layer); "
        "the first requests of each new shape are slow while it compiles"))
    cache: dict[str, Any] | None = Field(None, description=(
        "step caching through cache-dit: a DBCacheConfig as a mapping (e.g. {Fn_compute_blocks: 8, "
        "residual_diff_threshold: 0.12}), plus an optional `taylorseer: {taylorseer_order: 1}`; {} takes "
        "cache-dit's defaults. Cached steps reuse earlier block outputs, so images change slightly; a batch "
        "then runs requests that started together to the end (new requests join the next batch)"))
    quantization: Literal["fp8"] | None = Field(None, description=(
        "fp8: the DiT's linear layers in float8 (dynamic activation scales) through torchao; needs a GPU with "
        "FP8 units (compute capability 8.9+)"))
    cpu_offload: bool = Field(False, description=(
        "keep the weights in CPU memory and stream each block to the GPU when it runs: fits small GPUs, slower"))
    attention_backend: str | None = Field(None, description=(
        "diffusers' attention backend for the DiT (e.g. flash, _native_cudnn, sage); None: PyTorch SDPA, "
        "which picks the fastest kernel it has for the shapes"))
    lora_root: str | None = Field(None, description=(
        "the directory LoRA adapters may be loaded from (a request's lora.path is resolved inside it); "
        "None: requests that name a LoRA are refused"))
    max_loras: int = Field(8, ge=1, description="LoRA adapters kept loaded at once (least recently used unloaded)")
    cfg_parallel: bool = Field(False, description=(
        "split every DiT forward over two ranks (one process each; devices names 2 GPUs, or \"cpu\"): with CFG, "
        "rank 0 runs the positive rows and rank 1 the negative ones; text encoders and VAE stay on rank 0"))
    ulysses_degree: int | None = Field(None, ge=2, description=(
        "Ulysses sequence parallelism: every DiT forward runs on this many ranks (one process each; devices names "
        "as many GPUs, or \"cpu\"), each on a slice of the sequence, the attention heads re-sharded by all-to-all "
        "(diffusers' context parallelism; DiTs with a context-parallel plan: Qwen-Image, FLUX, Wan); it must "
        "divide the DiT's attention heads. Text encoders and VAE stay in the stage's process"))
