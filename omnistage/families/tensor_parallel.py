"""A transformers decoder sharded in place for tensor parallelism (engine/ar/parallel.py runs the ranks).

The model is built on the meta device, its projections replaced by their shards, and only then materialized, so
no rank ever holds the whole model: q/k/v and gate/up are column-parallel (this rank's heads, kv heads included,
and its slice of the intermediate size), o and down row-parallel, the embedding and LM head vocab-parallel. Each
rank reads its slices straight from the safetensors files. Attention sees its per-rank head counts through the
shapes (transformers' attention modules infer the head count from the projection width), and the KV cache per
rank holds kv_heads / world heads. Decoders whose forward is the plain embed -> layers -> norm loop only.
"""

from __future__ import annotations

import functools
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

_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROW = ("o_proj", "down_proj")


def check_shardable(config: PretrainedConfig, world: int, where: str) -> None:
    """A ConfigError naming the field unless `world` ranks can split this decoder evenly."""
    text = config.get_text_config()
    if text.model_type not in hf._PLAIN_DECODERS:
        raise ConfigError(f"{where}: tensor parallelism supports {', '.join(sorted(hf._PLAIN_DECODERS))} decoders, "
                          f"not {text.model_type!r}; set it to 1")
    sizes = {"attention heads": text.num_attention_heads,
             "key/value heads": getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
             "intermediate size": text.intermediate_size}
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


def _shard(model: nn.Module, text: PretrainedConfig, group: TPGroup, dtype: torch.dtype) -> dict[str, tuple[int, int]]:
    """Replace the model's projections, embedding and head by this rank's shards (on the meta device); returns
    parameter name -> (split dim, rows or columns per rank) for the loader."""
    n = group.world
    split: dict[str, tuple[int, int]] = {}
    for name, module in list(model.named_modules()):
        leaf = name.rsplit(".", 1)[-1]
        if not isinstance(module, nn.Linear) or leaf not in _COLUMN + _ROW:
            continue
        parent = model.get_submodule(name.rsplit(".", 1)[0])
        bias = module.bias is not None
        if leaf in _COLUMN:
            new: nn.Module = nn.Linear(module.in_features, module.out_features // n, bias=bias, dtype=dtype)
            split[f"{name}.weight"] = (0, module.out_features // n)
            if bias:
                split[f"{name}.bias"] = (0, module.out_features // n)
        else:
            new = RowParallelLinear(module.in_features, module.out_features, bias, group, dtype)
            split[f"{name}.weight"] = (1, module.in_features // n)
        setattr(parent, leaf, new)
    names = {id(m): name for name, m in model.named_modules()}
    decoder = model.get_decoder()
    embed_name = names[id(decoder.embed_tokens)]
    head_name = names[id(model.get_output_embeddings())]
    embed = VocabParallelEmbedding(text.vocab_size, text.hidden_size, group, dtype)
    head = ParallelLMHead(text.vocab_size, text.hidden_size, group, dtype)
    decoder.embed_tokens = embed
    model.set_output_embeddings(head)
    if getattr(text, "tie_word_embeddings", False) or getattr(model.config, "tie_word_embeddings", False):
        head.weight = embed.weight
    split[f"{embed_name}.weight"] = split[f"{head_name}.weight"] = (0, embed.weight.shape[0])
    return split


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
        split = _shard(model, text, group, dtype)
    model.to_empty(device=group.device)
    decoder = model.get_decoder()
    with torch.device(group.device):  # its tables are buffers that are not in the checkpoint
        decoder.rotary_emb = type(decoder.rotary_emb)(config=text)
    hf.load_weights(model, path, shard=_slicer(split, group.rank))
    model.eval().requires_grad_(False)
    lm = hf.HFCausalLM(model, config, plain_loop=True)
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    lm.kv_spec = KVSpec(lm.kv_spec.num_layers, kv_heads // group.world, lm.kv_spec.head_dim, lm.kv_spec.dtype)
    return lm


def launch_causal_lm(path: Path, dtype_name: str, devices: str | None, world: int, where: str) -> TPModel:
    """Check the split, then start the group: rank 0 here, ranks 1.. as follower processes."""
    check_shardable(AutoConfig.from_pretrained(path), world, where)
    return launch(functools.partial(load_shard, Path(path), dtype_name), stage_devices(devices, world, where))
