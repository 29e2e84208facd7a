"""Decode bursts (several decode steps per launch, tokens drawn on the device and fed on) change no output: the
same tokens as single steps for greedy and sampled requests (the same noise, penalties from the device history,
banned ids), stops inside a burst end the request at the stop with the same text, context limits and added rows
(a talker's) hold. Greedy parity with HF under bursts (and preemption) is in tests/families/causal_lm."""

from __future__ import annotations

import pytest
import torch

from omnistage import Omni
from omnistage.config.deploy import load_deploy_config
from omnistage.families.causal_lm import build_ar_engine
from omnistage.families.registry import detect_family
from omnistage.sampling_params import SamplingParams
from omnistage.testing.sync import recording_device_waits, recording_queue_drains
from omnistage.types import StageInput

PROMPTS = [[5, 77, 123, 9, 300], [8, 19, 250], [3, 66, 7, 9, 10, 11, 12]]
SAMPLED = SamplingParams(max_tokens=11, temperature=0.9, top_k=40, top_p=0.8, repetition_penalty=1.3,
                         frequency_penalty=0.2, presence_penalty=0.1, bad_token_ids=[5, 6, 7], ignore_eos=True)


def run_engine(path: str, burst: int, params: list[SamplingParams], max_model_len: int = 128
               ) -> tuple[dict[str, list[int]], dict[str, str | None], dict[str, int]]:
    """Every prompt added at once, stepped to the end (so both runs batch identically): tokens, finish reasons."""
    family, info = detect_family(path)
    # eager: bursts with the engine's own columns (on a GPU too; the captured graphs have their own test below)
    stage = {"max_model_len": max_model_len, "advanced": {"overlap_sampled": True, "decode_burst": burst},
             "dtype": "float32", "enforce_eager": True}
    engine = build_ar_engine(family.pipeline(info, load_deploy_config({"stages": {"lm": stage}})), "lm")
    try:
        for i, (prompt, p) in enumerate(zip(PROMPTS, params, strict=True)):
            engine.add_request(StageInput(str(i), prompt, params=p))
        tokens, reasons = {str(i): [] for i in range(len(PROMPTS))}, {}
        while engine.has_work():
            for out in engine.step():
                assert out.error is None, out.error
                tokens[out.request_id] += out.token_ids
                if out.finished:
                    reasons[out.request_id] = out.finish_reason
        return tokens, reasons, engine.stats()
    finally:
        engine.shutdown()


@pytest.mark.parametrize("rows", ["sampled", "greedy", "mixed"])
def test_bursts_draw_what_single_steps_draw(tiny_qwen2: str, rows: str) -> None:
    greedy = SamplingParams(max_tokens=11, temperature=0, repetition_penalty=1.2, ignore_eos=True)
    params = {"sampled": [SAMPLED] * 3, "greedy": [greedy] * 3,
              "mixed": [SAMPLED, greedy, SAMPLED.with_overrides(top_k=0, top_p=1.0, temperature=1.3)]}[rows]
    single, _, single_stats = run_engine(tiny_qwen2, 1, params)
    burst, _, stats = run_engine(tiny_qwen2, 4, params)
    assert burst == single
    assert single_stats["num_burst_steps"] == 0 and stats["num_burst_steps"] >= 8  # 10 decode steps: 2 bursts
    assert all(len(t) == 11 for t in burst.values())
    if rows != "greedy":
        assert not {5, 6, 7} & {t for ids in burst.values() for t in ids}


def test_stops_and_limits_inside_a_burst(tiny_qwen2: str) -> None:
    """A stop id drawn mid-burst ends its request there (the rest of the burst is dropped) while the others go on;
    a context limit that is not a multiple of the burst ends at the limit."""
    greedy = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    free, _, _ = run_engine(tiny_qwen2, 1, [greedy] * 3)
    # a token's first occurrence, in the middle of a burst (token 0 comes from the prefill, bursts from 1 on)
    stop_at = next(i for i in range(3, 30) if free["0"][i] not in free["0"][:i] and i % 4 in (2, 3))
    to_limit = SamplingParams(max_tokens=None, temperature=0, ignore_eos=True)  # until the context is full
    stop = SamplingParams(max_tokens=None, temperature=0, ignore_eos=True, stop_token_ids=[free["0"][stop_at]])
    params = [stop, to_limit, greedy.with_overrides(max_tokens=9)]
    expected, expected_reasons, _ = run_engine(tiny_qwen2, 1, params, max_model_len=31)
    got, reasons, stats = run_engine(tiny_qwen2, 4, params, max_model_len=31)
    assert got == expected and reasons == expected_reasons
    assert got["0"] == free["0"][: stop_at + 1] and reasons["0"] == "stop"
    assert len(PROMPTS[1]) + len(got["1"]) == 31 and reasons["1"] == "length"
    assert stats["num_burst_steps"] > 0 and stats["kv_blocks_used"] == 0


def test_stop_strings_and_text_through_the_server_path(tiny_qwen2: str) -> None:
    """Text detokenized from several tokens of one burst arrives whole; a stop string inside a burst cuts it."""
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outs = {}
    for burst in (1, 4):
        with Omni(tiny_qwen2, {"stages": {"lm": {"max_model_len": 128, "advanced": {"decode_burst": burst}}}}) as omni:
            free = omni.generate(["Once upon a time"], params)[0]
            stop = free.text[len(free.text) // 2 :][:3]
            cut = omni.generate(["Once upon a time"], params.with_overrides(stop=[stop]))[0]
            outs[burst] = (free.text, free.token_ids, cut.text, cut.finish_reason, omni.stats()["lm"])
    assert outs[4][:4] == outs[1][:4]
    assert outs[4][3] == "stop" and len(outs[4][2]) < len(outs[4][0])
    assert outs[4][4]["num_burst_steps"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("num_prompts", [2, 3])
def test_burst_graphs_draw_what_single_steps_draw(tiny_qwen2: str, num_prompts: int) -> None:
    """On CUDA a burst is one graph replay with the draw captured in it (static columns, the sampler's generator
    registered with the graph). For a batch that fills its graph's bucket, sampled tokens equal single steps'
    (the same noise); a padded batch (3 in a bucket of 4) draws other noise, so there only greedy rows must agree.
    Launching a burst never waits for the device (no sync, and it returns while GPU work queued before it still
    runs), also when the batch fills only part of the host buffers (max_num_seqs 64: strided host slices)."""
    prompts, greedy = PROMPTS[:num_prompts], SamplingParams(max_tokens=11, temperature=0, ignore_eos=True)
    params = [SAMPLED, greedy.with_overrides(repetition_penalty=1.2), SAMPLED][:num_prompts]
    family, info = detect_family(tiny_qwen2)
    runs, waits, drains = {}, [], []
    for burst in (1, 4):
        stage = {"max_model_len": 128, "advanced": {"overlap_sampled": True, "decode_burst": burst}, "max_num_seqs": 64}
        engine = build_ar_engine(family.pipeline(info, load_deploy_config({"stages": {"lm": stage}})), "lm")
        engine.runner.launch_burst = recording_queue_drains(
            recording_device_waits(engine.runner.launch_burst, waits), drains)
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
                engine.add_request(StageInput(str(i), prompt, params=p))
            tokens = {str(i): [] for i in range(num_prompts)}
            while engine.has_work():
                for out in engine.step():
                    tokens[out.request_id] += out.token_ids
            runs[burst] = (tokens, engine.stats()["num_burst_steps"], bool(engine.runner.burst_graphs))
        finally:
            engine.shutdown()
    (single, _, _), (burst, burst_steps, captured) = runs[1], runs[4]
    assert captured and burst_steps >= 8 and not waits and not drains
    assert burst["1"] == single["1"]
    if num_prompts == 2:
        assert burst == single
    assert not {5, 6, 7} & {t for ids in burst.values() for t in ids}


def test_an_abort_during_a_burst_frees_it_and_spares_the_others(tiny_qwen2: str) -> None:
    """A request aborted while its burst is in flight (a client disconnect) returns nothing more and frees its
    blocks and history slot; the others decode exactly what they decode alone in single steps."""
    family, info = detect_family(tiny_qwen2)
    expected, _, _ = run_engine(tiny_qwen2, 1, [SAMPLED.with_overrides(temperature=0.0)] * 3)
    stage = {"max_model_len": 128, "advanced": {"overlap_sampled": True, "decode_burst": 4}, "dtype": "float32",
             "enforce_eager": True}
    engine = build_ar_engine(family.pipeline(info, load_deploy_config({"stages": {"lm": stage}})), "lm")
    try:
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(StageInput(str(i), prompt, params=SAMPLED.with_overrides(temperature=0.0)))
        tokens = {str(i): [] for i in range(len(PROMPTS))}
        while engine.has_work():
            for out in engine.step():
                tokens[out.request_id] += out.token_ids
            if engine.in_flight is not None and engine.in_flight.steps > 1 and "1" in engine.seqs:
                engine.abort("1")  # its burst is in flight
                aborted_at = len(tokens["1"])
        assert tokens["0"] == expected["0"] and tokens["2"] == expected["2"]
        assert 0 < aborted_at == len(tokens["1"]) < 11 and tokens["1"] == expected["1"][:aborted_at]
        assert engine.stats()["kv_blocks_used"] == 0 and sorted(engine._free_history_slots) == list(range(64))
    finally:
        engine.shutdown()


def test_a_bursts_positions_equal_each_steps() -> None:
    """What a burst graph computes once for all its steps (slots through the block tables, lengths, rotary
    positions) equals what each step alone computed, with steps crossing into later blocks."""
    from omnistage.engine.ar.cuda_graphs import burst_positions

    steps, block = 8, 4
    tables = torch.randperm(40).view(5, 8).int()  # 5 rows, 8 blocks each, shuffled
    pos = torch.tensor([0, 3, 9, 17, 21])
    rope = pos + torch.tensor([0, 5, 0, -2, 7])  # rotary positions with a per-row offset (M-RoPE's delta)
    slots, lens, ropes = burst_positions(tables, pos, rope, torch.arange(steps)[:, None], block)
    for j in range(steps):
        at = pos + j
        assert torch.equal(slots[j], tables.gather(1, (at // block)[:, None])[:, 0].long() * block + at % block)
        assert torch.equal(lens[j], at + 1) and torch.equal(ropes[j], rope + j)
    assert slots.is_contiguous()


def test_rotary_tables_for_many_steps_equal_each_steps(tiny_qwen2: str) -> None:
    """The rotary tables a burst computes for all its steps at once are each step's, row for row."""
    from transformers import AutoModelForCausalLM

    from omnistage.families.hf import rotary_tables

    decoder = AutoModelForCausalLM.from_pretrained(tiny_qwen2).model
    positions = torch.tensor([[3, 17, 40], [4, 18, 41], [5, 19, 42]])  # [steps, rows]
    cos, sin = rotary_tables(decoder, positions.flatten(), torch.float32)
    for j, step in enumerate(positions):
        want_cos, want_sin = rotary_tables(decoder, step, torch.float32)
        assert torch.equal(cos[3 * j : 3 * j + 3], want_cos) and torch.equal(sin[3 * j : 3 * j + 3], want_sin)
