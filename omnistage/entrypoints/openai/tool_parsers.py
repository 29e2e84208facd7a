"""Tool calls in generated text, for chat templates that write them Hermes-style (Qwen2.5, Qwen3, Hermes, ...):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`parse_tool_calls` splits a finished reply into content and calls; `ToolCallStream` does it as text arrives,
holding back only what may still turn out to be a tag, and emits each call whole once its closing tag is in.
A block that is not valid JSON with a string `name` stays in the content, so nothing the model wrote is lost.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, serialised (OpenAI's wire form)
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def to_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _call_of(block: str) -> ToolCall | None:
    try:
        data = json.loads(block)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    args = data.get("arguments", data.get("parameters", {}))
    return ToolCall(data["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """(content without the tool-call blocks, the calls in order)."""
    stream = ToolCallStream()
    content, calls = stream.feed(text)
    rest, more = stream.finish()
    return (content + rest).strip(), calls + more


def _tag_prefix_at_end(text: str) -> int:
    """Length of the longest suffix of `text` that could be the start of OPEN."""
    for size in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-size:]):
            return size
    return 0


class ToolCallStream:
    """Feed text deltas; get back (content safe to show now, calls completed now)."""

    def __init__(self) -> None:
        self.pending = ""  # text not yet classified
        self.in_call = False
        self.num_calls = 0

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self.pending += delta
        content, calls = "", []
        while True:
            if self.in_call:
                end = self.pending.find(CLOSE)
                if end < 0:
                    return content, calls
                block, self.pending = self.pending[:end], self.pending[end + len(CLOSE):]
                self.in_call = False
                call = _call_of(block.strip())
                if call is None:
                    content += OPEN + block + CLOSE
                else:
                    calls.append(call)
                    self.num_calls += 1
                continue
            start = self.pending.find(OPEN)
            if start >= 0:
                content += self.pending[:start]
                self.pending = self.pending[start + len(OPEN):]
                self.in_call = True
                continue
            keep = _tag_prefix_at_end(self.pending)
            content += self.pending[: len(self.pending) - keep]
            self.pending = self.pending[len(self.pending) - keep:]
            return content, calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the reply's end: whatever is held back is content (an unclosed block included)."""
        rest = (OPEN if self.in_call else "") + self.pending
        self.pending, self.in_call = "", False
        return rest, []


def _forced_calls(text: str, mode: str) -> list[ToolCall]:
    """Calls from a reply a grammar forced to be one JSON call ("named") or a JSON list of them ("required")."""
    try:
        data = json.loads(text, strict=False)
    except json.JSONDecodeError:
        return []
    items = data if mode == "required" and isinstance(data, list) else [data]
    calls = [_call_of(json.dumps(item)) for item in items]
    return [c for c in calls if c is not None]


def tool_calls_of(text: str, mode: str) -> tuple[str, list[ToolCall]]:
    """A finished reply's (content, calls) under the request's tool mode: "none", "auto", "named", "required"."""
    if mode == "none":
        return text, []
    if mode == "auto":
        return parse_tool_calls(text)
    calls = _forced_calls(text, mode)
    return ("" if calls else text), calls


class StreamedToolCalls:
    """One streamed choice's text deltas -> (content delta, tool-call deltas in OpenAI's streamed shape)."""

    def __init__(self, mode: str) -> None:
        self.mode, self.num_calls = mode, 0
        self.stream = ToolCallStream() if mode == "auto" else None
        self.held = ""  # a forced reply is one JSON document: read at its end

    def _deltas(self, calls: list[ToolCall]) -> list[dict]:
        out = []
        for call in calls:
            out.append({"index": self.num_calls, **call.to_dict()})
            self.num_calls += 1
        return out

    def feed(self, text: str, finished: bool) -> tuple[str, list[dict]]:
        if self.mode == "none":
            return text, []
        if self.stream is None:
            self.held += text
            if not finished:
                return "", []
            content, calls = tool_calls_of(self.held, self.mode)
            return content, self._deltas(calls)
        content, calls = self.stream.feed(text)
        if finished:
            rest, _ = self.stream.finish()
            content += rest
        return content, self._deltas(calls)
