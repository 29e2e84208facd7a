"""Qwen3-Omni's MoE thinker over a tensor-parallel group (tensor_parallel.py shards it, engine/ar/parallel.py runs
the ranks): attention and the vocabulary as for Qwen2, each expert's intermediate size split over the ranks (every
rank its slice of every expert's gate / up rows and down columns; the router replicated, so every rank sends the
same tokens to the same experts) and each sparse block's partial output all-reduced. Rank 0 holds the media
encoders whole and alone runs them; DeepStack features ride in the input embeddings' extra columns to every rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers.initialization import no_init_weights

from omnistage.engine.ar.parallel import TPGroup
from omnistage.families import hf, tensor_parallel
from omnistage.families.moe import fuse_moe
from omnistage.families.qwen2_5_omni.models import THINKER_KEYS, ThinkerText, thinker_skeleton
from omnistage.families.qwen3_omni_moe import models
from omnistage.kernels import moe

THINKER_DECODERS = ("qwen3_omni_moe_text",)


def load_thinker_shard(path: Path, dtype_name: str, group: TPGroup) -> hf.HFCausalLM:
    """This rank's thinker: rank 0 the whole thinker with its text decoder, embedding and LM head sharded and its
    media encoders whole; the other ranks only their shard of the text decoder and head."""
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeThinkerForConditionalGeneration

    config = Qwen3OmniMoeConfig.from_pretrained(path).thinker_config
    text, device = config.text_config, group.device
    dtype = hf.resolve_dtype(dtype_name, text, device)
    if group.rank == 0:
        root = thinker_skeleton(Qwen3OmniMoeThinkerForConditionalGeneration, config, dtype, device)
    else:
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeThinkerTextModel

        with torch.device("meta"), no_init_weights():
            root = ThinkerText(config, Qwen3OmniMoeThinkerTextModel, dtype)
    decoder = root.model.language_model
    tensor_parallel.load_sharded(root, decoder, "lm_head", text, group, dtype, path, THINKER_KEYS)
    lm = models.ThinkerLM(root) if group.rank == 0 else _TextShard(root, config)
    tensor_parallel.reduce_expert_blocks(lm.decoder, group)  # on the blocks it runs (fused on CUDA or not)
    return tensor_parallel.sharded_kv(lm, text, group.world)


class _TextShard(models.ThinkerLM):
    """A follower's thinker: the thinker's forward (DeepStack additions included) over its text shard, without the
    media encoders, which only rank 0 holds; the MoE blocks fused as rank 0's are, so every rank computes alike."""

    def __init__(self, root: ThinkerText, config: Any):  # ThinkerLM's attributes, less the encoders'
        text = config.text_config
        hf.HFCausalLM.__init__(self, root, text, decoder=root.model.language_model, lm_head=root.lm_head,
                               plain_loop=True)
        self.hidden, self.num_layers = text.hidden_size, text.num_hidden_layers
        self.deepstack = len(config.vision_config.deepstack_visual_indexes)
        self.graph_safe = moe.available(self.device) and fuse_moe(self.decoder, text) > 0
