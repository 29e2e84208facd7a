"""The Qwen2.5-Omni thinker with `tensor_parallel_size: 2` (gloo, 2 CPU processes, float32): the same greedy text as
one rank for a text request and for one with an image and audio (encoders on rank 0, their features merged into
the sharded decoder's input, M-RoPE positions), and the talker gets the same thinker states, so it speaks the same
codes and audio. Sharded sums are added in another order than one rank's, so states match to 1e-4, not bitwise."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omnistage import Omni, SamplingParams
from omnistage.errors import ConfigError
from omnistage.families import qwen2_5_omni

pytest.importorskip("torchvision", reason="Qwen2.5-Omni's processor needs torchvision (installed by scripts/test)")

PARAMS = {"thinker": SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
          "talker": SamplingParams(max_tokens=16, temperature=0, repetition_penalty=1.05, ignore_eos=True)}
SPOKEN = [[{"role": "user", "content": [{"type": "text", "text": text}]}]
          for text in ("Say something nice about rivers.", "Why?")]


def media_messages() -> list[dict]:
    from PIL import Image

    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 255, (56, 84, 3), dtype=np.uint8))
    audio = (0.3 * np.sin(2 * np.pi * 440 * np.arange(16000) / 16000)).astype(np.float32)
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "audio", "audio": audio},
                                         {"type": "text", "text": "What do you see and hear?"}]}]


def deploy(tp: int, **thinker: object) -> dict:
    # inline: the stages in this process, so the handoff spy below sees the thinker's states; the reply handed
    # over at its end: one handoff per request, all its rows
    return {"worker_backend": "inline", "async_chunk": False, "stages": {
        "*": {"max_model_len": 512, "dtype": "float32", "devices": "cpu", "block_size": 4},
        "thinker": {"tensor_parallel_size": tp} | thinker}}


def run(path: str, tp: int, monkeypatch: pytest.MonkeyPatch) -> tuple[list, dict]:
    """Two text requests' and a media request's outputs (text and speech), and the thinker states per request the
    talker was handed (by the request's last text)."""
    handed: dict[str, dict[str, torch.Tensor]] = {}
    edge = qwen2_5_omni.thinker_to_talker

    def spy(pipeline, request, out):
        if out.hidden_states:
            handed[request.messages[0]["content"][-1]["text"]] = dict(out.hidden_states)
        return edge(pipeline, request, out)

    with monkeypatch.context() as patch:
        patch.setattr(qwen2_5_omni, "thinker_to_talker", spy)
        with Omni(path, deploy(tp)) as omni:
            outs = omni.generate([*SPOKEN, media_messages()], PARAMS, ("text", "audio"), voice="Ethan")
    assert [o.error for o in outs] == [None] * 3
    return outs, handed


@pytest.fixture(scope="module")
def one_rank(tiny_qwen2_5_omni: str) -> tuple[list, dict]:
    with pytest.MonkeyPatch.context() as patch:
        return run(tiny_qwen2_5_omni, 1, patch)


def test_tp2_thinker_gives_one_rank_text_states_and_audio(tiny_qwen2_5_omni: str, one_rank, monkeypatch) -> None:
    outs1, handed1 = one_rank
    outs2, handed2 = run(tiny_qwen2_5_omni, 2, monkeypatch)
    assert [o.token_ids for o in outs2] == [o.token_ids for o in outs1]
    assert outs2[2].num_prompt_tokens == outs1[2].num_prompt_tokens > 40  # media features merged (30 with one
    # placeholder each)
    assert len(handed1) == len(handed2) == 3
    for text, states in handed2.items():  # per prompt and reply token: its input embedding and last hidden state
        for name in ("embed", "last"):
            torch.testing.assert_close(states[name], handed1[text][name], rtol=1e-4, atol=1e-4)
    for a, b in zip(outs1, outs2, strict=True):
        assert a.audio.shape == b.audio.shape and a.audio.size > 0  # as many codes
        np.testing.assert_allclose(b.audio, a.audio, rtol=1e-4, atol=1e-4)


def test_ranks_that_do_not_divide_the_thinker_are_a_config_error(tiny_qwen2_5_omni: str) -> None:
    with pytest.raises(ConfigError, match=r"stages\.thinker\.tensor_parallel_size: 3 does not divide the model's 4 "
                       r"attention heads"):
        Omni(tiny_qwen2_5_omni, deploy(3))


@pytest.mark.parametrize("stage, message", [
    ("talker", r"stages\.talker\.tensor_parallel_size: the talker runs on one device"),
    ("token2wav", r"stages\.token2wav\.tensor_parallel_size: this stage is not autoregressive")])
def test_the_talker_and_token2wav_refuse_ranks(tiny_qwen2_5_omni: str, stage: str, message: str) -> None:
    config = deploy(1)
    config["stages"][stage] = {"tensor_parallel_size": 2, "devices": "cpu"}
    with pytest.raises(ConfigError, match=message):
        Omni(tiny_qwen2_5_omni, config)
