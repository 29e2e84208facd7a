"""Block-local attention: frames in blocks of `block`; a query in block i attends to the keys of blocks
i-back .. i+ahead (a DiT's block attention, e.g. Qwen2.5-Omni's token2wav).

Through a dense mask, every query scores every frame and most scores are thrown away. Here each query block
scores only its own window of key blocks. On CUDA one Triton program per (sequence, query block, head) reads
its query block and key/value blocks straight from the fused QKV projection's output and writes the result
in the layout the output projection reads (no copies around the kernel); elsewhere the same windows run
through torch's SDPA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is needed only on CUDA
    triton = None


def block_window_mask(frames: int, block: int, back: int, ahead: int, device: torch.device,
                      lengths: torch.Tensor | None = None) -> torch.Tensor | None:
    """Which keys of each query block's window (`back` blocks before it to `ahead` after it) are real frames:
    [blocks, 1, 1, window] bool, or None when all are. With `lengths` ([B] real frames per sequence, the rest
    padding): [B x blocks, 1, 1, window]; a query block whose window holds no real frame (padding only) keeps
    its padding keys, so no row's softmax is empty (some backends make an empty one NaN, and NaN times a zero
    weight still reaches the real rows)."""
    blocks = -(-frames // block)
    if lengths is None and back == ahead == 0 and frames % block == 0:
        return None
    offsets = torch.arange((back + 1 + ahead) * block, device=device)
    start = (torch.arange(blocks, device=device) - back) * block
    position = start[:, None] + offsets[None, :]
    inside = (position >= 0) & (position < frames)
    if lengths is None:
        return inside[:, None, None, :]
    real = inside & (position < lengths.to(device)[:, None, None])  # [B, blocks, window]
    real |= inside & ~real.any(-1, keepdim=True)
    return real.flatten(0, 1)[:, None, None, :]


def block_attention_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int, back: int, ahead: int,
                         mask: torch.Tensor | None) -> torch.Tensor:
    """[B, frames, heads, dim] q, k, v -> [B, frames, heads, dim]; `mask` from block_window_mask (one for
    every sequence, or one per sequence)."""
    batch, frames, heads, dim = q.shape
    blocks = -(-frames // block)
    pad = blocks * block - frames

    def blocked(x: torch.Tensor, before: int = 0, after: int = 0) -> torch.Tensor:
        """[B, frames, H, D] -> [B, blocks + before + after, block, H, D], zero-padded."""
        return F.pad(x, (0, 0, 0, 0, before * block, pad + after * block)).view(batch, -1, block, heads, dim)

    def windows(x: torch.Tensor) -> torch.Tensor:
        """[B * blocks, H, window, D]: each query block's keys (or values), `back` blocks before to `ahead` after."""
        x = blocked(x, back, ahead)
        x = torch.cat([x[:, j : j + blocks] for j in range(back + 1 + ahead)], dim=2) if back or ahead else x
        return x.flatten(0, 1).transpose(1, 2)

    queries = blocked(q).flatten(0, 1).transpose(1, 2)
    if mask is not None and mask.shape[0] == blocks:
        mask = mask.repeat(batch, 1, 1, 1)
    out = F.scaled_dot_product_attention(queries, windows(k), windows(v), attn_mask=mask)
    return out.transpose(1, 2).reshape(batch, blocks * block, heads, dim)[:, :frames]


def fused_available(qkv: torch.Tensor) -> bool:
    """Whether block_attention runs the Triton kernel on `qkv` (else torch's SDPA, which needs the mask)."""
    dim = qkv.shape[-1]
    return triton is not None and qkv.is_cuda and dim >= 16 and dim & (dim - 1) == 0


def rotate_heads(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> None:
    """Rotary embedding (rotate-half layout) on the first `heads` heads of the query and key, in place:
    qkv [B, frames, 3, heads, dim], cos/sin [frames, dim]. What block_attention's kernel does as it loads them."""
    rotated = qkv[:, :, :2, :heads]
    half = rotated.shape[-1] // 2
    turned = torch.cat([-rotated[..., half:], rotated[..., :half]], dim=-1)
    rotated.copy_(rotated * cos[:, None, None] + turned * sin[:, None, None])


def block_attention(qkv: torch.Tensor, block: int, back: int, ahead: int, mask: torch.Tensor | None = None,
                    lengths: torch.Tensor | None = None,
                    rotary: tuple[torch.Tensor, torch.Tensor, int] | None = None) -> torch.Tensor:
    """qkv [B, frames, 3, heads, dim] (a fused projection's output, viewed) -> [B, frames, heads, dim].
    `lengths` ([B], optional): real frames per sequence; keys past them are padding no query sees (padding
    queries get zeros or padding). `mask` (block_window_mask, with the same `lengths`) is used by the torch
    path only. `rotary` (cos, sin [frames, dim], n): the first n heads of query and key are rotated first
    (rotate_heads; the kernel rotates as it loads, in float32, and leaves qkv as it was). The Triton kernel
    multiplies float32 on TF32 tensor cores when torch's matmuls do (torch.backends.cuda.matmul.allow_tf32),
    else in full float32."""
    if not fused_available(qkv):
        if rotary is not None:
            rotate_heads(qkv, *rotary)
        return block_attention_sdpa(*qkv.unbind(2), block, back, ahead, mask)
    batch, frames, _, heads, dim = qkv.shape
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    out = torch.empty(batch, frames, heads, dim, device=qkv.device, dtype=qkv.dtype)
    blocks = -(-frames // block)
    exact = qkv.dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32
    cos, sin, rotated = (out, out, 0) if rotary is None else (rotary[0].contiguous(), rotary[1].contiguous(),
                                                              rotary[2])
    _block_attention_kernel[(batch * blocks, heads)](
        qkv, out, out if lengths is None else lengths, cos, sin, rotated, frames, blocks, *qkv.stride()[:4],
        *out.stride()[:3], dim ** -0.5, BLOCK=block, PAD=max(16, triton.next_power_of_2(block)), DIM=dim,
        BACK=back, AHEAD=ahead, PRECISION="ieee" if exact else "tf32", HAS_LENGTHS=lengths is not None,
        HAS_ROTARY=rotated > 0,
    )
    return out


if triton is not None:

    @triton.jit
    def _rotated(x, part, pos, ok, cols, s_frame, COS, SIN, DIM: tl.constexpr):
        """Rows `pos` of a query or key head (`x`, loaded from `part`) times the rotary tables, in float32."""
        partner = tl.load(part + pos[:, None] * s_frame + ((cols + DIM // 2) % DIM)[None, :], mask=ok[:, None],
                          other=0.0)
        table = pos[:, None] * DIM + cols[None, :]
        cos = tl.load(COS + table, mask=ok[:, None], other=0.0).to(tl.float32)
        sin = tl.load(SIN + table, mask=ok[:, None], other=0.0).to(tl.float32)
        sign = tl.where(cols < DIM // 2, -1.0, 1.0)[None, :]
        return (x.to(tl.float32) * cos + sign * partner.to(tl.float32) * sin).to(x.dtype)

    @triton.jit
    def _block_attention_kernel(QKV, OUT, LENGTHS, COS, SIN, rotated_heads, frames, blocks, s_batch, s_frame,
                                s_part, s_head, o_batch, o_frame, o_head, scale, BLOCK: tl.constexpr,
                                PAD: tl.constexpr, DIM: tl.constexpr, BACK: tl.constexpr, AHEAD: tl.constexpr,
                                PRECISION: tl.constexpr, HAS_LENGTHS: tl.constexpr, HAS_ROTARY: tl.constexpr):
        """One (sequence, query block, head): online softmax over the window's key blocks, one at a time."""
        seq = tl.program_id(0) // blocks
        i = tl.program_id(0) % blocks
        head = tl.program_id(1)
        rows = tl.arange(0, PAD)
        cols = tl.arange(0, DIM)
        base = QKV + seq.to(tl.int64) * s_batch + head * s_head
        q_pos = i * BLOCK + rows
        q_ok = (rows < BLOCK) & (q_pos < frames)
        q = tl.load(base + q_pos[:, None] * s_frame + cols[None, :], mask=q_ok[:, None], other=0.0)
        rotate = False
        if HAS_ROTARY:
            rotate = head < rotated_heads
            if rotate:
                q = _rotated(q, base, q_pos, q_ok, cols, s_frame, COS, SIN, DIM)
        real = frames
        if HAS_LENGTHS:
            real = tl.load(LENGTHS + seq).to(tl.int32)  # keys past it are padding
        best = tl.full([PAD], float("-inf"), tl.float32)
        total = tl.zeros([PAD], tl.float32)
        acc = tl.zeros([PAD, DIM], tl.float32)
        for j in tl.static_range(BACK + 1 + AHEAD):
            k_pos = (i - BACK + j) * BLOCK + rows
            k_ok = (rows < BLOCK) & (k_pos >= 0) & (k_pos < real)
            offsets = k_pos[:, None] * s_frame + cols[None, :]
            k = tl.load(base + s_part + offsets, mask=k_ok[:, None], other=0.0)
            if rotate:
                k = _rotated(k, base + s_part, k_pos, k_ok, cols, s_frame, COS, SIN, DIM)
            v = tl.load(base + 2 * s_part + offsets, mask=k_ok[:, None], other=0.0)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            scores = tl.where(k_ok[None, :], scores, float("-inf"))
            new_best = tl.maximum(best, tl.max(scores, axis=1))
            shift = tl.where(new_best == float("-inf"), 0.0, new_best)  # a window block wholly outside
            p = tl.exp(scores - shift[:, None])
            keep = tl.exp(best - shift)
            total = total * keep + tl.sum(p, axis=1)
            acc = acc * keep[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            best = new_best
        out = acc / tl.where(total > 0, total, 1.0)[:, None]  # a padding block with no real key in reach: zeros
        o = OUT + seq.to(tl.int64) * o_batch + head * o_head
        tl.store(o + q_pos[:, None] * o_frame + cols[None, :], out.to(OUT.dtype.element_ty), mask=q_ok[:, None])
