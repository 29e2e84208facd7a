"""omnistage's 12 Hz codec decoder vs the qwen-tts package's decoder (fp32, CPU), and streamed vs one-shot."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from omnistage.families.qwen3_tts.codec import load_codec_decoder

from . import reference

Q, SIZE, WINDOW = 4, 32, 8  # codebooks, codebook size, decoder attention window (frames)
DECODER = dict(
    codebook_size=SIZE, codebook_dim=16, latent_dim=32, hidden_size=32, intermediate_size=64,
    num_attention_heads=2, num_key_value_heads=2, num_hidden_layers=2, num_quantizers=Q, sliding_window=WINDOW,
    decoder_dim=32, upsample_rates=[8, 5, 4, 3], upsampling_ratios=[2, 2],
)
ENCODER = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
    head_dim=16, num_filters=4, upsample_groups=32, codebook_dim=16, num_quantizers=Q, codebook_size=SIZE,
    upsampling_ratios=[8, 6, 5, 4],
)
ATOL = 1e-5  # fp32: same ops in the same order up to attention/conv kernels


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    reference.require_reference_venv()
    return reference.make_speech_tokenizer(tmp_path_factory.mktemp("st"), ENCODER, DECODER)


def _codes(batch: int, frames: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, SIZE, size=(batch, Q, frames))


def test_decode_matches_reference(tokenizer_dir: Path) -> None:
    codes = _codes(2, 20)
    ref = reference.decode(tokenizer_dir, codes)
    ours = load_codec_decoder(tokenizer_dir).decode(torch.from_numpy(codes)).numpy()
    assert ours.shape == ref.shape == (2, 20 * 1920)
    assert np.abs(ref).max() > 1e-3  # the tiny weights make a non-trivial signal
    np.testing.assert_allclose(ours, ref, atol=ATOL, rtol=0)


def test_batched_equals_single(tokenizer_dir: Path) -> None:
    model = load_codec_decoder(tokenizer_dir)
    codes = torch.from_numpy(_codes(3, 12, seed=1))
    batched = model.decode(codes)
    for i in range(3):
        # Batch size changes GEMM/conv accumulation order; the random unit-gain decoder amplifies that fp32
        # noise (not a real model's scale), hence a loose bound here and the tight one against the reference.
        torch.testing.assert_close(batched[i : i + 1], model.decode(codes[i : i + 1]), atol=5e-3, rtol=0)


def test_streamed_windows_match_one_shot(tokenizer_dir: Path) -> None:
    model = load_codec_decoder(tokenizer_dir)
    codes = torch.from_numpy(_codes(1, 40, seed=2))
    full = model.decode(codes)
    # Full left context reproduces one-shot up to the batch-shape fp32 noise (see above). A context of
    # 2 * WINDOW + 4 frames is NOT enough yet on this tiny model (open question, see the doc).
    streamed = torch.cat(model.stream(codes, window=5, left_context=codes.shape[-1]), dim=-1)
    torch.testing.assert_close(streamed, full, atol=5e-3, rtol=0)
    # With no left context the windows' starts differ: the bound must not pass vacuously.
    cold = torch.cat(model.stream(codes, window=5, left_context=0), dim=-1)
    assert (cold - full).abs().max() > 1e-3
