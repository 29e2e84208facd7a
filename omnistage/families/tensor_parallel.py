"""A transformers decoder sharded in place for tensor parallelism (engine/ar/parallel.py runs the ranks).

The model is built on the meta device, its projections replaced by their shards, and only then materialized, so
no rank ever holds the whole model: q/k/v and gate/up are column-parallel (this rank's heads, kv heads included,
and its slice of the intermediate size), o and down row-parallel, the embedding and LM head vocab-parallel. Each
rank reads its slices straight from the safetensors files. Attention sees its per-rank head counts through the
shapes (transformers' attention modules infer the head count from the projection width), and the KV cache per
rank holds kv_heads / world heads. Decoders whose forward is the plain embed -> layers -> norm loop only. MoE
experts in transformers' fused layout split their intermediate size too (every rank a slice of every expert, the
router whole), their blocks' partial outputs all-reduced (`reduce_expert_blocks`). The decoder may be a part of a
bigger model (an omni thinker's text decoder beside its media encoders, under the checkpoint's `thinker.` prefix):
only that part and the LM head shard, the rest stays whole on the ranks that build it (`load_sharded`), and a model
that prepares its own inputs on rank 0 gets its token embeddings through the group (`PreparingTPModel`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.initialization import no_init_weights

from omnistage.devices import resolve_device
from omnistage.engine.ar.attention import KVSpec
from omnistage.engine.ar.parallel import TPGroup, TPModel, launch
from omnistage.engine.ar.tp_layers import ParallelLMHead, RowParallelLinear, VocabParallelEmbedding
from omnistage.errors import ConfigError
from omnistage.families import hf
from omnistage.families.moe import MOE_DECODERS, fuse_moe
from omnistage.kernels import moe as moe_kernels
from omnistage.types import StageInput

_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROW = ("o_proj", "down_proj")


def check_shardable(config: PretrainedConfig, world: int, where: str,
                    decoders: Collection[str] = hf._PLAIN_DECODERS) -> None:
    """A ConfigError naming the field unless `world` ranks can split this decoder (one of the model types
    `decoders`) evenly."""
    text = config.get_text_config()
    if text.model_type not in decoders:
        raise ConfigError(f"{where}: tensor parallelism supports {', '.join(sorted(decoders))} decoders, "
                          f"not {text.model_type!r}; set it to 1")
    sizes = {"attention heads": text.num_attention_heads,
             "key/value heads": getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
             "intermediate size": text.intermediate_size}
    if getattr(text, "num_experts", 0):
        sizes["expert intermediate size"] = text.moe_intermediate_size
    for what, size in sizes.items():
        if size % world:
            raise ConfigError(f"{where}: {world} does not divide the model's {size} {what}; choose a divisor of "
                              f"{size}")


def stage_devices(devices: str | None, world: int, where: str) -> list[torch.device]:
    """One device per rank: the first `world` of `devices`, all CPU for "cpu"; None: cuda:0.. if there are
    GPUs, else the CPU."""
    if devices is None:
        names = [str(i) for i in range(world)] if torch.cuda.is_available() else ["cpu"] * world
    elif devices.strip() == "cpu":
        names = ["cpu"] * world
    else:
        names = [d.strip() for d in devices.split(",")][:world]
    out = [resolve_device(n) for n in names]
    if out[0].type == "cuda" and torch.cuda.device_count() < world:
        raise ConfigError(f"{where}: {world} ranks need {world} GPUs; this host has {torch.cuda.device_count()}")
    return out


def _shard(root: nn.Module, decoder: nn.Module, head: str, text: PretrainedConfig, group: TPGroup,
           dtype: torch.dtype) -> dict[str, tuple[int, int]]:
    """Replace the decoder's projections and embedding, and root's LM head (at attribute path `head`), by this
    rank's shards (on the meta device); returns parameter name in `root` -> (split dim, rows or columns per rank)
    for the loader. Only the decoder's linears are touched: a bigger root's other parts (media encoders, whose
    projections may share the names) stay whole."""
    n = group.world
    prefix = {id(m): name for name, m in root.named_modules()}[id(decoder)]
    prefix = f"{prefix}." if prefix else ""
    split: dict[str, tuple[int, int]] = {}
    for name, module in list(decoder.named_modules()):
        leaf = name.rsplit(".", 1)[-1]
        if not isinstance(module, nn.Linear) or leaf not in _COLUMN + _ROW:
            continue
        parent = decoder.get_submodule(name.rsplit(".", 1)[0])
        key, bias = prefix + name, module.bias is not None
        if leaf in _COLUMN:
            new: nn.Module = nn.Linear(module.in_features, module.out_features // n, bias=bias, dtype=dtype)
            split[f"{key}.weight"] = (0, module.out_features // n)
            if bias:
                split[f"{key}.bias"] = (0, module.out_features // n)
        else:
            new = RowParallelLinear(module.in_features, module.out_features, bias, group, dtype)
            split[f"{key}.weight"] = (1, module.in_features // n)
        setattr(parent, leaf, new)
    for name, module in decoder.named_modules():  # transformers' fused experts: [experts, 2 * inter, hidden] etc.
        fused = getattr(module, "gate_up_proj", None)
        if not isinstance(fused, nn.Parameter) or fused.ndim != 3:
            continue
        experts, hidden, inter = module.down_proj.shape
        module.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * (inter // n), hidden, dtype=dtype))
        module.down_proj = nn.Parameter(torch.empty(experts, hidden, inter // n, dtype=dtype))
        # the checkpoint's per-expert tensors (hf.load_weights fills the fused ones' views): gate / up rows, down
        # columns
        split[f"{prefix}{name}.gate_up_proj"] = (0, inter // n)
        split[f"{prefix}{name}.down_proj"] = (1, inter // n)
    decoder.embed_tokens = VocabParallelEmbedding(text.vocab_size, text.hidden_size, group, dtype)
    owner, _, leaf = head.rpartition(".")
    setattr(root.get_submodule(owner), leaf, ParallelLMHead(text.vocab_size, text.hidden_size, group, dtype))
    split[f"{prefix}embed_tokens.weight"] = split[f"{head}.weight"] = (0, decoder.embed_tokens.weight.shape[0])
    return split


def load_sharded(root: nn.Module, decoder: nn.Module, head: str, text: PretrainedConfig, group: TPGroup,
                 dtype: torch.dtype, path: Path, prefix_map: dict[str, str] | None = None) -> None:
    """Shard `decoder` (a part of `root`, built on the meta device) and root's LM head at `head` for this rank,
    materialize what is still on the meta device on the group's device (parts of root built there already keep
    their tensors), and read root's weights, this rank's slices of the sharded ones, from the checkpoint at `path`
    (its keys renamed by `prefix_map`, as in hf.load_weights: a decoder inside a bigger checkpoint)."""
    with torch.device("meta"):
        split = _shard(root, decoder, head, text, group, dtype)
    for module in root.modules():
        own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        if any(t.is_meta for t in own):
            module.to_empty(device=group.device, recurse=False)
    lm_head = root.get_submodule(head)
    tied = getattr(text, "tie_word_embeddings", False) or getattr(getattr(root, "config", None),
                                                                  "tie_word_embeddings", False)
    if tied:  # after materializing, which gives every module new tensors of its own
        lm_head.weight = decoder.embed_tokens.weight
    with torch.device(group.device):  # its tables are buffers that are not in the checkpoint
        decoder.rotary_emb = type(decoder.rotary_emb)(config=text)
    hf.load_weights(root, path, prefix_map, shard=_slicer(split, group.rank))
    root.eval().requires_grad_(False)


def reduce_expert_blocks(decoder: nn.Module, group: TPGroup) -> int:
    """All-reduce the output of each of the decoder's sparse MoE blocks (those with `experts`): each rank's
    experts hold its slice of every expert's intermediate size (routing replicated: every rank routes the same
    tokens to the same experts), so a block's output is a partial sum. Call it on the blocks the model will run
    (after any swap for fused kernels). Returns how many blocks reduce."""
    blocks = [layer.mlp for layer in decoder.layers if hasattr(layer.mlp, "experts")]
    for block in blocks:
        if getattr(block, "shared_expert", None) is not None:  # its row-parallel down projection reduces itself
            raise ConfigError("tensor parallelism does not cover MoE blocks with a shared expert; set "
                              "tensor_parallel_size to 1")
        block.register_forward_hook(lambda module, args, out: group.all_reduce(out))
    return len(blocks)


def sharded_kv(lm: hf.HFCausalLM, text: PretrainedConfig, world: int) -> hf.HFCausalLM:
    """`lm` (a shard) with its KV spec cut to this rank's share of the KV heads."""
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    lm.kv_spec = KVSpec(lm.kv_spec.num_layers, kv_heads // world, lm.kv_spec.head_dim, lm.kv_spec.dtype)
    return lm


def _slicer(split: dict[str, tuple[int, int]], rank: int) -> Any:
    def take(name: str, lazy: Any) -> torch.Tensor:
        if name not in split:
            return lazy[:]
        dim, size = split[name]
        full = lazy.get_shape()[dim]
        start, stop = rank * size, min(rank * size + size, full)
        part = lazy[start:stop] if dim == 0 else lazy[:, start:stop]
        if stop - start < size:  # the vocabulary's last shard: zero rows up to the shard size
            pad = list(part.shape)
            pad[dim] = size - (stop - start)
            part = torch.cat([part, part.new_zeros(pad)], dim=dim)
        return part

    return take


def load_shard(path: Path, dtype_name: str, group: TPGroup) -> hf.HFCausalLM:
    """This rank's shard of the causal LM at `path`, as an ARModel on `group.device` (the plain HF layer loop)."""
    config = AutoConfig.from_pretrained(path)
    text = config.get_text_config()
    dtype = hf.resolve_dtype(dtype_name, config, group.device)
    with torch.device("meta"), no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=hf.ATTN_IMPL)
    names = {id(m): name for name, m in model.named_modules()}
    decoder = model.get_decoder()
    load_sharded(model, decoder, names[id(model.get_output_embeddings())], text, group, dtype, path)
    if text.model_type in MOE_DECODERS:  # every rank its slice of every expert, on the fused kernels on CUDA
        if moe_kernels.available(group.device):
            fuse_moe(decoder, text)
        reduce_expert_blocks(decoder, group)
    return sharded_kv(hf.HFCausalLM(model, config, plain_loop=True), text, group.world)


class PreparingTPModel(TPModel):
    """Rank 0's view of a group whose model completes its own inputs (`prepare_input`, e.g. an omni thinker's
    media encoders and rotary positions, on rank 0 alone): the token embeddings it needs there come through the
    group's `embed` (each rank holds a slice of the vocabulary)."""

    def prepare_input(self, inp: StageInput, first: bool) -> StageInput:
        return self.local.prepare_input(inp, first, embed=self.embed)


def launch_preparing(load_shard: Callable[[Path, str, TPGroup], Any], path: Path, dtype_name: str,
                     devices: str | None, world: int, where: str) -> PreparingTPModel:
    """Start the group of a stage whose rank 0 prepares its own inputs (an omni thinker): every rank's model is
    `load_shard(path, dtype_name, group)`, rank 0's with a `prepare_input(inp, first, embed)`."""
    return launch(functools.partial(load_shard, Path(path), dtype_name), stage_devices(devices, world, where),
                  PreparingTPModel)


def launch_causal_lm(path: Path, dtype_name: str, devices: str | None, world: int, where: str) -> TPModel:
    """Check the split, then start the group: rank 0 here, ranks 1.. as follower processes."""
    check_shardable(AutoConfig.from_pretrained(path), world, where, hf._PLAIN_DECODERS | {"qwen3_moe"})
    return launch(functools.partial(load_shard, Path(path), dtype_name), stage_devices(devices, world, where))
