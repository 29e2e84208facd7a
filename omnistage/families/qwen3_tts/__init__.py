"""Qwen3-TTS-12Hz (issue 53): talker (AR: one frame of Q codes per step) -> codec (generation: 24 kHz audio).

CustomVoice (a named speaker), VoiceDesign (a voice described by an instruction) and Base (voice clone: the
speaker encoder's x-vector, and for ICL the reference audio's codes with its transcript) checkpoints. The talker's
stage is talker.py, the codec decoder codec.py, the clone encoders speaker.py / reference_audio.py, notes in
docs/families/qwen3_tts.md. Request options: `voice` (CustomVoice: a speaker of the checkpoint's `spk_id`, any case;
default its first), `instruct` (VoiceDesign, and CustomVoice checkpoints other than 0.6B: how to speak), `language`
(default "auto"), `task_type` (must name this checkpoint's kind), Base: `ref_audio` (24 kHz mono float32) or
`voice_features` (what `clone_features` returned), `ref_text`, `x_vector_only_mode`; `non_streaming_mode` (the text
mode; default as the package's generate_* methods: streaming text for Base, non-streaming for the others) and the
code predictor's sampling `subtalker_dosample/temperature/top_k/top_p` (default: generation_config.json).
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from typing import Any, ClassVar

import numpy as np
import torch

from omnistage.config.deploy import Advanced, DeployConfig, parse_section
from omnistage.devices import resolve_device
from omnistage.engine.ar.engine import ARAdvanced, AREngine
from omnistage.engine.generation.engine import GenerationEngine
from omnistage.errors import RequestError
from omnistage.families.base import CheckpointInfo, Edge, Pipeline, StageSpec
from omnistage.families.causal_lm import ar_engine
from omnistage.families.qwen3_tts import talker as talker_mod
from omnistage.families.qwen3_tts.codec import CodecOptions, CodecStage, load_codec_decoder
from omnistage.sampling_params import SamplingParams
from omnistage.types import OmniOutput, OmniRequest, StageInput, StageOutput

SAMPLE_RATE = 24000
_SUBTALKER = ("subtalker_dosample", "subtalker_temperature", "subtalker_top_k", "subtalker_top_p")
KINDS = {"custom_voice": "CustomVoice", "voice_design": "VoiceDesign", "base": "Base"}
REF_CODES = "qwen3_tts_ref_codes"  # a request's pipeline_state key: its ICL reference codes, for the codec edge
_MIN_REF_SAMPLES = SAMPLE_RATE // 4  # the encoders' reflect paddings need a few frames of reference audio
_CLONE_CACHE = 64  # clone_features results kept (LRU by content)


class Qwen3TTSPipeline(Pipeline):
    audio_sample_rate: ClassVar[int | None] = SAMPLE_RATE
    config: dict[str, Any] | None = None
    generation: dict[str, Any] | None = None

    @property
    def talker_config(self) -> dict[str, Any]:
        return self.config["talker_config"]

    def text_of(self, request: OmniRequest) -> str:
        if request.prompt is not None:
            return request.prompt
        if request.messages:
            content = request.messages[-1].get("content")
            if isinstance(content, str):
                return content
            if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                return "".join(p.get("text", "") for p in content)
            raise RequestError("the last message must be text: this model reads it aloud", "messages")
        raise RequestError("send the text to speak as a prompt or a message", "prompt")

    @property
    def tts_kind(self) -> str:
        """custom_voice, voice_design or base (`config.tts_model_type`)."""
        return self.config.get("tts_model_type")

    @property
    def can_clone(self) -> bool:
        return self.tts_kind == "base"

    def speakers(self) -> list[str]:
        """The checkpoint's speaker names ([] for VoiceDesign and Base)."""
        return list(self.talker_config.get("spk_id") or {}) if self.tts_kind == "custom_voice" else []

    def languages(self) -> list[str]:
        return ["auto", *sorted(self.talker_config.get("codec_language_id") or {})]

    def _clone_encoders(self) -> tuple[Any, Any]:
        """The speaker encoder and the speech tokenizer's encoder, loaded on first use (CPU). Caller holds the lock."""
        if self._encoders is None:
            from omnistage.families.qwen3_tts.reference_audio import ReferenceEncoder
            from omnistage.families.qwen3_tts.speaker import load_speaker_encoder

            self._encoders = (load_speaker_encoder(self.model_path, self.config.get("speaker_encoder_config") or {}),
                              ReferenceEncoder(self.model_path / "speech_tokenizer"))
        return self._encoders

    def clone_features(self, audio: np.ndarray, ref_text: str | None, x_vector_only: bool) -> dict[str, torch.Tensor]:
        """A reference voice's features: "x_vector" [hidden] and, unless x-vector only or without a transcript,
        "ref_codes" [T, Q] int64 (CPU). Thread-safe; cached by the audio's content (LRU)."""
        if not self.can_clone:
            raise RequestError(f"this model does not clone voices (it is a {KINDS.get(self.tts_kind)} model)",
                               "ref_audio")
        audio = np.ascontiguousarray(np.asarray(audio, dtype=np.float32).reshape(-1))
        if audio.shape[0] < _MIN_REF_SAMPLES or not np.isfinite(audio).all():
            raise RequestError(f"ref_audio must be at least {_MIN_REF_SAMPLES / SAMPLE_RATE:.2f} s of finite mono "
                               f"samples at {SAMPLE_RATE} Hz", "ref_audio")
        codes = not x_vector_only and bool(ref_text)
        key = (hashlib.sha256(audio.tobytes()).hexdigest(), codes)
        from omnistage.families.qwen3_tts.speaker import x_vector

        with self._clone_lock:
            if key in self._clone_cache:
                self._clone_cache.move_to_end(key)
                return dict(self._clone_cache[key])
            speaker, reference = self._clone_encoders()
            feats = {"x_vector": x_vector(speaker, audio)}
            if codes:
                feats["ref_codes"] = reference.encode(audio)
            self._clone_cache[key] = feats
            while len(self._clone_cache) > _CLONE_CACHE:
                self._clone_cache.popitem(last=False)
            return dict(feats)

    def _check_options(self, opts: dict[str, Any]) -> str:
        """The request's language (lower case), after checking task_type, voice, language and the clone options
        against this checkpoint."""
        kind = self.tts_kind
        task = opts.get("task_type")
        if task is not None and str(task).lower().replace("_", "") != KINDS[kind].lower():
            raise RequestError(f"task_type {task!r} does not match this model: it is a {KINDS[kind]} model "
                               f"(task_type {KINDS[kind]!r})", "task_type")
        language = str(opts.get("language") or "auto").lower()
        if language not in self.languages():
            raise RequestError(f"unknown language {opts.get('language')!r}; this model knows: "
                               f"{', '.join(self.languages())}", "language")
        voice = opts.get("voice")
        if voice and kind == "custom_voice" and voice.lower() not in self.talker_config["spk_id"]:
            raise RequestError(f"unknown voice {voice!r}; this model's voices: {', '.join(self.speakers())}", "voice")
        if voice and kind != "custom_voice":
            raise RequestError(f"this {KINDS[kind]} model has no named voices; "
                               + ("describe the voice in `instructions`" if kind == "voice_design" else
                                  "send ref_audio (a reference voice) instead"), "voice")
        cloning = opts.get("ref_audio") is not None or opts.get("voice_features") is not None
        if cloning and not self.can_clone:
            raise RequestError(f"this model does not clone voices (it is a {KINDS[kind]} model); drop ref_audio "
                               "or serve a Qwen3-TTS Base checkpoint", "ref_audio")
        if self.can_clone and not cloning:
            raise RequestError("this Base (voice clone) model needs a reference voice: send ref_audio (and its "
                               "ref_text for the best clone) or an uploaded voice", "ref_audio")
        return language

    def _clone_prompt(self, opts: dict[str, Any]) -> dict[str, Any]:
        """talker_input's Base arguments: the x-vector and, for ICL, ref codes + the ref text's ids."""
        ref_text = opts.get("ref_text") or None
        xvec_only = bool(opts.get("x_vector_only_mode"))
        feats = opts.get("voice_features")
        if feats is None:
            feats = self.clone_features(opts["ref_audio"], ref_text, xvec_only)
        if not isinstance(feats, dict) or "x_vector" not in feats:
            raise RequestError("voice_features must be what clone_features returned (an x_vector)", "voice")
        x_vec = torch.as_tensor(feats["x_vector"]).float().reshape(-1)
        if x_vec.shape[0] != self.talker_config["hidden_size"]:
            raise RequestError(f"the voice's x-vector has {x_vec.shape[0]} values; this model's are "
                               f"{self.talker_config['hidden_size']}: the voice was made for another model", "voice")
        out: dict[str, Any] = {"x_vector": x_vec}
        codes = feats.get("ref_codes")
        if codes is not None and ref_text and not xvec_only:
            out["ref_codes"] = torch.as_tensor(codes).long()
            out["ref_text_ids"] = self.tokenizer(f"<|im_start|>assistant\n{ref_text}<|im_end|>\n")["input_ids"]
        return out

    def preprocess(self, request: OmniRequest) -> StageInput:
        text = self.text_of(request)
        ids = self.tokenizer(f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
        opts, kind = request.options, self.tts_kind
        language = self._check_options(opts)
        speaker = (opts.get("voice") or self.speakers()[0]) if kind == "custom_voice" else None
        prefix = talker_mod.codec_prefix_ids(self.talker_config, speaker, language)
        instruct = opts.get("instruct") if kind == "voice_design" or \
            (kind == "custom_voice" and self.config.get("tts_model_size") != "0b6") else None
        # (the 0.6B CustomVoice model was not trained with instructions; Base takes none, as the package's)
        instruct_ids = self.tokenizer(f"<|im_start|>user\n{instruct}<|im_end|>\n")["input_ids"] if instruct else None
        non_streaming = opts.get("non_streaming_mode")
        streaming = kind == "base" if non_streaming is None else not bool(non_streaming)
        clone = self._clone_prompt(opts) if kind == "base" else {}
        ref = clone.get("ref_codes")
        if ref is not None:
            request.pipeline_state[REF_CODES] = ref
        overrides = {k: opts[k] for k in _SUBTALKER if k in opts}
        length = talker_mod.prompt_length(ids, prefix, instruct_ids, x_vector="x_vector" in clone,
                                          ref_text_ids=clone.get("ref_text_ids"),
                                          ref_frames=0 if ref is None else ref.shape[0], streaming=streaming)
        params = self.talker_params(request, length)
        return talker_mod.talker_input(request.request_id, ids, prefix, params, self.generation,
                                       instruct_ids=instruct_ids, streaming=streaming, **clone, **overrides)

    def talker_params(self, request: OmniRequest, prompt_len: int) -> SamplingParams:
        """The request's talker params (else the stage's defaults, the checkpoint's generation config), with the
        control ids suppressed (eos excepted, unless `ignore_eos`: then eos too, as it is no code the codec could
        decode) and at least 2 frames; frames bounded by the context."""
        params = request.stage_params.get("talker") or request.stage_params.get("*") or \
            self.stage_config("talker").sampling_params()
        vocab, eos = self.talker_config["vocab_size"], self.talker_config["codec_eos_token_id"]
        suppressed = [i for i in range(vocab - talker_mod.SUPPRESSED_TAIL, vocab) if i != eos or params.ignore_eos]
        room = self.max_model_len - prompt_len
        return params.with_overrides(bad_token_ids=sorted({*params.bad_token_ids, *suppressed}),
                                     min_tokens=max(2, params.min_tokens),
                                     max_tokens=min(params.max_tokens or room, room))

    def build_engine(self, stage: str, device: str | None = None) -> AREngine | GenerationEngine:
        cfg = self.stage_config(stage)
        dev = resolve_device(device or cfg.devices)
        if stage == "talker":
            dtype = getattr(torch, cfg.dtype) if cfg.dtype != "auto" else \
                torch.float32 if dev.type == "cpu" else torch.bfloat16
            model = talker_mod.load_talker(self.model_path, dev, dtype)
            return ar_engine(stage, cfg, model, model.talker.config, None,
                             (self.talker_config["codec_eos_token_id"],))
        if stage == "codec":
            options = parse_section(CodecOptions, cfg.options, "stages.codec.options")
            decoder = load_codec_decoder(self.model_path / "speech_tokenizer").to(dev)
            return GenerationEngine.from_stage(stage, CodecStage(decoder, dev, **options.model_dump()), cfg)
        raise KeyError(stage)

    def to_output(self, stage: str, out: StageOutput) -> OmniOutput:
        audio = out.tensors.get("audio")
        return OmniOutput(out.request_id, audio=None if audio is None else audio.numpy(), sample_rate=SAMPLE_RATE)


HANDOFF = "qwen3_tts"  # a request's pipeline_state key: whether its codec request is open


def talker_to_codec(request: OmniRequest, out: StageOutput) -> StageInput | None:
    """The talker's frames for the codec: as they come (a streamed edge) or all at the end. The first chunk
    carries the codec's progress counter (the number of ICL reference frames prepended to it, else 0)."""
    codes = out.tensors.get("codes")
    if codes is None and not out.finished:
        return None
    params = None
    if not request.pipeline_state.get(HANDOFF):
        # ICL: the reference frames go first, as the decoder's left context; the codec emits from frame `done` on
        ref = request.pipeline_state.get(REF_CODES)
        if ref is not None:
            codes = ref if codes is None else torch.cat([ref.to(codes), codes])
        params = {"done": 0 if ref is None else int(ref.shape[0]), "stream": bool(request.options.get("stream_audio"))}
    tensors = {} if codes is None else {"codes": codes}
    request.pipeline_state[HANDOFF] = True
    return StageInput(out.request_id, [], params=params, tensors=tensors, final=out.finished)


class Qwen3TTSFamily:
    name = "qwen3_tts"

    def matches(self, info: CheckpointInfo) -> bool:
        return (info.config or {}).get("model_type") == "qwen3_tts"

    def default_deploy(self, info: CheckpointInfo) -> dict[str, Any]:
        """The talker samples as the checkpoint's generation config says; frames reach the codec as they are made
        (async_chunk), which decodes them in windows for a streaming client and whole at the end otherwise."""
        g = _generation(info)
        params = {"temperature": g.get("temperature", 0.9) if g.get("do_sample", True) else 0.0,
                  "top_k": g.get("top_k", 50), "top_p": g.get("top_p", 1.0),
                  "repetition_penalty": g.get("repetition_penalty", 1.05), "max_tokens": g.get("max_new_tokens", 2048)}
        return {"async_chunk": True, "stages": {"talker": {"default_sampling_params": params}}}

    def pipeline(self, info: CheckpointInfo, deploy: DeployConfig) -> Qwen3TTSPipeline:
        from transformers import AutoTokenizer

        config = info.config or {}
        if config.get("tts_model_type") not in KINDS:
            raise RequestError(f"Qwen3-TTS {config.get('tts_model_type')!r} checkpoints are not supported "
                               f"(tts_model_type one of {', '.join(KINDS)})", "model")
        deploy.check_stages({"talker": ARAdvanced, "codec": Advanced}, options={"codec": CodecOptions})
        stages = [StageSpec("talker", "ar"), StageSpec("codec", "generation", ("audio",))]
        pipeline = Qwen3TTSPipeline(info.path, deploy, stages)
        pipeline.edges = [Edge("talker", "codec", talker_to_codec, streamed=True)]
        pipeline.config, pipeline.generation = config, _generation(info)
        pipeline._encoders, pipeline._clone_lock, pipeline._clone_cache = None, threading.Lock(), OrderedDict()
        pipeline.tokenizer = AutoTokenizer.from_pretrained(info.path)
        native = config["talker_config"].get("max_position_embeddings", 32768)
        configured = deploy.stage("talker").max_model_len
        pipeline.max_model_len = min(native, configured) if configured else native
        return pipeline


def _generation(info: CheckpointInfo) -> dict[str, Any]:
    """generation_config.json as a plain dict (the package reads it so too; its sampling keys are its own)."""
    file = info.path / "generation_config.json"
    return json.loads(file.read_text(encoding="utf-8")) if file.is_file() else {}
