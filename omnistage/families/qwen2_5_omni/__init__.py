"""Qwen2.5-Omni: thinker (AR, text) -> talker (AR, codec codes) -> token2wav (generation, 24 kHz audio).

Requests for text only never touch the talker or token2wav. See models.py for what flows on each edge.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
import yaml
from pydantic import BaseModel, ConfigDict, Field

from omnistage.config.deploy import Advanced, DeployConfig, parse_section
from omnistage.devices import resolve_device
from omnistage.engine.ar.engine import ARAdvanced, AREngine
from omnistage.engine.generation.engine import GenerationEngine
from omnistage.errors import ConfigError, RequestError
from omnistage.families import hf, tensor_parallel
from omnistage.families.base import CheckpointInfo, Edge, StageSpec
from omnistage.families.causal_lm import TextPipeline, ar_engine, template_error, template_kwargs
from omnistage.families.qwen2_5_omni import models
from omnistage.media import MEDIA_PART_TYPES, MediaBudget, MediaLimits, RemotePolicy, check_part_count, load_part
from omnistage.sampling_params import SamplingParams
from omnistage.types import OmniOutput, OmniRequest, StageInput, StageOutput

# The system prompt the released model was trained to speak under.
SPEECH_SYSTEM_PROMPT = (
    "You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of perceiving auditory "
    "and visual inputs, as well as generating text and speech."
)
# Speech allowed per text token the thinker may write: several times what the trained model speaks, so only
# runaway talking (random weights, a talker that misses its end code) is cut.
SECONDS_PER_TEXT_TOKEN = 1.0
THINKER_DECODERS = ("qwen2_5_omni_text",)  # the thinker's text decoder: Qwen2 layers, M-RoPE
_MEDIA_TENSORS = ("image_grid_thw", "video_grid_thw", "video_second_per_grid", "use_audio_in_video")


class OmniPipeline(TextPipeline):
    processor: Any = None
    config: Any = None
    voices: tuple[str, ...] = ()
    voice_bos: dict[str, int] | None = None
    audio_sample_rate: ClassVar[int | None] = models.SAMPLE_RATE
    input_modalities: ClassVar[tuple[str, ...]] = ("text", "image", "audio", "video")

    # ---- the caller's request -> the thinker's input ------------------------------------------

    def preprocess(self, request: OmniRequest) -> StageInput:
        inp, voice = self.thinker_input(request)
        t2w = request.stage_params.get("token2wav")
        seed = t2w.seed if t2w is not None and t2w.seed is not None else request.options.get("seed", 0)
        request.pipeline_state[HANDOFF] = OmniHandoff(inp, voice, seed)
        return inp

    def thinker_input(self, request: OmniRequest) -> tuple[StageInput, str | None]:
        """The thinker's input (the chat template over the messages with their media, under the speech system prompt
        when speech is asked for without a system message; the processor's features and layout tensors) and the
        voice a speech request speaks with."""
        speech = "audio" in request.output_modalities
        voice = self.voice_named(request.options.get("voice")) if speech else None
        use_audio_in_video = bool(request.options.get("use_audio_in_video", False))
        messages, media, media_kwargs = self._split_media(request, use_audio_in_video)
        if speech and messages[0].get("role") != "system":
            messages.insert(0, {"role": "system", "content": [{"type": "text", "text": SPEECH_SYSTEM_PROMPT}]})
        try:
            text = self.processor.apply_chat_template(messages, tokenize=False, **template_kwargs(request.options))
            batch = self.processor(
                text=[text], audio=media.get("audio") or None, images=media.get("image") or None,
                videos=media.get("video") or None, return_tensors="pt", padding=False,
                **{**(request.options.get("mm_processor_kwargs") or {}), **media_kwargs},
            )
        except (ValueError, TypeError, KeyError) as exc:  # the messages' shape or media, not the server
            raise template_error(exc) from None
        tensors = {k: v[0] if k == "input_ids" else v for k, v in batch.items() if isinstance(v, torch.Tensor)}
        ids = tensors.pop("input_ids").tolist()
        tensors.pop("attention_mask", None)
        tensors["use_audio_in_video"] = torch.tensor(use_audio_in_video)
        inp = StageInput(request.request_id, ids, params=self.entry_params(request), tensors=tensors,
                         return_hidden_states=speech)
        return inp, voice

    def _split_media(
        self, request: OmniRequest, use_audio_in_video: bool
    ) -> tuple[list[dict], dict[str, list], dict[str, Any]]:
        """Messages with media parts turned into the template's placeholders, the media in order, and the
        processor arguments they need. A part may carry a decoded object ({"type": "image", "image": PIL
        image}, "audio": float32 array at 16 kHz, "video": Video) or be an OpenAI part (image_url,
        input_audio, audio_url, video_url; AsyncOmni has fetched their URLs already) checked against the deploy
        config's limits. With `use_audio_in_video`, each video's sound track joins the audio list and the processor
        is told which video it belongs to."""
        media: dict[str, list] = {kind: list(items) for kind, items in request.media.items()}
        fps: list[float] = []
        audio_of_video: list[int | None] = [None] * len(media.get("audio", []))
        limits = MediaLimits.from_config(self.deploy.limits)
        policy = RemotePolicy.from_config(self.deploy.media)
        budget = MediaBudget(limits.max_total_bytes)
        check_part_count(request.messages, limits)
        messages = []
        for i, message in enumerate(request.messages or [{"role": "user", "content": request.prompt or ""}]):
            content = message.get("content")
            if not isinstance(content, list):
                messages.append(message)
                continue
            parts = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind in MEDIA_PART_TYPES:
                    item = load_part(part, f"messages[{i}].content[{j}]", limits, policy=policy, budget=budget,
                                     use_audio_in_video=use_audio_in_video)
                    kind, value = item.kind, item.value
                elif kind in ("image", "audio", "video") and kind in part:
                    value = part[kind]
                else:
                    parts.append(part)
                    continue
                media.setdefault(kind, []).append(value.frames if kind == "video" else value)
                if kind == "audio":
                    audio_of_video.append(None)
                if kind == "video":
                    fps.append(value.fps)
                    if use_audio_in_video:
                        if value.audio is None:
                            raise RequestError(f"messages[{i}].content[{j}]: use_audio_in_video is set but the "
                                               "video has no audio track", "use_audio_in_video")
                        media.setdefault("audio", []).append(value.audio)
                        audio_of_video.append(len(media["video"]) - 1)
                parts.append({"type": kind})
            messages.append({**message, "content": parts})
        kwargs: dict[str, Any] = {"fps": fps[0]} if fps else {}  # media decoding samples every video alike
        if use_audio_in_video and fps:
            kwargs.update(load_audio_from_video=True, audio_from_video_indices=audio_of_video)
        return messages, media, kwargs

    # ---- stage engines ---------------------------------------------------------------------------

    def build_engine(self, stage: str, device: str | None = None) -> AREngine | GenerationEngine:
        from transformers import Qwen2_5OmniTalkerForConditionalGeneration, Qwen2_5OmniThinkerForConditionalGeneration

        cfg = self.stage_config(stage)
        dev = resolve_device(device or cfg.devices)
        if stage == "thinker":
            thinker_cfg = self.config.thinker_config
            if cfg.tensor_parallel_size > 1:  # the plain HF layer loop on every rank (no fused decoder, no graphs)
                model = tensor_parallel.launch_preparing(models.load_thinker_shard, self.model_path, cfg.dtype,
                                                         device or cfg.devices, cfg.tensor_parallel_size,
                                                         f"stages.{stage}.tensor_parallel_size")
            else:
                dtype = hf.resolve_dtype(cfg.dtype, thinker_cfg.text_config, dev)
                model = models.ThinkerLM(models.load_part(Qwen2_5OmniThinkerForConditionalGeneration,
                                                          self.model_path, thinker_cfg, dtype, dev))
            eos = hf.eos_token_ids(self.model_path, thinker_cfg.text_config, self.tokenizer)
            return ar_engine(stage, cfg, model, thinker_cfg.text_config, self.tokenizer, eos,
                             {"embed": 0, "last": thinker_cfg.text_config.num_hidden_layers})
        if stage == "talker":
            talker_cfg = self.config.talker_config
            dtype = hf.resolve_dtype(cfg.dtype, talker_cfg, dev)
            talker = models.load_part(Qwen2_5OmniTalkerForConditionalGeneration, self.model_path, talker_cfg,
                                      dtype, dev)
            text_ids = sorted({talker_cfg.tts_text_end_token_id, talker_cfg.tts_text_pad_token_id,
                               *(int(v["bos_token"]) for v in models.load_voices(self.model_path).values())})
            table = models.checkpoint_rows(self.model_path, "thinker.model.embed_tokens.weight", text_ids)
            thinker = self.config.thinker_config
            media_ids = [thinker.audio_token_id, thinker.image_token_id, thinker.video_token_id]
            model = models.TalkerLM(talker, dict(zip(text_ids, table, strict=True)), media_ids)
            return ar_engine(stage, cfg, model, talker_cfg, None, tuple(sorted(self.codec_stops)),
                             tuned=TALKER_TUNED)
        if stage == "token2wav":
            t2w = models.load_token2wav(self.model_path, self.config.token2wav_config, dev, dit_dtype(cfg.dtype, dev))
            options = parse_section(Token2WavOptions, cfg.options, "stages.token2wav.options")
            advanced = parse_section(Token2WavAdvanced, cfg.advanced, "stages.token2wav.advanced")
            decoder = models.Token2Wav(t2w, models.load_voices(self.model_path), dev, use_graphs=not cfg.enforce_eager,
                                       max_batch=cfg.max_num_seqs, **options.model_dump(),
                                       **advanced.model_dump(exclude={"stream_priority"}))
            decoder.warm_up()
            return GenerationEngine.from_stage(stage, decoder, cfg)
        raise KeyError(stage)

    def to_output(self, stage: str, out: StageOutput) -> OmniOutput:
        if stage == "token2wav":
            audio = out.tensors.get("audio")
            return OmniOutput(out.request_id, audio=None if audio is None else audio.numpy(),
                              sample_rate=self.audio_sample_rate)
        return super().to_output(stage, out)

    def voice_named(self, name: str | None) -> str | None:
        """The checkpoint's voice `name` names, matched case-insensitively; None: its first voice."""
        if not name:
            return self.voices[0] if self.voices else None
        for voice in self.voices:
            if voice.lower() == name.lower():
                return voice
        raise RequestError(f"unknown voice {name!r}; this model has {list(self.voices)}", "audio.voice")

    def talker_params(self, request: OmniRequest) -> SamplingParams:
        """The talker never samples what token2wav cannot decode: codec ids past the DiT's code embedding
        other than the two stop codes (a trained talker does not either; random weights would, and token2wav
        would fail the request), nor the codec start code. Its code budget is the speech bound."""
        params = request.stage_params.get("talker") or self.stage_config("talker").sampling_params()
        return params.with_overrides(bad_token_ids=sorted({*params.bad_token_ids, *self.undecodable_codes}),
                                     max_tokens=self.speech_codes(request, params.max_tokens))

    def speech_codes(self, request: OmniRequest, talker_max: int | None) -> int | None:
        """The most codes the talker may speak for `request`: the least of the talker's `max_tokens`, the
        request's `audio.max_duration_s` in codes, and SECONDS_PER_TEXT_TOKEN of speech per reply token the
        thinker may write (so a short `max_tokens` gives short speech). None: until the talker's context ends."""
        rate = models.SAMPLE_RATE / (models.Token2Wav.HOP * self.config.token2wav_config.dit_config.repeats)
        bounds = [talker_max] if talker_max is not None else []
        if (seconds := request.options.get("max_duration_s")) is not None:
            bounds.append(max(1, math.ceil(seconds * rate)))
        thinker = request.pipeline_state[HANDOFF].thinker_input.params if HANDOFF in request.pipeline_state else None
        if thinker is not None and thinker.max_tokens is not None:
            bounds.append(max(1, math.ceil(thinker.max_tokens * SECONDS_PER_TEXT_TOKEN * rate)))
        return min(bounds) if bounds else None

    @functools.cached_property
    def codec_stops(self) -> frozenset[int]:
        """The talker's end and padding codes: never sent to token2wav."""
        cfg = self.config.talker_config
        return frozenset({cfg.tts_codec_pad_token_id, cfg.tts_codec_end_token_id})

    @functools.cached_property
    def undecodable_codes(self) -> tuple[int, ...]:
        cfg = self.config.talker_config
        decodable = self.config.token2wav_config.dit_config.num_embeds  # ids 0..num_embeds embed
        return (cfg.tts_codec_start_token_id,
                *(i for i in range(decodable + 1, cfg.vocab_size) if i not in self.codec_stops))

    def transcription_messages(self, audio: Any, task: str, language: str | None = None,
                               prompt: str | None = None) -> list[dict[str, Any]]:
        """The neutral instruction under the system prompt Qwen's audio cookbook gives the model for the task."""
        role = "translation" if task == "translate" else "recognition"
        system = {"role": "system", "content": [{"type": "text", "text": f"You are a speech {role} model."}]}
        return [system, *super().transcription_messages(audio, task, language, prompt)]


HANDOFF = "qwen2_5_omni"  # the key of a request's OmniHandoff in its pipeline_state


@dataclass
class OmniHandoff:
    """What one request's edges carry between stages: set when its thinker input is prepared, then the thinker's
    reply states gathered until the talker opens (the talker's prompt ends with the first reply token's states)."""

    thinker_input: StageInput  # the talker's prompt needs the thinker's prompt ids and media layout
    voice: str | None
    token2wav_seed: int
    embed: list[torch.Tensor] = field(default_factory=list)  # thinker rows not yet sent to the talker
    last: list[torch.Tensor] = field(default_factory=list)
    first_token: int | None = None  # the thinker's first reply token
    talker_open: bool = False  # the talker has its prompt: later rows stream to it one step at a time


def thinker_to_talker(pipeline: OmniPipeline, request: OmniRequest, out: StageOutput) -> StageInput | None:
    """The thinker's reply, as states per computed token, becomes the talker's prompt and then its added
    rows. Streamed (`async_chunk`), the talker opens once the first reply token's states exist and gets
    each later row as the thinker computes it; otherwise `out` is the whole reply, at its end."""
    state: OmniHandoff = request.pipeline_state[HANDOFF]
    if state.talker_open and not out.finished:  # a row per request per thinker step: lean
        if not out.hidden_states:
            return None
        tensors = {"thinker_embed": out.hidden_states["embed"], "thinker_last": out.hidden_states["last"]}
        return StageInput(out.request_id, [], tensors=tensors, final=False)
    thinker_inp = state.thinker_input
    if out.hidden_states:
        state.embed.append(out.hidden_states["embed"])
        state.last.append(out.hidden_states["last"])
    if state.first_token is None and out.token_ids:
        state.first_token = out.token_ids[0]
    rows = sum(len(x) for x in state.last)
    prompt_len = len(thinker_inp.token_ids)
    if not state.talker_open and rows <= prompt_len and not out.finished:
        return None  # the talker's prompt ends with the first reply token's states
    cfg, params = pipeline.config.talker_config, None  # (opening the talker, or the reply's end)
    tensors = {}
    if rows:  # no kernels here (a request per output): the talker sums a step's rows at once
        tensors["thinker_embed"], tensors["thinker_last"] = _joined(state.embed), _joined(state.last)
    state.embed, state.last = [], []
    if not state.talker_open or out.finished:  # the talker reads the text ids when it opens and at the reply's end
        tensors["text_eos"] = torch.tensor(cfg.tts_text_end_token_id)
        tensors["text_pad"] = torch.tensor(cfg.tts_text_pad_token_id)
    if not state.talker_open:
        state.talker_open = True
        params = pipeline.talker_params(request)  # later chunks only add rows: the talker keeps the first's
        tensors.update({
            "prompt_ids": torch.tensor(thinker_inp.token_ids),
            "voice_bos": torch.tensor(pipeline.voice_bos[state.voice]),
            "first_token": torch.tensor(state.first_token),
            **{k: thinker_inp.tensors[k] for k in _MEDIA_TENSORS if k in thinker_inp.tensors},
        })
        if "feature_attention_mask" in thinker_inp.tensors:
            tensors["audio_lengths"] = thinker_inp.tensors["feature_attention_mask"].sum(-1)
    return StageInput(out.request_id, [], params=params, tensors=tensors, final=out.finished)


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def talker_to_token2wav(pipeline: OmniPipeline, request: OmniRequest, out: StageOutput) -> StageInput | None:
    """Codes (without the talker's stop codes) for token2wav: all at the end, or as they come when the
    token2wav stage decodes in windows. The noise seed: the token2wav entry of the request's sampling params
    (its `seed`), else the request's `seed` option, else 0 (fixed when the request was prepared)."""
    stop = pipeline.codec_stops  # runs once per code per request: no config attribute reads here
    codes = [c for c in out.token_ids if c not in stop]
    if not codes and not out.finished:
        return None
    state: OmniHandoff = request.pipeline_state[HANDOFF]
    params = {"voice": state.voice, "seed": state.token2wav_seed}
    return StageInput(out.request_id, codes, params=params, final=out.finished)


class Token2WavOptions(BaseModel):
    """`stages.token2wav.options`: how audio is cut into chunks while codes still arrive."""

    model_config = ConfigDict(extra="forbid", strict=True)

    window: int = Field(0, ge=0, description="codes per streamed audio chunk; 0 decodes the whole utterance at "
                        "the end")
    first_window: int | None = Field(None, ge=1, description="codes in the first chunk (smaller: audio starts "
                                     "sooner); None: 24, or window if smaller")
    max_window: int | None = Field(None, ge=1, description="later windows double from window up to this many "
                                   "codes (less context recomputed per code, bigger chunks); None: window")
    vocoder_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="the vocoder's convolutions: float32, or bfloat16 (CUDA: tensor cores, less exact)")


class Token2WavAdvanced(Advanced):
    """`stages.token2wav.advanced`: internal tuning of the DiT solve and the vocoder."""

    kept_context: bool = Field(True, description="each window's look-back layers read the keys and values the "
                               "previous window's solve kept (windows must be whole DiT blocks, `left` unset); "
                               "false: solve `left` codes of context again with each window")
    left: int | None = Field(None, ge=0, description="codes of left context solved with each window when "
                             "kept_context is off; None: what the DiT attends back to")
    right: int | None = Field(None, ge=0, description="codes of look-ahead each window waits for; None: what the "
                              "DiT attends ahead to")
    vocoder_context: int = Field(16, ge=0, description="mel frames of context on each side of a window for the "
                                 "vocoder")
    num_steps: int = Field(10, ge=2, description="flow-matching ODE steps")
    tf32: bool = Field(False, description="a float32 DiT's matmuls on TensorFloat-32 tensor cores (torch's "
                       "process-wide switch, held while a solve launches: float32 stages inline beside it may get "
                       "TF32 matmuls then too)")
    cublas_sm_carveout: int = Field(32, ge=0, description="SMs the DiT's cuBLAS matmuls leave free for the other "
                                    "stages' kernels (CUDA)")
    carveout_max_batch: int | None = Field(2, ge=1, description="the largest batch of windows cublas_sm_carveout "
                                           "applies to (None: all): a busy server's large batches run at full width")
    overlap_vocoder_max_batch: int | None = Field(
        None, ge=0, description="on CUDA, the vocoder of a batch of up to this many windows runs on a stream of its "
        "own beside the next window's solve; 0: never; None: 2, or 0 with the DiT in strict float32 (whose long "
        "solves starve the vocoder beside them)")
    widen_vocoder_spans: bool = Field(True, description="a window whose vocoder span has no CUDA graph (mostly a "
                                      "request's last) is vocoded at a captured length with more earlier mel on its "
                                      "left, not eagerly at a new length (which cuDNN plans first, holding the stage)")


# The talker's family-tuned AR defaults: after the reply, 8 codes per launch, so the host (and the interpreter the
# inline stages share) does per-token work once per 8 codes.
TALKER_TUNED = {"decode_burst": 8}
CONFIGS = Path(__file__).with_name("configs")  # the shipped deploy configs (configs/qwen2_5_omni/ copies them)


def dit_dtype(name: str, device: torch.device) -> torch.dtype:
    """token2wav's DiT precision: "auto" is bfloat16 on a GPU, float32 (exact, as transformers runs it) on the
    CPU, like every stage's "auto"."""
    if name != "auto":
        return getattr(torch, name)
    return torch.bfloat16 if device.type == "cuda" else torch.float32


class Qwen25OmniFamily:
    name = "qwen2_5_omni"

    def matches(self, info: CheckpointInfo) -> bool:
        return "Qwen2_5OmniForConditionalGeneration" in info.architectures

    def default_deploy(self, info: CheckpointInfo) -> dict[str, Any]:
        """The shipped configs/1gpu.yaml, or 2gpu.yaml with two or more GPUs visible. Without a GPU the stages'
        `devices` and `dtype` (which name GPUs and GPU precisions) are dropped: every stage on the CPU, float32."""
        gpus = torch.cuda.device_count()
        deploy = yaml.safe_load((CONFIGS / ("2gpu.yaml" if gpus >= 2 else "1gpu.yaml")).read_text())
        if gpus == 0:
            for stage in deploy["stages"].values():
                stage.pop("devices", None)
                stage.pop("dtype", None)
        return deploy

    def pipeline(self, info: CheckpointInfo, deploy: DeployConfig) -> OmniPipeline:
        from transformers import Qwen2_5OmniConfig, Qwen2_5OmniProcessor

        deploy.check_stages({"thinker": ARAdvanced, "talker": ARAdvanced, "token2wav": Token2WavAdvanced},
                            options={"token2wav": Token2WavOptions})
        stages = [StageSpec("thinker", "ar", ("text",)), StageSpec("talker", "ar"),
                  StageSpec("token2wav", "generation", ("audio",))]
        pipeline = OmniPipeline(info.path, deploy, stages)
        pipeline.edges = [
            Edge("thinker", "talker", lambda r, o: thinker_to_talker(pipeline, r, o)),
            Edge("talker", "token2wav", lambda r, o: talker_to_token2wav(pipeline, r, o),
                 streamed=bool(deploy.stage("token2wav").options.get("window"))),
        ]
        with models.thinker_ids_unflagged():
            pipeline.config = Qwen2_5OmniConfig.from_pretrained(info.path)
        if (ranks := deploy.stage("thinker").tensor_parallel_size) > 1:  # only the thinker's text decoder shards
            tensor_parallel.check_shardable(pipeline.config.thinker_config.text_config, ranks,
                                            "stages.thinker.tensor_parallel_size", THINKER_DECODERS)
        if deploy.stage("talker").tensor_parallel_size > 1:
            raise ConfigError("invalid deploy config: stages.talker.tensor_parallel_size: the talker runs on one "
                              "device (tensor parallelism covers the thinker); set it to 1")
        pipeline.processor = Qwen2_5OmniProcessor.from_pretrained(info.path)
        pipeline.tokenizer = pipeline.processor.tokenizer
        voices = models.load_voices(info.path)
        pipeline.voices = tuple(voices)
        pipeline.voice_bos = {name: int(v["bos_token"]) for name, v in voices.items()}
        text_cfg = pipeline.config.thinker_config.text_config
        configured = deploy.stage("thinker").max_model_len
        native = text_cfg.max_position_embeddings
        pipeline.max_model_len = min(native, configured) if configured else native
        return pipeline
