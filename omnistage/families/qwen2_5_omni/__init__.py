"""Qwen2.5-Omni: thinker (AR, text) -> talker (AR, codec codes) -> token2wav (generation, 24 kHz audio).

Requests for text only never touch the talker or token2wav. See models.py for what flows on each edge.
"""

from __future__ import annotations

import difflib
import functools
from typing import Any, ClassVar

import torch

from omnistage.config.deploy import DeployConfig
from omnistage.devices import resolve_device
from omnistage.engine.ar.engine import AREngine
from omnistage.engine.generation.engine import GenerationEngine
from omnistage.errors import ConfigError, RequestError
from omnistage.families import hf
from omnistage.families.base import CheckpointInfo, Edge, StageSpec
from omnistage.families.causal_lm import TextPipeline, ar_engine
from omnistage.families.qwen2_5_omni import models
from omnistage.media import MEDIA_PART_TYPES, MediaLimits, load_part
from omnistage.sampling_params import SamplingParams
from omnistage.types import OmniOutput, OmniRequest, StageInput, StageOutput

# The system prompt the released model was trained to speak under.
SPEECH_SYSTEM_PROMPT = (
    "You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of perceiving auditory "
    "and visual inputs, as well as generating text and speech."
)
_MEDIA_TENSORS = ("image_grid_thw", "video_grid_thw", "video_second_per_grid", "use_audio_in_video")


class OmniPipeline(TextPipeline):
    processor: Any = None
    config: Any = None
    voices: tuple[str, ...] = ()
    voice_bos: dict[str, int] | None = None
    audio_sample_rate: ClassVar[int | None] = models.SAMPLE_RATE

    # ---- the caller's request -> the thinker's input ------------------------------------------

    def preprocess(self, request: OmniRequest) -> StageInput:
        speech = "audio" in request.output_modalities
        voice = request.options.get("voice") or (self.voices[0] if self.voices else None)
        if speech and voice not in self.voices:
            raise RequestError(f"unknown voice {voice!r}; this model has {list(self.voices)}", "audio.voice")
        use_audio_in_video = bool(request.options.get("use_audio_in_video", False))
        messages, media, media_kwargs = self._split_media(request, use_audio_in_video)
        if speech and messages[0].get("role") != "system":
            messages.insert(0, {"role": "system", "content": [{"type": "text", "text": SPEECH_SYSTEM_PROMPT}]})
        try:
            text = self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            batch = self.processor(
                text=[text], audio=media.get("audio") or None, images=media.get("image") or None,
                videos=media.get("video") or None, return_tensors="pt", padding=False, **media_kwargs,
            )
        except (ValueError, TypeError, KeyError) as exc:  # the messages' shape or media, not the server
            raise RequestError(f"could not prepare these messages for the model: {exc}", "messages") from None
        tensors = {k: v[0] if k == "input_ids" else v for k, v in batch.items() if isinstance(v, torch.Tensor)}
        ids = tensors.pop("input_ids").tolist()
        tensors.pop("attention_mask", None)
        tensors["use_audio_in_video"] = torch.tensor(use_audio_in_video)
        inp = StageInput(request.request_id, ids, params=self.entry_params(request), tensors=tensors,
                         return_hidden_states=speech)
        request.pipeline_state["thinker_input"] = inp  # the talker's handoff needs the prompt and media layout
        request.pipeline_state["voice"] = voice
        return inp

    def _split_media(
        self, request: OmniRequest, use_audio_in_video: bool
    ) -> tuple[list[dict], dict[str, list], dict[str, Any]]:
        """Messages with media parts turned into the template's placeholders, the media in order, and the
        processor arguments they need. A part may carry a decoded object ({"type": "image", "image": PIL
        image}, "audio": float32 array at 16 kHz, "video": Video) or be an OpenAI part (image_url,
        input_audio, audio_url, video_url). With `use_audio_in_video`, each video's sound track joins the
        audio list and the processor is told which video it belongs to."""
        media: dict[str, list] = {kind: list(items) for kind, items in request.media.items()}
        fps: list[float] = []
        audio_of_video: list[int | None] = [None] * len(media.get("audio", []))
        limits = MediaLimits(max_bytes=self.deploy.limits.max_media_bytes)
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
                    item = load_part(part, f"messages[{i}].content[{j}]", limits,
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
            dtype = hf.resolve_dtype(cfg.dtype, thinker_cfg.text_config, dev)
            model = models.ThinkerLM(models.load_part(Qwen2_5OmniThinkerForConditionalGeneration, self.model_path,
                                                      thinker_cfg, dtype, dev))
            eos = hf.eos_token_ids(self.model_path, thinker_cfg.text_config, self.tokenizer)
            return ar_engine(stage, cfg, model, thinker_cfg.text_config, self.tokenizer, eos,
                             {"embed": 0, "last": model.num_layers})
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
            return ar_engine(stage, cfg, model, talker_cfg, None, tuple(sorted(self.codec_stops)))
        if stage == "token2wav":
            dit_dtype = torch.float32 if cfg.dtype == "auto" else getattr(torch, cfg.dtype)  # fp32 unless asked
            t2w = models.load_token2wav(self.model_path, self.config.token2wav_config, dev, dit_dtype)
            decoder = models.Token2Wav(t2w, models.load_voices(self.model_path), dev, use_graphs=not cfg.enforce_eager,
                                       max_batch=cfg.max_num_seqs, **token2wav_options(cfg.options))
            decoder.warm_up()
            return GenerationEngine(stage, decoder, cfg.max_num_seqs)
        raise KeyError(stage)

    def to_output(self, stage: str, out: StageOutput) -> OmniOutput:
        if stage == "token2wav":
            audio = out.tensors.get("audio")
            return OmniOutput(out.request_id, audio=None if audio is None else audio.numpy(),
                              sample_rate=self.audio_sample_rate)
        return super().to_output(stage, out)

    def talker_params(self, request: OmniRequest) -> SamplingParams:
        """The talker never samples what token2wav cannot decode: codec ids past the DiT's code embedding
        other than the two stop codes (a trained talker does not either; random weights would, and token2wav
        would fail the request), nor the codec start code."""
        params = request.stage_params.get("talker") or self.stage_config("talker").sampling_params()
        return params.with_overrides(bad_token_ids=sorted({*params.bad_token_ids, *self.undecodable_codes}))

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


def thinker_to_talker(pipeline: OmniPipeline, request: OmniRequest, out: StageOutput) -> StageInput | None:
    """The thinker's reply, as states per computed token, becomes the talker's prompt and then its added
    rows. Streamed (`async_chunk`), the talker opens once the first reply token's states exist and gets
    each later row as the thinker computes it; otherwise `out` is the whole reply, at its end."""
    feed = request.pipeline_state.get("talker_feed")
    if feed is not None and feed["open"] and not out.finished:  # a row per request per thinker step: lean
        if not out.hidden_states:
            return None
        tensors = {"thinker_embed": out.hidden_states["embed"], "thinker_last": out.hidden_states["last"]}
        return StageInput(out.request_id, [], tensors=tensors, final=False)
    if feed is None:
        feed = request.pipeline_state["talker_feed"] = {"embed": [], "last": [], "first_token": None, "open": False}
    thinker_inp: StageInput = request.pipeline_state["thinker_input"]
    if out.hidden_states:
        feed["embed"].append(out.hidden_states["embed"])
        feed["last"].append(out.hidden_states["last"])
    if feed["first_token"] is None and out.token_ids:
        feed["first_token"] = out.token_ids[0]
    rows = sum(len(x) for x in feed["last"])
    prompt_len = len(thinker_inp.token_ids)
    if not feed["open"] and rows <= prompt_len and not out.finished:
        return None  # the talker's prompt ends with the first reply token's states
    cfg, params = pipeline.config.talker_config, None  # (opening the talker, or the reply's end)
    tensors = {}
    if rows:  # no kernels here (a request per output): the talker sums a step's rows at once
        tensors["thinker_embed"], tensors["thinker_last"] = _joined(feed["embed"]), _joined(feed["last"])
    feed["embed"], feed["last"] = [], []
    if not feed["open"] or out.finished:  # the talker reads the text ids when it opens and at the reply's end
        tensors["text_eos"] = torch.tensor(cfg.tts_text_end_token_id)
        tensors["text_pad"] = torch.tensor(cfg.tts_text_pad_token_id)
    if not feed["open"]:
        feed["open"] = True
        params = pipeline.talker_params(request)  # later chunks only add rows: the talker keeps the first's
        tensors.update({
            "prompt_ids": torch.tensor(thinker_inp.token_ids),
            "voice_bos": torch.tensor(pipeline.voice_bos[request.pipeline_state["voice"]]),
            "first_token": torch.tensor(feed["first_token"]),
            **{k: thinker_inp.tensors[k] for k in _MEDIA_TENSORS if k in thinker_inp.tensors},
        })
        if "feature_attention_mask" in thinker_inp.tensors:
            tensors["audio_lengths"] = thinker_inp.tensors["feature_attention_mask"].sum(-1)
    return StageInput(out.request_id, [], params=params, tensors=tensors, final=out.finished)


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def talker_to_token2wav(pipeline: OmniPipeline, request: OmniRequest, out: StageOutput) -> StageInput | None:
    """Codes (without the talker's stop codes) for token2wav: all at the end, or as they come when the
    token2wav stage decodes in windows."""
    stop = pipeline.codec_stops  # runs once per code per request: no config attribute reads here
    codes = [c for c in out.token_ids if c not in stop]
    if not codes and not out.finished:
        return None
    params = {"voice": request.pipeline_state["voice"], "seed": request.options.get("seed", 0)}
    return StageInput(out.request_id, codes, params=params, final=out.finished)


TOKEN2WAV_OPTIONS = {  # name: (what it does, the smallest value; None: a boolean; a tuple: the choices)
    "window": ("codes per streamed audio chunk; 0 decodes the whole utterance at the end", 0),
    "first_window": ("codes in the first chunk (smaller: audio starts sooner); default: 24, or window if smaller", 1),
    "max_window": ("later windows double from window up to this many codes (less context recomputed per code, "
                   "bigger chunks); default: window", 1),
    "kept_context": ("true (default): each window's look-back layers read the keys and values the previous "
                     "window's solve kept, instead of solving left context again (windows must be whole DiT "
                     "blocks, `left` unset); false: solve `left` codes of context with each window", None),
    "left": ("codes of left context each window is solved with when kept_context is off; default: what the DiT "
             "attends back to", 0),
    "right": ("codes of look-ahead each window waits for; default: what the DiT attends ahead to", 0),
    "vocoder_context": ("mel frames of context on each side of a window for the vocoder", 0),
    "num_steps": ("flow-matching ODE steps", 2),
    "tf32": ("true: the float32 DiT's matmuls run on TensorFloat-32 tensor cores (faster, slightly less exact; "
             "torch's process-wide switch, held while a solve launches: a float32 thinker or talker inline beside "
             "it may get TF32 matmuls then too)", None),
    "cublas_sm_carveout": ("SMs the DiT's cuBLAS matmuls leave free for the other stages' kernels", 0),
    "carveout_max_batch": ("the largest batch of windows cublas_sm_carveout applies to (default: all)", 1),
    "overlap_vocoder_max_batch": ("on CUDA, the vocoder of a batch of up to this many windows runs on a stream "
                                  "of its own, so a request's next window is solved while the last one is "
                                  "vocoded; 0: never (default: 2, or 0 with the DiT in strict float32, whose "
                                  "long solves starve the vocoder beside them)", 0),
    "widen_vocoder_spans": ("true (default): a window whose vocoder span has no CUDA graph (a request's last, "
                            "mostly) is vocoded at a captured length, with more of the request's earlier mel on "
                            "its left, not eagerly at a new length (cuDNN plans each new length for ~0.2-0.9 s, "
                            "holding the stage)", None),
    "vocoder_dtype": ("the vocoder's convolutions: float32 (default) or bfloat16 (CUDA: tensor cores, less exact)",
                      models.VOCODER_DTYPES),
}


def token2wav_options(options: dict[str, Any]) -> dict[str, Any]:
    """The deploy config's token2wav options, checked: known names, integers in range, booleans."""
    for key, value in options.items():
        where = f"stages.token2wav.options.{key}"
        if key not in TOKEN2WAV_OPTIONS:
            close = difflib.get_close_matches(key, list(TOKEN2WAV_OPTIONS), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"{where}: unknown option{hint} (valid: {', '.join(TOKEN2WAV_OPTIONS)})")
        what, least = TOKEN2WAV_OPTIONS[key]
        if isinstance(least, tuple):
            if value not in least:
                raise ConfigError(f"{where}: expected one of {', '.join(least)}, got {value!r} ({what})")
            continue
        if least is None and not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r} ({what})")
        if least is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
            raise ConfigError(f"{where}: expected an integer >= {least}, got {value!r} ({what})")
    return dict(options)


class Qwen25OmniFamily:
    name = "qwen2_5_omni"

    def matches(self, info: CheckpointInfo) -> bool:
        return "Qwen2_5OmniForConditionalGeneration" in info.architectures

    def default_deploy(self, info: CheckpointInfo) -> dict[str, Any]:
        """What configs/qwen2_5_omni/1gpu.yaml sets, for a server started without a deploy config: the three
        stages share one device in the server process, each with its memory share; speech streams. With two or
        more GPUs visible, 2gpu.yaml's split instead: the talker alone on cuda:1 (on two H200s one request's
        RTF 0.096 against 0.107 on one; benchmarks/results/omni_qwen2_5.md, run 23)."""
        # The talker's released sampling settings (transformers' generate defaults); it speaks until its
        # end code or the end of its context (max_tokens None).
        talker = {"temperature": 0.9, "top_k": 40, "top_p": 0.8, "repetition_penalty": 1.05, "max_tokens": None}
        deploy = {
            "worker_backend": "inline",
            "async_chunk": True,
            "stages": {
                "thinker": {"gpu_memory_utilization": 0.55},
                "talker": {"gpu_memory_utilization": 0.25, "default_sampling_params": talker,
                           "overlap_sampled": True, "decode_burst": 8},
                "token2wav": {"max_num_seqs": 32, "options": {"window": 48, "max_window": 192, "cublas_sm_carveout": 32,
                                                              "carveout_max_batch": 2}},
            },
        }
        if torch.cuda.device_count() >= 2:
            stages = deploy["stages"]
            stages["thinker"].update(devices="0", gpu_memory_utilization=0.65)
            stages["talker"].update(devices="1", gpu_memory_utilization=0.8)
            stages["token2wav"]["devices"] = "0"
        return deploy

    def pipeline(self, info: CheckpointInfo, deploy: DeployConfig) -> OmniPipeline:
        from transformers import Qwen2_5OmniConfig, Qwen2_5OmniProcessor

        names = ["thinker", "talker", "token2wav"]
        deploy.check_stage_names(names)
        stages = [StageSpec("thinker", "ar", ("text",)), StageSpec("talker", "ar"),
                  StageSpec("token2wav", "generation", ("audio",))]
        pipeline = OmniPipeline(info.path, deploy, stages)
        pipeline.edges = [
            Edge("thinker", "talker", lambda r, o: thinker_to_talker(pipeline, r, o)),
            Edge("talker", "token2wav", lambda r, o: talker_to_token2wav(pipeline, r, o),
                 streamed=bool(token2wav_options(deploy.stage("token2wav").options).get("window"))),
        ]
        with models.thinker_ids_unflagged():
            pipeline.config = Qwen2_5OmniConfig.from_pretrained(info.path)
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
