"""Spoken output is bounded even when the talker never says its end code (random weights, `ignore_eos`): by the
talker's `max_tokens`, by the request's `max_duration_s`, and by the thinker's `max_tokens` (a short text reply
speaks briefly). Voice names match case-insensitively."""

from __future__ import annotations

import pytest

from omnistage import Omni, SamplingParams
from omnistage.errors import RequestError

pytest.importorskip("torchvision", reason="Qwen2.5-Omni's processor needs torchvision (installed by scripts/test)")

SAMPLES_PER_CODE = 2 * 240  # two mel frames a code, 240 samples a frame: 50 codes a second at 24 kHz
MESSAGES = [{"role": "user", "content": "Hi!"}]


@pytest.fixture(scope="module")
def omni(tiny_qwen2_5_omni: str):
    # An unbounded talker that never stops by itself: only the speech bound ends it (context: 512).
    deploy = {"stages": {"*": {"max_model_len": 512, "dtype": "float32"},
                         "talker": {"default_sampling_params": {"max_tokens": None, "temperature": 0,
                                                                "ignore_eos": True}}}}
    with Omni(tiny_qwen2_5_omni, deploy) as omni:
        yield omni


def _codes(out) -> int:
    assert out.error is None, out.error
    assert len(out.audio) % SAMPLES_PER_CODE == 0
    return len(out.audio) // SAMPLES_PER_CODE


def test_short_max_tokens_gives_short_speech(omni: Omni) -> None:
    thinker = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    (out,) = omni.generate([MESSAGES], {"thinker": thinker}, ("text", "audio"))
    assert len(out.token_ids) == 2
    assert _codes(out) == 2 * 50  # one second of speech per text token the thinker may write


def test_max_duration_bounds_speech(omni: Omni) -> None:
    thinker = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    (out,) = omni.generate([MESSAGES], {"thinker": thinker}, ("text", "audio"), max_duration_s=0.2)
    assert _codes(out) == 10


def test_talker_max_tokens_bounds_speech(omni: Omni) -> None:
    params = {"thinker": SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
              "talker": SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)}
    (out,) = omni.generate([MESSAGES], params, ("text", "audio"))
    assert _codes(out) == 7


def test_voice_names_match_case_insensitively(omni: Omni) -> None:
    params = {"thinker": SamplingParams(max_tokens=2, temperature=0, ignore_eos=True),
              "talker": SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)}
    (lower,) = omni.generate([MESSAGES], params, ("text", "audio"), voice="ethan")
    (exact,) = omni.generate([MESSAGES], params, ("text", "audio"), voice="Ethan")
    assert lower.error is None and (lower.audio == exact.audio).all()
    with pytest.raises(RequestError, match="unknown voice 'nobody'.*Chelsie"):
        omni.generate([MESSAGES], params, ("text", "audio"), voice="nobody")
