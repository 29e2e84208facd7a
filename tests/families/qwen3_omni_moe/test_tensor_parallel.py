"""Qwen3-Omni's MoE thinker with `tensor_parallel_size: 2` (gloo, 2 CPU processes, float32): every expert's
intermediate size split over the ranks, routing replicated, partial outputs all-reduced. The same greedy text as
one rank for a text request and for one with an image (DeepStack) and audio, and the talker gets the same thinker
states and speaks the same codes and audio. Sharded sums are added in another order than one rank's, so states
match to 1e-4, not bitwise."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import omnistage.families.qwen3_omni_moe as family
from omnistage import Omni, SamplingParams
from omnistage.errors import ConfigError

from .test_parity import IMAGE_AUDIO

pytest.importorskip("torchvision", reason="Qwen3-Omni's processor needs torchvision")

PARAMS = {"thinker": SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
          "talker": SamplingParams(max_tokens=8, temperature=0, repetition_penalty=1.05, ignore_eos=True)}
TEXTS = [[{"role": "user", "content": [{"type": "text", "text": text}]}]
         for text in ("Say something nice about rivers.", "Why?")]


def deploy(tp: int) -> dict:
    # inline: the handoff spy below sees the thinker's states; the reply handed over at its end, all rows at once
    return {"worker_backend": "inline", "async_chunk": False, "stages": {
        "*": {"max_model_len": 512, "dtype": "float32", "devices": "cpu", "block_size": 4},
        "thinker": {"tensor_parallel_size": tp}}}


def run(path: str, tp: int, monkeypatch: pytest.MonkeyPatch) -> tuple[list, dict]:
    """Outputs (text and speech) of two text requests and an image + audio one, and the thinker states the talker
    was handed, by the request's last text."""
    handed: dict[str, dict[str, torch.Tensor]] = {}
    edge = family.thinker_to_talker

    def spy(pipeline, request, out):
        if out.hidden_states:
            handed[request.messages[-1]["content"][-1]["text"]] = dict(out.hidden_states)
        return edge(pipeline, request, out)

    with monkeypatch.context() as patch:
        patch.setattr(family, "thinker_to_talker", spy)
        with Omni(path, deploy(tp)) as omni:
            outs = omni.generate([*TEXTS, IMAGE_AUDIO], PARAMS, ("text", "audio"), voice="Ethan")
    assert [o.error for o in outs] == [None] * 3
    return outs, handed


def test_tp2_moe_thinker_gives_one_rank_text_states_and_audio(tiny_qwen3_omni: str, monkeypatch) -> None:
    outs1, handed1 = run(tiny_qwen3_omni, 1, monkeypatch)
    outs2, handed2 = run(tiny_qwen3_omni, 2, monkeypatch)
    assert [o.token_ids for o in outs2] == [o.token_ids for o in outs1]
    assert len(handed1) == len(handed2) == 3
    for text, states in handed2.items():  # per computed token: its input embedding and the talker's hidden layer
        assert states.keys() == handed1[text].keys() == {"embed", "hidden"}
        for name, rows in states.items():
            torch.testing.assert_close(rows, handed1[text][name], rtol=1e-4, atol=1e-4)
    for a, b in zip(outs1, outs2, strict=True):
        assert a.audio.shape == b.audio.shape and a.audio.size > 0  # as many frames
        np.testing.assert_allclose(b.audio, a.audio, rtol=1e-4, atol=1e-4)


def test_ranks_that_do_not_divide_the_experts_are_a_config_error(tiny_qwen3_omni: str) -> None:
    with pytest.raises(ConfigError, match=r"stages\.thinker\.tensor_parallel_size: 3 does not divide the model's 4 "
                       r"attention heads"):
        Omni(tiny_qwen3_omni, deploy(3))


def test_the_talker_refuses_ranks(tiny_qwen3_omni: str) -> None:
    config = deploy(1)
    config["stages"]["talker"] = {"tensor_parallel_size": 2, "devices": "cpu"}
    with pytest.raises(ConfigError, match=r"stages\.talker\.tensor_parallel_size: the talker runs on one device"):
        Omni(tiny_qwen3_omni, config)
