"""Mutated requests against real servers on tiny checkpoints (a causal LM: chat, completions, embeddings, tokenize,
detokenize; Qwen2.5-Omni: chat and completions with speech), sent concurrently so
bad requests share engine batches with good ones. Asserted: no 5xx but declared stage failures, no hang, the
server still answers a valid request exactly as before, and its memory stays bounded.

The count is bounded for CI; `--fuzz-requests N` runs a longer fuzz (e.g. 20000).
"""

from __future__ import annotations

import collections
import concurrent.futures
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from fuzz import Call, Mutator

from omnistage.entrypoints.openai.server import BackgroundServer

API_KEY = "fuzz-key"
REQUEST_TIMEOUT_S = 60.0  # far beyond any tiny request: hitting it is a hang
RSS_GROWTH_LIMIT = 1 << 30
# A 5xx the server may answer: a stage failing one request, said without internals. Anything else is a defect.
DECLARED_FAILURE = re.compile(r"stage '\w+'")
PROBE = {"messages": [{"role": "user", "content": "Tell me about the river."}], "max_tokens": 5, "temperature": 0}


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _send(client: httpx.Client, call: Call) -> tuple[int, str]:
    headers = {"Content-Type": call.content_type}
    if call.stream:
        with client.stream(call.method, call.path, content=call.body, headers=headers) as resp:
            text = "".join(resp.iter_text())
            return resp.status_code, text
    resp = client.request(call.method, call.path, content=call.body, headers=headers)
    return resp.status_code, resp.text


def _in_band_errors(text: str) -> list[str]:
    """Error events inside a 200 event stream."""
    return [line for line in text.splitlines() if line.startswith("data: {\"error\"")]


def fuzz(url: str, model: str, count: int, seed: int, stages: int, audio: bool) -> dict[str, Any]:
    mutator = Mutator(seed, model, stages, audio, endpoints=not audio)
    calls = [mutator.call() for _ in range(count)]
    statuses: collections.Counter[int] = collections.Counter()
    defects: list[str] = []
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=url, headers=headers, timeout=REQUEST_TIMEOUT_S) as client:

        def one(i: int) -> None:
            call = calls[i]
            try:
                status, text = _send(client, call)
            except httpx.TimeoutException:
                defects.append(f"#{i} hung: {call.path} {call.body[:300]!r}")
                return
            statuses[status] += 1
            declared = status >= 500 and DECLARED_FAILURE.search(text) and "Error" not in text
            if status >= 500 and not declared:
                defects.append(f"#{i} {status}: {call.path} {call.body[:300]!r} -> {text[:300]}")
            for event in _in_band_errors(text) if status == 200 else []:
                if '"internal_error"' in event and not DECLARED_FAILURE.search(event):
                    defects.append(f"#{i} in-band: {call.body[:300]!r} -> {event[:300]}")

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(one, range(count)))
    return {"statuses": dict(statuses), "defects": defects}


def _probe(url: str, model: str) -> dict[str, Any]:
    resp = httpx.post(f"{url}/v1/chat/completions", json={"model": model, **PROBE}, timeout=REQUEST_TIMEOUT_S,
                      headers={"Authorization": f"Bearer {API_KEY}"})
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["message"]


def _run(engine: Any, model: str, count: int, seed: int, stages: int, audio: bool) -> None:
    with BackgroundServer(engine, api_key=API_KEY) as server:
        before, rss_before = _probe(server.url, model), _rss()
        result = fuzz(server.url, model, count, seed, stages, audio)
        assert not result["defects"], "\n".join(result["defects"][:20])
        assert sum(result["statuses"].values()) == count
        assert result["statuses"].get(200, 0) > count // 20, result["statuses"]  # some mutations stay valid
        assert _probe(server.url, model) == before
        health = httpx.get(f"{server.url}/health", timeout=10)
        assert health.status_code == 200, health.text
        assert _rss() - rss_before < RSS_GROWTH_LIMIT


def test_fuzz_causal_lm(tiny_qwen2: str, fuzz_requests: int) -> None:
    from omnistage.entrypoints.async_omni import AsyncOmni

    engine = AsyncOmni.from_model(tiny_qwen2, {"stages": {"lm": {"max_model_len": 128, "dtype": "float32"}}},
                                  served_model_name="tiny")
    try:
        _run(engine, "tiny", fuzz_requests, seed=1, stages=1, audio=False)
    finally:
        engine.shutdown()


def test_fuzz_qwen2_5_omni(tiny_qwen2_5_omni: str, fuzz_requests: int) -> None:
    pytest.importorskip("torchvision", reason="Qwen2.5-Omni's processor needs torchvision (installed by scripts/test)")
    from omnistage.entrypoints.async_omni import AsyncOmni

    deploy = {"stages": {"*": {"max_model_len": 256, "dtype": "float32"},
                         "talker": {"default_sampling_params": {"max_tokens": 16, "temperature": 0}}}}
    engine = AsyncOmni.from_model(tiny_qwen2_5_omni, deploy, served_model_name="omni")
    try:
        _run(engine, "omni", max(200, fuzz_requests // 4), seed=2, stages=3, audio=True)
    finally:
        engine.shutdown()
