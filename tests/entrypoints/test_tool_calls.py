"""Tool calling on a real server with the official client: a forced call (named or required) is a grammar, so even
random weights produce a call whose arguments validate; Hermes-style blocks in a reply become tool_calls (whole
and in stream deltas); the call and its result go back to the model in the next turn."""

from __future__ import annotations

import json

import pytest
from openai_helpers import CHAT, Served, assert_openai_error

pytest.importorskip("xgrammar")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 5}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}
# Forces the reply to be one Hermes-style block, as a model trained for tools writes it.
BLOCK = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,5}"\}\}\n</tool_call>'


def _args(call) -> dict:
    return json.loads(call.function.arguments, strict=False)


def test_named_tool_choice_round_trip(real_served: Served) -> None:
    client = real_served.client()
    out = client.chat.completions.create(
        model=real_served.model, messages=CHAT, tools=[WEATHER, TIME], max_tokens=60, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert set(_args(call)) == {"city"} and len(_args(call)["city"]) <= 5
    # the call and its result go back to the model
    messages = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21}'}]
    follow = client.chat.completions.create(model=real_served.model, messages=messages, tools=[WEATHER, TIME],
                                            max_tokens=4, temperature=0)
    assert follow.choices[0].message.content is not None


def test_required_tool_choice(real_served: Served) -> None:
    out = real_served.client().chat.completions.create(
        model=real_served.model, messages=CHAT, tools=[WEATHER, TIME], tool_choice="required", max_tokens=100,
        temperature=0)
    calls = out.choices[0].message.tool_calls
    assert calls and all(c.function.name in ("get_weather", "get_time") for c in calls)
    assert out.choices[0].finish_reason == "tool_calls"


def test_hermes_blocks_become_tool_calls_whole_and_streamed(real_served: Served) -> None:
    client = real_served.client()
    kwargs = dict(model=real_served.model, messages=CHAT, tools=[WEATHER], max_tokens=80, temperature=0,
                  extra_body={"structured_outputs": {"regex": BLOCK}})
    whole = client.chat.completions.create(**kwargs).choices[0]
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_weather" and whole.finish_reason == "tool_calls"
    assert not whole.message.content
    deltas, content, reasons = [], "", []
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        deltas += delta.tool_calls or []
        reasons += [chunk.choices[0].finish_reason] if chunk.choices[0].finish_reason else []
    assert "<tool_call>" not in content and reasons == ["tool_calls"]
    (streamed,) = deltas
    assert streamed.index == 0 and streamed.function.name == "get_weather"
    assert _args(streamed) == _args(call)


def test_tool_choice_none_and_errors(real_served: Served) -> None:
    client = real_served.client()
    out = client.chat.completions.create(model=real_served.model, messages=CHAT, tools=[WEATHER], tool_choice="none",
                                         max_tokens=3, temperature=0)
    assert out.choices[0].message.tool_calls is None and out.choices[0].finish_reason == "length"
    http = real_served.http()
    base = {"model": real_served.model, "messages": CHAT, "max_tokens": 3}
    resp = http.post("/v1/chat/completions", json={**base, "tool_choice": "required"})
    assert_openai_error(resp, 400, "tool_choice needs 'tools'")
    resp = http.post("/v1/chat/completions", json={**base, "tools": [WEATHER],
                                                   "tool_choice": {"type": "function", "function": {"name": "nope"}}})
    assert_openai_error(resp, 400, "'nope'")
