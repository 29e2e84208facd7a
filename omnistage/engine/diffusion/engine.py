"""The diffusion engine: denoising loops of many requests, batched step by step.

The family supplies the model parts (`DiffusionModel`): `encode` prompts into conditioning, `velocity` (the DiT
forward on a batch of rows, each at its own timestep) and `decode` latents into images; the engine owns the loop.
A request arrives either unencoded (the engine encodes the prompts of the requests it admits together, in one
call) or with its conditioning from a separate encode stage (encoder.py); both give the same rows.
Each `step()` runs ONE denoising step for every running request, so requests join at step boundaries and leave as
soon as their schedule ends, never waiting for a batch to drain; rows of one forward may be at different steps of
different schedules (the timestep and the sampler's update are per request).

Batching invariants:
- The running batch holds requests of one group: the model's `batch_key` (the shapes one forward can stack:
  size, text length) and the LoRA adapter and scale (one adapter state per forward), at most `max_num_seqs`
  images (a lone request with more runs alone). With step caching (`options.cache`) the batch is a cohort:
  requests of one step count that start together and run to the end together (see accelerate.py).
- Waiting requests are admitted in arrival order; one of another group waits for the batch to drain, and holds
  the ones behind it (no starvation).
- With CFG (`cfg_scale(params)` not None) a request adds a negative branch: its rows again, with the negative
  conditioning, in the same forward, mixed by `combine` (by default neg + scale * (pos - neg)).
- Each request has its own sampler (`schedule`): its timesteps and its update, which may keep state between
  steps; the forward is shared, the update is per request.
- Latents are drawn as diffusers' `prepare_latents` draws them for `torch.Generator("cpu").manual_seed(seed)`:
  one CPU normal draw of shape [n, *noise_shape] in the model's dtype, so the seed gives diffusers' image; the
  conditioning of a request's n images is its prompt's, repeated n times (`num_images_per_prompt`).
- Per-request state (latents, conditioning) lives in the engine and is dropped on finish or abort; an abort
  takes effect at the next step boundary.

Each step yields, per running request, a delta with `tensors["progress"] = [[steps done, steps]]` (int64) and
`num_output_tokens` = steps done; the last also carries the decoded rows, `tensors["images"]` ([n, H, W, 3] float32
in [0, 1]) or under the model's `output_name`, and a video request's `tensors["fps"]` (int64 [1], its `fps`).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from omnistage.config.deploy import StageConfig, parse_section
from omnistage.engine.diffusion.accelerate import Accelerator
from omnistage.engine.diffusion.encoder import COND, PROMPT_TOKENS, UNCOND, branch, encode_requests, is_encoded
from omnistage.engine.diffusion.lora import LoraKey, LoraManager
from omnistage.engine.diffusion.params import DiffusionOptions, DiffusionParams
from omnistage.engine.parallel import GroupLost
from omnistage.errors import OmniError
from omnistage.types import StageInput, StageOutput

logger = logging.getLogger(__name__)
LOG_PROGRESS_AFTER_S = 10.0  # requests shorter than this log nothing on their way

Conditioning = dict[str, torch.Tensor]  # every tensor has one row per prompt (or per image)
# A request's input tensors (StageInput.tensors), e.g. the images an edit model edits: "image_0", "image_1", ...
# uint8 [H, W, 3] each, in the order the caller gave them.
Inputs = dict[str, torch.Tensor]


class DiffusionModel(Protocol):
    """What a diffusion family gives the engine. `params` are resolved (no None left that the model needs)."""

    device: torch.device
    dtype: torch.dtype

    def batch_key(self, params: DiffusionParams) -> Hashable:
        """Requests with equal keys can share a forward (same latent and text shapes)."""
        ...

    def schedule(self, params: DiffusionParams) -> Sampler:
        """A new sampler for one request (the flow-match `Schedule`, or a stateful multistep solver)."""
        ...

    def noise_shape(self, params: DiffusionParams) -> tuple[int, ...]:
        """The shape of one image's initial noise, as diffusers draws it (before any packing)."""
        ...

    def pack(self, noise: torch.Tensor, key: Hashable) -> torch.Tensor:
        """Noise [n, *noise_shape] on the device -> the latent rows `velocity` takes."""
        ...

    def cfg_scale(self, params: DiffusionParams) -> float | None:
        """The CFG scale when the request runs a negative branch, else None."""
        ...

    def encode(self, prompts: list[str], params: list[DiffusionParams], inputs: list[Inputs]) -> Conditioning:
        """One row per prompt; `params[i]` and `inputs[i]` are those of the request prompt i belongs to (a negative
        prompt is conditioned on its request's input images too). All are of one batch key."""
        ...

    def velocity(self, latents: torch.Tensor, timesteps: torch.Tensor, cond: Conditioning, key: Hashable
                 ) -> torch.Tensor:
        """The DiT forward: `timesteps` [rows] float32 on the device, the schedule's timesteps."""
        ...

    def decode(self, latents: torch.Tensor, key: Hashable) -> torch.Tensor:
        """Latent rows -> one output per row on the CPU: images [rows, H, W, 3] float32 in [0, 1] by default
        (see `output_name`)."""
        ...

    # Optional: `output_name`, the key of the decoded rows in the last delta's tensors ("images" if unset; e.g.
    # "video" for [rows, F, H, W, 3], "audio" for [rows, channels, samples]).

    # Optional: `prompt_tokens(params, cond) -> int`, the text tokens of a request's positive prompt that the DiT
    # attends to, from its one conditioning row; outputs carry it as `num_prompt_tokens` (0 without it).

    # Optional: `cfg_scale_at(params, timestep) -> float`, the CFG scale of the step at `timestep` when it varies
    # over the schedule (a two-expert model guides each expert with its own scale); `cfg_scale` still decides
    # whether the request runs a negative branch at all.

    # Optional: `final_latents(latents, cond) -> latents`, what a finished request decodes from its last latents
    # and its (positive) conditioning rows, e.g. a conditioning frame kept out of the denoising.


class Sampler(Protocol):
    """One request's sampler, made by `DiffusionModel.schedule` and used by that request alone, so it may keep
    state between steps (a multistep solver's history, an SDE solver's generator)."""

    timesteps: torch.Tensor  # [steps] on the CPU: what the model is conditioned on at each step

    @property
    def num_steps(self) -> int: ...

    def step(self, velocity: torch.Tensor, index: int, latents: torch.Tensor) -> torch.Tensor:
        """The latents after step `index`, from the model's output for this request's rows."""
        ...

    # Optional: `init_noise_sigma` (float), the scale of the initial noise (1 if unset), and
    # `model_input(latents, index) -> latents`, the scaling of the latents the model sees at step `index`.


def cat_conditioning(conds: list[Conditioning]) -> Conditioning:
    """The default `collate`: the batch's conditioning rows stacked (a family whose text lengths vary per request
    overrides it to pad)."""
    return {k: torch.cat([c[k] for c in conds]) for k in conds[0]}


def cfg_combine(pos: torch.Tensor, neg: torch.Tensor, scale: float) -> torch.Tensor:
    return neg + scale * (pos - neg)


@dataclass
class _Job:
    request_id: str
    params: DiffusionParams
    key: Hashable
    schedule: Sampler
    cfg: float | None
    inputs: Inputs
    lora: LoraKey
    group: Hashable  # what must be equal for requests to share a forward
    started: float = 0.0  # time.monotonic() at admission
    logged: int = 0  # the last progress quarter logged
    latents: torch.Tensor | None = None  # [n, ...] once started
    cond: Conditioning | None = None  # [n, ...] rows
    uncond: Conditioning | None = None  # [n, ...] rows of the negative branch (CFG only)
    done: int = 0  # steps taken
    prompt_tokens: int = 0  # the positive prompt's text tokens (the model's `prompt_tokens`), for usage

    @property
    def rows(self) -> int:
        return self.params.n

    def progress(self) -> torch.Tensor:
        return torch.tensor([[self.done, self.schedule.num_steps]], dtype=torch.int64)


class DiffusionEngine:
    def __init__(self, name: str, model: DiffusionModel, max_num_seqs: int = 8,
                 options: DiffusionOptions | None = None):
        self.name = name
        self.model = model
        self.max_num_seqs = max_num_seqs
        options = options or DiffusionOptions()
        self.accel = Accelerator(model, options, name)
        self.lora = LoraManager(getattr(model, "transformers", None) or getattr(model, "transformer", None),
                                options.lora_root,
                                getattr(model, "pipeline_class", None), options.max_loras)
        # Optional hooks of the model: how CFG mixes the branches, how conditioning rows form a batch.
        self.combine = getattr(model, "combine", cfg_combine)
        self.collate = getattr(model, "collate", cat_conditioning)
        self.cfg_at = getattr(model, "cfg_scale_at", None)  # a CFG scale per step (two-expert models)
        self.final_latents = getattr(model, "final_latents", None)
        self.output_name: str = getattr(model, "output_name", "images")
        self.waiting: dict[str, _Job] = {}  # arrival order
        self.running: dict[str, _Job] = {}  # admission order; one batch key
        self.failed: list[StageOutput] = []  # to hand out at the next step
        self.num_steps = 0

    @classmethod
    def from_stage(cls, name: str, model: DiffusionModel, cfg: StageConfig,
                   options_class: type[DiffusionOptions] = DiffusionOptions) -> DiffusionEngine:
        """The engine of stage `name` as its deploy config sizes it (`max_num_seqs`: images per forward) and
        accelerates it (`options`, validated by the family's `options_class`)."""
        options = parse_section(options_class, cfg.options, f"stages.{name}.options")
        return cls(name, model, cfg.max_num_seqs, options)

    @property
    def device(self) -> torch.device | None:
        return getattr(self.model, "device", None)

    # ---- requests ----------------------------------------------------------------------------

    def add_request(self, inp: StageInput) -> None:
        try:
            params = DiffusionParams.of(inp.params).check()
            if params.seed is None:
                params.seed = secrets.randbits(63)
            key, schedule, lora = self.model.batch_key(params), self.model.schedule(params), self.lora.key(params.lora)
            group = (key, lora, schedule.num_steps if self.accel.cohorts else None)
            job = _Job(inp.request_id, params, key, schedule, self.model.cfg_scale(params), dict(inp.tensors),
                       lora, group)
        except Exception as exc:
            self.failed.append(StageOutput.failure(inp.request_id, self.name, *self._error(exc)))
            return
        self.waiting[inp.request_id] = job

    def add_input_chunk(self, request_id: str, chunk: StageInput) -> None:
        """A diffusion request is whole when added; there are no chunks to take."""

    def abort(self, request_id: str) -> None:
        self.waiting.pop(request_id, None)
        job = self.running.pop(request_id, None)
        if job is not None and self.running and self.accel.cohorts:  # the cohort's rows changed
            self.accel.begin(job.schedule.num_steps - job.done)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.failed)

    def stats(self) -> dict[str, Any]:
        return {"num_running": len(self.running), "num_waiting": len(self.waiting), "num_steps": self.num_steps,
                "num_running_images": sum(j.rows for j in self.running.values())}

    def shutdown(self) -> None:
        self.waiting.clear()
        self.running.clear()
        self.failed.clear()
        if hasattr(self.model, "close"):  # a parallel group: its follower processes
            self.model.close()

    # ---- the loop ----------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[StageOutput]:
        """Admit compatible waiting requests, run one denoising step for the batch, decode the finished ones."""
        outputs, self.failed = self.failed, []
        outputs += self._start(self._admit())
        if self.running:
            outputs += self._denoise()
        return outputs

    def _admit(self) -> list[_Job]:
        if self.running and self.accel.cohorts:
            return []  # a cohort runs to its end as it started
        jobs = list(self.running.values()) or list(self.waiting.values())[:1]
        if not jobs:
            return []
        group, rows = jobs[0].group, sum(j.rows for j in self.running.values())
        admitted = []
        for job in list(self.waiting.values()):
            if job.group != group or (rows and rows + job.rows > self.max_num_seqs):
                break  # in arrival order: later requests do not overtake this one
            del self.waiting[job.request_id]
            admitted.append(job)
            rows += job.rows
        return admitted

    def _start(self, jobs: list[_Job]) -> list[StageOutput]:
        """Encode the prompts of newly admitted requests (one call) and draw their initial latents."""
        if not jobs:
            return []
        try:
            if not self.running:  # a new batch: its adapter state and step cache
                self.lora.activate(jobs[0].lora)
                self.accel.begin(jobs[0].schedule.num_steps)
            # Requests from an encode stage bring their conditioning; the others are encoded here, in one pass.
            fresh = [job for job in jobs if not is_encoded(job.inputs)]
            encoded = encode_requests(self.model, [job.params for job in fresh], [job.inputs for job in fresh])
            for job, encoding in zip(fresh, encoded, strict=True):
                job.inputs = encoding
            device = self.model.device
            for job in jobs:
                encoding = {k: v.to(device) for k, v in job.inputs.items() if k != PROMPT_TOKENS}
                job.cond = branch(encoding, COND, job.rows)
                job.uncond = branch(encoding, UNCOND, job.rows) if job.cfg is not None else None
                job.prompt_tokens = int(job.inputs[PROMPT_TOKENS])
                generator = torch.Generator("cpu").manual_seed(job.params.seed)
                noise = torch.randn((job.rows, *self.model.noise_shape(job.params)), generator=generator,
                                    dtype=self.model.dtype)
                sigma = getattr(job.schedule, "init_noise_sigma", 1.0)
                noise = noise if sigma == 1.0 else noise * sigma
                job.latents = self.model.pack(noise.to(self.model.device), job.key)
        except Exception as exc:  # a failed encode fails the requests it was for, not the stage
            logger.exception("stage %s: encoding failed", self.name)
            error = self._error(exc)
            return [StageOutput.failure(job.request_id, self.name, *error) for job in jobs]
        for job in jobs:
            job.inputs = {}  # encoded into the conditioning; not needed any more
            job.started = time.monotonic()
        self.running.update((job.request_id, job) for job in jobs)
        return []

    def _denoise(self) -> list[StageOutput]:
        jobs = list(self.running.values())
        try:
            self._step(jobs)
            finished = [job for job in jobs if job.done == job.schedule.num_steps]
            images = self._decode(finished)
        except GroupLost:  # a rank of a parallel group is gone: the stage restarts
            raise
        except Exception as exc:  # a failed step fails its batch, not the stage
            logger.exception("stage %s: step failed", self.name)
            error = self._error(exc)
            self.running.clear()
            return [StageOutput.failure(job.request_id, self.name, *error) for job in jobs]
        outputs = []
        for job in jobs:
            self._log_progress(job)
            tensors = {"progress": job.progress()}
            finished = job.request_id in images
            if finished:
                del self.running[job.request_id]
                tensors[self.output_name] = images[job.request_id]
                if job.params.fps is not None:  # a video's frame rate travels with its frames
                    tensors["fps"] = torch.tensor([job.params.fps], dtype=torch.int64)
            outputs.append(StageOutput(job.request_id, self.name, tensors=tensors, num_output_tokens=job.done,
                                       num_prompt_tokens=job.prompt_tokens, finished=finished,
                                       finish_reason="stop" if finished else None))
        return outputs

    def _step(self, jobs: list[_Job]) -> None:
        """One Euler step for every row of the batch, each at its own request's step; CFG branches in the same
        forward after the positive rows."""
        self.num_steps += 1
        device = self.model.device

        def per_row(values: list[torch.Tensor], of: list[_Job]) -> torch.Tensor:
            return torch.cat([v.expand(job.rows) for v, job in zip(values, of, strict=True)])

        inputs = {job.request_id: job.schedule.model_input(job.latents, job.done)
                  if hasattr(job.schedule, "model_input") else job.latents for job in jobs}
        timesteps = per_row([job.schedule.timesteps[job.done] for job in jobs], jobs)
        guided = [job for job in jobs if job.cfg is not None]
        model_latents = torch.cat([*inputs.values(), *(inputs[job.request_id] for job in guided)])
        if guided:
            timesteps = torch.cat([timesteps, per_row([job.schedule.timesteps[job.done] for job in guided], guided)])
        cond = self.collate([job.cond for job in jobs] + [job.uncond for job in guided])
        pred = self.model.velocity(model_latents, timesteps.to(device), cond, jobs[0].key)
        start, neg = 0, sum(job.rows for job in jobs)
        for job in jobs:
            velocity = pred[start:start + job.rows]
            if job.cfg is not None:
                timestep = float(job.schedule.timesteps[job.done])
                scale = job.cfg if self.cfg_at is None else self.cfg_at(job.params, timestep)
                velocity = self.combine(velocity, pred[neg:neg + job.rows], scale)
                neg += job.rows
            job.latents = job.schedule.step(velocity, job.done, job.latents)
            job.done += 1
            start += job.rows

    def _decode(self, jobs: list[_Job]) -> dict[str, torch.Tensor]:
        """Decode finished requests together, in groups of one VAE mode (tiling / slicing are per request and
        change memory, not the image beyond the tiles' blending)."""
        out = {}
        def mode(job: _Job) -> tuple[bool, bool]:
            return job.params.vae_use_tiling, job.params.vae_use_slicing

        for tiling, slicing in sorted({mode(job) for job in jobs}):
            group = [job for job in jobs if mode(job) == (tiling, slicing)]
            vae = getattr(self.model, "vae", None)
            if vae is not None and hasattr(vae, "use_tiling"):
                vae.use_tiling, vae.use_slicing = tiling, slicing
            latents = [job.latents if self.final_latents is None else self.final_latents(job.latents, job.cond)
                       for job in group]
            images, start = self.model.decode(torch.cat(latents), group[0].key), 0
            for job in group:
                out[job.request_id] = images[start:start + job.rows]
                start += job.rows
        return out

    def _log_progress(self, job: _Job) -> None:
        """Generations that run long log each quarter of their steps (a server operator sees them move)."""
        quarter = 4 * job.done // job.schedule.num_steps
        if quarter > job.logged and time.monotonic() - job.started > LOG_PROGRESS_AFTER_S:
            logger.info("stage %s: request %s at step %d of %d (%.1f s)", self.name, job.request_id, job.done,
                        job.schedule.num_steps, time.monotonic() - job.started)
        job.logged = max(job.logged, quarter)

    def _error(self, exc: Exception) -> tuple[str, int]:
        return f"stage {self.name!r} failed: {exc}", exc.status if isinstance(exc, OmniError) else 500
