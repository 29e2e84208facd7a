"""Qwen3-Omni (`Qwen3OmniMoeForConditionalGeneration`): thinker (AR, text) -> talker (AR, a frame of codec codes
per step: the first codebook sampled, the others from the code predictor in the same step) -> code2wav
(generation, 24 kHz audio).

The API is the Qwen2.5-Omni family's (chat completions with `modalities` and `audio.voice`, streamed text and PCM16,
`sampling_params_list` entries per stage: thinker, talker, code2wav); the request parsing and media handling are
its pipeline's. Requests for text only never touch the talker or code2wav. What flows on each edge: models.py.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml
from pydantic import BaseModel, ConfigDict, Field

from omnistage.config.deploy import Advanced, DeployConfig, parse_section
from omnistage.devices import resolve_device
from omnistage.engine.ar.engine import ARAdvanced, AREngine
from omnistage.engine.generation.engine import GenerationEngine
from omnistage.errors import ConfigError
from omnistage.families import hf, tensor_parallel
from omnistage.families.base import CheckpointInfo, Edge, StageSpec
from omnistage.families.causal_lm import ar_engine
from omnistage.families.qwen2_5_omni import OmniPipeline
from omnistage.families.qwen3_omni_moe import models, parallel
from omnistage.sampling_params import SamplingParams
from omnistage.types import OmniOutput, OmniRequest, StageInput, StageOutput

# Speech allowed per text token the thinker may write (as Qwen2.5-Omni's): only runaway talking is cut.
SECONDS_PER_TEXT_TOKEN = 1.0
CONTROL_IDS = 1024  # the talker vocabulary's last 1024 ids are control ids: never sampled, except its eos
_MEDIA_TENSORS = ("image_grid_thw", "video_grid_thw", "video_second_per_grid")
HANDOFF = "qwen3_omni_moe"  # the key of a request's Handoff in its pipeline_state


class Qwen3OmniPipeline(OmniPipeline):
    audio_sample_rate = models.SAMPLE_RATE
    streams_audio: bool = False  # code2wav decodes in windows (its `window` option): the talker's edge streams
    speaker_ids: dict[str, int] | None = None  # voice name -> the talker's codec id for it

    def preprocess(self, request: OmniRequest) -> StageInput:
        """The thinker's input as Qwen2.5-Omni's (for speech without a system message, under the system prompt Qwen's
        examples speak with, Qwen2.5-Omni's), and this family's handoff."""
        inp, voice = self.thinker_input(request)
        request.pipeline_state[HANDOFF] = Handoff(inp, voice)
        return inp

    def build_engine(self, stage: str, device: str | None = None) -> AREngine | GenerationEngine:
        from transformers import Qwen3OmniMoeThinkerForConditionalGeneration

        from omnistage.families.qwen2_5_omni.models import load_part

        cfg = self.stage_config(stage)
        dev = resolve_device(device or cfg.devices)
        if stage == "thinker":
            thinker_cfg = self.config.thinker_config
            if cfg.tensor_parallel_size > 1:  # transformers' layer loop on every rank (no CUDA graphs)
                model = tensor_parallel.launch_preparing(parallel.load_thinker_shard, self.model_path, cfg.dtype,
                                                         device or cfg.devices, cfg.tensor_parallel_size,
                                                         f"stages.{stage}.tensor_parallel_size")
            else:
                dtype = hf.resolve_dtype(cfg.dtype, thinker_cfg.text_config, dev)
                model = models.ThinkerLM(load_part(Qwen3OmniMoeThinkerForConditionalGeneration, self.model_path,
                                                   thinker_cfg, dtype, dev))
            eos = hf.eos_token_ids(self.model_path, thinker_cfg.text_config, self.tokenizer)
            return ar_engine(stage, cfg, model, thinker_cfg.text_config, self.tokenizer, eos,
                             {"embed": 0, "hidden": self.config.talker_config.accept_hidden_layer})
        if stage == "talker":
            talker_cfg = self.config.talker_config
            dtype = hf.resolve_dtype(cfg.dtype, talker_cfg.text_config, dev)
            model = models.load_talker(self.model_path, talker_cfg, self.config, dtype, dev)
            return ar_engine(stage, cfg, model, talker_cfg.text_config, None, (talker_cfg.codec_eos_token_id,))
        if stage == "code2wav":
            options = parse_section(Code2WavOptions, cfg.options, "stages.code2wav.options")
            model = models.load_code2wav(self.model_path, self.config.code2wav_config, dev)
            decoder = models.Code2Wav(model, dev, **options.model_dump(exclude={"window"}),
                                      window=options.window or options.chunk)
            return GenerationEngine.from_stage(stage, decoder, cfg)
        raise KeyError(stage)

    def to_output(self, stage: str, out: StageOutput) -> OmniOutput:
        if stage == "code2wav":
            audio = out.tensors.get("audio")
            return OmniOutput(out.request_id, audio=None if audio is None else audio.numpy(),
                              sample_rate=self.audio_sample_rate)
        return super(OmniPipeline, self).to_output(stage, out)

    def talker_params(self, request: OmniRequest) -> SamplingParams:
        """The request's talker params (else the stage's defaults) with the control ids suppressed (eos excepted,
        as transformers' generate) and the speech bound as its frame budget."""
        params = request.stage_params.get("talker") or self.stage_config("talker").sampling_params()
        return params.with_overrides(bad_token_ids=sorted({*params.bad_token_ids, *self.control_codes}),
                                     max_tokens=self.speech_codes(request, params.max_tokens))

    def speech_codes(self, request: OmniRequest, talker_max: int | None) -> int | None:
        """The most frames the talker may speak: the least of its `max_tokens`, the request's
        `audio.max_duration_s` and SECONDS_PER_TEXT_TOKEN per reply token the thinker may write."""
        rate = models.frames_per_second(self.config.code2wav_config)
        bounds = [talker_max] if talker_max is not None else []
        if (seconds := request.options.get("max_duration_s")) is not None:
            bounds.append(max(1, math.ceil(seconds * rate)))
        thinker = request.pipeline_state[HANDOFF].thinker_input.params if HANDOFF in request.pipeline_state else None
        if thinker is not None and thinker.max_tokens is not None:
            bounds.append(max(1, math.ceil(thinker.max_tokens * SECONDS_PER_TEXT_TOKEN * rate)))
        return min(bounds) if bounds else None

    @functools.cached_property
    def control_codes(self) -> tuple[int, ...]:
        cfg = self.config.talker_config
        vocab = cfg.text_config.vocab_size
        return tuple(i for i in range(max(0, vocab - CONTROL_IDS), vocab) if i != cfg.codec_eos_token_id)


@dataclass
class Handoff:
    """One request's edge state: its thinker input, then the thinker's rows gathered until the talker opens (its
    prompt ends with the first reply token's embedding)."""

    thinker_input: StageInput
    voice: str | None
    embed: list[torch.Tensor] = field(default_factory=list)
    hidden: list[torch.Tensor] = field(default_factory=list)
    talker_open: bool = False


def thinker_to_talker(pipeline: Qwen3OmniPipeline, request: OmniRequest, out: StageOutput) -> StageInput | None:
    """The thinker's rows become the talker's prompt (once the first reply token's embedding exists) and then its
    reply rows (embeddings only), one chunk per thinker output; the last chunk ends the reply."""
    state: Handoff = request.pipeline_state[HANDOFF]
    if state.talker_open and not out.finished:
        if not out.hidden_states:
            return None
        return StageInput(out.request_id, [], tensors={"thinker_embed": out.hidden_states["embed"]}, final=False)
    if out.hidden_states:
        state.embed.append(out.hidden_states["embed"])
        state.hidden.append(out.hidden_states["hidden"])
    rows = sum(len(x) for x in state.embed)
    inp = state.thinker_input
    n = len(inp.token_ids)
    if not state.talker_open and rows <= n and not out.finished:
        return None
    tensors: dict[str, torch.Tensor] = {}
    if rows:
        tensors["thinker_embed"] = torch.cat(state.embed)
    params = None
    if not state.talker_open:
        state.talker_open = True
        params = pipeline.talker_params(request)
        tensors.update({
            "thinker_hidden": torch.cat(state.hidden)[:n],
            "prompt_ids": torch.tensor(inp.token_ids),
            "speaker": torch.tensor(pipeline.speaker_ids[state.voice]),
            "subtalker": models.SUBTALKER_GREEDY if params.greedy else models.SUBTALKER_SAMPLED,
            **{k: inp.tensors[k] for k in _MEDIA_TENSORS if k in inp.tensors},
        })
        if "feature_attention_mask" in inp.tensors:
            tensors["audio_lengths"] = inp.tensors["feature_attention_mask"].sum(-1)
    state.embed, state.hidden = [], []
    return StageInput(out.request_id, [], params=params, tensors=tensors, final=out.finished)


def talker_to_code2wav(pipeline: Qwen3OmniPipeline, request: OmniRequest, out: StageOutput) -> StageInput | None:
    """The talker's frames [k, Q] for code2wav: as they come when it decodes in windows, else all at the end."""
    codes = out.tensors.get("codes")
    if codes is None and not out.finished:
        return None
    opened = request.pipeline_state.setdefault(HANDOFF + ".code2wav", False)
    params = None if opened else {"stream": pipeline.streams_audio}
    request.pipeline_state[HANDOFF + ".code2wav"] = True
    return StageInput(out.request_id, [], params=params, tensors={} if codes is None else {"codes": codes},
                      final=out.finished)


class Code2WavOptions(BaseModel):
    """`stages.code2wav.options`: how audio is cut into chunks while frames still arrive (12.5 frames a second)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    window: int = Field(0, ge=0, description="frames per streamed audio chunk; 0 decodes the whole utterance at "
                        "the end")
    first_window: int = Field(10, ge=1, description="frames in a streamed request's first chunk (smaller: audio "
                              "starts sooner)")
    left_context: int = Field(25, ge=1, description="earlier frames decoded again with each window (as "
                              "transformers' chunked decode)")
    chunk: int = Field(300, ge=1, description="frames per decode of an utterance decoded at its end")


def _speaks(info: CheckpointInfo) -> bool:
    """Thinking and Captioner checkpoints have no talker (`enable_audio_output` false): the thinker alone runs."""
    return bool((info.config or {}).get("enable_audio_output", True))


CONFIGS = Path(__file__).with_name("configs")  # the shipped deploy configs


class Qwen3OmniMoeFamily:
    name = "qwen3_omni_moe"

    def matches(self, info: CheckpointInfo) -> bool:
        return "Qwen3OmniMoeForConditionalGeneration" in info.architectures

    def default_deploy(self, info: CheckpointInfo) -> dict[str, Any]:
        """The shipped configs/1gpu.yaml, or 2gpu.yaml with two or more GPUs visible. Without a GPU the stages'
        `devices` and `dtype` are dropped: every stage on the CPU, float32. A checkpoint without a talker keeps
        the thinker's section alone."""
        gpus = torch.cuda.device_count()
        deploy = yaml.safe_load((CONFIGS / ("2gpu.yaml" if gpus >= 2 else "1gpu.yaml")).read_text())
        if not _speaks(info):
            deploy["stages"] = {"thinker": deploy["stages"]["thinker"]}
        if gpus == 0:
            for stage in deploy["stages"].values():
                stage.pop("devices", None)
                stage.pop("dtype", None)
        return deploy

    def pipeline(self, info: CheckpointInfo, deploy: DeployConfig) -> Qwen3OmniPipeline:
        from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeProcessor

        speaks = _speaks(info)
        deploy.check_stages({"thinker": ARAdvanced, **({"talker": ARAdvanced, "code2wav": Advanced} if speaks else {})},
                            options={"code2wav": Code2WavOptions})
        config = Qwen3OmniMoeConfig.from_pretrained(info.path)
        if (ranks := deploy.stage("thinker").tensor_parallel_size) > 1:  # only the thinker's text decoder shards
            tensor_parallel.check_shardable(config.thinker_config.text_config, ranks,
                                            "stages.thinker.tensor_parallel_size", parallel.THINKER_DECODERS)
        if speaks and deploy.stage("talker").tensor_parallel_size > 1:
            raise ConfigError("invalid deploy config: stages.talker.tensor_parallel_size: the talker runs on one "
                              "device (tensor parallelism covers the thinker); set it to 1")
        stages = [StageSpec("thinker", "ar", ("text",))]
        if speaks:
            stages += [StageSpec("talker", "ar"), StageSpec("code2wav", "generation", ("audio",))]
        pipeline = Qwen3OmniPipeline(info.path, deploy, stages)
        pipeline.config = config
        if speaks:
            pipeline.streams_audio = bool(deploy.stage("code2wav").options.get("window"))
            pipeline.edges = [
                Edge("thinker", "talker", lambda r, o: thinker_to_talker(pipeline, r, o)),
                Edge("talker", "code2wav", lambda r, o: talker_to_code2wav(pipeline, r, o),
                     streamed=pipeline.streams_audio),
            ]
        pipeline.processor = Qwen3OmniMoeProcessor.from_pretrained(info.path)
        pipeline.tokenizer = pipeline.processor.tokenizer
        speakers = (config.talker_config.speaker_id or {}) if speaks else {}
        # named as the released model card names them; transformers' default voice, Ethan, first
        pipeline.speaker_ids = {name.capitalize(): int(speakers[name])
                                for name in sorted(speakers, key=lambda s: (s.lower() != "ethan", s))}
        pipeline.voices = tuple(pipeline.speaker_ids)
        text_cfg = config.thinker_config.text_config
        configured = deploy.stage("thinker").max_model_len
        native = text_cfg.max_position_embeddings
        pipeline.max_model_len = min(native, configured) if configured else native
        return pipeline
