"""Running transformers model classes inside omnistage engines.

transformers lets a model use an attention function of ours. Registered under ATTN_IMPL, it
receives each layer's Q/K/V for one packed row of tokens and hands them to the engine's paged
attention, which knows sequence boundaries from the metadata passed through the forward's
kwargs; the mask builder therefore returns no mask. Shared by every family built on HF classes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig
from transformers.initialization import no_init_weights
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from omnistage.engine.ar.attention import AttentionMetadata, KVSpec, paged_attention
from omnistage.errors import ConfigError
from omnistage.kernels import skinny_gemm

ATTN_IMPL = "omnistage_paged"
_METADATA_KWARG = "omnistage_attn"
SKINNY_HEAD_MAX_WEIGHTS = 1 << 25  # LM heads up to this many weights take skinny_gemm at decode (see compute_logits)


def _attention(
    module: nn.Module,
    query: torch.Tensor,  # [1, H, T, D]
    key: torch.Tensor,  # [1, KVH, T, D]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    meta: AttentionMetadata = kwargs[_METADATA_KWARG]
    out = paged_attention(
        module.layer_idx, query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
        meta, scaling, sliding_window,
    )
    return out.unsqueeze(0), None  # [1, T, H, D], as transformers expects


def _no_mask(*args: Any, **kwargs: Any) -> None:
    return None


ALL_ATTENTION_FUNCTIONS.register(ATTN_IMPL, _attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPL, _no_mask)


def resolve_dtype(name: str, config: PretrainedConfig, device: torch.device) -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cpu":
        return torch.float32  # CPU matmuls in half precision are slow and less exact
    stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    stored = getattr(torch, stored) if isinstance(stored, str) else stored
    return stored if stored in (torch.bfloat16, torch.float16) else torch.bfloat16


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{str(path)!r} has no .safetensors weights")
    return files


# A released MoE checkpoint stores each expert's projections apart (`<experts>.<i>.gate_proj.weight`, ...);
# transformers' modules hold them fused per layer: `<experts>.gate_up_proj` [experts, 2 * inter, hidden] (gate
# rows, then up rows) and `<experts>.down_proj` [experts, hidden, inter].
_EXPERT_KEY = re.compile(r"^(?P<experts>.+\.experts)\.(?P<index>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def _expert_slice(params: dict[str, torch.Tensor], name: str) -> tuple[str, torch.Tensor] | None:
    """The fused parameter a per-expert checkpoint tensor belongs to, and the view of it the tensor fills."""
    match = _EXPERT_KEY.match(name)
    if match is None:
        return None
    fused_name = f"{match['experts']}.{'down_proj' if match['proj'] == 'down_proj' else 'gate_up_proj'}"
    fused = params.get(fused_name)
    if fused is None or fused.ndim != 3:
        return None
    row = fused[int(match["index"])]
    if match["proj"] == "down_proj":
        return fused_name, row
    half = row.shape[0] // 2
    return fused_name, row[:half] if match["proj"] == "gate_proj" else row[half:]


def load_weights(
    model: nn.Module, path: Path, prefix_map: dict[str, str] | None = None,
    shard: Callable[[str, Any], torch.Tensor] | None = None,
) -> None:
    """Copy checkpoint tensors straight into the model's (device, dtype) parameters, one tensor
    at a time, so no full-precision copy of the model ever exists. Per-expert MoE tensors go into their
    slices of the fused expert parameters; a fused parameter counts as loaded once every slice is.
    `shard(name, lazy_slice)`: the part of parameter `name` this tensor-parallel rank holds, read from the
    file's lazy slice (so a rank reads only its part)."""
    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    device = next(model.parameters()).device
    loaded: set[str] = set()
    slices: dict[str, int] = {}  # fused parameter -> slices filled
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt", device=str(device)) as f:
            for key in f.keys():
                name = key
                for old, new in (prefix_map or {}).items():
                    if name.startswith(old):
                        name = new + name[len(old) :]
                target = params.get(name)
                fused = None if target is not None else _expert_slice(params, name)
                if fused is not None:
                    name, target = fused
                if target is None:
                    continue
                tensor = f.get_tensor(key) if shard is None else shard(name, f.get_slice(key))
                if tensor.shape != target.shape:
                    raise ConfigError(f"{key}: checkpoint shape {tuple(tensor.shape)} != model {tuple(target.shape)}")
                with torch.no_grad():
                    target.copy_(tensor)
                if fused is None:
                    loaded.add(name)
                else:
                    slices[name] = slices.get(name, 0) + 1
    for name, count in slices.items():  # gate_up: two slices per expert, down: one
        if count == params[name].shape[0] * (2 if name.endswith("gate_up_proj") else 1):
            loaded.add(name)
    model.tie_weights()
    tied = {name for name, p in model.named_parameters() if any(p is params[n] for n in loaded)}
    missing = [n for n, _ in model.named_parameters() if n not in loaded and n not in tied]
    if missing:
        raise ConfigError(f"checkpoint {str(path)!r} lacks weights for: {', '.join(missing[:5])}")


def load_causal_lm(path: Path, dtype_name: str, device: torch.device) -> tuple[nn.Module, PretrainedConfig]:
    config = AutoConfig.from_pretrained(path)
    dtype = resolve_dtype(dtype_name, config, device)
    with torch.device(device), no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=ATTN_IMPL)
    load_weights(model, path)
    return model.eval().requires_grad_(False), config


def load_tokenizer(path: Path) -> Any:
    return AutoTokenizer.from_pretrained(path)


def eos_token_ids(path: Path, config: PretrainedConfig, tokenizer: Any) -> tuple[int, ...]:
    ids: list[int] = []
    gen = path / "generation_config.json"
    candidates = [json.loads(gen.read_text()).get("eos_token_id")] if gen.is_file() else []
    candidates += [getattr(config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)]
    for value in candidates:
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, int) and v not in ids:
                ids.append(v)
    return tuple(ids)


# Decoders whose forward is exactly: embed -> rotary -> layers -> norm. For these we run the layer
# loop ourselves, skipping transformers' mask and output-recording machinery: less Python per step,
# and nothing in it syncs with the host, so the decode step can be captured in a CUDA graph.
_PLAIN_DECODERS = {"qwen2", "qwen3", "llama", "mistral"}


def hf_position_ids(positions: torch.Tensor) -> torch.Tensor:
    """Engine positions ([T], or [axes, T] for multi-axis rotary) as transformers wants them:
    [1, T], or [axes, 1, T]; a single axis is plain positions."""
    if positions.dim() == 2 and positions.shape[0] == 1:
        positions = positions[0]
    return positions[None] if positions.dim() == 1 else positions[:, None]


def rotary_tables(decoder: nn.Module, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, head_dim] of the decoder's rotary embedding for tokens at `positions` (each token's row on
    its own: tables for many steps at once equal each step's)."""
    probe = torch.empty(1, 0, dtype=dtype, device=positions.device)  # the embedding reads only dtype and device
    cos, sin = decoder.rotary_emb(probe, hf_position_ids(positions))
    return cos[0], sin[0]


class HFCausalLM:
    """An HF causal LM seen through the AR engine's ARModel interface.

    A family may pass a `fast_forward` (embeddings, positions, metadata -> final hidden states) for
    steps that need no intermediate hidden states, and for composite models (an omni thinker or
    talker) the decoder and head to run, plus an `input_proj` applied to input embeddings first.
    """

    def __init__(
        self,
        model: nn.Module,
        config: PretrainedConfig,
        fast_forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor] | None = None,
        *,
        decoder: nn.Module | None = None,
        lm_head: nn.Module | None = None,
        input_proj: nn.Module | None = None,
        plain_loop: bool | None = None,
    ):
        self.model = model
        self.decoder = decoder if decoder is not None else model.get_decoder()
        self.lm_head = lm_head if lm_head is not None else model.get_output_embeddings()
        self.input_proj = input_proj
        self.fast_forward = fast_forward
        text = config.get_text_config()
        self.plain_loop = plain_loop if plain_loop is not None else text.model_type in _PLAIN_DECODERS
        self.graph_safe = fast_forward is not None or self.plain_loop
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        param = next(model.parameters())
        self.kv_spec = KVSpec(text.num_hidden_layers, kv_heads, head_dim, param.dtype)
        self.device = param.device
        self.vocab_size = text.vocab_size
        tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}.values()  # tied weights count once
        self.weight_bytes = sum(t.numel() * t.element_size() for t in tensors)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.decoder.embed_tokens(token_ids)

    def _inputs(self, token_ids: torch.Tensor, embeds: torch.Tensor | None, partial: bool = False) -> torch.Tensor:
        """Input embeddings, through `input_proj` if any. `partial`: the consumer (the fused forward's first
        add+RMSNorm) takes a linear projection's split-K partials, so a decode batch's projection is one skinny
        GEMM kernel with no reduce of its own."""
        hidden = embeds if embeds is not None else self.embed(token_ids)
        if self.input_proj is None:
            return hidden
        if partial and isinstance(self.input_proj, nn.Linear):
            return skinny_gemm.linear(hidden, self.input_proj.weight, self.input_proj.bias, partial=True)
        return self.input_proj(hidden)

    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        embeds: torch.Tensor | None = None,
        output_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        num_layers = self.kv_spec.num_layers
        fast = self.fast_forward is not None and set(output_layers) <= {0, num_layers}
        hidden = self._inputs(token_ids, embeds, partial=fast and 0 not in output_layers)
        if fast:
            # the embeddings and the final states are the fast loop's own input and output
            out = self.fast_forward(hidden, positions, attn)
            return out, {i: hidden if i == 0 else out for i in output_layers}
        if self.plain_loop:
            return self._plain_forward(hidden, positions, attn, output_layers)
        out = self.decoder(
            inputs_embeds=hidden[None],
            position_ids=hf_position_ids(positions),
            use_cache=False,
            output_hidden_states=bool(output_layers),
            **{_METADATA_KWARG: attn},
        )
        layers = {i: out.hidden_states[i][0] for i in output_layers}
        return out.last_hidden_state[0], layers

    def _plain_forward(
        self, hidden: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata, output_layers: tuple[int, ...]
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Same numbers as the decoder's own forward (hidden-state indices as in transformers:
        0 = embeddings, i = output of layer i, the last one after the final norm)."""
        d = self.decoder
        hidden = hidden[None]
        position_ids = hf_position_ids(positions)
        rotary = d.rotary_emb(hidden, position_ids)
        layers: dict[int, torch.Tensor] = {0: hidden[0]} if 0 in output_layers else {}
        num_layers = len(d.layers)
        for i, layer in enumerate(d.layers):
            hidden = layer(hidden, attention_mask=None, position_embeddings=rotary, position_ids=position_ids,
                           **{_METADATA_KWARG: attn})
            if i + 1 in output_layers and i + 1 < num_layers:
                layers[i + 1] = hidden[0]
        hidden = d.norm(hidden)
        if num_layers in output_layers:
            layers[num_layers] = hidden[0]
        return hidden[0], layers

    def rotary_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Rotary tables for `AttentionMetadata.rotary` (a decode burst computes all its steps' at once); None
        where the forward would not read them (no fused forward)."""
        if self.fast_forward is None:
            return None
        return rotary_tables(self.decoder, positions, self.kv_spec.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # A small head (the talker's 8448 codes) through the skinny-GEMM kernel, which beats cuBLAS there at decode
        # batch sizes; cuBLAS stays faster on a large one (the thinker's 152k-row head)
        if isinstance(self.lm_head, nn.Linear) and self.lm_head.weight.numel() <= SKINNY_HEAD_MAX_WEIGHTS:
            return skinny_gemm.linear_to_float(hidden, self.lm_head.weight, self.lm_head.bias)
        return self.lm_head(hidden).float()
