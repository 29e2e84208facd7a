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
    num_attention_heads=2, num_key_value_heads=2, head_dim=8, num_hidden_layers=2, num_quantizers=Q,
    sliding_window=WINDOW, decoder_dim=32, upsample_rates=[8, 5, 4, 3], upsampling_ratios=[2, 2],
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
    # Full left context reproduces one-shot up to the batch-shape fp32 noise (see above); less than the
    # receptive field (2 x 7 + 12 = 26 frames here) is not exact, and this unit-gain decoder amplifies the gap.
    streamed = torch.cat(model.stream(codes, window=5, left_context=codes.shape[-1]), dim=-1)
    torch.testing.assert_close(streamed, full, atol=5e-3, rtol=0)
    # With no left context the windows' starts differ: the bound must not pass vacuously.
    cold = torch.cat(model.stream(codes, window=5, left_context=0), dim=-1)
    assert (cold - full).abs().max() > 1e-3


# --- CodecStage: windows, batching, receptive field (random decoder, no reference venv needed) ---

from omnistage.engine.generation.engine import GenerationEngine  # noqa: E402
from omnistage.families.qwen3_tts.codec import CodecDecoder, CodecOptions, CodecStage  # noqa: E402
from omnistage.types import StageInput  # noqa: E402

UP = 1920  # samples per frame of DECODER
NOISE = 1e-5  # fp32 noise of a different batch shape on this small-gain random decoder


@pytest.fixture(scope="module")
def decoder() -> CodecDecoder:
    torch.manual_seed(0)
    model = CodecDecoder(DECODER).eval()
    with torch.no_grad():  # HF init leaves many weights at exact constants; make every path carry signal
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def _frames(n: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, SIZE, size=(n, Q)))


def test_receptive_field_is_exact(decoder: CodecDecoder) -> None:
    # Changing frame 0 changes no sample of frames >= receptive_field: the stated bound holds.
    codes = _frames(40, 3).T[None]
    other = codes.clone()
    other[..., 0] = (other[..., 0] + 1) % SIZE
    diff = (decoder.decode(codes) - decoder.decode(other)).abs().view(40, UP).amax(1)
    assert diff[0] > 1e-6  # the change is visible where it happens
    assert diff[decoder.receptive_field :].max() == 0
    assert diff[decoder.receptive_field - 1] > 0  # and it is not looser than needed
    assert decoder.receptive_field == 2 * (WINDOW - 1) + 12


def test_streamed_with_default_context_matches_one_shot(decoder: CodecDecoder) -> None:
    codes = _frames(48, 4).T[None]
    full = decoder.decode(codes)
    exact = torch.cat(decoder.stream(codes, window=5, left_context=decoder.receptive_field), dim=-1)
    torch.testing.assert_close(exact, full, atol=NOISE, rtol=0)
    # The stage's default context (CodecOptions, 25 frames, one short of this receptive field): within 1e-4.
    default = torch.cat(decoder.stream(codes, window=5, left_context=CodecOptions().left_context), dim=-1)
    assert (default - full).abs().max() < 1e-4
    # No context: the windows' starts differ visibly, so the bounds above are not vacuous.
    cold = torch.cat(decoder.stream(codes, window=5, left_context=0), dim=-1)
    assert (cold - full).abs().max() > 1e-3


def _inp(rid: str, codes: torch.Tensor, stream: bool, done: int = 0, final: bool = True) -> StageInput:
    return StageInput(rid, params={"done": done, "stream": stream}, tensors={"codes": codes}, final=final)


def test_stage_batched_equals_each_alone(decoder: CodecDecoder) -> None:
    # Rows of different lengths, offsets (done > 0: ICL reference frames) and modes in ONE forward.
    stage = CodecStage(decoder, torch.device("cpu"), first_window=3, window=6, left_context=25)
    specs = [("a", 30, True, 0, False), ("b", 11, False, 4, True), ("c", 17, True, 5, True), ("d", 2, True, 0, False)]
    make = lambda: [_inp(r, _frames(n, i), s, d, f) for i, (r, n, s, d, f) in enumerate(specs)]  # noqa: E731
    together = stage.generate(make())
    alone = [stage.generate([inp])[0] for inp in make()]
    for (t, tf), (a, af) in zip(together, alone, strict=True):
        assert tf == af
        assert t["audio"].shape == a["audio"].shape
        torch.testing.assert_close(t["audio"], a["audio"], atol=NOISE, rtol=0)
    # What was emitted: a streams its first window (3 frames); b/c emit from their `done`; d waits.
    assert [t["audio"].numel() // UP for t, _ in together] == [3, 7, 12, 0]
    one_shot = decoder.decode(_frames(11, 1).T[None])[0, 4 * UP :]
    torch.testing.assert_close(together[1][0]["audio"], one_shot, atol=NOISE, rtol=0)


def test_engine_streams_in_order_and_frees_state(decoder: CodecDecoder) -> None:
    stage = CodecStage(decoder, torch.device("cpu"), first_window=2, window=5, left_context=25)
    engine = GenerationEngine("codec", stage)
    codes = _frames(23, 7)
    engine.add_request(_inp("r", codes[:1], True, final=False))
    engine.add_request(_inp("gone", codes[:4], True, final=False))
    chunks: list[torch.Tensor] = []
    for i in range(1, 23):
        engine.add_input_chunk("r", StageInput("r", tensors={"codes": codes[i : i + 1]}, final=i == 22))
        for out in engine.step():
            if out.request_id == "r":
                chunks.append(out.tensors["audio"])
        if i == 3:  # abort mid-stream: the engine keeps nothing of it
            engine.abort("gone")
            assert "gone" not in engine.requests
    assert "r" not in engine.requests and not engine.requests and not engine.launched
    sizes = [c.numel() // UP for c in chunks if c.numel()]
    assert sizes[0] == 2 and all(s == 5 for s in sizes[1:-1])
    torch.testing.assert_close(torch.cat(chunks), decoder.decode(codes.T[None])[0], atol=NOISE, rtol=0)
