"""token2wav's DiT solved window by window with a kept context: each window's look-back layers read the keys
and values the previous window's solve computed for its last block, instead of solving that block again."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omnistage.families.qwen2_5_omni import dit as dit_module
from omnistage.kernels import block_attention as kernels

DEVICES = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


def solver_without_look_ahead(path: Path, device: torch.device, num_steps: int = 3):
    """The tiny checkpoint's DiT with its look-ahead layer made a plain one: then nothing a window computes
    depends on later frames, and windows continuing kept contexts must equal one solve of the whole."""
    from transformers import Qwen2_5OmniConfig

    from omnistage.families.qwen2_5_omni import models

    config = Qwen2_5OmniConfig.from_pretrained(path).token2wav_config
    dit = models.load_token2wav(path, config, device).code2wav_dit_model
    for block in dit.transformer_blocks:
        block.look_ahead_block = 0
    voice = models.load_voices(path)["Ethan"]
    solver = dit_module.DiTSolver(dit, num_steps=num_steps, guidance_scale=0.5, sway=-1.0)
    speaker = voice["cond"].to(device)
    return solver, speaker, solver.speaker_features(voice["ref_mel"].to(device))


@pytest.mark.parametrize("path", ["torch", "triton"])
@pytest.mark.parametrize("device", DEVICES)
def test_windows_continuing_kept_contexts_equal_one_solve(monkeypatch, tiny_qwen2_5_omni: str, path: str,
                                                          device: str) -> None:
    """Codes 0..48 solved at once, and as windows 0..12, 12..36 (beside another request's first window,
    padded), 36..48, each continuing the context the one before kept: the same mel frames. Without the kept
    context (has_kept 0) the second window's first block differs."""
    if path == "triton":
        pytest.importorskip("triton")
        if device == "cpu" and torch.cuda.is_available():
            pytest.skip("Triton's interpreter runs CPU tensors only on a machine without a GPU (tests/conftest.py)")
        monkeypatch.setattr(kernels, "fused_available", lambda qkv: True)
        monkeypatch.setattr(dit_module, "fused_available", lambda qkv: True)
    dev = torch.device(device)
    solver, speaker, features = solver_without_look_ahead(Path(tiny_qwen2_5_omni), dev)
    r, block = solver.repeats, solver.block_size
    assert solver.kept_frames == block and len(solver.back_layers) == 1  # the tiny DiT: one layer looks back
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 30, (1, 48), generator=gen).to(dev)
    noise = torch.randn(1, 48 * r, solver.mel_dim, generator=gen).to(dev)
    other_codes = torch.randint(0, 30, (1, 24), generator=gen).to(dev)
    other_noise = torch.randn(1, 24 * r, solver.mel_dim, generator=gen).to(dev)
    one = torch.ones(1, dtype=torch.long, device=dev)
    with torch.inference_mode():
        whole = solver.solve(noise, codes, speaker, features)
        nothing = torch.zeros(1, *solver.kept_shape(), device=dev)
        first, kept = solver.solve(noise[:, : 12 * r], codes[:, :12], speaker, features, None, nothing, 0 * one,
                                   12 * r * one)
        # the second window beside another request's first one (12 codes, padded to 24): a batch of two
        pair = solver.solve(torch.cat([noise[:, 12 * r : 36 * r], other_noise]),
                            torch.cat([codes[:, 12:36], other_codes]), speaker.expand(2, -1),
                            features.expand(2, -1, -1), torch.tensor([24 * r, 12 * r], device=dev),
                            torch.cat([kept, nothing]), torch.tensor([1, 0], device=dev),
                            torch.tensor([24 * r, 12 * r], device=dev))
        second, kept_after = pair[0][:1], pair[1][:1]
        third, _ = solver.solve(noise[:, 36 * r :], codes[:, 36:], speaker, features, None, kept_after, one,
                                12 * r * one)
        forgetting, _ = solver.solve(noise[:, 12 * r : 36 * r], codes[:, 12:36], speaker, features, None, kept,
                                     0 * one, 24 * r * one)
        other_alone = solver.solve(other_noise[:, : 12 * r], other_codes[:, :12], speaker, features)
    tol = {"rtol": 1e-4, "atol": 1e-4}
    torch.testing.assert_close(torch.cat([first, second, third], dim=-1), whole, **tol)
    torch.testing.assert_close(pair[0][1:, :, : 12 * r], other_alone, **tol)
    assert not torch.allclose(forgetting[..., :block], whole[..., 12 * r : 12 * r + block], atol=1e-3)
