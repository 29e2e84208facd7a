"""Sampling through the real engine on a tiny checkpoint: seeds, filters, penalties, logprobs,
stop conditions. Each test compares against an independent computation, not a recorded value."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from omnistage import Omni, SamplingParams
from omnistage.engine.ar.sampler import Sampler, SampleRow, apply_penalties
from omnistage.testing.sync import recording_device_waits, recording_queue_drains

PROMPTS = ["Once upon a time", "The weather today", "Numbers: 1, 2, 3", "Why"]


@pytest.fixture(scope="module")
def omni(tiny_qwen2: str):
    with Omni(tiny_qwen2, {"stages": {"lm": {"max_model_len": 128, "dtype": "float32"}}}) as o:
        yield o


def test_seeded_sampling_is_reproducible_and_batch_independent(omni: Omni) -> None:
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    alone = omni.generate([PROMPTS[0]], params)[0].token_ids
    again = omni.generate([PROMPTS[0]], params)[0].token_ids
    mixed = omni.generate(
        [PROMPTS[1], PROMPTS[0], PROMPTS[2]],
        [SamplingParams(max_tokens=9, temperature=0.7, seed=1), params, SamplingParams(max_tokens=20, temperature=0)],
    )[1].token_ids
    assert alone == again == mixed
    other_seed = omni.generate([PROMPTS[0]], params.with_overrides(seed=8))[0].token_ids
    assert other_seed != alone


def test_greedy_and_top_k_1_agree(omni: Omni) -> None:
    greedy = omni.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    top1 = omni.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=1.5, top_k=1, ignore_eos=True))
    assert [o.token_ids for o in greedy] == [o.token_ids for o in top1]


def test_logprobs_match_hf_distribution(omni: Omni, tiny_qwen2: str) -> None:
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=3, ignore_eos=True)
    (out,) = omni.generate([PROMPTS[2]], params)
    tok = AutoTokenizer.from_pretrained(tiny_qwen2)
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32)
    ids = tok.encode(PROMPTS[2]) + out.token_ids
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].log_softmax(-1)
    n_prompt = len(ids) - len(out.token_ids)
    assert len(out.logprobs) == 4
    for i, lp in enumerate(out.logprobs):
        row = ref[n_prompt - 1 + i]
        assert lp.token_id == out.token_ids[i] == row.argmax().item()
        assert lp.logprob == pytest.approx(row[lp.token_id].item(), abs=1e-4)
        top_ids = [t for t, _ in lp.top]
        assert top_ids == row.topk(3).indices.tolist()


def test_stop_conditions(omni: Omni) -> None:
    base = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    (full,) = omni.generate([PROMPTS[0]], base)
    # stop_token_ids: stops right after the first occurrence of the 5th generated token
    stop_id = full.token_ids[4]
    (out,) = omni.generate([PROMPTS[0]], base.with_overrides(stop_token_ids=[stop_id]))
    assert out.token_ids == full.token_ids[: full.token_ids.index(stop_id) + 1]
    assert out.finish_reason == "stop"
    # stop strings: text is cut before the stop string, which is not returned
    stop = full.text[5:8]
    (out,) = omni.generate([PROMPTS[0]], base.with_overrides(stop=[stop]))
    assert out.finish_reason == "stop"
    assert out.text == full.text[: full.text.index(stop)]
    (out,) = omni.generate([PROMPTS[0]], base.with_overrides(stop=[stop], include_stop_str_in_output=True))
    assert out.text == full.text[: full.text.index(stop) + len(stop)]
    # max_tokens
    (out,) = omni.generate([PROMPTS[0]], base.with_overrides(max_tokens=3))
    assert out.token_ids == full.token_ids[:3] and out.finish_reason == "length"


def test_min_tokens_defers_stop_tokens(omni: Omni) -> None:
    greedy = SamplingParams(max_tokens=30, temperature=0)
    first = omni.generate([PROMPTS[0]], greedy)[0].token_ids[0]
    stop_now = omni.generate([PROMPTS[0]], greedy.with_overrides(stop_token_ids=[first]))[0]
    assert stop_now.token_ids == [first] and stop_now.finish_reason == "stop"
    for params in (greedy, SamplingParams(max_tokens=30, temperature=1.0, seed=3)):
        out = omni.generate([PROMPTS[0]], params.with_overrides(stop_token_ids=[first], min_tokens=6))[0]
        assert len(out.token_ids) >= 6
        assert first not in out.token_ids[:5]


def test_penalties_against_direct_formula() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0], [1.0, 1.0, 1.0, 1.0]])
    rows = [
        SampleRow(SamplingParams(repetition_penalty=2.0), [0], [1], None, []),
        SampleRow(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), [3], [2, 2, 0], None, [3]),
    ]
    out = apply_penalties(logits.clone(), rows)
    assert out[0].tolist() == [1.0, -2.0, 0.5, 3.0]
    assert out[1, :3].tolist() == [1.0 - 0.5 - 0.25, 1.0, 1.0 - 1.0 - 0.25]
    assert out[1, 3] == float("-inf")


def test_cached_ban_masks_equal_the_scattered_ones() -> None:
    """The sampler's per-set mask cache bans exactly what scattering the ids does, row by row."""
    logits = torch.randn(3, 16, generator=torch.Generator().manual_seed(0))
    rows = [SampleRow(SamplingParams(), [], [], None, banned) for banned in ((1, 5, 15), (), (1, 5, 15))]
    sampler = Sampler()
    cached = apply_penalties(logits.clone(), rows, lambda b: sampler._ban_mask(b, 16, logits.device))
    torch.testing.assert_close(cached, apply_penalties(logits.clone(), rows))
    assert cached[0].isinf().nonzero().flatten().tolist() == [1, 5, 15] and not cached[1].isinf().any()
    assert len(sampler._ban_masks) == 2  # one mask per distinct set


def test_top_p_and_min_p_keep_the_right_tokens() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    sampler = Sampler(seed=0)
    for params, allowed in [
        (SamplingParams(temperature=1.0, top_p=0.7), {0, 1}),
        (SamplingParams(temperature=1.0, min_p=0.25), {0, 1, 2}),
        (SamplingParams(temperature=1.0, top_k=2), {0, 1}),
    ]:
        seen = {sampler(logits, [SampleRow(params, [], [], None, [])])[0][0] for _ in range(300)}
        assert seen == allowed, params


@pytest.mark.parametrize("greedy_row", [False, True], ids=["sampled", "sampled_and_penalised_greedy"])
def test_decoding_in_flight_samples_the_same_tokens(tiny_qwen2: str, greedy_row: bool) -> None:
    """Steps kept in flight draw on the device (penalties from the device-side token history, filters, bans,
    per-request seeds) exactly what step-by-step sampling on the host draws. Seeded, so which requests share
    a step (thread timing) does not matter. float32 on a GPU too: bfloat16 logits tie often, and at a tie on a
    top-k or top-p boundary the device's draw kernel keeps every tied token where torch's sort keeps the ones it
    orders first (omnistage/kernels/draw.py); run 16d saw this test fail once in bfloat16."""
    sampled = SamplingParams(max_tokens=20, temperature=0.9, top_k=40, top_p=0.8, repetition_penalty=1.3,
                             frequency_penalty=0.2, presence_penalty=0.1, bad_token_ids=[5, 6, 7], ignore_eos=True)
    params = [sampled.with_overrides(seed=11),
              sampled.with_overrides(temperature=0.0 if greedy_row else 1.2, top_k=0, seed=12),
              sampled.with_overrides(seed=13)]
    runs = {}
    for overlap in (True, False):
        deploy = {"stages": {"lm": {"max_model_len": 128, "dtype": "float32", "advanced": {
                                    "overlap_decode": overlap, "overlap_sampled": overlap}}}}
        with Omni(tiny_qwen2, deploy) as omni:
            first = omni.generate(PROMPTS[:3], params)
            second = omni.generate(PROMPTS[1:4], params)  # history slots reused by new requests
            runs[overlap] = ([o.token_ids for o in first + second], omni.stats()["lm"])
    (tokens, stats), (reference, plain_stats) = runs[True], runs[False]
    assert stats["num_overlapped_steps"] > 30 and plain_stats["num_overlapped_steps"] == 0
    assert tokens == reference
    assert not {5, 6, 7} & {t for row in tokens for t in row}
    with Omni(tiny_qwen2, {"stages": {"lm": {"max_model_len": 128, "dtype": "float32"}}}) as omni:  # the defaults
        assert [o.token_ids for o in omni.generate(PROMPTS[:3], params)] == reference[:3]
        assert omni.stats()["lm"]["num_overlapped_steps"] > 0  # sampled steps overlap by default
        greedy = [o.token_ids for o in omni.generate(PROMPTS[:3], SamplingParams(max_tokens=20, temperature=0,
                                                                                 ignore_eos=True))]
    assert tokens[0] != greedy[0] and tokens[2] != greedy[2]  # it did sample


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_launching_a_sampled_step_never_waits_for_the_device(tiny_qwen2: str) -> None:
    """The point of a step in flight: launching it (graph replay, hidden rows, device-side penalties, filters,
    draw, history record, token copy) must not synchronise with the GPU. CUDA's sync debug mode turns any wait
    into an error; a launch queued behind GPU spin must return before the spin ends (waits it does not see, e.g.
    a copy from pageable memory; two rows in max_num_seqs 64's buffers: strided host slices)."""
    from omnistage.config.deploy import load_deploy_config
    from omnistage.families.causal_lm import build_ar_engine
    from omnistage.families.registry import detect_family
    from omnistage.types import StageInput

    family, info = detect_family(tiny_qwen2)
    deploy = {"stages": {"lm": {"max_model_len": 128, "advanced": {"overlap_sampled": True}, "max_num_seqs": 64}}}
    engine = build_ar_engine(family.pipeline(info, load_deploy_config(deploy)), "lm", hidden_state_layers={"embed": 0})
    params = SamplingParams(max_tokens=12, temperature=0.9, top_k=40, top_p=0.8, repetition_penalty=1.3,
                            frequency_penalty=0.2, bad_token_ids=[5], ignore_eos=True)
    for i in range(2):
        engine.add_request(StageInput(f"r{i}", [11 + i, 23, 37, 41], params=params.with_overrides(seed=i),
                                      return_hidden_states=i == 0))  # a talker's feed: hidden rows too
    engine.step()  # prefill: sampled on the host
    engine.step()  # the first step in flight (loads the history)
    waits: list[str] = []
    drains: list[str] = []
    engine.runner.launch_decode = recording_queue_drains(
        recording_device_waits(engine.runner.launch_decode, waits), drains)
    try:
        while engine.has_work():
            engine.step()
    finally:
        engine.shutdown()
    assert not waits and not drains
    assert engine.num_overlapped_steps >= 8


def test_device_history_draws_what_the_token_lists_draw() -> None:
    """The device path (columns, TokenHistory rows) and the list path (`Sampler.__call__`) are one arithmetic:
    same tokens from the same seeds; recording a draw equals loading the lists that include it."""
    from omnistage.engine.ar.sampler import TokenHistory

    vocab, cpu = 50, torch.device("cpu")
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, repetition_penalty=1.5, frequency_penalty=0.3,
                            presence_penalty=0.2)
    lists = [([1, 2, 3], [4, 4, 9]), ([7], []), ([10, 11], [12, 30, 30, 30])]

    def rows() -> list[SampleRow]:  # fresh per-request generators for each path
        return [SampleRow(params if i != 1 else params.with_overrides(temperature=0.0), prompt, out,
                          torch.Generator().manual_seed(i) if i != 2 else None, (5,) if i == 0 else ())
                for i, (prompt, out) in enumerate(lists)]

    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(1))
    expected, _ = Sampler(seed=5)(logits.clone(), rows())
    sampler, history, slots = Sampler(seed=5), TokenHistory(4, vocab, cpu), torch.tensor([2, 0, 3])
    for slot, (prompt, out) in zip(slots.tolist(), lists, strict=True):
        history.load(slot, prompt, out)
    drawn = sampler.on_device(logits.clone(), sampler.columns(rows(), vocab, cpu), history.rows(slots))
    assert drawn.tolist() == expected
    history.record(slots, drawn)
    reloaded = TokenHistory(4, vocab, cpu)
    for slot, (prompt, out), token in zip(slots.tolist(), lists, expected, strict=True):
        reloaded.load(slot, prompt, out + [token])
    for got, want in zip(history.rows(slots), reloaded.rows(slots), strict=True):
        torch.testing.assert_close(got, want)
