"""BigVGAN's anti-aliased SnakeBeta activation in one pass.

transformers runs each of the vocoder's activations (18 per upsampling stage) as five passes over the signal:
replicate pad, a 2x upsampling grouped transposed convolution (12 taps), SnakeBeta, replicate pad, a 2x
downsampling depthwise convolution (12 taps); at a batch of streamed windows those passes take about three
quarters of the vocoder's time. Here one Triton kernel reads each input sample and writes each output sample
once: every output is the 12-tap low-pass of SnakeBeta over 12 upsampled samples, each a 6-tap polyphase sum
of the input, with both pads as clamped indices. Same arithmetic up to float summation order.
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

if triton is not None:

    @triton.jit
    def _anti_aliased_snake_kernel(X, Y, ALPHA, INV_BETA, UP, DOWN, channels, length, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)  # one (batch, channel) row
        t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = t < length
        channel = row % channels
        alpha = tl.load(ALPHA + channel)
        inv_beta = tl.load(INV_BETA + channel)
        x = X + row * length
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for m in tl.static_range(12):
            # upsampled sample n (the downsampler's replicate padding: n clamped to the signal)
            n = tl.minimum(tl.maximum(2 * t - 5 + m, 0), 2 * length - 1)
            odd = n % 2
            base = n // 2 - 3 + odd
            u = tl.zeros([BLOCK], dtype=tl.float32)
            for k in tl.static_range(6):
                # the upsampler's replicate padding: input index clamped; even samples take the odd taps
                value = tl.load(x + tl.minimum(tl.maximum(base + k, 0), length - 1), mask=ok, other=0.0)
                tap = tl.where(odd == 1, tl.load(UP + 10 - 2 * k), tl.load(UP + 11 - 2 * k))
                u += value * tap
            wave = tl.sin(u * alpha)
            acc += tl.load(DOWN + m) * (u + inv_beta * wave * wave)
        tl.store(Y + row * length + t, acc, mask=ok)


def fused_available(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda and x.dtype == torch.float32


class FusedAntiAliasedSnake(nn.Module):
    """Drop-in for transformers' `Qwen2_5OmniAntiAliasedActivation1d` around a SnakeBeta: the fused kernel on
    CUDA (float32), the wrapped module elsewhere."""

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
                       down: torch.Tensor, block: int = 256) -> torch.Tensor:
    """x [B, C, T] -> [B, C, T]: 2x upsample (`up`, gain included), SnakeBeta (per channel exp(alpha) and
    1 / (exp(beta) + eps)), low-pass 2x downsample (`down`)."""
    x = x.contiguous()
    batch, channels, length = x.shape
    out = torch.empty_like(x)
    grid = (batch * channels, triton.cdiv(length, block))
    _anti_aliased_snake_kernel[grid](x, out, alpha, inv_beta, up, down, channels, length, BLOCK=block)
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
