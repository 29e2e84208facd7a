"""The dense Triton GEMM equals torch's linear layer (on CPU through Triton's interpreter)."""

import pytest
import torch
import torch.nn.functional as F

import omnistage.kernels.dense_gemm as dense

pytest.importorskip("triton")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def force_triton(monkeypatch):
    monkeypatch.setattr(dense, "_use_triton", lambda x: x.dim() == 2)


@pytest.mark.parametrize("gelu", [False, True])
@pytest.mark.parametrize("tiles", [dense.Tiles(16, 32, 32), dense.Tiles(32, 16, 16, num_warps=2)])
def test_linear_matches_torch(force_triton, gelu: bool, tiles: dense.Tiles) -> None:
    x, w, b = torch.randn(70, 90, device=DEVICE), torch.randn(50, 90, device=DEVICE), torch.randn(50, device=DEVICE)
    got = dense.linear(x, w, b, gelu=gelu, tiles=tiles)  # ragged tiles in M, N and K
    want = F.linear(x, w, b)
    if gelu:
        want = F.gelu(want, approximate="tanh")
    assert got.shape == (70, 50) and got.dtype == x.dtype
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_row_does_not_depend_on_the_others(force_triton) -> None:
    x, w, b = torch.randn(40, 64, device=DEVICE), torch.randn(48, 64, device=DEVICE), torch.randn(48, device=DEVICE)
    tiles = dense.Tiles(16, 16, 32)
    assert torch.equal(dense.linear(x, w, b, tiles=tiles)[:7], dense.linear(x[:7], w, b, tiles=tiles))
