"""Stable Audio Open: text to stereo audio clips. One diffusion stage, `dit`, holding the T5 text encoder and the
projection model, the DiT and the Oobleck VAE (or an `encode` stage for the first two, as for image families);
it outputs audio.

Detected from a diffusers `StableAudioPipeline` directory (model_index.json). The stage's plumbing is the shared
`ImagePipeline` (families/diffusion.py) with what audio changes: no width or height, a clip's `audio_start` and
`audio_length` (seconds) checked against the model's window (the DiT's `sample_size` latent frames times the VAE's
hop, at the VAE's rate) and its seconds conditioners' range, and the output as time-major [samples, channels]
float32 at the VAE's sample rate. Request defaults are diffusers' `StableAudioPipeline.__call__` ones: 100 steps,
CFG 7.0, the clip from 0 s to the end of the window. `POST /v1/audio/generate` serves it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar

import numpy as np
import torch

from omnistage.config.deploy import DeployConfig
from omnistage.engine.diffusion import DiffusionParams
from omnistage.errors import RequestError
from omnistage.families.base import CheckpointInfo
from omnistage.families.diffusion import STAGE, ImagePipeline, Parts, prompt_of
from omnistage.families.stable_audio.model import audio_config, sample_span
from omnistage.types import OmniOutput, OmniRequest, StageOutput

DEFAULTS = {"num_inference_steps": 100, "guidance_scale": 7.0, "audio_start": 0.0}


class StableAudioAudioPipeline(ImagePipeline):
    generates_audio: ClassVar[bool] = True  # a prompt's DiffusionParams to a clip: POST /v1/audio/generate
    audio: dict[str, Any]  # the checkpoint's clip geometry (model.audio_config)

    @classmethod
    def build(cls, info: CheckpointInfo, deploy: DeployConfig) -> StableAudioAudioPipeline:
        pipeline = super().build(info, deploy)
        pipeline.stages = [replace(s, outputs=("audio",)) if s.name == STAGE else s for s in pipeline.stages]
        pipeline.audio = audio_config(info.path)
        pipeline.audio_sample_rate = pipeline.audio["sample_rate"]
        pipeline.defaults = dict(DEFAULTS)
        return pipeline

    @property
    def max_audio_seconds(self) -> float:
        return self.audio["max_seconds"]

    def load_model(self, device: torch.device, dtype: torch.dtype, parts: Parts = "all") -> Any:
        from omnistage.families.stable_audio.model import StableAudioModel

        return StableAudioModel(self.model_path, device, dtype, parts)

    def resolve(self, params: DiffusionParams, images: list[Any]) -> DiffusionParams:
        """Diffusers' defaults; an unset length runs to the end of the window, as diffusers' audio_end_in_s does."""
        params = params.with_defaults(**self.defaults)
        if params.audio_length is None and params.audio_start < self.max_audio_seconds:
            params.audio_length = self.max_audio_seconds - params.audio_start
        return params

    def request_params(self, request: OmniRequest) -> DiffusionParams:
        """The request's params, checked against the model's window and conditioners (RequestError names the
        field); a pure function of the request."""
        params = request.options.get("diffusion")
        if not isinstance(params, DiffusionParams):
            sampling = request.stage_params.get(STAGE) or request.stage_params.get("*")
            params = DiffusionParams(seed=getattr(sampling, "seed", None))
        if request.media.get("image") or request.media.get("mask"):
            raise RequestError("this model generates audio from text; it takes no input images", "image")
        params = self.resolve(replace(params, prompt=prompt_of(request)), []).check()
        if params.n != 1:
            raise RequestError(f"this model makes one clip per request (got n={params.n}); send several requests",
                               "n")
        longest, low, high = self.max_audio_seconds, self.audio["min_value"], self.audio["max_value"]
        if not low <= params.audio_start <= high:
            raise RequestError(f"audio_start must be in [{low:g}, {high:g}] s for this model (got "
                               f"{params.audio_start:g})", "audio_start")
        if params.audio_length is None or params.audio_start + params.audio_length > longest + 1e-9:
            raise RequestError(f"audio_start + audio_length must be at most {longest:g} s, this model's longest clip "
                               f"(got {params.audio_start:g} + {params.audio_length or 0:g})", "audio_length")
        if params.audio_start + params.audio_length > high:
            raise RequestError(f"audio_start + audio_length must be at most {high:g} s for this model's seconds "
                               "conditioning", "audio_length")
        start, end = sample_span(params, self.audio_sample_rate)
        if end <= start:
            raise RequestError(f"audio_length {params.audio_length:g} s is shorter than one sample at "
                               f"{self.audio_sample_rate} Hz", "audio_length")
        return params

    def to_output(self, stage: str, out: StageOutput) -> OmniOutput:
        """Progress as the image families report it; the clip, on the last delta, as float32 [samples, channels]
        (mono: [samples]) at the VAE's rate."""
        clip = out.tensors.get("audio")
        audio = None
        if clip is not None:
            audio = np.ascontiguousarray(clip[0].T.numpy(), dtype=np.float32)
            audio = audio.reshape(-1) if audio.shape[1] == 1 else audio
        progress = out.tensors.get("progress")
        steps = None if progress is None else (int(progress[-1, 0]), int(progress[-1, 1]))
        return OmniOutput(out.request_id, audio=audio, sample_rate=self.audio_sample_rate if clip is not None else None,
                          num_output_tokens=out.num_output_tokens, progress=steps,
                          num_prompt_tokens=out.num_prompt_tokens)


class StableAudioFamily:
    name = "stable_audio"

    def matches(self, info: CheckpointInfo) -> bool:
        return info.class_name == "StableAudioPipeline"

    def default_deploy(self, info: CheckpointInfo) -> dict[str, Any]:
        return {"stages": {STAGE: {"max_num_seqs": 8}}}

    def pipeline(self, info: CheckpointInfo, deploy: DeployConfig) -> StableAudioAudioPipeline:
        return StableAudioAudioPipeline.build(info, deploy)
