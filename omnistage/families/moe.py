"""transformers' sparse MoE blocks on omnistage's fused MoE kernels (`omnistage.kernels.moe`): the Qwen MoE
layout every MoE family here shares (a top-k router `gate` with `top_k` / `norm_topk_prob`, `experts` with fused
`gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I], optionally a sigmoid-gated `shared_expert`): Qwen3-MoE and
Qwen2-MoE causal LMs, Qwen3-Omni's thinker and talker."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.kernels import moe

# causal-LM decoders of this layout whose forward is the plain embed -> layers -> norm loop (HFCausalLM.plain_loop)
MOE_DECODERS = {"qwen3_moe", "qwen2_moe"}

class FusedSparseMoe(nn.Module):
    """transformers' sparse MoE block (with or without its sigmoid-gated shared expert) with its experts on
    `moe.fused_experts`: the block's own router weights, expert tensors and shared expert (same
    submodule names, so the same state dict), routed as its router routes (`moe.route`)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.gate, self.experts = block.gate, block.experts
        self.shared_expert = getattr(block, "shared_expert", None)
        self.shared_expert_gate = getattr(block, "shared_expert_gate", None)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        weights, ids = moe.route(F.linear(x, self.gate.weight), self.gate.top_k, self.gate.norm_topk_prob)
        out = moe.fused_experts(x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.view(hidden_states.shape)


def fuse_moe(decoder: nn.Module, config: Any) -> int:
    """Swap the decoder's sparse MoE blocks for `FusedSparseMoe` (SiLU experts; what the kernels compute).
    Returns how many were swapped."""
    if config.hidden_act != "silu":
        return 0
    swapped = 0
    for layer in decoder.layers:
        if hasattr(layer.mlp, "experts") and hasattr(layer.mlp, "gate"):
            layer.mlp = FusedSparseMoe(layer.mlp)
            swapped += 1
    return swapped
