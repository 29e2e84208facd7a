"""token2wav's block attention: each query block attends only to its window of key blocks. The Triton kernel
runs in Triton's interpreter on a machine without a GPU (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from omnistage.kernels import block_attention as kernels

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def dense_reference(q, k, v, block, back, ahead):
    """What transformers computes: every frame against every frame, blocks out of reach masked to -inf."""
    frames = q.shape[1]
    index = torch.arange(frames, device=q.device) // block
    diff = index[None, :] - index[:, None]
    bias = torch.zeros(frames, frames, dtype=q.dtype, device=q.device).masked_fill(
        (diff < -back) | (diff > ahead), float("-inf"))
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=bias)
    return out.transpose(1, 2)


@pytest.mark.parametrize("frames", [48, 50, 7, 168])
@pytest.mark.parametrize("reach", [(0, 0), (1, 0), (0, 1), (2, 1)])
def test_windowed_sdpa_equals_masked_dense_attention(frames: int, reach: tuple[int, int]) -> None:
    torch.manual_seed(frames)
    q, k, v = (torch.randn(3, frames, 2, 8, dtype=torch.float64) for _ in range(3))
    mask = kernels.block_window_mask(frames, 24, *reach, q.device)
    got = kernels.block_attention_sdpa(q, k, v, 24, *reach, mask)
    assert got.shape == q.shape
    torch.testing.assert_close(got, dense_reference(q, k, v, 24, *reach), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("frames", [48, 50, 7])
@pytest.mark.parametrize("reach", [(0, 0), (1, 0), (0, 1), (2, 1)])
def test_triton_kernel_equals_masked_dense_attention(monkeypatch, frames: int, reach: tuple[int, int]) -> None:
    pytest.importorskip("triton")
    monkeypatch.setattr(kernels, "fused_available", lambda qkv: True)
    torch.manual_seed(frames)
    qkv = torch.randn(2, frames, 3, 2, 16, device=DEVICE)  # the fused projection's layout, read in place
    got = kernels.block_attention(qkv, 24, *reach)
    expected = dense_reference(*qkv.unbind(2), 24, *reach)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_whole_blocks_within_reach_need_no_mask() -> None:
    assert kernels.block_window_mask(48, 24, 0, 0, torch.device("cpu")) is None
    assert kernels.block_window_mask(50, 24, 0, 0, torch.device("cpu")) is not None  # the last block is partial


@pytest.mark.parametrize("path", ["sdpa", "triton"])
@pytest.mark.parametrize("reach", [(0, 0), (2, 1)])
def test_padding_past_each_sequences_length_changes_nothing_before_it(monkeypatch, path: str,
                                                                      reach: tuple[int, int]) -> None:
    """Sequences of 50 and 7 real frames padded to 96 (padding filled with large values): their real rows equal
    the unpadded attention's, and no row is NaN (padding blocks beyond every real key included)."""
    if path == "triton":
        pytest.importorskip("triton")
        monkeypatch.setattr(kernels, "fused_available", lambda qkv: True)
    torch.manual_seed(0)
    lengths = [50, 7]
    qkv = torch.full((2, 96, 3, 2, 16), 1e3, device=DEVICE)
    for row, n in enumerate(lengths):
        qkv[row, :n] = torch.randn(n, 3, 2, 16, device=DEVICE)
    real = torch.tensor(lengths, device=DEVICE)
    mask = kernels.block_window_mask(96, 24, *reach, DEVICE, real)
    got = kernels.block_attention(qkv, 24, *reach, mask, real)
    assert not got.isnan().any()
    for row, n in enumerate(lengths):
        alone = dense_reference(*qkv[row : row + 1, :n].unbind(2), 24, *reach)
        torch.testing.assert_close(got[row : row + 1, :n], alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", ["sdpa", "triton"])
def test_rotary_on_the_first_heads_equals_rotating_before_attention(monkeypatch, path: str) -> None:
    """The DiT rotates head 0 of query and key: the kernel does it as it loads them, the torch path in place
    before attending. Both equal rotating by hand, then attending; a kernel rotating nothing (or every head)
    would not."""
    if path == "triton":
        pytest.importorskip("triton")
        monkeypatch.setattr(kernels, "fused_available", lambda qkv: True)
    torch.manual_seed(1)
    frames, dim = 50, 16
    qkv = torch.randn(2, frames, 3, 2, dim, device=DEVICE)
    angles = torch.arange(frames, device=DEVICE)[:, None] * torch.rand(dim // 2, device=DEVICE).repeat(2)[None]
    cos, sin = angles.cos(), angles.sin()
    by_hand = qkv.clone()
    q0, k0 = by_hand[:, :, 0, 0], by_hand[:, :, 1, 0]
    for x in (q0, k0):
        x.copy_(x * cos + torch.cat([-x[..., dim // 2 :], x[..., : dim // 2]], -1) * sin)
    expected = dense_reference(*by_hand.unbind(2), 24, 1, 0)
    mask = kernels.block_window_mask(frames, 24, 1, 0, DEVICE)
    got = kernels.block_attention(qkv.clone(), 24, 1, 0, mask, rotary=(cos, sin, 1))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, dense_reference(*qkv.unbind(2), 24, 1, 0), atol=1e-3)


@pytest.mark.parametrize("path", ["sdpa", "triton"])
@pytest.mark.parametrize("reach", [(1, 0), (1, 1), (2, 1), (0, 1)])
def test_a_kept_left_context_equals_attending_over_it_in_one_sequence(monkeypatch, path: str,
                                                                      reach: tuple[int, int]) -> None:
    """Key and value of the block before a window, kept from an earlier solve (`left`): the window's queries
    attend into it exactly as if those frames led the sequence (rotary at their positions included); a row
    without a kept block (left_lengths 0) as if it were not there; padding past `lengths` unseen as usual."""
    if path == "triton":
        pytest.importorskip("triton")
        monkeypatch.setattr(kernels, "fused_available", lambda qkv: True)
    torch.manual_seed(2)
    kept, frames, dim = 24, 50, 16
    full = torch.randn(3, kept + frames, 3, 2, dim, device=DEVICE)  # rows: kept; kept and padded; none kept
    angles = torch.arange(-kept, frames, device=DEVICE)[:, None] * torch.rand(dim // 2, device=DEVICE).repeat(2)
    cos, sin = angles.cos(), angles.sin()
    rotated = full.clone()
    kernels.rotate_heads(rotated, cos, sin, 1)
    lengths = torch.tensor([frames, 30, frames], device=DEVICE)
    left_lengths = torch.tensor([kept, kept, 0], device=DEVICE)
    got = kernels.block_attention(full[:, kept:].clone(), 24, *reach, None, lengths, (cos, sin, 1),
                                  left=full[:, :kept, 1:].clone(), left_lengths=left_lengths)
    assert got.shape == (3, frames, 2, dim) and not got.isnan().any()
    expected = [dense_reference(*rotated[0:1].unbind(2), 24, *reach)[:, kept:],
                dense_reference(*rotated[1:2, : kept + 30].unbind(2), 24, *reach)[:, kept:],
                dense_reference(*rotated[2:3, kept:].unbind(2), 24, *reach)]
    for row, want in enumerate(expected):
        torch.testing.assert_close(got[row : row + 1, : want.shape[1]], want, rtol=1e-5, atol=1e-5)
    if reach[0]:  # the kept block is really read: without it the first block's rows differ
        alone = dense_reference(*rotated[0:1, kept:].unbind(2), 24, *reach)
        assert not torch.allclose(got[0:1, :24], alone[:, :24], atol=1e-3)
