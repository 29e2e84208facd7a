"""Server behaviour through the official `openai` client and raw httpx, against both the scripted
FakeEngine and a real AsyncOmni on a tiny checkpoint (the `served` fixture runs each test on both)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai_helpers import API_KEY, CHAT, FakeEngine, Served, assert_openai_error, assert_still_serving, sse_events

from omnistage.entrypoints.openai.server import BackgroundServer

# ---------------------------------------------------------------- basics


def test_health_is_open_without_key(served: Served) -> None:
    resp = httpx.get(f"{served.url}/health")
    assert resp.status_code == 200 and resp.json()["status"] == "ok"


def test_models_lists_served_name(served: Served) -> None:
    models = served.client().models.list()
    assert [m.id for m in models.data] == [served.model]
    assert models.data[0].object == "model"


def test_chat_non_stream(served: Served) -> None:
    out = served.client().chat.completions.create(model=served.model, messages=CHAT, max_tokens=5)
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    choice = out.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content
    assert choice.finish_reason == "length"
    assert out.usage.completion_tokens == 5 and out.usage.prompt_tokens > 0
    assert out.usage.total_tokens == out.usage.prompt_tokens + 5
    assert out.usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_stream_with_usage(served: Served) -> None:
    stream = served.client().chat.completions.create(
        model=served.model, messages=CHAT, max_tokens=6, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert all(c.usage is None for c in chunks[:-1])
    # Same tokens as the non-streamed call (greedy).
    full = served.client().chat.completions.create(model=served.model, messages=CHAT, max_tokens=6, temperature=0)
    again = served.client().chat.completions.create(
        model=served.model, messages=CHAT, max_tokens=6, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in again if c.choices) == full.choices[0].message.content
    assert text


def test_raw_sse_framing_ends_with_done(served: Served) -> None:
    body = {"model": served.model, "messages": CHAT, "max_tokens": 3, "stream": True}
    with served.http() as http, http.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp)
    assert events[-1] == "[DONE]"
    assert all(json.loads(e)["object"] == "chat.completion.chunk" for e in events[:-1])


def test_n_fans_out(served: Served) -> None:
    client = served.client()
    out = client.chat.completions.create(model=served.model, messages=CHAT, max_tokens=4, n=2, seed=7)
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.completion_tokens == 8
    stream = client.chat.completions.create(model=served.model, messages=CHAT, max_tokens=4, n=2, stream=True)
    texts = {0: "", 1: ""}
    roles = set()
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.delta.role:
                roles.add(c.index)
    assert roles == {0, 1} and all(texts.values())


def test_chat_logprobs(served: Served) -> None:
    out = served.client().chat.completions.create(
        model=served.model, messages=CHAT, max_tokens=4, logprobs=True, top_logprobs=2, temperature=0
    )
    content = out.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert isinstance(entry.token, str) and entry.logprob <= 0.0
        assert len(entry.top_logprobs) == 2
        if served.kind == "real":
            assert bytes(entry.bytes).decode(errors="replace") == entry.token
            # Greedy: the sampled token is the most likely one.
            assert entry.logprob == pytest.approx(max(t.logprob for t in entry.top_logprobs), abs=1e-4)
    assert "".join(e.token for e in content) == out.choices[0].message.content or served.kind == "fake"


def test_chat_stream_logprobs(served: Served) -> None:
    stream = served.client().chat.completions.create(
        model=served.model, messages=CHAT, max_tokens=4, logprobs=True, stream=True
    )
    entries = [e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(entries) == 4 and all(e.top_logprobs == [] for e in entries)


def test_completions_string_tokens_batch(served: Served) -> None:
    client = served.client()
    one = client.completions.create(model=served.model, prompt="the old town", max_tokens=3)
    assert one.object == "text_completion" and one.choices[0].text and one.usage.completion_tokens == 3
    ids = client.completions.create(model=served.model, prompt=[5, 6, 7, 8], max_tokens=3)
    assert ids.choices[0].text and ids.usage.prompt_tokens == 4
    batch = client.completions.create(model=served.model, prompt=["a river", "the town"], max_tokens=2, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.usage.completion_tokens == 8
    default = client.completions.create(model=served.model, prompt="the old town")
    assert default.usage.completion_tokens == 16  # OpenAI's default max_tokens for completions


def test_completions_stream_and_logprobs(served: Served) -> None:
    client = served.client()
    stream = client.completions.create(
        model=served.model, prompt="the old town", max_tokens=4, stream=True, logprobs=2,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 4
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert len(tokens) == 4
    full = client.completions.create(model=served.model, prompt="the old town", max_tokens=4, logprobs=2)
    lp = full.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert lp.text_offset[0] == 0 and all(len(t) <= 2 for t in lp.top_logprobs)


def test_max_tokens_default_fills_context(served: Served) -> None:
    """Chat without max_tokens: the runtime generates until the context is full (or EOS)."""
    out = served.client().chat.completions.create(model=served.model, messages=CHAT)
    assert out.choices[0].finish_reason in ("length", "stop")
    if out.choices[0].finish_reason == "length":
        assert out.usage.total_tokens == served.engine.max_model_len


# ---------------------------------------------------------------- auth


def test_auth_required(served: Served) -> None:
    body = {"model": served.model, "messages": CHAT, "max_tokens": 2}
    no_key = httpx.post(f"{served.url}/v1/chat/completions", json=body)
    assert_openai_error(no_key, 401, "API key")
    wrong = httpx.post(f"{served.url}/v1/models", headers={"Authorization": "Bearer nope"})
    assert_openai_error(wrong, 401, "invalid API key")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{served.url}/v1", api_key="nope", max_retries=0).models.list()
    ok = httpx.post(f"{served.url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert ok.status_code == 200


# ---------------------------------------------------------------- bad input never breaks the server

BAD_CHAT = [
    ({"messages": []}, 400, ["messages", "at least one"]),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, ["messages[0].role", "wizard"]),
    ({"messages": [{"role": "user"}]}, 400, ["content"]),
    ({"messages": CHAT, "temperature": -1}, 400, ["temperature"]),
    ({"messages": CHAT, "top_p": 2}, 400, ["top_p"]),
    ({"messages": CHAT, "max_tokens": "ten"}, 400, ["max_tokens"]),
    ({"messages": CHAT, "n": 0}, 400, ["n"]),
    ({"messages": CHAT, "n": 17}, 400, ["n"]),
    ({"messages": CHAT, "max_tokens": 100000}, 400, ["max_tokens"]),
    ({"messages": CHAT, "max_tokens": 0}, 400, ["max_tokens"]),
    ({"messages": CHAT, "top_logprobs": 2}, 400, ["top_logprobs requires logprobs"]),
    ({"messages": CHAT, "logprobs": True, "top_logprobs": 50}, 400, ["top_logprobs", "20"]),
    ({"messages": CHAT, "stop": [""]}, 400, ["stop"]),
    ({"messages": CHAT, "bogus": 1}, 400, ["unknown field 'bogus'"]),
    ({"messages": CHAT, "modalities": ["video"]}, 400, ["modalities"]),
    ({"messages": CHAT, "tools": [{"type": "function"}]}, 400, ["tools"]),
    ({"messages": [{"role": "user", "content": [{"type": "blob"}]}]}, 400, ["blob"]),
    ({"model": "gpt-9", "messages": CHAT}, 404, ["gpt-9", "this server serves"]),
]


@pytest.mark.parametrize(("body", "status", "words"), BAD_CHAT, ids=[str(i) for i in range(len(BAD_CHAT))])
def test_bad_chat_requests(served: Served, body: dict, status: int, words: list[str]) -> None:
    body = {"model": served.model, **body}
    with served.http() as http:
        err = assert_openai_error(http.post("/v1/chat/completions", json=body), status, *words)
        if status == 404:
            assert err["code"] == "model_not_found" and served.model in err["message"]
        stream = http.post("/v1/chat/completions", json={**body, "stream": True})
        assert stream.status_code == status  # streamed requests fail the same way, before any byte
    assert_still_serving(served)


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"prompt": []}, ["prompt"]),
        ({"prompt": 5}, ["prompt"]),
        ({"prompt": [1, -2]}, ["token ids"]),
        ({"prompt": "x", "echo": True}, ["echo"]),
        ({"prompt": "x", "logprobs": 99}, ["logprobs"]),
        ({}, ["'prompt' is required"]),
    ],
)
def test_bad_completion_requests(served: Served, body: dict, words: list[str]) -> None:
    with served.http() as http:
        assert_openai_error(http.post("/v1/completions", json={"model": served.model, **body}), 400, *words)
    assert_still_serving(served)


@pytest.mark.parametrize(
    "raw",
    [b"{not json", b"", b"[1, 2]", b'"text"', b'{"messages": [{"role": "user", "content": "x"}'],
    ids=str,
)
def test_malformed_bodies(served: Served, raw: bytes) -> None:
    with served.http() as http:
        resp = http.post("/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"})
    err = assert_openai_error(resp, 400)
    assert "JSON" in err["message"] or "required" in err["message"]
    assert_still_serving(served)


def test_unknown_route_and_method(served: Served) -> None:
    with served.http() as http:
        assert_openai_error(http.get("/v1/nothing"), 404, "/v1/nothing")
        assert_openai_error(http.get("/v1/chat/completions"), 405, "GET")
    assert_still_serving(served)


def test_stop_token_ids_and_extensions_accepted(served: Served) -> None:
    out = served.client().chat.completions.create(
        model=served.model,
        messages=CHAT,
        max_tokens=3,
        extra_body={
            "top_k": 5,
            "min_p": 0.01,
            "repetition_penalty": 1.1,
            "ignore_eos": True,
            "stop_token_ids": [1],
            "skip_special_tokens": True,
            "min_tokens": 1,
            "return_token_ids": True,
        },
    )
    assert len(out.choices[0].model_extra["token_ids"]) == out.usage.completion_tokens


def test_literal_extra_body_is_honoured(served: Served) -> None:
    """A client that is not the openai SDK sends extra_body as a JSON field: merged into the request, its
    values winning over the body's; on both endpoints."""
    with served.http() as http:
        chat = http.post("/v1/chat/completions", json={"model": served.model, "messages": CHAT, "max_tokens": 6,
                                                       "extra_body": {"max_tokens": 2, "detokenize": True}})
        assert chat.status_code == 200, chat.text
        assert chat.json()["usage"]["completion_tokens"] == 2
        cmpl = http.post("/v1/completions", json={"model": served.model, "prompt": "Once", "max_tokens": 6,
                                                  "extra_body": {"sampling_params_list": [{"max_tokens": 3}]}})
        assert cmpl.status_code == 200, cmpl.text
        assert cmpl.json()["usage"]["completion_tokens"] == 3


def test_vllm_sampling_fields_in_the_body(served: Served) -> None:
    out = served.client().chat.completions.create(
        model=served.model, messages=CHAT, max_tokens=3,
        extra_body={"top_k": -1, "detokenize": True, "output_kind": 0, "truncate_prompt_tokens": None,
                    "prompt_logprobs": None, "spaces_between_special_tokens": True, "best_of": 1, "bad_words": []},
    )
    assert out.usage.completion_tokens == 3
    with served.http() as http:
        err = assert_openai_error(http.post("/v1/chat/completions", json={"model": served.model, "messages": CHAT,
                                                                          "max_tokns": 3}), 400)
        assert "did you mean 'max_tokens'?" in err["message"] and err["param"] == "max_tokns"


def test_served_model_names() -> None:
    """Several names (vLLM's --served-model-name a b): all listed, any accepted and echoed, a missing model
    means the first, another name is OpenAI's 404 model_not_found."""
    with BackgroundServer(FakeEngine(), api_key=API_KEY, served_model_names=["alpha", "beta"]) as server:
        with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30) as http:
            assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["alpha", "beta"]
            for model, reported in (("beta", "beta"), (None, "alpha"), ("", "alpha")):
                body = {"messages": CHAT, "max_tokens": 2, **({} if model is None else {"model": model})}
                resp = http.post("/v1/chat/completions", json=body)
                assert resp.status_code == 200 and resp.json()["model"] == reported, resp.text
            err = assert_openai_error(http.post("/v1/completions", json={"model": "fake-model", "prompt": "x"}),
                                      404, "'fake-model' does not exist", "'alpha', 'beta'")
            assert (err["code"], err["type"], err["param"]) == ("model_not_found", "invalid_request_error", "model")


def test_cli_served_model_name_takes_several() -> None:
    from omnistage.entrypoints.cli import build_parser

    args = build_parser().parse_args(["serve", "some/model", "--served-model-name", "a", "b"])
    assert args.served_model_name == ["a", "b"]
    assert build_parser().parse_args(["serve", "some/model"]).served_model_name is None
