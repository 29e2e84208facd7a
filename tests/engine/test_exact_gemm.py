"""3xTF32 linear layers equal a float64 product to float32's precision (on CPU through Triton's interpreter);
on a GPU closer than cuBLAS's strict float32, and used only where torch would run strict float32."""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
from omnistage.kernels import exact_gemm  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, gelu: bool) -> torch.Tensor:
    y = F.linear(x.double(), w.double(), None if b is None else b.double())
    return F.gelu(y, approximate="tanh") if gelu else y


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference relative to the largest value."""
    return ((got.double() - want).abs().max() / want.abs().max()).item()


# one shape per tile choice (few rows and columns; up to 1024 rows; more), ragged in every dimension
@pytest.mark.parametrize(("rows", "cols", "depth"), [(37, 72, 200), (300, 1100, 96), (1030, 70, 40)])
@pytest.mark.parametrize(("with_bias", "gelu"), [(False, False), (True, False), (True, True)])
def test_exact_linear_matches_a_float64_product(rows: int, cols: int, depth: int, with_bias: bool,
                                               gelu: bool) -> None:
    torch.manual_seed(0)
    x, w = torch.randn(rows, depth, device=DEVICE), torch.randn(cols, depth, device=DEVICE) * depth ** -0.5
    b = torch.randn(cols, device=DEVICE) if with_bias else None
    got = exact_gemm.exact_linear(x, w, b, gelu)
    assert got.shape == (rows, cols) and got.dtype == torch.float32
    assert _error(got, _reference(x, w, b, gelu)) < 2e-6


def test_strided_input_rows() -> None:
    x = torch.randn(20, 130, device=DEVICE)[:, 1:129]  # rows 130 apart
    w = torch.randn(64, 128, device=DEVICE)
    assert _error(exact_gemm.exact_linear(x, w), _reference(x, w, None, False)) < 2e-6


@CUDA
@pytest.mark.parametrize("rows", [144, 816, 1920])
@pytest.mark.parametrize(("cols", "depth", "gelu"), [(3072, 1024, False), (1024, 1024, False), (2048, 1024, True),
                                                     (1024, 2048, False)])
def test_on_a_gpu_closer_to_float64_than_cublas_strict_float32(rows: int, cols: int, depth: int,
                                                               gelu: bool) -> None:
    """token2wav's DiT matmuls (qkv, o, ff up with GELU, ff down) at its window batches."""
    torch.manual_seed(0)
    x, w = torch.randn(rows, depth, device=DEVICE), torch.randn(cols, depth, device=DEVICE) * depth ** -0.5
    b = torch.randn(cols, device=DEVICE) * 0.1
    want = _reference(x, w, b, gelu)
    assert not torch.backends.cuda.matmul.allow_tf32
    cublas = F.gelu(F.linear(x, w, b), approximate="tanh") if gelu else F.linear(x, w, b)
    ours = _error(exact_gemm.exact_linear(x, w, b, gelu), want)
    assert ours < 1e-6 and ours <= _error(cublas, want)


@CUDA
def test_on_a_gpu_only_strict_float32_goes_to_the_kernel(monkeypatch) -> None:
    x, w, b = torch.randn(48, 64, device=DEVICE), torch.randn(32, 64, device=DEVICE), torch.randn(32, device=DEVICE)
    assert exact_gemm.exact_applies(x)
    assert not exact_gemm.exact_applies(x.bfloat16()) and not exact_gemm.exact_applies(x.cpu())
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", True)
    assert not exact_gemm.exact_applies(x)  # TF32 asked for: cuBLAS's TF32 matmul
    torch.testing.assert_close(exact_gemm.linear(x, w, b), F.linear(x, w, b), rtol=0, atol=0)
