"""Per-request inputs beyond token ids, which multi-stage pipelines (omni thinkers and talkers) use:
shifted or explicit rotary positions, embeddings added to generated tokens (streamed, with stalls),
and banned tokens. Each is checked against HF computing the same thing by hand."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from omnistage.config.deploy import load_deploy_config
from omnistage.families.causal_lm import build_ar_engine
from omnistage.families.registry import detect_family
from omnistage.sampling_params import SamplingParams
from omnistage.types import StageInput

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPT = [5, 77, 123, 9, 300, 41, 8, 19, 250, 3, 66]


@pytest.fixture(scope="module")
def hf(tiny_qwen2: str):
    return AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32).eval()


@pytest.fixture(params=[1, 4], ids=["steps", "bursts"])
def engine(tiny_qwen2: str, request):
    family, info = detect_family(tiny_qwen2)
    stage = {"max_model_len": 128, "block_size": 4, "dtype": "float32",  # as HF runs
             "advanced": {"decode_burst": request.param}}
    pipeline = family.pipeline(info, load_deploy_config({"stages": {"lm": stage}}))
    engine = build_ar_engine(pipeline, "lm")
    yield engine
    engine.shutdown()


def run(engine, *inputs: StageInput, chunks: dict[str, list[StageInput]] | None = None) -> dict[str, list[int]]:
    """Step to completion; when a request stalls, feed it its next chunk."""
    for inp in inputs:
        engine.add_request(inp)
    tokens = {inp.request_id: [] for inp in inputs}
    pending = {k: list(v) for k, v in (chunks or {}).items()}
    while True:
        if not engine.has_work():
            fed = [rid for rid, rest in pending.items() if rest]
            if not fed:
                break
            for rid in fed:
                engine.add_input_chunk(rid, pending[rid].pop(0))
        for out in engine.step():
            assert out.error is None, out.error
            tokens[out.request_id] += out.token_ids
    return tokens


def hf_greedy(hf, prompt: list[int], n: int, rope=None, adds=None) -> list[int]:
    """Greedy decoding by full recomputation, with explicit position ids and added embeddings."""
    ids = list(prompt)
    for _ in range(n):
        embeds = hf.get_input_embeddings()(torch.tensor([ids]))[0]
        if adds is not None:
            for i in range(len(ids) - len(prompt)):
                embeds[len(prompt) + i] += adds(i)
        pos = rope(len(ids)) if rope else torch.arange(len(ids))
        with torch.no_grad():
            logits = hf(inputs_embeds=embeds[None], position_ids=pos[None]).logits[0, -1]
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]


def test_shifted_and_explicit_rotary_positions(engine, hf) -> None:
    explicit = torch.arange(len(PROMPT)) * 3  # e.g. M-RoPE-like jumps over a media span
    delta = int(explicit[-1]) + 1 - len(PROMPT)
    got = run(
        engine,
        StageInput("shift", PROMPT, params=GREEDY, rope_delta=7),
        StageInput("explicit", PROMPT, params=GREEDY, rope_positions=explicit[None], rope_delta=delta),
    )
    assert got["shift"] == hf_greedy(hf, PROMPT, 8, rope=lambda n: torch.arange(n) + 7)
    assert got["explicit"] == hf_greedy(
        hf, PROMPT, 8, rope=lambda n: torch.cat([explicit, torch.arange(len(PROMPT), n) + delta])
    )
    assert got["explicit"] != hf_greedy(hf, PROMPT, 8)  # the positions really mattered (a shift alone cannot:
    # rotary attention sees only relative positions)


def test_added_embeddings_streamed_with_stalls(engine, hf) -> None:
    torch.manual_seed(0)
    rows = torch.randn(3, hf.config.hidden_size) * 0.5
    default = torch.randn(hf.config.hidden_size) * 0.5
    expected = hf_greedy(hf, PROMPT, 8, adds=lambda i: rows[i] if i < 3 else default)
    whole = run(engine, StageInput("a", PROMPT, params=GREEDY, embed_adds=rows, embed_add_default=default))
    assert whole["a"] == expected
    # the same rows arriving one at a time: the request waits for each before decoding past it
    first = StageInput("b", PROMPT, params=GREEDY, embed_adds=rows[:1], final=False)
    chunks = [StageInput("b", embed_adds=rows[1:2], final=False),
              StageInput("b", embed_adds=rows[2:], embed_add_default=default, final=True)]
    assert run(engine, first, chunks={"b": chunks})["b"] == expected
    # rows given as parts (a sender's two tensors, summed per step by the engine), between whole rows
    halves = [StageInput("c", embed_adds=(rows[1:2] - 1.0, torch.ones(1, hf.config.hidden_size)), final=False),
              StageInput("c", embed_adds=rows[2:], embed_add_default=default, final=True)]
    first = StageInput("c", PROMPT, params=GREEDY, embed_adds=rows[:1], final=False)
    assert run(engine, first, chunks={"c": halves})["c"] == expected
    assert expected != hf_greedy(hf, PROMPT, 8)


def test_a_request_waiting_for_its_rows_is_not_left_behind_by_steps_in_flight(engine, hf) -> None:
    """Request "a" has all its rows and can decode with steps kept in flight; "b" runs out of rows and gets each
    next one three steps late. Once it arrives, b decodes on the next step: it does not wait for a chain of a's
    in-flight steps to end. Both equal HF's tokens."""
    torch.manual_seed(1)
    rows = torch.randn(12, hf.config.hidden_size) * 0.5
    default = torch.randn(hf.config.hidden_size) * 0.5
    long = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    engine.add_request(StageInput("a", PROMPT, params=long, embed_adds=rows, embed_add_default=default))
    engine.add_request(StageInput("b", PROMPT, params=GREEDY, embed_adds=rows[:1], final=False))
    tokens, fed, stalled, waits, since = {"a": [], "b": []}, 1, 0, [], None
    for _ in range(100):
        b = engine.seqs.get("b")
        if b is not None and len(b.embed_adds) <= b.num_computed - b.num_prompt_tokens:  # b is out of rows
            stalled += 1
            if stalled > 3:  # its next row arrives (the 7th, b's last decode step's, says no more will)
                engine.add_input_chunk("b", StageInput("b", embed_adds=rows[fed : fed + 1], final=fed == 6,
                                                       embed_add_default=default))
                fed, stalled, since = fed + 1, 0, 0
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
            if out.request_id == "b" and out.token_ids and since is not None:
                waits.append(since)
                since = None
        since = None if since is None else since + 1
        if not engine.has_work() and fed > 6:
            break
    assert tokens["a"] == hf_greedy(hf, PROMPT, 40, adds=lambda i: rows[i] if i < 12 else default)
    assert tokens["b"] == hf_greedy(hf, PROMPT, 8, adds=lambda i: rows[i] if i < 7 else default)
    # a's steps did run in flight (once b was done), or (bursts) several at a time
    assert engine.num_overlapped_steps > 5 or engine.num_burst_steps > 5
    assert len(waits) == 6 and max(waits) == 0, waits  # b's token came from the step right after its row


def test_bad_token_ids_are_never_sampled(engine) -> None:
    plain = run(engine, StageInput("p", PROMPT, params=GREEDY))["p"]
    banned = GREEDY.with_overrides(bad_token_ids=plain[:2])
    got = run(engine, StageInput("b", PROMPT, params=banned))["b"]
    assert not set(got) & set(plain[:2])


def test_a_steps_added_rows_mix_whole_rows_and_parts() -> None:
    from omnistage.engine.ar.model_runner import ModelRunner

    a, b, c, d, e = (torch.randn(1, 6) for _ in range(5))  # rows as the engine keeps them: [1, D]
    got = ModelRunner._stacked_adds([a, (b, c), d, (e, a, b)])
    torch.testing.assert_close(got, torch.cat([a, b + c, d, e + a + b]))
    torch.testing.assert_close(ModelRunner._stacked_adds([(b, c), (d, e)]), torch.cat([b + c, d + e]))
