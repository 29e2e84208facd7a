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
                      lengths: torch.Tensor | None = None, starts: torch.Tensor | None = None) -> torch.Tensor | None:
    """Which keys of each query block's window (`back` blocks before it to `ahead` after it) are real frames:
    [blocks, 1, 1, window] bool, or None when all are. With `lengths` ([B] real frames per sequence, the rest
    padding; `starts` [B], optional: padding before them too): [B x blocks, 1, 1, window]; a query block whose
    window holds no real frame (padding only) keeps its padding keys, so no row's softmax is empty (some
    backends make an empty one NaN, and NaN times a zero weight still reaches the real rows)."""
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
    if starts is not None:
        real &= position >= starts.to(device)[:, None, None]
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
                    rotary: tuple[torch.Tensor, torch.Tensor, int] | None = None,
                    left: torch.Tensor | None = None, left_lengths: torch.Tensor | None = None) -> torch.Tensor:
    """qkv [B, frames, 3, heads, dim] (a fused projection's output, viewed) -> [B, frames, heads, dim].
    `lengths` ([B], optional): real frames per sequence; keys past them are padding no query sees (padding
    queries get zeros or padding). `mask` (block_window_mask, with the same `lengths`; with `left`,
    kept_window_mask) is used by the torch path only. `rotary` (cos, sin [frames, dim], n): the first n heads of
    query and key are rotated first (rotate_heads; the kernel rotates as it loads, in float32, and leaves qkv as
    it was).
    `left` ([B, left_frames, 2, heads, dim], whole blocks; optional): key and value (not rotated) of the frames
    just before frame 0, kept from an earlier solve, so that look-back windows reach into them; `left_lengths`
    [B]: how many of them are real (the last ones; 0: none). With `left`, `rotary`'s tables start at position
    -left_frames. The Triton kernel multiplies float32 on TF32 tensor cores when torch's matmuls do
    (torch.backends.cuda.matmul.allow_tf32), else in full float32."""
    if not fused_available(qkv):
        if left is not None:
            return _block_attention_after(qkv, left, left_lengths, block, back, ahead, lengths, rotary, mask)
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
    if left is not None:
        assert left.shape[1] % block == 0 and left.stride(-1) == 1, "left context: whole blocks, rows contiguous"
        left_strides, left_frames = left.stride()[:4], left.shape[1]
    else:
        left, left_lengths, left_strides, left_frames = out, out, (0, 0, 0, 0), 0
    _block_attention_kernel[(batch * blocks, heads)](
        qkv, out, out if lengths is None else lengths, cos, sin, rotated, frames, blocks, *qkv.stride()[:4],
        *out.stride()[:3], left, left_lengths, *left_strides, dim ** -0.5, BLOCK=block,
        PAD=max(16, triton.next_power_of_2(block)), DIM=dim, BACK=back, AHEAD=ahead,
        PRECISION="ieee" if exact else "tf32", HAS_LENGTHS=lengths is not None, HAS_ROTARY=rotated > 0,
        LEFT_FRAMES=left_frames,
    )
    return out


def kept_window_mask(frames: int, block: int, back: int, ahead: int, device: torch.device,
                     lengths: torch.Tensor | None, left_frames: int, left_lengths: torch.Tensor) -> torch.Tensor:
    """block_window_mask over [left; frames] (what the torch path of block_attention with `left` attends over):
    the left context's missing frames and the padding masked."""
    batch = left_lengths.shape[0]
    ends = (lengths if lengths is not None else torch.full((batch,), frames, device=device)) + left_frames
    return block_window_mask(left_frames + frames, block, back, ahead, device, ends, left_frames - left_lengths)


def _block_attention_after(qkv: torch.Tensor, left: torch.Tensor, left_lengths: torch.Tensor, block: int,
                           back: int, ahead: int, lengths: torch.Tensor | None,
                           rotary: tuple[torch.Tensor, torch.Tensor, int] | None,
                           mask: torch.Tensor | None = None) -> torch.Tensor:
    """The torch path with a kept left context: attention over [left; qkv] with the left context's missing
    frames and the padding masked (`mask`: kept_window_mask's, computed here if not given), the left
    context's own query rows dropped."""
    frames, left_frames = qkv.shape[1], left.shape[1]
    no_query = torch.zeros_like(left[:, :, :1])
    joined = torch.cat([torch.cat([no_query, left], dim=2), qkv], dim=1)
    if rotary is not None:
        rotate_heads(joined, *rotary)
    if mask is None:
        mask = kept_window_mask(frames, block, back, ahead, qkv.device, lengths, left_frames, left_lengths)
    return block_attention_sdpa(*joined.unbind(2), block, back, ahead, mask)[:, left_frames:]


if triton is not None:

    @triton.jit
    def _rotated(x, partner, pos, ok, cols, COS, SIN, DIM: tl.constexpr):
        """Rows of a query or key head (`x`; `partner`: the same rows loaded half a head further round) times
        the rotary tables' rows `pos`, in float32."""
        table = pos[:, None] * DIM + cols[None, :]
        cos = tl.load(COS + table, mask=ok[:, None], other=0.0).to(tl.float32)
        sin = tl.load(SIN + table, mask=ok[:, None], other=0.0).to(tl.float32)
        sign = tl.where(cols < DIM // 2, -1.0, 1.0)[None, :]
        return (x.to(tl.float32) * cos + sign * partner.to(tl.float32) * sin).to(x.dtype)

    @triton.jit
    def _block_attention_kernel(QKV, OUT, LENGTHS, COS, SIN, rotated_heads, frames, blocks, s_batch, s_frame,
                                s_part, s_head, o_batch, o_frame, o_head, LEFT, LEFT_LENGTHS, l_batch, l_frame,
                                l_part, l_head, scale, BLOCK: tl.constexpr, PAD: tl.constexpr, DIM: tl.constexpr,
                                BACK: tl.constexpr, AHEAD: tl.constexpr, PRECISION: tl.constexpr,
                                HAS_LENGTHS: tl.constexpr, HAS_ROTARY: tl.constexpr, LEFT_FRAMES: tl.constexpr):
        """One (sequence, query block, head): online softmax over the window's key blocks, one at a time. Key
        positions below 0 come from LEFT (the kept context) when LEFT_FRAMES > 0; the rotary tables' row
        for position p is p + LEFT_FRAMES."""
        seq = tl.program_id(0) // blocks
        i = tl.program_id(0) % blocks
        head = tl.program_id(1)
        rows = tl.arange(0, PAD)
        cols = tl.arange(0, DIM)
        turned = (cols + DIM // 2) % DIM
        base = QKV + seq.to(tl.int64) * s_batch + head * s_head
        q_pos = i * BLOCK + rows
        q_ok = (rows < BLOCK) & (q_pos < frames)
        q_at = base + q_pos[:, None] * s_frame
        q = tl.load(q_at + cols[None, :], mask=q_ok[:, None], other=0.0)
        rotate = False
        if HAS_ROTARY:
            rotate = head < rotated_heads
            if rotate:
                partner = tl.load(q_at + turned[None, :], mask=q_ok[:, None], other=0.0)
                q = _rotated(q, partner, q_pos + LEFT_FRAMES, q_ok, cols, COS, SIN, DIM)
        real = frames
        if HAS_LENGTHS:
            real = tl.load(LENGTHS + seq).to(tl.int32)  # keys past it are padding
        kept_from = 0
        left_base = LEFT + seq.to(tl.int64) * l_batch + head * l_head
        if LEFT_FRAMES > 0:
            kept_from = -tl.load(LEFT_LENGTHS + seq).to(tl.int32)  # the first real kept position
        best = tl.full([PAD], float("-inf"), tl.float32)
        total = tl.zeros([PAD], tl.float32)
        acc = tl.zeros([PAD, DIM], tl.float32)
        for j in tl.static_range(BACK + 1 + AHEAD):
            k_pos = (i - BACK + j) * BLOCK + rows
            in_block = rows < BLOCK
            in_qkv = in_block & (k_pos >= 0) & (k_pos < real)
            k_at = base + k_pos[:, None] * s_frame
            k = tl.load(k_at + s_part + cols[None, :], mask=in_qkv[:, None], other=0.0)
            v = tl.load(k_at + 2 * s_part + cols[None, :], mask=in_qkv[:, None], other=0.0)
            k_ok = in_qkv
            if LEFT_FRAMES > 0:  # masked loads: no memory traffic for key blocks at positions >= 0
                kept = in_block & (k_pos < 0) & (k_pos >= kept_from)
                l_at = left_base + (k_pos + LEFT_FRAMES)[:, None] * l_frame
                k += tl.load(l_at + cols[None, :], mask=kept[:, None], other=0.0)
                v += tl.load(l_at + l_part + cols[None, :], mask=kept[:, None], other=0.0)
                k_ok = k_ok | kept
            if rotate:
                partner = tl.load(k_at + s_part + turned[None, :], mask=in_qkv[:, None], other=0.0)
                if LEFT_FRAMES > 0:
                    partner += tl.load(l_at + turned[None, :], mask=kept[:, None], other=0.0)
                k = _rotated(k, partner, k_pos + LEFT_FRAMES, k_ok, cols, COS, SIN, DIM)
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
