"""Qwen3-TTS Base (voice clone) and the streaming text mode vs the qwen-tts package, greedy, fp32 on the CPU, on the
tiny checkpoints: the x-vector and ICL reference codes, code frames of ICL / x-vector-only clones alone and batched,
a CustomVoice request in streaming text mode, a clone's waveform end to end, and bad clone input."""

from __future__ import annotations

import queue
from pathlib import Path

import numpy as np
import pytest

from omnistage.config.deploy import load_deploy_config
from omnistage.engine.ar.engine import AREngine, AREngineConfig
from omnistage.errors import RequestError
from omnistage.families.base import CheckpointInfo
from omnistage.families.qwen3_tts import Qwen3TTSFamily, Qwen3TTSPipeline, talker_to_codec
from omnistage.families.qwen3_tts.talker import load_talker
from omnistage.runtime.launch import start_orchestrator
from omnistage.sampling_params import SamplingParams
from omnistage.testing.qwen3_tts import Q, make_tiny_qwen3_tts
from omnistage.types import OmniOutput, OmniRequest, StageOutput

from . import reference

FRAMES = 24
GREEDY = dict(do_sample=False, subtalker_dosample=False)
TEXT, REF_TEXT = "Hello there, how are you?", "This is my voice."


def _voice(seed: int, seconds: float = 1.2) -> np.ndarray:
    """A reference 'voice': a few harmonics with a wobble and noise, within [-1, 1]."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(24000 * seconds)) / 24000
    f0 = 110 + 40 * seed
    wav = sum(np.sin(2 * np.pi * f0 * k * t + rng.uniform(0, 6)) / k for k in range(1, 5))
    wav = wav * (0.6 + 0.4 * np.sin(2 * np.pi * 3 * t)) + 0.05 * rng.standard_normal(t.shape)
    return (0.4 * wav / np.abs(wav).max()).astype(np.float32)


VOICES = [_voice(0), _voice(1, 0.9)]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen3_tts(tmp_path_factory.mktemp("qwen3_tts_base"), variant="base")


@pytest.fixture(scope="module")
def custom(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen3_tts(tmp_path_factory.mktemp("qwen3_tts_cv"))


def _pipeline(checkpoint: Path, deploy: dict | None = None) -> Qwen3TTSPipeline:
    family = Qwen3TTSFamily()
    info = CheckpointInfo.read(checkpoint)
    return family.pipeline(info, load_deploy_config({"worker_backend": "inline", **(deploy or {})},
                                                    base=family.default_deploy(info)))


def _request(i: int, text: str = TEXT, **options) -> OmniRequest:
    return OmniRequest(request_id=f"r{i}", prompt=text, output_modalities=("audio",),
                       stage_params={"talker": SamplingParams(temperature=0.0, repetition_penalty=1.05,
                                                              max_tokens=FRAMES)},
                       options={"subtalker_dosample": False, **options})


def _talk(checkpoint: Path, pipeline: Qwen3TTSPipeline, requests: list[OmniRequest]) -> list[np.ndarray]:
    """The talker stage over the requests' preprocessed inputs as one batch: each request's frames [T, Q]."""
    tc = pipeline.talker_config
    engine = AREngine("talker", load_talker(checkpoint), AREngineConfig(max_model_len=256, num_kv_blocks=64,
                                                                        max_num_seqs=8),
                      eos_token_ids=(tc["codec_eos_token_id"],))
    for r in requests:
        engine.add_request(pipeline.preprocess(r))
    merged: dict[str, StageOutput] = {}
    while engine.seqs:
        for out in engine.step():
            merged[out.request_id] = merged[out.request_id].merge(out) if out.request_id in merged else out
    assert all(merged[r.request_id].error is None for r in requests)
    return [merged[r.request_id].tensors["codes"].numpy() for r in requests]


@pytest.fixture(scope="module")
def expected(base: Path) -> list[dict[str, np.ndarray]]:
    """The package's clones: ICL of voice 0 and 1 (streaming text, the Base default), x-vector only of voice 0,
    ICL of voice 0 in non-streaming text mode."""
    reference.require_reference_venv()
    items = [{"text": TEXT, "audio": VOICES[0], "ref_text": REF_TEXT},
             {"text": "A tiny test of speech.", "audio": VOICES[1], "ref_text": "Another voice, short."},
             {"text": TEXT, "audio": VOICES[0], "x_vector_only_mode": True},
             {"text": TEXT, "audio": VOICES[0], "ref_text": REF_TEXT, "non_streaming_mode": True}]
    return reference.clone(base, items, max_new_tokens=FRAMES + 1, **GREEDY)


def test_package_loads_the_base_factory_whole(base: Path) -> None:
    reference.require_reference_venv()
    info = reference.call("load_info", dir=str(base))
    assert info == {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": []}


def test_clone_features_match_the_package(base: Path, expected: list[dict[str, np.ndarray]]) -> None:
    pipeline = _pipeline(base)
    for voice, ref in zip(VOICES, expected[:2], strict=True):
        feats = pipeline.clone_features(voice, "text", x_vector_only=False)
        # same ops as the package (float32 STFT, convs); only summation order can differ
        np.testing.assert_allclose(feats["x_vector"].numpy(), ref["x_vector"], atol=1e-5, rtol=1e-5)
        assert feats["ref_codes"].shape == (len(ref["ref_codes"]), Q)
        np.testing.assert_array_equal(feats["ref_codes"].numpy(), ref["ref_codes"])
    assert "ref_codes" not in pipeline.clone_features(VOICES[0], "text", x_vector_only=True)
    again = pipeline.clone_features(VOICES[0].copy(), "other text", x_vector_only=False)
    assert again["x_vector"] is pipeline.clone_features(VOICES[0], "t", x_vector_only=False)["x_vector"]  # cached


def test_clone_codes_alone_and_batched(base: Path, expected: list[dict[str, np.ndarray]]) -> None:
    pipeline = _pipeline(base)
    opts = [dict(ref_audio=VOICES[0], ref_text=REF_TEXT),
            dict(ref_audio=VOICES[1], ref_text="Another voice, short."),
            dict(ref_audio=VOICES[0], ref_text=REF_TEXT, x_vector_only_mode=True),
            dict(ref_audio=VOICES[0], ref_text=REF_TEXT, non_streaming_mode=True)]
    texts = [TEXT, "A tiny test of speech.", TEXT, TEXT]
    batched = _talk(base, pipeline, [_request(i, t, **o) for i, (t, o) in enumerate(zip(texts, opts, strict=True))])
    for got, ref in zip(batched, expected, strict=True):
        assert len(ref["codes"]) >= 2
        np.testing.assert_array_equal(got, ref["codes"])
    (alone,) = _talk(base, pipeline, [_request(9, TEXT, **opts[2])])
    np.testing.assert_array_equal(alone, expected[2]["codes"])
    # precomputed features (an uploaded voice) give the same prompt
    feats = pipeline.clone_features(VOICES[1], "x", x_vector_only=False)
    (uploaded,) = _talk(base, pipeline, [_request(8, texts[1], voice_features=feats,
                                                  ref_text="Another voice, short.")])
    np.testing.assert_array_equal(uploaded, expected[1]["codes"])


def test_streaming_text_mode_custom_voice(custom: Path) -> None:
    reference.require_reference_venv()
    (ref,), _ = reference.generate(custom, [{"text": TEXT, "speaker": "ryan"}], non_streaming_mode=False,
                                   max_new_tokens=FRAMES + 1, **GREEDY)
    (got,) = _talk(custom, _pipeline(custom), [_request(0, voice="RYAN", non_streaming_mode=False)])
    np.testing.assert_array_equal(got, ref)


def test_clone_waveform_end_to_end(base: Path, expected: list[dict[str, np.ndarray]]) -> None:
    """ICL through the orchestrator: ref codes go to the codec as left context, the audio is the generated part.
    The package decodes ref + generated and cuts int(ref / total * samples) — exactly the ref frames' samples,
    as every frame is 1920 samples — so the two agree up to fp32 noise, which this random decoder (most samples
    saturated at +-1) amplifies on a few samples."""
    orchestrator = start_orchestrator(_pipeline(base))
    done: queue.SimpleQueue[OmniOutput] = queue.SimpleQueue()
    try:
        result = OmniOutput("r0")
        orchestrator.submit(_request(0, ref_audio=VOICES[0], ref_text=REF_TEXT), done.put)
        while True:
            out = done.get(timeout=120)
            result.merge(out)
            if out.finished:
                break
    finally:
        orchestrator.shutdown()
    assert result.error is None
    ref = expected[0]["wav"]
    assert len(result.audio) == len(expected[0]["codes"]) * 1920 == len(ref) and np.abs(ref).max() > 1e-3
    np.testing.assert_allclose(result.audio, ref, atol=2e-3, rtol=0)
    assert np.abs(result.audio - ref).mean() < 1e-5


def test_edge_prepends_reference_codes(base: Path) -> None:
    pipeline = _pipeline(base)
    request = _request(0, ref_audio=VOICES[0], ref_text=REF_TEXT)
    pipeline.preprocess(request)
    ref = pipeline.clone_features(VOICES[0], REF_TEXT, x_vector_only=False)["ref_codes"]
    first = talker_to_codec(request, StageOutput("r0", tensors={"codes": ref[:2] * 0 + 1}))
    assert first.params["done"] == len(ref) and first.tensors["codes"].shape == (len(ref) + 2, Q)
    assert (first.tensors["codes"][: len(ref)] == ref).all()
    later = talker_to_codec(request, StageOutput("r0", tensors={"codes": ref[:1]}, finished=True))
    assert later.params is None and later.final and later.tensors["codes"].shape == (1, Q)


def test_bad_clone_input_is_a_request_error(base: Path, custom: Path) -> None:
    cv, b = _pipeline(custom), _pipeline(base)
    assert cv.speakers() == ["vivian", "ryan", "eric"] and b.speakers() == [] and b.can_clone and not cv.can_clone
    assert cv.tts_kind == "custom_voice" and b.tts_kind == "base" and "english" in b.languages()
    cases = [
        (cv, dict(ref_audio=VOICES[0]), "ref_audio", "does not clone voices"),
        (b, {}, "ref_audio", "needs a reference voice"),
        (cv, dict(language="klingon"), "language", "english"),
        (cv, dict(voice="nobody"), "voice", "vivian"),
        (b, dict(ref_audio=VOICES[0], task_type="CustomVoice"), "task_type", "Base model"),
        (cv, dict(task_type="Base"), "task_type", "CustomVoice model"),
        (b, dict(ref_audio=VOICES[0][:100]), "ref_audio", "at least"),
    ]
    for pipeline, options, param, words in cases:
        with pytest.raises(RequestError) as err:
            pipeline.preprocess(_request(0, **options))
        assert err.value.param == param and words in str(err.value), (options, str(err.value))
    with pytest.raises(RequestError, match="does not clone voices"):
        cv.clone_features(VOICES[0], None, x_vector_only=True)
