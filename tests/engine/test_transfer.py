"""to_host: the device tensors' values on the host, as ordinary (not pinned) tensors, in order."""

from __future__ import annotations

import pytest
import torch

from omnistage.engine.transfer import to_host


def test_to_host_keeps_values_and_order_on_cpu() -> None:
    tensors = [torch.arange(5), torch.randn(2, 3)]
    out = to_host(tensors)
    assert [t.device.type for t in out] == ["cpu", "cpu"]
    for got, want in zip(out, tensors, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned copies need a GPU")
def test_to_host_from_cuda_through_pinned_memory() -> None:
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # copied on the current stream, after what it queued
        a = torch.randn(4096, device="cuda")
        b = (a * 2).to(torch.bfloat16)
        out = to_host([a, torch.arange(3), b, torch.zeros(0, device="cuda")])
    assert [t.device.type for t in out] == ["cpu"] * 4
    assert not any(t.is_pinned() for t in out)  # the pinned blocks went back to the host cache
    torch.testing.assert_close(out[0], a.cpu(), rtol=0, atol=0)
    torch.testing.assert_close(out[1], torch.arange(3), rtol=0, atol=0)
    torch.testing.assert_close(out[2], b.cpu(), rtol=0, atol=0)
    assert out[3].shape == (0,)
