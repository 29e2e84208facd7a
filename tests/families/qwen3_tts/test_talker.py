"""omnistage's Qwen3-TTS talker stage (AR engine + code predictor hook) vs the qwen-tts package's generate, greedy,
on the tiny CustomVoice checkpoint (fp32, CPU): identical codes for every codebook, batched and alone."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from omnistage.engine.ar.engine import AREngine, AREngineConfig
from omnistage.families.qwen3_tts.codec import load_codec_decoder
from omnistage.families.qwen3_tts.talker import TalkerLM, codec_prefix_ids, load_talker, talker_input, talker_params
from omnistage.testing.qwen3_tts import CODEBOOK, Q, make_tiny_qwen3_tts
from omnistage.types import StageOutput

from . import reference

# (text, speaker): greedy, the first two end by eos (after 46 and 9 frames), the third runs to the limit; "eric"
# is a dialect speaker (language auto -> its dialect's id)
ITEMS = [("Hello there, how are you?", "Vivian"), ("A tiny test of speech.", "ryan"), ("The quick brown fox.", "eric")]
MAX_FRAMES = 60
GREEDY = dict(do_sample=False, subtalker_dosample=False)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen3_tts(tmp_path_factory.mktemp("qwen3_tts"))


@pytest.fixture(scope="module")
def talker(checkpoint: Path) -> TalkerLM:
    return load_talker(checkpoint)


def _configs(checkpoint: Path) -> tuple[dict, dict]:
    config = json.loads((checkpoint / "config.json").read_text())
    return config["talker_config"], json.loads((checkpoint / "generation_config.json").read_text())


def _run(checkpoint: Path, talker: TalkerLM, items: list[tuple[str, str | None]], max_frames: int = MAX_FRAMES,
         kv_blocks: int = 64, preemptions: int | None = None, seed: int | list[int | None] | None = None,
         **overrides) -> list[StageOutput]:
    """The talker stage over `items` as one batch: each request's merged output. `preemptions`: at least that
    many happened; `seed`: the requests' seeds (one for all, or one each)."""
    tc, gen = _configs(checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    config = AREngineConfig(max_model_len=min(256, kv_blocks * 16), num_kv_blocks=kv_blocks, max_num_seqs=8)
    engine = AREngine("talker", talker, config, eos_token_ids=(tc["codec_eos_token_id"],))
    for i, (text, speaker, *instruct) in enumerate(items):
        ids = tokenizer(f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
        instruct_ids = tokenizer(f"<|im_start|>user\n{instruct[0]}<|im_end|>\n")["input_ids"] if instruct else None
        params = talker_params(tc, gen, max_frames, **overrides)
        params = params.with_overrides(seed=seed[i] if isinstance(seed, list) else seed)
        engine.add_request(talker_input(f"r{i}", ids, codec_prefix_ids(tc, speaker), params, gen,
                                        instruct_ids=instruct_ids, **overrides))
    merged: dict[str, StageOutput] = {}
    while engine.seqs:
        for out in engine.step():
            merged[out.request_id] = merged[out.request_id].merge(out) if out.request_id in merged else out
    outs = [merged[f"r{i}"] for i in range(len(items))]
    assert all(o.error is None for o in outs), [o.error for o in outs]
    if preemptions is not None:
        assert engine.stats()["num_preemptions"] >= preemptions
    return outs


@pytest.fixture(scope="module")
def reference_codes(checkpoint: Path) -> list[np.ndarray]:
    reference.require_reference_venv()
    # max_new_tokens counts c0 draws and the package runs the code predictor one step late: MAX_FRAMES + 1 draws
    # give MAX_FRAMES whole frames, as omnistage's max_tokens=MAX_FRAMES does
    codes, _ = reference.generate(checkpoint, [{"text": t, "speaker": s} for t, s in ITEMS],
                                  max_new_tokens=MAX_FRAMES + 1, **GREEDY)
    return codes


def test_greedy_codes_match_reference_batched(checkpoint: Path, talker: TalkerLM,
                                              reference_codes: list[np.ndarray]) -> None:
    outs = _run(checkpoint, talker, ITEMS, **GREEDY)
    assert [o.finish_reason for o in outs] == ["stop", "stop", "length"]
    for out, ref in zip(outs, reference_codes, strict=True):
        assert ref.shape[1] == Q and 2 <= len(ref) <= MAX_FRAMES
        np.testing.assert_array_equal(out.tensors["codes"].numpy(), ref)
        assert out.num_output_tokens == len(ref) + (out.finish_reason == "stop")  # the eos frame is not emitted


def test_greedy_codes_match_reference_alone(checkpoint: Path, talker: TalkerLM,
                                            reference_codes: list[np.ndarray]) -> None:
    for item, ref in zip(ITEMS, reference_codes, strict=True):
        (out,) = _run(checkpoint, talker, [item], **GREEDY)
        np.testing.assert_array_equal(out.tensors["codes"].numpy(), ref)


def test_greedy_codes_survive_preemption(checkpoint: Path, talker: TalkerLM,
                                         reference_codes: list[np.ndarray]) -> None:
    """A KV cache for ~1.5 of the 3 requests: the newest is preempted and recomputed, its generated positions
    again with their code-predictor additions (`Sequence.step_adds`), so the codes do not change."""
    outs = _run(checkpoint, talker, ITEMS, kv_blocks=8, preemptions=1, **GREEDY)
    for out, ref in zip(outs, reference_codes, strict=True):
        np.testing.assert_array_equal(out.tensors["codes"].numpy(), ref)


def test_speech_tokenizer_decodes_as_reference(checkpoint: Path, reference_codes: list[np.ndarray]) -> None:
    """The factory's `speech_tokenizer/` (written without the package) decodes the same in both."""
    codes = reference_codes[1].T[None]  # [1, Q, T]
    ref = reference.decode(checkpoint / "speech_tokenizer", codes)
    ours = load_codec_decoder(checkpoint / "speech_tokenizer").decode(torch.from_numpy(codes)).numpy()
    assert np.abs(ref).max() > 1e-3
    np.testing.assert_allclose(ours, ref, atol=1e-5, rtol=0)


def test_sampled_codes_are_codebook_entries(checkpoint: Path, talker: TalkerLM) -> None:
    """Sampling c0 and the code predictor (temperature, top-k, top-p): every frame is Q valid codebook entries."""
    torch.manual_seed(0)
    outs = _run(checkpoint, talker, ITEMS, max_frames=12, do_sample=True, temperature=0.9, top_k=50,
                subtalker_dosample=True, subtalker_temperature=1.2, subtalker_top_k=8, subtalker_top_p=0.9)
    for out in outs:
        codes = out.tensors["codes"]
        assert codes.shape[1] == Q and 1 <= len(codes) <= 12
        assert int(codes.min()) >= 0 and int(codes.max()) < CODEBOOK


def test_seeded_sampling_does_not_depend_on_the_batch(checkpoint: Path, talker: TalkerLM) -> None:
    """A seeded request draws c0 and every code-predictor code from its own generator: the same codes alone and
    beside unseeded requests."""
    sampled = dict(do_sample=True, temperature=1.0, top_k=20, subtalker_dosample=True, subtalker_temperature=1.3,
                   subtalker_top_k=16)
    (alone,) = _run(checkpoint, talker, ITEMS[:1], max_frames=16, seed=7, **sampled)
    batched = _run(checkpoint, talker, ITEMS, max_frames=16, seed=[7, None, None], **sampled)[0]
    np.testing.assert_array_equal(batched.tensors["codes"].numpy(), alone.tensors["codes"].numpy())
    other = _run(checkpoint, talker, ITEMS[:1], max_frames=16, seed=8, **sampled)[0]
    assert not torch.equal(other.tensors["codes"], alone.tensors["codes"])  # the seed matters


# VoiceDesign: no speaker; an instruction describes the voice (its rows come first in the prompt)
DESIGN = [("Hello there, how are you?", None, "A deep calm voice, slow."),
          ("The quick brown fox.", None, "Bright and fast, a little breathless.")]


def test_voice_design_codes_match_reference(tmp_path: Path) -> None:
    checkpoint = make_tiny_qwen3_tts(tmp_path / "design", variant="voice_design")
    reference.require_reference_venv()
    refs, _ = reference.generate(checkpoint, [{"text": t, "instruct": i} for t, _, i in DESIGN],
                                 max_new_tokens=MAX_FRAMES + 1, **GREEDY)
    talker = load_talker(checkpoint)
    batched = _run(checkpoint, talker, DESIGN, **GREEDY)
    alone = [_run(checkpoint, talker, [item], **GREEDY)[0] for item in DESIGN]
    for b, a, ref in zip(batched, alone, refs, strict=True):
        np.testing.assert_array_equal(b.tensors["codes"].numpy(), ref)
        np.testing.assert_array_equal(a.tensors["codes"].numpy(), ref)
