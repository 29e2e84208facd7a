"""Fault containment in the AR engine (a real tiny Qwen2): per-request work that raises (stop checks,
sampling-parameter application, logprobs) fails that request alone, its batch-mates get the tokens they get
alone, the engine frees the request's blocks and goes on serving; callers hear which stage failed, never the
exception. The poison is put into a request after admission, as a bug elsewhere would (admission refuses it)."""

from __future__ import annotations

import pytest

from omnistage.config.deploy import load_deploy_config
from omnistage.errors import RequestError
from omnistage.families.causal_lm import build_ar_engine
from omnistage.families.registry import detect_family
from omnistage.sampling_params import SamplingParams
from omnistage.types import StageInput

PROMPTS = [[5, 77, 123, 9], [300, 41, 8], [19, 250, 3, 66, 7], [11, 12], [40, 41, 42]]
FAILED = "stage 'lm' failed on this request; the server log has the details"


@pytest.fixture(scope="module", params=[1, 4], ids=["steps", "bursts"])
def engine(tiny_qwen2: str, request):
    family, info = detect_family(tiny_qwen2)
    stage = {"max_model_len": 128, "block_size": 4, "dtype": "float32", "advanced": {"decode_burst": request.param}}
    engine = build_ar_engine(family.pipeline(info, load_deploy_config({"stages": {"lm": stage}})), "lm")
    yield engine
    engine.shutdown()


def innocent(i: int) -> SamplingParams:
    if i == 0:  # a seeded sampled request: its tokens do not depend on its batch-mates either
        return SamplingParams(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True)
    return SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def run(engine, requests: dict[str, tuple[list[int], SamplingParams]], poison: dict | None = None) -> dict:
    """Run the requests in one batch to completion; `poison` is set on request 'bad' after admission."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(StageInput(rid, prompt, params=params))
    for name, value in (poison or {}).items():
        setattr(engine.seqs["bad"].params, name, value)
    results = {rid: {"tokens": [], "text": "", "error": None} for rid in requests}
    while engine.has_work():
        for out in engine.step():
            r = results[out.request_id]
            r["tokens"] += out.token_ids
            r["text"] += out.text
            if out.error:
                assert r["error"] is None and out.finished
                r["error"] = (out.error, out.error_status)
    return results


@pytest.mark.parametrize("poison", [{"stop_token_ids": 5}, {"bad_token_ids": [1_000_000]}, {"logprobs": 2.5},
                                    {"stop_token_ids": [10**30], "min_tokens": 4}],
                         ids=["stop-int", "bad-id", "logprobs", "huge-id"])
def test_a_poisoned_request_fails_alone(engine, poison: dict) -> None:
    alone = {}
    for i, prompt in enumerate(PROMPTS[:4]):
        alone.update(run(engine, {f"ok{i}": (prompt, innocent(i))}))
    requests = {f"ok{i}": (prompt, innocent(i)) for i, prompt in enumerate(PROMPTS[:4])}
    requests["bad"] = (PROMPTS[4], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    together = run(engine, requests, poison)
    assert together["bad"]["error"] == (FAILED, 500)
    for rid in alone:
        assert together[rid] == alone[rid], rid
        assert len(alone[rid]["tokens"]) == 8 and alone[rid]["error"] is None
    assert engine.block_manager.num_used == 0 and not engine.seqs  # the failed request's blocks are free
    after = run(engine, {"next": (PROMPTS[4], innocent(1))})  # and the engine goes on
    assert after["next"]["error"] is None and len(after["next"]["tokens"]) == 8


@pytest.mark.parametrize(("params", "field"), [
    ({"stop_token_ids": [512]}, "stop_token_ids"),  # the tiny vocabulary has 512 ids
    ({"bad_token_ids": [0, 1_000_000]}, "bad_token_ids"),
])
def test_token_ids_outside_the_vocabulary_are_refused_at_admission(engine, params: dict, field: str) -> None:
    with pytest.raises(RequestError, match=rf"{field}=.* token ids must be in \[0, 512\)") as info:
        engine.add_request(StageInput("r", [1, 2, 3], params=SamplingParams(min_tokens=2, **params)))
    assert info.value.status == 400 and not engine.seqs


def test_params_changed_after_they_were_built_are_checked_again(engine) -> None:
    params = SamplingParams()
    params.stop_token_ids = 5  # a caller's mutation: the engine checks what it is given
    with pytest.raises(RequestError, match="stop_token_ids=5 is invalid: must be a list of integer token ids"):
        engine.add_request(StageInput("r", [1, 2, 3], params=params))
    assert not engine.seqs
