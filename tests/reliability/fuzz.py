"""A seeded generator of mutated API requests: valid bodies with one or a few fields swapped for values of the
wrong type, out of range, huge, nested wrongly, or removed, plus bodies that are not JSON at all.

Every request it makes is a (method, path, body) the server must answer with a status below 500, or with a
declared stage failure; `Mutator(seed)` makes the same sequence each time, so a failure names its seed and
index and replays.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

# Values that break assumptions: types, ranges, sizes, nesting.
ODD_VALUES: list[Any] = [
    None, True, False, 0, -1, 1, 2, 2.5, -0.0, 512, 100_000, 2**31, 2**63, 2**64, -(2**70), 10**30, 1e308, -1e308,
    "", "x", "0", "null", "a" * 5000, "\u0000", "\udfff"[:0] + "é漢🙂", [], [5], [-1], [512], [10**9], [2**64],
    ["a"], [["a"]], [None], [1.5], [True], {}, {"a": 1}, {"": None}, [{}], list(range(300)), ["s"] * 300,
]
# Values a careless but well-meaning client sends: right type, edge of the range.
NEAR_VALUES: list[Any] = [0, 1, 3, 0.0, 0.5, 1.0, 2.0, -2.0, 20, 21, [0], [1, 2], [151643], ["\n"], ["the", "a"],
                          "stop", True, False, None, {"include_usage": True}, 2**32]
SAMPLING_FIELDS = [
    "temperature", "top_p", "top_k", "min_p", "max_tokens", "max_completion_tokens", "min_tokens", "n", "stop",
    "stop_token_ids", "seed", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "ignore_eos", "skip_special_tokens", "bad_token_ids", "logit_bias", "bad_words",
    "include_stop_str_in_output", "detokenize", "prompt_logprobs", "best_of", "user", "stream", "stream_options",
]
CHAT_FIELDS = [*SAMPLING_FIELDS, "messages", "model", "modalities", "audio", "tools", "tool_choice",
               "response_format", "sampling_params_list", "extra_body", "chat_template_kwargs"]
COMPLETION_FIELDS = [*SAMPLING_FIELDS, "prompt", "model", "echo", "suffix", "sampling_params_list", "extra_body"]
PART_KINDS = ["text", "image_url", "input_audio", "audio_url", "video_url", "image", "bogus", None, 5]


@dataclass
class Call:
    method: str
    path: str
    body: bytes
    content_type: str = "application/json"
    stream: bool = False


class Mutator:
    def __init__(self, seed: int, model: str, stages: int = 1, audio: bool = False, endpoints: bool = False) -> None:
        """`endpoints`: also fuzz /v1/embeddings, /tokenize and /detokenize (models that serve them)."""
        self.rng, self.model, self.stages, self.audio = random.Random(seed), model, stages, audio
        self.endpoints = endpoints

    # ---- valid bodies to start from

    def _chat(self) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "max_tokens": self.rng.randint(1, 4), "temperature": 0,
                                "messages": [{"role": "user", "content": "Tell me about the river."}]}
        if self.audio and self.rng.random() < 0.3:
            body.update(modalities=["text", "audio"], audio={"voice": "Chelsie", "format": "wav"})
        return body

    def _completion(self) -> dict[str, Any]:
        return {"model": self.model, "prompt": "The river", "max_tokens": self.rng.randint(1, 4), "temperature": 0}

    # ---- mutations

    def _odd(self) -> Any:
        return self.rng.choice(ODD_VALUES if self.rng.random() < 0.6 else NEAR_VALUES)

    def _mutate_params(self, params: dict[str, Any]) -> None:
        for _ in range(self.rng.choice((1, 1, 1, 2, 3))):
            params[self.rng.choice(SAMPLING_FIELDS)] = self._odd()

    def _mutate_messages(self, body: dict[str, Any]) -> None:
        choice = self.rng.randrange(6)
        if choice == 0:
            body["messages"] = self._odd()
        elif choice == 1:
            body["messages"] = [{"role": self.rng.choice(["user", "system", "tool", "robot", 3]),
                                 "content": self._odd()}]
        elif choice == 2:
            kind = self.rng.choice(PART_KINDS)
            part = {"type": kind}
            if isinstance(kind, str):
                part[kind] = self.rng.choice([self._odd(), {"url": self._odd()}, {"data": self._odd()}])
            body["messages"] = [{"role": "user", "content": [{"type": "text", "text": "Look"}, part]}]
        elif choice == 3:
            body["messages"] = [{"role": "user", "content": "hi"}] * self.rng.choice([0, 1, 300])
        elif choice == 4:
            body["messages"] = [{"role": "user"}]
        else:
            body["messages"] = [{"role": "user", "content": "hi", "extra": self._odd()}]

    def _stage_list(self) -> list[Any] | Any:
        if self.rng.random() < 0.15:
            return self._odd()
        entries: list[Any] = [{} for _ in range(self.rng.randint(1, self.stages + 1))]
        target = self.rng.randrange(len(entries))
        if self.rng.random() < 0.1:
            entries[target] = self._odd()
        else:
            self._mutate_params(entries[target])
        return entries

    def body(self) -> tuple[str, dict[str, Any]]:
        chat = self.rng.random() < 0.65
        body, fields = (self._chat(), CHAT_FIELDS) if chat else (self._completion(), COMPLETION_FIELDS)
        path = "/v1/chat/completions" if chat else "/v1/completions"
        for _ in range(self.rng.choice((1, 1, 2, 3))):
            roll = self.rng.random()
            if roll < 0.4:
                self._mutate_params(body)
            elif roll < 0.55:
                body["sampling_params_list"] = self._stage_list()
            elif roll < 0.65:
                body["extra_body"] = self.rng.choice([self._odd(), {self.rng.choice(SAMPLING_FIELDS): self._odd()}])
            elif roll < 0.8 and chat:
                self._mutate_messages(body)
            elif roll < 0.88:
                body.pop(self.rng.choice(fields), None)
            elif not chat:
                body["prompt"] = self._odd()
            else:
                body[self.rng.choice(fields)] = self._odd()
        return path, body

    def _other_endpoint(self) -> tuple[str, dict[str, Any]]:
        """/v1/embeddings, /tokenize, /detokenize: a valid body with one field made odd."""
        path, body = self.rng.choice([
            ("/v1/embeddings", {"model": self.model, "input": "The river"}),
            ("/tokenize", {"model": self.model, "prompt": "The river"}),
            ("/tokenize", {"model": self.model, "messages": [{"role": "user", "content": "hi"}]}),
            ("/detokenize", {"model": self.model, "tokens": [1, 2, 3]}),
        ])
        fields = [*body, "encoding_format", "dimensions", "add_generation_prompt", "add_special_tokens"]
        body[self.rng.choice(fields)] = self._odd()
        return path, body

    def call(self) -> Call:
        roll = self.rng.random()
        if self.endpoints and roll > 0.85:
            path, body = self._other_endpoint()
            return Call("POST", path, json.dumps(body, allow_nan=True).encode())
        if roll < 0.05:  # not JSON, or JSON that is not an object
            path = self.rng.choice(["/v1/chat/completions", "/v1/completions"])
            raw = self.rng.choice([b"{", b"[]", b"null", b"\xff\xfe", b'{"model": ', b"12", b""])
            return Call("POST", path, raw)
        path, body = self.body()
        stream = body.get("stream") is True
        return Call("POST", path, json.dumps(body, allow_nan=True).encode(), stream=stream)
