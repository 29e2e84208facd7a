"""Hermes-style tool calls out of generated text, whole and as it streams in arbitrary pieces."""

from __future__ import annotations

import json

import pytest

from omnistage.entrypoints.openai.tool_parsers import ToolCallStream, parse_tool_calls

REPLY = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
         '<tool_call>{"name": "get_time", "arguments": {}}</tool_call> Done.')


def test_whole_reply() -> None:
    content, calls = parse_tool_calls(REPLY)
    assert content == "Let me check. Done."
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "Paris"} and calls[1].arguments == "{}"
    assert calls[0].id != calls[1].id and calls[0].to_dict()["type"] == "function"


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 50])
def test_streamed_in_pieces_equals_whole(piece: int) -> None:
    stream, content, names = ToolCallStream(), "", []
    for i in range(0, len(REPLY), piece):
        text, calls = stream.feed(REPLY[i:i + piece])
        assert "<" not in text or "<tool" not in text  # a tag never leaks into content
        content += text
        names += [c.name for c in calls]
    rest, _ = stream.finish()
    assert (content + rest) == "Let me check. Done." and names == ["get_weather", "get_time"]


def test_what_is_not_a_call_stays_content() -> None:
    text = "a <tool_call>not json</tool_call> b <tool_call>{\"x\": 1}</tool_call> c <tool_ca"
    content, calls = parse_tool_calls(text)
    assert calls == [] and content == text
    unclosed = 'x <tool_call>{"name": "f"'
    assert parse_tool_calls(unclosed) == (unclosed, [])
