"""Any transformers causal LM (Qwen2, Qwen3, Llama, ...): one AR stage that produces text."""

from __future__ import annotations

import functools
import logging
from typing import Any, ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from omnistage.config.deploy import DeployConfig, StageConfig, parse_section
from omnistage.devices import resolve_device
from omnistage.engine.ar.engine import ARAdvanced, AREngine, AREngineConfig
from omnistage.engine.ar.parallel import TPModel
from omnistage.errors import ConfigError, RequestError
from omnistage.families import hf, tensor_parallel
from omnistage.families.base import CheckpointInfo, Pipeline, StageSpec
from omnistage.families.causal_lm.fused_decoder import FusedDecoder
from omnistage.families.moe import MOE_DECODERS, fuse_moe
from omnistage.kernels import moe as moe_kernels
from omnistage.sampling_params import SamplingParams
from omnistage.types import OmniOutput, OmniRequest, StageInput, StageOutput

logger = logging.getLogger(__name__)
_SUPPORTED = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


def template_error(exc: Exception) -> RequestError:
    """A 400 for messages the chat template refused: the template's own message (it names what to fix, e.g.
    roles that must alternate) when it raised one, a fixed sentence for anything else (no internals)."""
    from jinja2 import TemplateError

    logger.info("chat template failed: %r", exc)
    detail = f": {' '.join(str(exc).split())[:200]}" if isinstance(exc, TemplateError) else ""
    return RequestError(f"could not apply the chat template to these messages{detail}; check their roles, order "
                        "and content parts", "messages")


def template_kwargs(options: dict[str, Any]) -> dict[str, Any]:
    """The request's chat-template arguments: tools, generation prompt or continuing the last message, and the
    caller's own `chat_template_kwargs` (which cannot replace the messages or turn tokenizing off)."""
    kwargs = dict(options.get("chat_template_kwargs") or {})
    for reserved in ("conversation", "messages", "tokenize", "return_dict", "return_tensors"):
        kwargs.pop(reserved, None)
    kwargs["add_generation_prompt"] = options.get("add_generation_prompt", True)
    if options.get("continue_final_message"):
        kwargs["continue_final_message"] = True
    if options.get("tools"):
        kwargs["tools"] = options["tools"]
    return kwargs


class TextPipeline(Pipeline):
    """Shared by every family whose entry stage is a tokenizer-driven LM."""

    def tokenize(self, request: OmniRequest) -> list[int]:
        if request.prompt_token_ids is not None:
            ids = list(request.prompt_token_ids)
            if any(not 0 <= t < len(self.tokenizer) for t in ids):
                raise RequestError(f"prompt token ids must be in [0, {len(self.tokenizer)})", "prompt")
            return ids
        if request.prompt is not None:
            return self.tokenizer.encode(request.prompt, add_special_tokens=True)
        if not request.messages:
            raise RequestError("messages must contain at least one message", "messages")
        self.refuse_media(request.messages)
        if self.tokenizer.chat_template is None:
            raise RequestError("this model has no chat template; use /v1/completions with a prompt", "messages")
        try:
            return list(self.tokenizer.apply_chat_template(
                request.messages, tokenize=True, return_dict=False, **template_kwargs(request.options)
            ))
        except Exception as exc:  # template errors are the caller's messages' fault
            raise template_error(exc) from None

    def refuse_media(self, messages: list[dict[str, Any]]) -> None:
        """A part the model cannot take is an error, never silently dropped (the chat template would)."""
        for i, message in enumerate(messages):
            content = message.get("content") if isinstance(message, dict) else None
            for j, part in enumerate(content if isinstance(content, list) else []):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    accepted = ", ".join(self.input_modalities)
                    raise RequestError(f"messages[{i}].content[{j}] is a {kind!r} part, but this model accepts "
                                       f"only {accepted} input; remove the part or serve a model that takes it",
                                       f"messages[{i}].content[{j}]")

    def entry_params(self, request: OmniRequest) -> SamplingParams:
        defaults = self.stage_config(self.entry).sampling_params()
        return request.stage_params.get(self.entry) or request.stage_params.get("*") or defaults


class LMOptions(BaseModel):
    """`stages.lm.options`: how /v1/embeddings turns a prompt into one vector."""

    model_config = ConfigDict(extra="forbid", strict=True)

    pooling: Literal["last", "mean"] = Field("last", description="the final hidden state of the prompt's last "
                                             "token, or the mean over all its tokens")
    normalize: bool = Field(True, description="embeddings scaled to unit length")


class CausalLMPipeline(TextPipeline):
    serves_embeddings: ClassVar[bool] = True

    def preprocess(self, request: OmniRequest) -> StageInput:
        ids = self.tokenize(request)
        if request.options.get("embed"):  # /v1/embeddings: one forward over the prompt, nothing generated
            return StageInput(request.request_id, ids, params=SamplingParams(max_tokens=1, temperature=0),
                              pooling=self.options.pooling)
        return StageInput(request.request_id, ids, params=self.entry_params(request))

    @functools.cached_property
    def options(self) -> LMOptions:
        return parse_section(LMOptions, self.stage_config("lm").options, "stages.lm.options")

    def to_output(self, stage: str, out: StageOutput) -> OmniOutput:
        result = super().to_output(stage, out)
        if (embedding := out.tensors.get("embedding")) is not None:
            if self.options.normalize:
                embedding = torch.nn.functional.normalize(embedding, dim=-1)
            result.embedding = embedding.numpy()
        return result

    def build_engine(self, stage: str, device: str | None = None) -> AREngine:
        return build_ar_engine(self, stage, device, {"last": last_layer(self.model_path)})


def last_layer(path: Any) -> int:
    """The index of the final (normed) hidden state, as transformers numbers hidden states."""
    return hf.AutoConfig.from_pretrained(path).get_text_config().num_hidden_layers


def build_ar_engine(
    pipeline: Pipeline, stage: str, devices: str | None = None, hidden_state_layers: dict[str, int] | None = None
) -> AREngine:
    """Load an HF causal LM checkpoint as the AR engine of `stage`."""
    cfg = pipeline.stage_config(stage)
    if cfg.tensor_parallel_size > 1:  # the plain HF layer loop on every rank (no fused decoder, no CUDA graphs)
        model: Any = tensor_parallel.launch_causal_lm(pipeline.model_path, cfg.dtype, devices or cfg.devices,
                                                     cfg.tensor_parallel_size, f"stages.{stage}.tensor_parallel_size")
        config = hf.AutoConfig.from_pretrained(pipeline.model_path)
    else:
        loaded, config = hf.load_causal_lm(pipeline.model_path, cfg.dtype, resolve_device(devices or cfg.devices))
        model = causal_lm_model(loaded, config)
    tokenizer = hf.load_tokenizer(pipeline.model_path)
    eos = hf.eos_token_ids(pipeline.model_path, config, tokenizer)
    return ar_engine(stage, cfg, model, config, tokenizer, eos, hidden_state_layers)


def ar_engine(
    stage: str,
    cfg: StageConfig,
    model: hf.HFCausalLM,
    config: Any,
    tokenizer: Any,
    eos_token_ids: tuple[int, ...],
    hidden_state_layers: dict[str, int] | None = None,
    tuned: dict[str, Any] | None = None,
) -> AREngine:
    """An AR engine for a loaded model, sized and tuned by the stage's deploy config; `tuned`: the family's
    defaults for the stage's `advanced` block."""
    if cfg.tensor_parallel_size > 1 and not isinstance(model, TPModel):
        raise ConfigError(f"stages.{stage}.tensor_parallel_size: this stage runs on one device only (tensor "
                          "parallelism covers causal-LM stages and the omni thinkers); set it to 1")
    engine_cfg = AREngineConfig.from_stage(cfg, context_length(config, cfg.max_model_len), hidden_state_layers,
                                           tuned, where=f"stages.{stage}.advanced")
    return AREngine(stage, model, engine_cfg, tokenizer, eos_token_ids)


def causal_lm_model(model: Any, config: Any) -> hf.HFCausalLM:
    """Wrap an HF causal LM for the AR engine, with the fused forward where its layers allow."""
    decoder = model.get_decoder()
    fused = FusedDecoder(decoder) if FusedDecoder.supports(decoder) else None
    lm = hf.HFCausalLM(model, config, fused.forward if fused else None)
    text = config.get_text_config()
    if text.model_type in MOE_DECODERS and moe_kernels.available(lm.device) and fuse_moe(decoder, text):
        # the fused MoE blocks never sync the host: the layer loop runs in CUDA graphs (transformers' own blocks
        # read the routing back, so without the kernels the whole decoder runs eagerly)
        lm.plain_loop = lm.graph_safe = True
    return lm


def context_length(config: Any, configured: int | None) -> int:
    native = getattr(config.get_text_config(), "max_position_embeddings", None) or 2048
    return min(native, configured) if configured else native


class CausalLMFamily:
    name = "causal_lm"

    def matches(self, info: CheckpointInfo) -> bool:
        return any(arch in _SUPPORTED for arch in info.architectures)

    def default_deploy(self, info: CheckpointInfo) -> dict[str, Any]:
        return {}

    def pipeline(self, info: CheckpointInfo, deploy: DeployConfig) -> CausalLMPipeline:
        deploy.check_stages({"lm": ARAdvanced}, options={"lm": LMOptions})
        pipeline = CausalLMPipeline(info.path, deploy, [StageSpec("lm", "ar", outputs=("text",))])
        pipeline.tokenizer = hf.load_tokenizer(info.path)
        pipeline.max_model_len = context_length(
            hf.AutoConfig.from_pretrained(info.path), deploy.stage("lm").max_model_len
        )
        return pipeline
