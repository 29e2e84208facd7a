"""End to end on a real AsyncOmni: HF parity through HTTP, stop strings, abort on disconnect freeing
KV blocks, and the CLI (serve start-up errors, bench serve)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch
from openai_helpers import API_KEY, CHAT, Served, assert_still_serving, wait_for

from omnistage.bench.serve import run_bench
from omnistage.entrypoints.cli import build_parser, serve_overrides

PROMPTS = [
    [{"role": "user", "content": "Tell me about the river in the old town."}],
    [{"role": "system", "content": "You answer in one line."}, {"role": "user", "content": "Why is water blue?"}],
    [
        {"role": "user", "content": "Name a city."},
        {"role": "assistant", "content": "The old town by the river."},
        {"role": "user", "content": "And its people?"},
    ],
]


@pytest.fixture(scope="module")
def hf(real_served: Served) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = real_served.extra["path"]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return AutoTokenizer.from_pretrained(path), model


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("prompt", range(len(PROMPTS)))
def test_greedy_chat_matches_hf_generate(real_served: Served, hf: tuple[Any, Any], prompt: int, stream: bool) -> None:
    tokenizer, model = hf
    messages, max_new = PROMPTS[prompt], 24
    enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True, return_tensors="pt")
    with torch.no_grad():
        full = model.generate(**enc, max_new_tokens=max_new, do_sample=False)
    expected = full[0, enc["input_ids"].shape[1] :].tolist()

    kwargs: dict[str, Any] = dict(
        model=real_served.model,
        messages=messages,
        max_tokens=max_new,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    client = real_served.client()
    if stream:
        chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
        got = [t for c in chunks if c.choices for t in (c.choices[0].model_extra or {}).get("token_ids") or []]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = chunks[-1].usage
    else:
        out = client.chat.completions.create(**kwargs)
        got, text, usage = out.choices[0].model_extra["token_ids"], out.choices[0].message.content, out.usage
    assert got == expected
    assert usage.prompt_tokens == enc["input_ids"].shape[1]
    assert text == tokenizer.decode(expected, skip_special_tokens=True)


def _stop_candidate(text: str) -> tuple[int, str]:
    """A 3-character ASCII-word substring whose first occurrence is at position p >= 3."""
    for p in range(3, len(text) - 3):
        cand = text[p : p + 3]
        if cand.isascii() and cand.strip() and cand.replace(" ", "").isalnum() and text.find(cand) == p:
            return p, cand
    raise AssertionError(f"the tiny model's output has no usable stop string: {text!r}")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_truncates(real_served: Served, include: bool) -> None:
    client = real_served.client()
    base = client.chat.completions.create(model=real_served.model, messages=CHAT, max_tokens=24, temperature=0)
    text = base.choices[0].message.content
    p, stop = _stop_candidate(text)
    out = client.chat.completions.create(
        model=real_served.model,
        messages=CHAT,
        max_tokens=24,
        temperature=0,
        stop=[stop],
        extra_body={"include_stop_str_in_output": include},
    )
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].message.content == text[: p + len(stop) if include else p]


def _record_outcomes(engine: Any, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Spy on engine.generate: request id -> 'finished' or 'closed' (left before finishing)."""
    outcomes: dict[str, str] = {}
    real_generate = engine.generate

    async def generate(request: Any) -> AsyncIterator[Any]:
        finished = False
        try:
            async for out in real_generate(request):
                finished = out.finished
                yield out
        finally:
            outcomes[request.request_id] = "finished" if finished else "closed"

    monkeypatch.setattr(engine, "generate", generate)
    return outcomes


def _stage_totals(engine: Any) -> tuple[int, int]:
    stats = engine.stats()
    assert stats and all({"num_running", "kv_blocks_used"} <= set(s) for s in stats.values()), stats
    return sum(s["num_running"] for s in stats.values()), sum(s["kv_blocks_used"] for s in stats.values())


def test_stream_disconnect_aborts_and_frees_kv(real_served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    outcomes = _record_outcomes(real_served.engine, monkeypatch)
    body = {
        "model": real_served.model,
        "messages": CHAT,
        "max_tokens": 900,
        "ignore_eos": True,
        "stream": True,
    }
    with real_served.http() as http, http.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        seen = 0
        for line in resp.iter_lines():
            seen += line.startswith("data: ")
            if seen == 3:
                running, used = _stage_totals(real_served.engine)
                assert running == 1 and used > 0
                break
    assert wait_for(lambda: _stage_totals(real_served.engine) == (0, 0), 5.0), real_served.engine.stats()
    assert list(outcomes.values()) == ["closed"]
    assert_still_serving(real_served)


def test_non_stream_disconnect_aborts(real_served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    import httpx

    outcomes = _record_outcomes(real_served.engine, monkeypatch)
    body = {"model": real_served.model, "messages": CHAT, "max_tokens": 900, "ignore_eos": True, "n": 4}
    with pytest.raises(httpx.ReadTimeout), real_served.http() as http:
        http.post("/v1/chat/completions", json=body, timeout=0.2)
    assert wait_for(lambda: len(outcomes) == 4, 5.0)
    assert wait_for(lambda: _stage_totals(real_served.engine) == (0, 0), 5.0), real_served.engine.stats()
    assert "closed" in outcomes.values()
    assert_still_serving(real_served)


# ---------------------------------------------------------------- CLI


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "omnistage", *args], capture_output=True, text=True, timeout=timeout)


def test_cli_serve_bad_path_is_one_line_error() -> None:
    proc = _cli("serve", "/nonexistent/model")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "/nonexistent/model" in lines[0], proc.stderr


def test_cli_serve_flags_become_overrides() -> None:
    args = build_parser().parse_args(
        ["serve", "m", "--max-num-seqs", "8", "--enforce-eager", "--dtype", "bfloat16",
         "--set", "stages.*.gpu_memory_utilization=0.5", "--set", "stages.lm.devices=[0, 1]", "--set", "x.y=abc"]
    )  # fmt: skip
    assert serve_overrides(args) == {
        "stages.*.max_num_seqs": 8,
        "stages.*.dtype": "bfloat16",
        "stages.*.enforce_eager": True,
        "stages.*.gpu_memory_utilization": 0.5,
        "stages.lm.devices": [0, 1],
        "x.y": "abc",
    }


def test_bench_serve_against_running_server(real_served: Served) -> None:
    result = run_bench(
        real_served.url, num_prompts=6, concurrency=3, input_len=12, output_len=8, api_key=API_KEY, seed=1
    )
    assert result["completed"] == 6 and result["errors"] == 0, result
    assert result["model"] == real_served.model and result["total_output_tokens"] == 48
    assert result["mean_prompt_tokens"] > 0
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_latency_ms"):
        assert 0 < result[key]["mean"] and result[key]["median"] <= result[key]["p99"]
    assert result["request_throughput"] > 0 and result["output_token_throughput"] > 0
    json.dumps(result)


def test_bench_serve_cli_poisson(real_served: Served) -> None:
    proc = _cli(
        "bench", "serve", "--base-url", real_served.url, "--num-prompts", "4", "--request-rate", "50",
        "--input-len", "8", "--output-len", "4", "--api-key", API_KEY,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["completed"] == 4 and result["request_rate"] == 50.0


def test_bench_counts_errors(real_served: Served) -> None:
    result = run_bench(real_served.url, real_served.model, num_prompts=2, output_len=4, api_key="wrong")
    assert result["completed"] == 0 and result["errors"] == 2 and "401" in result["error_samples"][0]


def test_text_parts_equal_plain_content(real_served: Served) -> None:
    client = real_served.client()
    plain = client.chat.completions.create(model=real_served.model, messages=CHAT, max_tokens=8, temperature=0)
    parts = [{"role": "user", "content": [{"type": "text", "text": CHAT[0]["content"]}]}]
    split = client.chat.completions.create(model=real_served.model, messages=parts, max_tokens=8, temperature=0)
    assert split.choices[0].message.content == plain.choices[0].message.content


@pytest.mark.parametrize("stream", [False, True])
def test_text_ending_mid_character_equals_decode(real_served: Served, hf: tuple[Any, Any], stream: bool) -> None:
    """The tiny model's greedy reply to this prompt stops, at 9 tokens, inside a multi-byte character: the
    held-back bytes come out at the finish as decode spells them (U+FFFD), whole and streamed."""
    tokenizer, _ = hf
    kwargs: dict[str, Any] = dict(model=real_served.model, prompt="Tell me about the river.", max_tokens=9,
                                  temperature=0, extra_body={"return_token_ids": True})
    client = real_served.client()
    if stream:
        chunks = [c for c in client.completions.create(**kwargs, stream=True) if c.choices]
        ids = [t for c in chunks for t in (c.choices[0].model_extra or {}).get("token_ids") or []]
        text = "".join(c.choices[0].text for c in chunks)
    else:
        choice = client.completions.create(**kwargs).choices[0]
        ids, text = choice.model_extra["token_ids"], choice.text
    expected = tokenizer.decode(ids, skip_special_tokens=True)
    assert len(ids) == 9 and expected.endswith("\ufffd")  # else the prompt no longer tests the flush
    assert text == expected
