"""Validation at the edge, against the real server on a tiny Qwen2 (vocabulary 512): top-level fields, every
`sampling_params_list` entry, `extra_body` and the Python API share one schema (SamplingParams). A violation is
a 400 in OpenAI's format naming the field's path; nothing unchecked reaches the engine, so a bad request never
fails its batch-mates, never takes the stage down and never uses up a restart. Error bodies carry no exception
internals."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest
from openai_helpers import CHAT, Served, assert_openai_error, assert_still_serving

from omnistage.errors import RequestError
from omnistage.sampling_params import InvalidParams, SamplingParams
from omnistage.types import OmniRequest

INTERNALS = re.compile(r"0x[0-9a-f]{4,}|Traceback|TypeError|IndexError|ValueError|RuntimeError|OverflowError|"
                       r"is not iterable|out of bounds")


def post(served: Served, body: dict, path: str = "/v1/chat/completions"):
    with served.http() as http:
        return http.post(path, json={"model": served.model, "messages": CHAT, "max_tokens": 4, **body})


def refused(served: Served, body: dict, param: str, *words: str, path: str = "/v1/chat/completions") -> dict:
    err = assert_openai_error(post(served, body, path), 400, *words)
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert not INTERNALS.search(err["message"]), err["message"]
    return err


def assert_unharmed(served: Served) -> None:
    """The stage is up, was never restarted, and serves."""
    with served.http() as http:
        assert http.get("/health").status_code == 200
    assert served.engine.orchestrator.restarts[("lm", 0)] == 0
    assert_still_serving(served)


@pytest.mark.parametrize(("entry", "field", "why"), [
    ({"stop_token_ids": 5}, "stop_token_ids", "must be a list of integer token ids (got 5)"),
    ({"stop_token_ids": "x"}, "stop_token_ids", "must be a list of integer token ids"),
    ({"stop_token_ids": [True]}, "stop_token_ids", "must be a list of integer token ids"),
    ({"stop": [["a"]]}, "stop", "must be a string or a list of strings"),
    ({"skip_special_tokens": "no"}, "skip_special_tokens", "must be true or false"),
    ({"ignore_eos": 1}, "ignore_eos", "must be true or false"),
    ({"logprobs": 2.5}, "logprobs", "must be an integer or null"),
    ({"logprobs": 21}, "logprobs", "must be in [0, 20]"),
    ({"max_tokens": 1.5}, "max_tokens", "must be an integer"),
    ({"temperature": True}, "temperature", "must be a finite number"),
    ({"temperature": "hot"}, "temperature", "must be a finite number"),
    ({"seed": 2**64}, "seed", "must be in"),
    ({"stop_token_ids": [512], "min_tokens": 2}, "stop_token_ids", "must be in [0, 512)"),
    ({"bad_token_ids": [1000000]}, "bad_token_ids", "must be in [0, 512)"),
    ({"bad_token_ids": [-1]}, "bad_token_ids", "must be >= 0"),
    ({"stop": ["x"] * 17}, "stop", "at most 16 stop strings"),
    ({"stop": ["x" * 513]}, "stop", "at most 512 characters"),
    ({"stop_token_ids": [1] * 4097}, "stop_token_ids", "at most 4096 token ids"),
])
def test_sampling_params_list_entries_are_checked_like_top_level_fields(
        real_served: Served, entry: dict, field: str, why: str) -> None:
    err = refused(real_served, {"sampling_params_list": [entry]}, f"sampling_params_list[0].{field}", why)
    assert err["message"].startswith(f"sampling_params_list[0].{field}: ")
    # the same through a literal extra_body, as non-SDK clients send it
    refused(real_served, {"extra_body": {"sampling_params_list": [entry]}}, f"sampling_params_list[0].{field}")
    assert_unharmed(real_served)


@pytest.mark.parametrize("entry", [{"stop_token_ids": None}, {"skip_special_tokens": None}, {"seed": None},
                                   {"stop": None}])
def test_null_in_an_entry_keeps_the_default(real_served: Served, entry: dict) -> None:
    resp = post(real_served, {"sampling_params_list": [entry], "temperature": 0})
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize(("body", "param", "why"), [
    ({"stop_token_ids": [512], "min_tokens": 2}, "stop_token_ids", "must be in [0, 512)"),
    ({"seed": 2**64}, "seed", "must be in"),
    ({"seed": -(2**63) - 1}, "seed", "must be in"),
    ({"stop": ["a"] * 17}, "stop", "at most 16 stop strings"),
    ({"stop": "y" * 513}, "stop", "at most 512 characters"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens", "must not exceed max_tokens"),
])
def test_top_level_fields_are_checked(real_served: Served, body: dict, param: str, why: str) -> None:
    err = refused(real_served, body, param, why)
    assert err["message"].startswith(f"{param}: ")
    assert_unharmed(real_served)


def test_request_size_bounds(real_served: Served) -> None:
    refused(real_served, {"n": 17}, "n", "n: ")
    refused(real_served, {"logprobs": True, "top_logprobs": 21}, "top_logprobs")
    refused(real_served, {"messages": CHAT * 1025}, "messages", "at most 1024")
    with real_served.http() as http:
        resp = http.post("/v1/completions", json={"model": real_served.model, "prompt": ["a"] * 9, "n": 8})
    assert "at most 64" in assert_openai_error(resp, 400)["message"]
    assert_unharmed(real_served)


def test_seeds_over_the_whole_range_are_served(real_served: Served) -> None:
    """0..2**64-1 (vLLM's range) and negative int64 seeds; an n-way fan-out's seed + i wraps, never overflows."""
    for seed in (0, 2**63, 2**64 - 1, -1):
        resp = post(real_served, {"seed": seed, "n": 2, "temperature": 1.0})
        assert resp.status_code == 200, resp.text
        resp = post(real_served, {"sampling_params_list": [{"seed": seed}], "n": 2})
        assert resp.status_code == 200, resp.text
    same = [post(real_served, {"seed": 2**64 - 1, "temperature": 1.0}).json()["choices"][0]["message"]["content"]
            for _ in range(2)]
    assert same[0] == same[1]


@pytest.mark.parametrize("poison", [
    {"stop_token_ids": [512], "min_tokens": 2},
    {"sampling_params_list": [{"bad_token_ids": [1000000]}]},
    {"sampling_params_list": [{"logprobs": 2.5}]},
    {"sampling_params_list": [{"stop_token_ids": 5}]},
])
def test_a_poisoned_request_does_not_fail_innocent_concurrent_ones(real_served: Served, poison: dict) -> None:
    innocent = [{"messages": [{"role": "user", "content": f"Tell me story {i}."}], "max_tokens": 12,
                 "temperature": 0, "ignore_eos": True} for i in range(4)]
    alone = [post(real_served, body).json()["choices"][0]["message"]["content"] for body in innocent]
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(post, real_served, body) for body in innocent]
        bad = [pool.submit(post, real_served, {**poison, "max_tokens": 12}) for _ in range(2)]
        answers = [f.result() for f in futures]
    for f in bad:
        assert f.result().status_code == 400, f.result().text
    assert [a.status_code for a in answers] == [200] * 4, [a.text for a in answers]
    assert [a.json()["choices"][0]["message"]["content"] for a in answers] == alone
    assert_unharmed(real_served)


def test_python_api_checks_stage_names_and_params(real_served: Served) -> None:
    """OmniRequest's per-stage params: a misspelled stage is a 400 naming it and the real ones (as over HTTP);
    values are SamplingParams, checked again at admission (a caller may change one after building it)."""
    orchestrator = real_served.engine.orchestrator

    def submit(stage_params: dict) -> None:
        orchestrator.submit(OmniRequest("api", prompt="hi", stage_params=stage_params), lambda out: None)

    with pytest.raises(RequestError) as info:
        submit({"llm": SamplingParams()})
    message = info.value.message
    assert info.value.status == 400 and "no stage 'llm'" in message and "its stages: lm" in message
    with pytest.raises(RequestError, match="must be a SamplingParams, not dict"):
        submit({"lm": {"temperature": 0}})
    changed = SamplingParams()
    changed.stop_token_ids = 5
    with pytest.raises(InvalidParams, match=r"stage_params\['lm'\]\.stop_token_ids: must be a list") as info:
        submit({"lm": changed})
    assert info.value.param == "stage_params['lm'].stop_token_ids"
    with pytest.raises(InvalidParams, match=r"stage_params\['\*'\]\.bad_token_ids: token ids must be in \[0, 512\)"):
        submit({"*": SamplingParams(bad_token_ids=[512])})
    assert not orchestrator.requests
    assert_unharmed(real_served)


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"stop_token_ids": 5}, "stop_token_ids"), ({"stop_token_ids": "x"}, "stop_token_ids"),
    ({"stop": [["a"]]}, "stop"), ({"skip_special_tokens": None}, "skip_special_tokens"),
    ({"logprobs": 2.5}, "logprobs"), ({"seed": 2**64}, "seed"), ({"temperature": float("nan")}, "temperature"),
    ({"max_tokens": True}, "max_tokens"), ({"bad_token_ids": (1, "2")}, "bad_token_ids"),
])
def test_sampling_params_are_strict(kwargs: dict, field: str) -> None:
    with pytest.raises(InvalidParams) as info:
        SamplingParams(**kwargs)
    assert info.value.param == field and info.value.status == 400
    assert SamplingParams(stop="x", bad_token_ids=(1, 2), temperature=1).bad_token_ids == [1, 2]
