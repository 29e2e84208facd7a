"""Fused elementwise ops for the decode hot path: residual-add + RMSNorm, rotary embedding (alone, or with
the KV-cache write of the rotated keys and the values), SiLU-mul; and
for the DiT: gated residual + LayerNorm + modulation, linear + tanh GELU.

Unfused, each is a handful of tiny kernels per layer; at batch 1 those launches cost as much as a
fifth of the step. On CUDA each op is one Triton kernel; elsewhere the same math runs in torch.
Numerics follow transformers' implementations: sums and the norm in fp32, results rounded to the
activation dtype where transformers rounds them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from omnistage.kernels import pdl

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is needed only on CUDA
    triton = None


def _use_triton(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda


def sum_partials(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A linear's result from either form: [M, N] as is, or partials [splits, M, N] summed in order."""
    if y.dim() == 2:
        return y
    total = y[0].clone()
    for part in y[1:]:
        total += part
    return total.to(dtype)


# ---- residual add + RMSNorm -------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _add_rmsnorm_kernel(X, R, W, Y, RES_OUT, stride_xp, stride_x, stride_r, stride_y, n_cols, eps,
                            HAS_RESIDUAL: tl.constexpr, STORE_SUM: tl.constexpr, PARTS: tl.constexpr,
                            BLOCK: tl.constexpr, PDL: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < n_cols
        w = tl.load(W + cols, mask=ok, other=0.0)  # a weight: read before the wait, beside the previous kernel
        pdl.wait_for_inputs(PDL)
        pdl.launch_next(PDL)
        x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0)
        if PARTS > 1:  # a linear's fp32 partial sums over slices of K: summed in order, rounded once
            for p in tl.static_range(1, PARTS):
                x += tl.load(X + p * stride_xp + row * stride_x + cols, mask=ok, other=0.0)
            x = x.to(Y.dtype.element_ty)
        if HAS_RESIDUAL:
            x = (x + tl.load(R + row * stride_r + cols, mask=ok, other=0.0)).to(Y.dtype.element_ty)
        if STORE_SUM:
            tl.store(RES_OUT + row * stride_y + cols, x, mask=ok)
        xf = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
        tl.store(Y + row * stride_y + cols, w * (xf * rstd).to(Y.dtype.element_ty), mask=ok)


def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rmsnorm(x + residual) * weight, x + residual); with no residual, x is the residual.
    Works on the last dimension of a 2-D tensor. x may also be a linear's fp32 partial sums [splits, T, H]
    (`skinny_gemm.linear(partial=True)`); they are summed and rounded to the residual's (or weight's) dtype."""
    dtype = residual.dtype if residual is not None else weight.dtype
    if not _use_triton(x):
        x = sum_partials(x, dtype)
        summed = x if residual is None else x + residual
        normed = summed.float() * torch.rsqrt(summed.float().pow(2).mean(-1, keepdim=True) + eps)
        return weight * normed.to(x.dtype), summed
    parts = x.shape[0] if x.dim() == 3 else 1
    rows, n_cols = x.shape[-2], x.shape[-1]
    out = torch.empty(rows, n_cols, dtype=dtype if parts > 1 else x.dtype, device=x.device)
    store_sum = residual is not None or parts > 1
    res_out = torch.empty_like(out) if store_sum else x
    _add_rmsnorm_kernel[(rows,)](
        x, residual if residual is not None else x, weight, out, res_out,
        x.stride(0) if parts > 1 else 0, x.stride(-2), residual.stride(0) if residual is not None else 0,
        out.stride(0), n_cols, eps, HAS_RESIDUAL=residual is not None, STORE_SUM=store_sum, PARTS=parts,
        BLOCK=triton.next_power_of_2(n_cols), num_warps=8 if n_cols > 2048 else 4, **pdl.kernel_args(x.device),
    )
    return out, res_out


# ---- rotary embedding -----------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _rotate_heads(X, Y, stride_xh, stride_yh, n_heads, cos1, cos2, sin1, sin2,
                      HALF: tl.constexpr, BLOCK_H: tl.constexpr):
        """Rotate one token's heads read at X into Y (Y may be X): rounded to X's dtype as the unfused ops
        round, then to Y's."""
        d = tl.arange(0, HALF)
        heads = tl.arange(0, BLOCK_H)
        ok = (heads < n_heads)[:, None]
        src = X + heads[:, None] * stride_xh + d[None, :]
        dst = Y + heads[:, None] * stride_yh + d[None, :]
        x1 = tl.load(src, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=ok, other=0.0).to(tl.float32)
        y1, y2 = rotate_half_pair(x1, x2, cos1[None, :], cos2[None, :], sin1[None, :], sin2[None, :])
        y1, y2 = y1.to(X.dtype.element_ty), y2.to(X.dtype.element_ty)
        tl.store(dst, y1.to(Y.dtype.element_ty), mask=ok)
        tl.store(dst + HALF, y2.to(Y.dtype.element_ty), mask=ok)

    @triton.jit
    def rotate_half_pair(x1, x2, cos1, cos2, sin1, sin2):
        """Rotate-half rotary of a head's first-half features x1 and second-half features x2, in float32: also
        the fused QKV GEMM's epilogue (skinny_gemm), so both round alike."""
        return x1 * cos1 - x2 * sin1, x2 * cos2 + x1 * sin2

    @triton.jit
    def _load_cos_sin(COS, SIN, tok, stride_c, HALF: tl.constexpr):
        d = tl.arange(0, HALF)
        cos1 = tl.load(COS + tok * stride_c + d).to(tl.float32)
        cos2 = tl.load(COS + tok * stride_c + HALF + d).to(tl.float32)
        sin1 = tl.load(SIN + tok * stride_c + d).to(tl.float32)
        sin2 = tl.load(SIN + tok * stride_c + HALF + d).to(tl.float32)
        return cos1, cos2, sin1, sin2

    @triton.jit
    def _rotary_kernel(Q, K, COS, SIN, stride_qt, stride_qh, stride_kt, stride_kh, stride_c,
                       n_q_heads, n_k_heads, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
        tok = tl.program_id(0).to(tl.int64)
        cos1, cos2, sin1, sin2 = _load_cos_sin(COS, SIN, tok, stride_c, HALF)
        q, k = Q + tok * stride_qt, K + tok * stride_kt
        _rotate_heads(q, q, stride_qh, stride_qh, n_q_heads, cos1, cos2, sin1, sin2, HALF, BLOCK_H)
        _rotate_heads(k, k, stride_kh, stride_kh, n_k_heads, cos1, cos2, sin1, sin2, HALF, BLOCK_H)

    @triton.jit
    def _rotary_kv_write_kernel(Q, K, V, KC, VC, COS, SIN, SLOTS,
                                stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                                stride_ct, stride_ch, stride_c, n_q_heads, n_k_heads,
                                HALF: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
        """One token: q rotated in place; rotated k and plain v stored at its cache slot. The tables and the
        slot are read before the PDL wait: kernels that finished before this one launched wrote them."""
        tok = tl.program_id(0).to(tl.int64)
        cos1, cos2, sin1, sin2 = _load_cos_sin(COS, SIN, tok, stride_c, HALF)
        slot = tl.load(SLOTS + tok).to(tl.int64) * stride_ct
        pdl.wait_for_inputs(PDL)
        pdl.launch_next(PDL)
        q = Q + tok * stride_qt
        _rotate_heads(q, q, stride_qh, stride_qh, n_q_heads, cos1, cos2, sin1, sin2, HALF, BLOCK_H)
        _rotate_heads(K + tok * stride_kt, KC + slot, stride_kh, stride_ch, n_k_heads,
                      cos1, cos2, sin1, sin2, HALF, BLOCK_H)
        heads = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, 2 * HALF)[None, :]
        ok = heads < n_k_heads
        v = tl.load(V + tok * stride_vt + heads * stride_vh + d, mask=ok, other=0.0)
        tl.store(VC + slot + heads * stride_ch + d, v.to(VC.dtype.element_ty), mask=ok)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half rotary embedding of q [T, H, D] and k [T, KVH, D] with cos/sin [T, D]."""
    if not _use_triton(q):
        def rotate(x: torch.Tensor) -> torch.Tensor:
            x1, x2 = x.chunk(2, dim=-1)
            return torch.cat((-x2, x1), dim=-1)

        c, s = cos[:, None, :], sin[:, None, :]
        return q * c + rotate(q) * s, k * c + rotate(k) * s
    half = q.shape[-1] // 2
    _rotary_kernel[(q.shape[0],)](
        q, k, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
        q.shape[1], k.shape[1], HALF=half, BLOCK_H=triton.next_power_of_2(max(q.shape[1], k.shape[1])),
    )
    return q, k


def rotary_kv_write(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """apply_rotary, then store k and v at each token's cache slot (as paged_attention would): on CUDA one
    kernel instead of three, and the rotated k goes straight to the cache (k itself is left unrotated).
    q, k, v [T, heads, D] (last dimension contiguous; strided views are fine), cos/sin [T, D],
    k_cache/v_cache [slots, KVH, D], slot_mapping [T]. Returns q, rotated (in place on CUDA)."""
    if not _use_triton(q):
        q, k = apply_rotary(q, k, cos, sin)
        k_cache.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
        v_cache.index_copy_(0, slot_mapping, v.to(v_cache.dtype))
        return q
    _rotary_kv_write_kernel[(q.shape[0],)](
        q, k, v, k_cache, v_cache, cos, sin, slot_mapping,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), cos.stride(0), q.shape[1], k.shape[1],
        HALF=q.shape[-1] // 2, BLOCK_H=triton.next_power_of_2(max(q.shape[1], k.shape[1])),
        **pdl.kernel_args(q.device),
    )
    return q


# ---- SiLU(gate) * up --------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _silu_mul_kernel(GU, Y, stride_gu, stride_y, n_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < n_cols
        gate = tl.load(GU + row * stride_gu + cols, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(GU + row * stride_gu + n_cols + cols, mask=ok, other=0.0)
        act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
        tl.store(Y + row * stride_y + cols, act * up, mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate then up) -> silu(gate) * up, [T, I]."""
    n = gate_up.shape[-1] // 2
    if not _use_triton(gate_up):
        return torch.nn.functional.silu(gate_up[:, :n]) * gate_up[:, n:]
    out = torch.empty(gate_up.shape[0], n, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(gate_up.shape[0], triton.cdiv(n, block))](gate_up, out, gate_up.stride(0), out.stride(0), n,
                                                              BLOCK=block)
    return out


# ---- gated residual + LayerNorm + modulation (a DiT's adaLN) ----------------------------------

if triton is not None:

    @triton.jit
    def _residual_norm_modulate_kernel(H, U, GATE, SHIFT, SCALE, H_OUT, X_OUT, n_cols, eps,
                                       HAS_UPDATE: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < n_cols
        h = tl.load(H + row * n_cols + cols, mask=ok, other=0.0)
        if HAS_UPDATE:
            update = tl.load(U + row * n_cols + cols, mask=ok, other=0.0).to(tl.float32)
            gate = tl.load(GATE + cols, mask=ok, other=0.0).to(tl.float32)
            h = (h.to(tl.float32) + gate * update).to(H.dtype.element_ty)
            tl.store(H_OUT + row * n_cols + cols, h, mask=ok)
        hf = h.to(tl.float32)
        mean = tl.sum(hf, axis=0) / n_cols
        centred = tl.where(ok, hf - mean, 0.0)
        rstd = tl.rsqrt(tl.sum(centred * centred, axis=0) / n_cols + eps)
        scale = tl.load(SCALE + cols, mask=ok, other=0.0).to(tl.float32)
        shift = tl.load(SHIFT + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(X_OUT + row * n_cols + cols, (centred * rstd * scale + shift).to(X_OUT.dtype.element_ty), mask=ok)


def residual_norm_modulate(
    h: torch.Tensor, update: torch.Tensor | None, gate: torch.Tensor | None, shift: torch.Tensor,
    scale: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A DiT block's seam: h += gate * update (when given), then x = layer_norm(h) * scale + shift (no affine
    weights; `scale` already 1 + the modulation's scale). h, update [rows, width]; gate, shift, scale [width].
    Returns (h, x): one pass over the rows instead of three."""
    if not _use_triton(h):
        if update is not None:
            h = torch.addcmul(h, gate, update)
        return h, torch.addcmul(shift, F.layer_norm(h, h.shape[-1:], eps=eps), scale)
    h, update = h.contiguous(), update.contiguous() if update is not None else None
    n_cols = h.shape[-1]
    h_out = torch.empty_like(h) if update is not None else h
    x = torch.empty_like(h)
    _residual_norm_modulate_kernel[(h.shape[0],)](
        h, update if update is not None else h, gate if gate is not None else shift, shift, scale, h_out, x,
        n_cols, eps, HAS_UPDATE=update is not None, BLOCK=triton.next_power_of_2(n_cols),
        num_warps=8 if n_cols > 2048 else 4,
    )
    return h_out, x


def linear_gelu_tanh(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """gelu(x @ weight.T + bias, approximate="tanh") for 2-D x. On CUDA one cuBLASLt matmul whose epilogue adds
    the bias and applies GELU (its tanh form) instead of a second pass over the product."""
    if x.is_cuda and x.dim() == 2:
        return torch._addmm_activation(bias, x, weight.t(), use_gelu=True)
    return F.gelu(F.linear(x, weight, bias), approximate="tanh")
