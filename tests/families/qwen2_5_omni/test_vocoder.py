"""The fused anti-aliased SnakeBeta kernels against transformers' five-pass activation. On a machine without a
GPU the Triton kernels run in Triton's interpreter (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize(("channels", "length"), [(8, 37), (3, 1), (5, 300), (2, 2)])
def test_fused_activation_equals_transformers(channels: int, length: int) -> None:
    pytest.importorskip("triton")
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
        Qwen2_5OmniAntiAliasedActivation1d,
        Qwen2_5OmniSnakeBeta,
    )

    from omnistage.families.qwen2_5_omni import vocoder

    torch.manual_seed(length)
    act = Qwen2_5OmniAntiAliasedActivation1d(Qwen2_5OmniSnakeBeta(channels)).to(DEVICE)
    with torch.no_grad():
        act.act.alpha.normal_()
        act.act.beta.normal_()
        fused = vocoder.FusedAntiAliasedSnake(act)
        x = 2 * torch.randn(2, channels, length, device=DEVICE)
        expected = act(x)
        got = vocoder.anti_aliased_snake(x, fused.alpha, fused.inv_beta, fused.up, fused.down, block=64)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_every_vocoder_activation_is_swapped(tiny_qwen2_5_omni: str) -> None:
    from pathlib import Path

    from transformers import Qwen2_5OmniConfig

    from omnistage.families.qwen2_5_omni import models, vocoder

    path = Path(tiny_qwen2_5_omni)
    model = models.load_token2wav(path, Qwen2_5OmniConfig.from_pretrained(path).token2wav_config, torch.device("cpu"))
    bigvgan = model.code2wav_bigvgan_model
    mel = torch.randn(2, 80, 30)
    with torch.no_grad():
        before = bigvgan(mel)
        swapped = vocoder.fuse_activations(bigvgan)
        after = bigvgan(mel)  # on the CPU the swapped modules run transformers' own activation
    expected = sum(len(block.activations) for block in bigvgan.resblocks) + 1  # + activation_post
    assert swapped == expected
    assert vocoder.fuse_activations(bigvgan) == 0  # already swapped
    torch.testing.assert_close(after, before)
