"""`omnistage bench serve` against real tiny servers: text mode with prompts of --input-len tokens (server or local
tokenizer), audio mode on Qwen2.5-Omni (time to first audio, RTF, stalls), and one-line errors for a refused key
and a server that is not there."""

from __future__ import annotations

import argparse
import json
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from omnistage.bench.serve import add_bench_serve_args, build_prompts, run_bench, stalls
from omnistage.entrypoints.openai.server import BackgroundServer

KEY = "bench-key"


@pytest.fixture(scope="module")
def lm_url(tiny_qwen2: str) -> Iterator[str]:
    from omnistage.entrypoints.async_omni import AsyncOmni

    engine = AsyncOmni.from_model(tiny_qwen2, {"stages": {"*": {"dtype": "float32"}}}, served_model_name="lm")
    with BackgroundServer(engine, api_key=KEY) as server:
        yield server.url
    engine.shutdown()


def _cli(*argv: str) -> int:
    parser = add_bench_serve_args(argparse.ArgumentParser(prog="omnistage bench serve"))
    args = parser.parse_args(list(argv))
    return args.func(args)


def test_text_mode_prompts_have_input_len_tokens(lm_url: str) -> None:
    result = run_bench(lm_url, num_prompts=4, concurrency=2, input_len=10, output_len=4, api_key=KEY, seed=3)
    assert result["completed"] == 4 and result["errors"] == 0, result
    assert result["model"] == "lm" and result["mode"] == "text"
    assert result["input_len_method"] == "server /tokenize" and result["mean_input_tokens"] == 10
    assert result["mean_prompt_tokens"] >= 10 and result["total_output_tokens"] == 16
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_latency_ms"):
        assert 0 < result[key]["mean"] and result[key]["median"] <= result[key]["p99"]
    assert "audio" not in result
    json.dumps(result)


def test_local_tokenizer_counts_tokens(lm_url: str, tiny_qwen2: str) -> None:
    result = run_bench(lm_url, num_prompts=2, input_len=7, output_len=2, api_key=KEY, tokenizer=tiny_qwen2)
    assert result["completed"] == 2
    assert result["input_len_method"] == f"local tokenizer {tiny_qwen2}" and result["mean_input_tokens"] == 7


def test_without_a_tokenizer_prompts_are_words() -> None:
    import asyncio

    prompts, counts = asyncio.run(build_prompts(None, 3, 5, seed=0))
    assert [len(p.split()) for p in prompts] == [5, 5, 5] and counts == []


def test_cli_prints_json_and_reads_openai_api_key(lm_url: str, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("OMNISTAGE_API_KEY", raising=False)
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    assert _cli("--base-url", lm_url, "--num-prompts", "2", "--input-len", "6", "--output-len", "3") == 0
    result = json.loads(capsys.readouterr().out)
    assert result["completed"] == 2 and result["mean_input_tokens"] == 6


@pytest.mark.parametrize(("key", "told"), [(None, "no API key was sent"), ("wrong", "the API key was refused")])
def test_401_is_one_readable_line(lm_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                  key: str | None, told: str) -> None:
    monkeypatch.delenv("OMNISTAGE_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    argv = ["--base-url", lm_url, "--num-prompts", "1", "--model", "lm"] + (["--api-key", key] if key else [])
    assert _cli(*argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    [line] = captured.err.splitlines()
    assert line.startswith("error: ") and "401" in line and told in line and "--api-key" in line


def test_connection_refused_is_one_readable_line(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert _cli("--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "1") == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("error: cannot connect to") and "connection refused" in line


def test_stalls_are_where_playback_runs_dry() -> None:
    chunks = [(0.0, 1.0), (0.5, 1.0), (3.0, 1.0), (3.2, 0.5)]  # played until 2.0, then nothing until 3.0
    assert stalls(chunks) == [1.0]
    assert stalls(chunks, buffer_s=1.0) == []  # starts at 1.0, plays until 3.0: the third chunk is just in time
    assert stalls([]) == [] and stalls([(0.1, 0.2)]) == []


@pytest.fixture(scope="module")
def omni_url(tiny_qwen2_5_omni: str) -> Iterator[str]:
    pytest.importorskip("torchvision", reason="Qwen2.5-Omni's processor needs torchvision")
    from omnistage.entrypoints.async_omni import AsyncOmni

    engine = AsyncOmni.from_model(tiny_qwen2_5_omni, {"stages": {"*": {"max_model_len": 512, "dtype": "float32"},
                                                                 "talker": {"default_sampling_params": {
                                                                     "max_tokens": 12, "temperature": 0}}}},
                                  served_model_name="omni")
    with BackgroundServer(engine) as server:
        yield server.url
    engine.shutdown()


def test_audio_mode(omni_url: str) -> None:
    result: dict[str, Any] = run_bench(omni_url, mode="audio", num_prompts=2, concurrency=2, input_len=8,
                                       output_len=4, return_token_ids=True)
    assert result["completed"] == 2 and result["errors"] == 0, result
    assert result["mode"] == "audio" and result["mean_input_tokens"] == 8
    audio = result["audio"]
    assert audio["total_audio_s"] == pytest.approx(2 * 12 * 2 * 240 / 24000)  # 12 codes each, as the talker is set
    assert 0 < audio["ttfa_ms"]["mean"] <= result["e2e_latency_ms"]["p99"]
    assert audio["rtf"]["mean"] > 0 and audio["audio_throughput"] > 0
    assert audio["stalls"] >= 0 and audio["requests_with_stalls"] <= 2
    json.dumps(result)
