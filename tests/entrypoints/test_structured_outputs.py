"""Structured output on a real server: the grammar masks the tiny model's random logits, so whatever it would
have said, the reply parses and validates (json_schema, json_object, vLLM's structured_outputs and guided_*),
streamed or not, batched beside unconstrained requests without changing them."""

from __future__ import annotations

import concurrent.futures
import json

import pytest
from openai_helpers import CHAT, Served, assert_openai_error

pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
          "required": ["city", "days"], "additionalProperties": False}


def _valid(text: str) -> dict:
    value = json.loads(text, strict=False)  # xgrammar's strings admit raw control characters
    assert set(value) == {"city", "days"} and isinstance(value["city"], str) and len(value["city"]) <= 6
    assert 1 <= value["days"] <= 7
    return value


def test_json_schema_response_format(real_served: Served) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA, "strict": True}}
    for seed in range(3):
        out = real_served.client().chat.completions.create(
            model=real_served.model, messages=CHAT, response_format=fmt, max_tokens=100, temperature=1.0, seed=seed)
        assert out.choices[0].finish_reason == "stop", out.choices[0]
        _valid(out.choices[0].message.content)


def test_json_object_and_streaming(real_served: Served) -> None:
    # Sampled: any JSON object lets greedy random weights repeat inside one string until max_tokens; seeds differ
    # by device, so the first seed whose object closes within the budget is checked.
    for seed in range(10):
        stream = real_served.client().chat.completions.create(
            model=real_served.model, messages=CHAT, response_format={"type": "json_object"}, max_tokens=300,
            temperature=1.0, seed=seed, stream=True)
        chunks = [c for c in stream if c.choices]
        if chunks[-1].choices[0].finish_reason == "stop":
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
            assert isinstance(json.loads(text, strict=False), dict)
            return
    pytest.fail("no seed closed its JSON object within 300 tokens")


@pytest.mark.parametrize("extra", [{"structured_outputs": {"choice": ["yes", "no"]}}, {"guided_choice": ["yes", "no"]},
                                   {"structured_outputs": {"regex": "[0-9]{4}"}}])
def test_vllm_fields(real_served: Served, extra: dict) -> None:
    out = real_served.client().completions.create(model=real_served.model, prompt="Answer:", max_tokens=20,
                                                  temperature=0, extra_body=extra)
    text = out.choices[0].text
    assert text in ("yes", "no") if "choice" in str(extra) else (len(text) == 4 and text.isdigit())


def test_constrained_and_free_requests_batch_without_interference(real_served: Served) -> None:
    client = real_served.client()

    def free() -> str:
        return client.chat.completions.create(model=real_served.model, messages=CHAT, max_tokens=12,
                                              temperature=0).choices[0].message.content

    def constrained() -> str:
        return client.chat.completions.create(model=real_served.model, messages=CHAT, max_tokens=100, temperature=0,
                                              extra_body={"guided_json": SCHEMA}).choices[0].message.content

    alone = free()
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        results = [pool.submit(f) for f in (free, constrained) * 3]
    outs = [r.result() for r in results]
    assert outs[0::2] == [alone] * 3
    assert len({json.dumps(_valid(o)) for o in outs[1::2]}) == 1  # greedy: the same valid JSON each time


def test_bad_specs_are_400(real_served: Served) -> None:
    http = real_served.http()
    base = {"model": real_served.model, "messages": CHAT, "max_tokens": 4}
    resp = http.post("/v1/chat/completions", json={**base, "structured_outputs": {"regex": "(unclosed"}})
    assert_openai_error(resp, 400, "could not be compiled")
    resp = http.post("/v1/chat/completions", json={**base, "response_format": {"type": "json_object"},
                                                   "guided_regex": "a+"})
    assert_openai_error(resp, 400, "send only one")
    resp = http.post("/v1/chat/completions", json={**base, "response_format": {"type": "json_schema"}})
    assert_openai_error(resp, 400, "json_schema")


def test_structured_output_crosses_to_a_stage_process(tiny_qwen2: str) -> None:
    """The process backend (the default with a GPU) carries the constraint to the stage's own process."""
    from omnistage import Omni, SamplingParams

    with Omni(tiny_qwen2, {"worker_backend": "process", "stages": {"lm": {"dtype": "float32"}}}) as omni:
        params = SamplingParams(max_tokens=10, temperature=0, structured_outputs={"choice": ["yes", "no"]},
                                logit_bias={5: 1.0})
        (out,) = omni.generate(["Answer:"], params)
    assert out.error is None and out.text in ("yes", "no")
