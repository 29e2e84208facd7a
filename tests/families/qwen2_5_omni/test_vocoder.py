"""The fused anti-aliased SnakeBeta kernels against transformers' five-pass activation. On a machine without a
GPU the Triton kernels run in Triton's interpreter (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _activation(channels: int) -> torch.nn.Module:
    """transformers' anti-aliased SnakeBeta on DEVICE, its alpha and beta drawn (not their flat defaults)."""
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
        Qwen2_5OmniAntiAliasedActivation1d,
        Qwen2_5OmniSnakeBeta,
    )

    act = Qwen2_5OmniAntiAliasedActivation1d(Qwen2_5OmniSnakeBeta(channels)).to(DEVICE)
    with torch.no_grad():
        act.act.alpha.normal_()
        act.act.beta.normal_()
    return act


@pytest.mark.parametrize(("channels", "length"), [(8, 37), (3, 1), (5, 300), (2, 2)])
def test_fused_activation_equals_transformers(channels: int, length: int) -> None:
    pytest.importorskip("triton")
    from omnistage.families.qwen2_5_omni import vocoder

    torch.manual_seed(length)
    act = _activation(channels)
    with torch.no_grad():
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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the bfloat16 vocoder runs on CUDA (fused activations)")
def test_fused_activation_reads_and_writes_bfloat16() -> None:
    """bfloat16 in and out, float32 inside: the float32 kernel's result on the same (rounded) input, rounded."""
    from omnistage.families.qwen2_5_omni import vocoder

    torch.manual_seed(0)
    act = _activation(16)
    with torch.no_grad():
        fused = vocoder.FusedAntiAliasedSnake(act)
        x = (2 * torch.randn(2, 16, 300, device=DEVICE)).bfloat16()
        got = fused(x)
        expected = fused(x.float())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, rtol=1e-2, atol=1e-2)


def test_vocoder_dtype_is_checked_and_bfloat16_needs_cuda(tiny_qwen2_5_omni: str) -> None:
    from pathlib import Path

    from transformers import Qwen2_5OmniConfig

    from omnistage.families.qwen2_5_omni import models

    path = Path(tiny_qwen2_5_omni)
    model = models.load_token2wav(path, Qwen2_5OmniConfig.from_pretrained(path).token2wav_config, DEVICE)
    voices = models.load_voices(path)
    with pytest.raises(ValueError, match="vocoder_dtype must be float32 or bfloat16, got 'float16'"):
        models.Token2Wav(model, voices, DEVICE, vocoder_dtype="float16")
    if DEVICE.type == "cuda":
        models.Token2Wav(model, voices, DEVICE, vocoder_dtype="bfloat16")
        assert model.code2wav_bigvgan_model.conv_pre.weight.dtype == torch.bfloat16
        models.Token2Wav(model, voices, DEVICE)  # the setting holds whatever the model was cast to before
        assert model.code2wav_bigvgan_model.conv_pre.weight.dtype == torch.float32
    else:
        with pytest.raises(ValueError, match="vocoder_dtype bfloat16 needs CUDA"):
            models.Token2Wav(model, voices, DEVICE, vocoder_dtype="bfloat16")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the bfloat16 vocoder runs on CUDA (fused activations)")
def test_bfloat16_vocoder_stays_near_float32(tiny_qwen2_5_omni: str) -> None:
    """The same mel through the float32 and the bfloat16 vocoder: the waveforms' relative RMS distance is small
    (a few percent on the released layout; benchmarks/results/omni_qwen2_5.md has the figure)."""
    from pathlib import Path

    from transformers import Qwen2_5OmniConfig

    from omnistage.families.qwen2_5_omni import models

    path = Path(tiny_qwen2_5_omni)
    config = Qwen2_5OmniConfig.from_pretrained(path).token2wav_config
    voices = models.load_voices(path)
    torch.manual_seed(0)
    mel = (torch.randn(1, config.dit_config.mel_dim, 120, device=DEVICE) - 4).cumsum(-1) / 20 - 4
    waves = []
    for dtype in ("float32", "bfloat16"):
        decoder = models.Token2Wav(models.load_token2wav(path, config, DEVICE), voices, DEVICE, vocoder_dtype=dtype)
        with torch.inference_mode():
            waves.append(decoder._vocode(mel)[0])
    reference, got = waves
    assert got.dtype == torch.float32 and got.shape == reference.shape
    rms = ((got - reference).pow(2).mean() / reference.pow(2).mean()).sqrt().item()
    assert rms < 0.05, rms
