"""BigVGAN's anti-aliased SnakeBeta activation in one pass.

transformers runs each of the vocoder's activations (18 per upsampling stage) as five passes over the signal:
replicate pad, a 2x upsampling grouped transposed convolution (12 taps), SnakeBeta, replicate pad, a 2x
downsampling depthwise convolution (12 taps); at a batch of streamed windows those passes take about three
quarters of the vocoder's time. Here two Triton kernels do it: one computes each upsampled sample as a 6-tap
polyphase sum of the input and applies SnakeBeta, the other takes the 12-tap low-pass of every second one;
both pads are clamped indices. Same arithmetic up to float summation order. The kernels read and write the
vocoder's dtype (float32, or bfloat16 with `cast_convolutions`) and compute in float32; the upsampled signal
between them stays float32.
"""

from __future__ import annotations

import torch
from torch import nn

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is needed only on CUDA
    triton = None

TAPS = 12  # the released vocoder's filters (up and down), ratio 2
DTYPES = ("float32", "bfloat16")  # what the vocoder's convolutions may run in (Token2Wav's vocoder_dtype)

if triton is not None:

    @triton.jit
    def _upsample_snake_kernel(X, S, ALPHA, INV_BETA, UP, channels, length, BLOCK: tl.constexpr):
        """Per input sample p of one (batch, channel) row: the upsampled samples 2p and 2p+1 (6-tap polyphase
        sums; the upsampler's replicate padding as clamped indices), through SnakeBeta, stored interleaved
        (one contiguous store)."""
        row = tl.program_id(0).to(tl.int64)
        p = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = p < length
        channel = row % channels
        x = X + row * length
        even = tl.zeros([BLOCK], dtype=tl.float32)
        odd = tl.zeros([BLOCK], dtype=tl.float32)
        for d in tl.static_range(7):  # inputs p-3 .. p+3: even samples take p-3..p+2, odd ones p-2..p+3
            value = tl.load(x + tl.minimum(tl.maximum(p + d - 3, 0), length - 1), mask=ok, other=0.0).to(tl.float32)
            if d < 6:
                even += value * tl.load(UP + 11 - 2 * d)
            if d > 0:
                odd += value * tl.load(UP + 12 - 2 * d)
        alpha = tl.load(ALPHA + channel)
        inv_beta = tl.load(INV_BETA + channel)
        wave_even = tl.sin(even * alpha)
        wave_odd = tl.sin(odd * alpha)
        both = tl.interleave(even + inv_beta * wave_even * wave_even, odd + inv_beta * wave_odd * wave_odd)
        n = 2 * tl.program_id(1) * BLOCK + tl.arange(0, 2 * BLOCK)
        tl.store(S + row * 2 * length + n, both, mask=n < 2 * length)

    @triton.jit
    def _downsample_kernel(S, Y, DOWN, length, BLOCK: tl.constexpr):
        """Output t: the 12-tap low-pass at upsampled samples 2t-5 .. 2t+6 (replicate padding: clamped), read
        as 7 [BLOCK, 2] tiles of consecutive (even, odd) pairs: contiguous loads."""
        row = tl.program_id(0).to(tl.int64)
        t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = t < length
        s = S + row * 2 * length
        parity = tl.arange(0, 2)
        acc = tl.zeros([BLOCK, 2], dtype=tl.float32)
        for j in tl.static_range(7):  # the pair at 2(t + j - 3): taps m = 2j + parity - 1 (m = -1, 12: none)
            tap = 2 * j + parity - 1
            weight = tl.load(DOWN + tap, mask=(tap >= 0) & (tap < 12), other=0.0)
            n = tl.minimum(tl.maximum(2 * (t[:, None] + j - 3) + parity[None, :], 0), 2 * length - 1)
            acc += weight[None, :] * tl.load(s + n, mask=ok[:, None], other=0.0)
        tl.store(Y + row * length + t, tl.sum(acc, axis=1).to(Y.dtype.element_ty), mask=ok)


def fused_available(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda and x.dtype in (torch.float32, torch.bfloat16)


class FusedAntiAliasedSnake(nn.Module):
    """Drop-in for transformers' `Qwen2_5OmniAntiAliasedActivation1d` around a SnakeBeta: the fused kernel on
    CUDA (float32 or bfloat16 signals; its filters and SnakeBeta parameters stay float32), the wrapped module
    elsewhere."""

    def __init__(self, activation: nn.Module):
        super().__init__()
        up, down = activation.upsample, activation.downsample
        if (up.ratio, up.kernel_size, down.stride, down.kernel_size) != (2, TAPS, 2, TAPS):
            raise ValueError("the fused activation covers ratio 2 with 12-tap filters only")
        self.original = activation
        snake = activation.act
        with torch.no_grad():
            self.register_buffer("alpha", snake.alpha.exp().float().contiguous(), persistent=False)
            self.register_buffer("inv_beta", (1.0 / (snake.beta.exp() + snake.no_div_by_zero)).float().contiguous(),
                                 persistent=False)
            self.register_buffer("up", (up.ratio * up.filter).reshape(-1).float().contiguous(), persistent=False)
            self.register_buffer("down", down.filter.reshape(-1).float().contiguous(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not fused_available(x):
            return self.original(x)
        return anti_aliased_snake(x, self.alpha, self.inv_beta, self.up, self.down)


def anti_aliased_snake(x: torch.Tensor, alpha: torch.Tensor, inv_beta: torch.Tensor, up: torch.Tensor,
                       down: torch.Tensor, block: int = 512) -> torch.Tensor:
    """x [B, C, T] -> [B, C, T]: 2x upsample (`up`, gain included), SnakeBeta (per channel exp(alpha) and
    1 / (exp(beta) + eps)), low-pass 2x downsample (`down`)."""
    x = x.contiguous()
    batch, channels, length = x.shape
    upsampled = torch.empty(batch, channels, 2 * length, device=x.device, dtype=torch.float32)
    out = torch.empty_like(x)
    grid = (batch * channels, triton.cdiv(length, block))
    _upsample_snake_kernel[grid](x, upsampled, alpha, inv_beta, up, channels, length, BLOCK=block)
    _downsample_kernel[grid](upsampled, out, down, length, BLOCK=block)
    return out


def fuse_activations(vocoder: nn.Module) -> int:
    """Swap each anti-aliased SnakeBeta activation inside `vocoder` for the fused one (once: swapped ones stay);
    returns how many were swapped."""
    swapped = 0
    for module in list(vocoder.modules()):
        if isinstance(module, FusedAntiAliasedSnake):
            continue
        for name, child in list(module.named_children()):
            if type(child).__name__.endswith("AntiAliasedActivation1d") and hasattr(child.act, "beta"):
                setattr(module, name, FusedAntiAliasedSnake(child))
                swapped += 1
    return swapped


def cast_convolutions(vocoder: nn.Module, dtype: torch.dtype) -> int:
    """Cast the vocoder's convolutions (nearly all of its arithmetic) to `dtype`, after `fuse_activations`: the
    fused activations' float32 filters and SnakeBeta parameters stay as they are. Returns how many were cast.
    Needs the fused activations on every path (CUDA): transformers' own would mix dtypes."""
    convolutions = [m for m in vocoder.modules() if isinstance(m, (nn.Conv1d, nn.ConvTranspose1d))]
    for module in convolutions:
        module.to(dtype)
    return len(convolutions)
