"""A fused forward for Llama-style decoders (Llama, Mistral, Qwen2, Qwen3), on the HF modules' own weights.

Between the GEMMs of a decode step, transformers' layers launch many tiny elementwise kernels, each a
launch and a round trip through memory. This forward keeps the weights where transformers put them but runs
each layer as: add+RMSNorm, one QKV GEMM that also applies the rotary and writes K/V to the cache,
paged attention, O GEMM, add+RMSNorm, one gate-up GEMM with SiLU-mul, down GEMM. Decode batches of
≤ 16 rows on CUDA take `skinny_gemm`'s kernels instead of cuBLAS; O and down leave split-K partial
sums that the following add+RMSNorm reduces. Q/K/V (and gate/up) weights are concatenated once at
load and the original parameters become views of the fused ones, so no memory is added and the HF
modules still work (the unfused path is used when intermediate hidden states are requested).
"""

from __future__ import annotations

import torch
from torch import nn

from omnistage.engine.ar.attention import AttentionMetadata, paged_attention
from omnistage.families.hf import rotary_tables
from omnistage.kernels import skinny_gemm
from omnistage.kernels.fused import add_rmsnorm, rotary_kv_write


def _fuse(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the weights (and biases) of linears sharing an input; re-point each to a view."""
    weight = torch.cat([lin.weight.data for lin in linears])
    has_bias = all(lin.bias is not None for lin in linears)
    bias = torch.cat([lin.bias.data for lin in linears]) if has_bias else None
    start = 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight = nn.Parameter(weight[start : start + n], requires_grad=False)
        if has_bias:
            lin.bias = nn.Parameter(bias[start : start + n], requires_grad=False)
        start += n
    return weight, bias


class FusedDecoder:
    def __init__(self, decoder: nn.Module):
        self.decoder = decoder
        self.layers = []
        for layer in decoder.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv_w, qkv_b = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
            gate_up_w, _ = _fuse([mlp.gate_proj, mlp.up_proj])
            self.layers.append({
                "layer_idx": attn.layer_idx,
                "qkv_w": qkv_w, "qkv_b": qkv_b,
                "q_size": attn.q_proj.weight.shape[0], "kv_size": attn.k_proj.weight.shape[0],
                "head_dim": attn.head_dim, "scaling": attn.scaling,
                "sliding_window": getattr(attn, "sliding_window", None),
                "q_norm": getattr(attn, "q_norm", None), "k_norm": getattr(attn, "k_norm", None),
                "o_w": attn.o_proj.weight, "o_b": attn.o_proj.bias,
                "gate_up_w": gate_up_w, "down_w": mlp.down_proj.weight,
                "in_norm": layer.input_layernorm, "post_norm": layer.post_attention_layernorm,
            })

    @staticmethod
    def supports(decoder: nn.Module) -> bool:
        """Only the exact layer shape this forward reproduces: SiLU gated MLP, RMSNorms, no MLP bias."""
        try:
            for layer in decoder.layers:
                attn, mlp = layer.self_attn, layer.mlp
                ok = (
                    all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "scaling", "head_dim"))
                    and all(getattr(mlp, n).bias is None for n in ("gate_proj", "up_proj", "down_proj"))
                    and getattr(decoder.config, "hidden_act", None) == "silu"
                    and hasattr(layer.input_layernorm, "variance_epsilon")
                    and hasattr(layer.post_attention_layernorm, "variance_epsilon")
                )
                if not ok:
                    return False
            return hasattr(decoder, "norm") and hasattr(decoder.norm, "variance_epsilon")
        except AttributeError:
            return False

    @staticmethod
    def _norm(x: torch.Tensor, residual: torch.Tensor | None, module: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        return add_rmsnorm(x, residual, module.weight, module.variance_epsilon)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        """hidden: [T, H] input embeddings (or a linear's split-K partials [splits, T, H], summed by the first
        add+RMSNorm) -> final (normed) hidden states [T, H]."""
        dtype = self.layers[0]["qkv_w"].dtype if self.layers else hidden.dtype  # the activations'
        cos, sin = attn.rotary if attn.rotary is not None else rotary_tables(self.decoder, positions, dtype)
        num_tokens = hidden.shape[-2]
        residual = None
        for p in self.layers:
            x, residual = self._norm(hidden, residual, p["in_norm"])
            d = p["head_dim"]
            k_cache, v_cache = attn.kv_cache.layer(p["layer_idx"])
            if p["q_norm"] is None:  # decode batches on CUDA: the rotary and the cache write in the GEMM's kernel
                q = skinny_gemm.qkv_rotary_kv_write(x, p["qkv_w"], p["qkv_b"], d, p["q_size"] // d, p["kv_size"] // d,
                                                    cos, sin, attn.slot_mapping, k_cache, v_cache)
            else:  # Qwen3's per-head norms come between the projection and the rotary
                qkv = skinny_gemm.linear(x, p["qkv_w"], p["qkv_b"])
                q, k, v = qkv.split([p["q_size"], p["kv_size"], p["kv_size"]], dim=-1)
                q = self._norm(q.reshape(-1, d), None, p["q_norm"])[0].view(num_tokens, -1, d)
                k = self._norm(k.reshape(-1, d), None, p["k_norm"])[0].view(num_tokens, -1, d)
                # q rotated in place on CUDA; rotated k and v go straight to the cache
                q = rotary_kv_write(q, k, v.reshape(num_tokens, -1, d), cos, sin, k_cache, v_cache,
                                    attn.slot_mapping)
            o = paged_attention(p["layer_idx"], q, None, None, attn, p["scaling"], p["sliding_window"],
                                kv_written=True)
            # o and down may come back as split-K partial sums: the next add+RMSNorm sums them
            hidden = skinny_gemm.linear(o.reshape(num_tokens, -1), p["o_w"], p["o_b"], partial=True)
            x, residual = self._norm(hidden, residual, p["post_norm"])
            hidden = skinny_gemm.linear(skinny_gemm.gate_up_silu(x, p["gate_up_w"]), p["down_w"], partial=True)
        return self._norm(hidden, residual, self.decoder.norm)[0]
