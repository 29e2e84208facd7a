"""Protocol conversions without a server: request -> SamplingParams, error wording, token spelling."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from omnistage.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, seeded_copies
from omnistage.entrypoints.openai.server import (
    TextOffsets,
    TokenTexts,
    chat_logprobs,
    completion_logprobs,
    validation_message,
)
from omnistage.sampling_params import InvalidParams, SamplingParams
from omnistage.types import TokenLogprob

USER = [{"role": "user", "content": "hi"}]


def chat(**kw: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": USER, **kw})


def test_sampling_params_from_chat() -> None:
    defaults = SamplingParams(temperature=0.7, top_k=20, max_tokens=16)
    p = chat(temperature=0.0, stop="END", max_completion_tokens=9, logprobs=True, top_logprobs=3).to_sampling_params(
        defaults
    )
    assert (p.temperature, p.top_k, p.stop, p.max_tokens, p.logprobs) == (0.0, 20, ["END"], 9, 3)
    unset = chat().to_sampling_params(defaults)
    assert unset.max_tokens is None and unset.temperature == 0.7 and unset.logprobs is None
    assert chat(logprobs=True).to_sampling_params(defaults).logprobs == 0


def test_sampling_params_from_completion() -> None:
    p = CompletionRequest.model_validate({"prompt": "x", "logprobs": 2}).to_sampling_params(SamplingParams())
    assert p.max_tokens == 16 and p.logprobs == 2


@pytest.mark.parametrize(("field", "value"), [("temperature", -0.1), ("top_p", 0.0), ("min_p", 2.0), ("top_k", -5)])
def test_out_of_range_raises_invalid_params(field: str, value: float) -> None:
    with pytest.raises(InvalidParams) as info:
        chat(**{field: value}).to_sampling_params(SamplingParams())
    assert info.value.param == field and info.value.status == 400


def test_seeded_copies() -> None:
    assert [p.seed for p in seeded_copies(SamplingParams(seed=5), 3)] == [5, 6, 7]
    assert [p.seed for p in seeded_copies(SamplingParams(), 2)] == [None, None]


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"messages": USER, "n": True}, "n: Input should be a valid integer (got True)"),
        ({"messages": [{"role": "user", "content": "x", "extra": 1}]}, "unknown field 'messages[0].extra'"),
        ({"messages": USER, "stream": "yes"}, "stream: Input should be a valid boolean (got 'yes')"),
        ({"messages": USER, "max_tokens": 5, "max_completion_tokens": 6}, "max_tokens and max_completion_tokens"),
        ({"messages": USER, "response_format": {"type": "xml"}}, "response_format"),
        ({"messages": USER, "logit_bias": {"1": "high"}}, "logit_bias"),
    ],
)
def test_validation_messages(body: dict, expected: str) -> None:
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate(body)
    message, _ = validation_message(info.value.errors())
    assert expected in message


def test_messages_to_dicts() -> None:
    req = chat(
        messages=[
            {"role": "developer", "content": "rules"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "u"}}],
            },
            {"role": "assistant", "content": None},
        ]
    )
    assert req.message_dicts() == [
        {"role": "system", "content": "rules"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "u"}}],
        },
        {"role": "assistant", "content": ""},
    ]


def test_prompt_inputs() -> None:
    def inputs(prompt: object) -> list[dict]:
        return CompletionRequest.model_validate({"prompt": prompt}).prompt_inputs()

    assert inputs("a") == [{"prompt": "a"}]
    assert inputs([1, 2]) == [{"prompt_token_ids": [1, 2]}]
    assert inputs(["a", "b"]) == [{"prompt": "a"}, {"prompt": "b"}]
    assert inputs([[1], [2, 3]]) == [{"prompt_token_ids": [1]}, {"prompt_token_ids": [2, 3]}]


def test_token_texts_rebuild_bytes(tiny_qwen2: str) -> None:
    """Byte-level tokens split characters; their bytes, concatenated, give back the exact text."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_qwen2)
    texts = TokenTexts(tok)
    assert texts.alphabet is not None
    sample = "naïve café — 河流 🙂 the river"
    ids = tok(sample, add_special_tokens=False)["input_ids"]
    assert bytes(b for i in ids for b in texts(i)[1]).decode() == sample
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    assert texts(eos) == ("<|im_end|>", list(b"<|im_end|>"))
    assert TokenTexts(None)(7) == ("token_id:7", None)


def test_logprob_formats() -> None:
    texts = TokenTexts(None)
    lps = [TokenLogprob(1, -0.25, [(1, -0.25), (2, float("-inf"))]), TokenLogprob(3, -1.0, [])]
    chat_lp = chat_logprobs(lps, texts)
    assert chat_lp is not None and chat_lp.content is not None
    assert [e.token for e in chat_lp.content] == ["token_id:1", "token_id:3"]
    assert chat_lp.content[0].top_logprobs[1].logprob == -9999.0  # JSON has no -inf
    offsets = TextOffsets(5)
    comp = completion_logprobs(lps, texts, offsets)
    assert comp is not None and comp.text_offset == [5, 15] and offsets.chars == 25
    assert comp.top_logprobs[0] == {"token_id:1": -0.25, "token_id:2": -9999.0}


def test_text_offsets_count_characters_split_over_byte_tokens(tiny_qwen2: str) -> None:
    """The emoji is four byte tokens and the é two: each of them starts where its character does, and the
    offsets carry over between streamed deltas."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_qwen2)
    texts = TokenTexts(tok)
    ids = tok("a\U0001F642b é!", add_special_tokens=False)["input_ids"]
    assert len(ids) == 10  # a, 4 emoji bytes, b, space, 2 bytes of é, !
    offsets, got = TextOffsets(), []
    for delta in (ids[:3], ids[3:8], ids[8:]):
        comp = completion_logprobs([TokenLogprob(i, -1.0, []) for i in delta], texts, offsets)
        got += comp.text_offset
    assert got == [0, 1, 1, 1, 1, 2, 3, 4, 4, 5]
    assert offsets.chars == len("a\U0001F642b é!")


def test_null_fields_mean_unset() -> None:
    req = chat(n=None, stream=None, logprobs=None, max_tokens=None, stop=None, temperature=None, stream_options=None)
    assert (req.n, req.stream, req.logprobs, req.include_usage) == (1, False, False, False)


def test_literal_extra_body_is_merged_and_wins() -> None:
    """Clients other than the openai SDK send extra_body as a field: merged in as the SDK would, its value
    winning a conflict; a nested one is merged too."""
    body = chat(max_tokens=9, extra_body={"max_tokens": 2, "top_k": 5, "extra_body": {"seed": 1}})
    assert (body.max_tokens, body.top_k, body.seed) == (2, 5, 1)
    prompt = CompletionRequest.model_validate({"prompt": "x", "extra_body": {"sampling_params_list": [{}]}})
    assert prompt.sampling_params_list == [{}]
    with pytest.raises(ValidationError, match="extra_body must be a JSON object"):
        chat(extra_body=[1])


def test_vllm_fields_accepted_and_unknown_ones_suggested() -> None:
    body = chat(detokenize=True, top_k=-1, prompt_logprobs=1, spaces_between_special_tokens=False, output_kind=0,
                truncate_prompt_tokens=None, guided_decoding=None, best_of=1, bad_words=[], min_tokens=2, seed=3)
    p = body.to_sampling_params(SamplingParams())
    assert (p.top_k, p.min_tokens, p.seed) == (-1, 2, 3)
    for bad, expected in (({"temprature": 1}, "did you mean 'temperature'?"),
                          ({"frobnicate": 1}, "unknown field 'frobnicate'; remove it"),
                          ({"best_of": 3}, "best_of is not supported"),
                          ({"bad_words": ["x"]}, "bad_words is not supported")):
        with pytest.raises(ValidationError) as info:
            chat(**bad)
        assert expected in validation_message(info.value.errors())[0]


def test_sampling_params_list_maps_to_stages() -> None:
    """One entry per stage in pipeline order (non-AR ones too); fewer: later stages keep their deploy
    defaults; one entry: every AR stage; more than the stages: a 400 naming the count."""
    from types import SimpleNamespace

    from omnistage.entrypoints.openai.serving import stage_sampling_params
    from omnistage.errors import RequestError

    defaults = {"thinker": SamplingParams(temperature=0.5), "talker": SamplingParams(max_tokens=99),
                "token2wav": SamplingParams()}
    stages = [SimpleNamespace(name=n, kind=k) for n, k in (("thinker", "ar"), ("talker", "ar"), ("token2wav", "gen"))]
    config = {name: SimpleNamespace(sampling_params=lambda p=p: p) for name, p in defaults.items()}
    engine = SimpleNamespace(pipeline=SimpleNamespace(stages=stages, stage_config=config.__getitem__))
    entries = [{"max_tokens": 4, "detokenize": True}, {"top_k": -1}, {"seed": 7, "top_p": 0.5}]
    full = stage_sampling_params(engine, entries)
    assert (full["thinker"].max_tokens, full["thinker"].temperature) == (4, 0.5)
    assert (full["talker"].top_k, full["talker"].max_tokens) == (-1, 99)
    assert full["token2wav"].seed == 7
    assert set(stage_sampling_params(engine, [{}, {}])) == {"thinker", "talker"}
    assert set(stage_sampling_params(engine, [{"seed": 1}])) == {"thinker", "talker"}
    with pytest.raises(RequestError, match="4 entries but this model has 3 stages"):
        stage_sampling_params(engine, [{}] * 4)
    with pytest.raises(RequestError, match=r"sampling_params_list\[1\]\.temperature: must be in \[0, 100\] \(got -1\); "
                                           r"this entry is for stage 'talker'"):
        stage_sampling_params(engine, [{}, {"temperature": -1}])
    with pytest.raises(RequestError, match=r"sampling_params_list\[0\]\.temperature: must be a finite number"):
        stage_sampling_params(engine, [{"temperature": "hot"}])
