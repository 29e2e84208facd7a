"""/metrics' request figures on a real server: token counters equal what the responses report, the latency
histograms count every finished request, the prefix cache's hits show, outcomes are counted by status."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from omnistage.entrypoints.openai.server import BackgroundServer

PROMPT = "The river runs over the stones and the light falls through the wind " * 4


def _samples(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.fixture(scope="module")
def server(tiny_qwen2: str):
    from omnistage.entrypoints.async_omni import AsyncOmni

    engine = AsyncOmni.from_model(tiny_qwen2, {"stages": {"lm": {"dtype": "float32"}}}, served_model_name="m")
    with BackgroundServer(engine) as srv:
        yield srv
    engine.shutdown()


def test_request_metrics(server: BackgroundServer) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    usages = [client.completions.create(model="m", prompt=PROMPT, max_tokens=5, temperature=0).usage
              for _ in range(3)]
    stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                            stream=True, stream_options={"include_usage": True})
    usages.append([c.usage for c in stream if c.usage][0])
    m = _samples(server.url)
    assert m[("omnistage_prompt_tokens_total", ())] == sum(u.prompt_tokens for u in usages)
    assert m[("omnistage_generation_tokens_total", ())] == sum(u.completion_tokens for u in usages)
    assert m[("omnistage_cached_prompt_tokens_total", ())] > 0  # the repeated prompt hit the prefix cache
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "time_per_output_token_seconds"):
        assert m[(f"omnistage_{name}_count", ())] == 4, name
        assert m[(f"omnistage_{name}_bucket", (("le", "+Inf"),))] == 4
    assert m[("omnistage_time_to_first_audio_seconds_count", ())] == 0
    assert m[("omnistage_stage_time_to_first_output_seconds_count", (("stage", "lm"),))] == 4
    assert m[("omnistage_requests_by_status_total", (("status", "ok"),))] == 4
    assert ("omnistage_stage_preemptions_total", (("replica", "0"), ("stage", "lm"))) in m


def test_stats_line_while_busy_quiet_when_idle(tiny_qwen2: str) -> None:
    from omnistage import Omni, SamplingParams
    from omnistage.runtime.metrics import StatsLogger

    with Omni(tiny_qwen2, {"stages": {"lm": {"dtype": "float32"}}}) as omni:
        stats = StatsLogger(omni.orchestrator, interval_s=0)  # not started: lines on demand
        assert stats.line() is None  # idle
        omni.generate(["The river"], SamplingParams(max_tokens=7, temperature=0, ignore_eos=True))
        line = stats.line()
        assert line is not None and "0 in flight" in line and "lm 0 running 0 waiting KV 0%" in line
        assert stats.last_tokens == {"lm": 7}
        assert stats.line() is None  # nothing new since
