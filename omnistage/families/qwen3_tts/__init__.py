"""Qwen3-TTS-12Hz (issue 53): talker (AR: one frame of Q codes per step) -> codec (generation: 24 kHz audio).

CustomVoice (a named speaker) and VoiceDesign (a voice described by an instruction) checkpoints, non-streaming text
mode; not Base (voice clone). The talker's stage is talker.py, the codec decoder codec.py, notes in
docs/families/qwen3_tts.md. Request options: `voice` (CustomVoice: a speaker of the checkpoint's `spk_id`; default
its first), `instruct` (VoiceDesign, and CustomVoice checkpoints other than 0.6B: how to speak), `language`
(default "auto") and the code predictor's sampling `subtalker_dosample/temperature/top_k/top_p` (default:
generation_config.json).
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

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

    def preprocess(self, request: OmniRequest) -> StageInput:
        text = self.text_of(request)
        ids = self.tokenizer(f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
        opts, kind = request.options, self.config.get("tts_model_type")
        speakers = list(self.talker_config["spk_id"])
        speaker = (opts.get("voice") or speakers[0]) if kind == "custom_voice" else None
        try:
            prefix = talker_mod.codec_prefix_ids(self.talker_config, speaker, opts.get("language") or "auto")
        except ValueError as exc:
            raise RequestError(str(exc), "voice") from None
        instruct = opts.get("instruct") if kind == "voice_design" or self.config.get("tts_model_size") != "0b6" \
            else None  # the 0.6B CustomVoice model was not trained with instructions
        instruct_ids = self.tokenizer(f"<|im_start|>user\n{instruct}<|im_end|>\n")["input_ids"] if instruct else None
        overrides = {k: opts[k] for k in _SUBTALKER if k in opts}
        params = self.talker_params(request, talker_mod.prompt_length(ids, prefix, instruct_ids))
        return talker_mod.talker_input(request.request_id, ids, prefix, params, self.generation,
                                       instruct_ids=instruct_ids, **overrides)

    def talker_params(self, request: OmniRequest, prompt_len: int) -> SamplingParams:
        """The request's talker params (else the stage's defaults, the checkpoint's generation config), with the
        control ids suppressed (eos excepted) and at least 2 frames; frames bounded by the context."""
        params = request.stage_params.get("talker") or request.stage_params.get("*") or \
            self.stage_config("talker").sampling_params()
        vocab, eos = self.talker_config["vocab_size"], self.talker_config["codec_eos_token_id"]
        suppressed = [i for i in range(vocab - talker_mod.SUPPRESSED_TAIL, vocab) if i != eos]
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
    carries the codec's progress counter."""
    codes = out.tensors.get("codes")
    if codes is None and not out.finished:
        return None
    tensors = {} if codes is None else {"codes": codes}
    params = None if request.pipeline_state.get(HANDOFF) else \
        {"done": 0, "stream": bool(request.options.get("stream_audio"))}
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
        if config.get("tts_model_type") not in ("custom_voice", "voice_design"):
            raise RequestError(f"Qwen3-TTS {config.get('tts_model_type')!r} checkpoints are not supported yet "
                               "(CustomVoice and VoiceDesign only)", "model")
        deploy.check_stages({"talker": ARAdvanced, "codec": Advanced}, options={"codec": CodecOptions})
        stages = [StageSpec("talker", "ar"), StageSpec("codec", "generation", ("audio",))]
        pipeline = Qwen3TTSPipeline(info.path, deploy, stages)
        pipeline.edges = [Edge("talker", "codec", talker_to_codec, streamed=True)]
        pipeline.config, pipeline.generation = config, _generation(info)
        pipeline.tokenizer = AutoTokenizer.from_pretrained(info.path)
        native = config["talker_config"].get("max_position_embeddings", 32768)
        configured = deploy.stage("talker").max_model_len
        pipeline.max_model_len = min(native, configured) if configured else native
        return pipeline


def _generation(info: CheckpointInfo) -> dict[str, Any]:
    """generation_config.json as a plain dict (the package reads it so too; its sampling keys are its own)."""
    file = info.path / "generation_config.json"
    return json.loads(file.read_text(encoding="utf-8")) if file.is_file() else {}
