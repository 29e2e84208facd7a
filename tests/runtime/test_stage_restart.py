"""A stage that dies is restarted in every backend, the inline one included, up to `max_restarts`, and /health
says so; its callers hear which stage failed, never the exception. Bad requests never kill a stage, so they
never use up a restart (process backend). Against the real HTTP server on a tiny Qwen2."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import httpx

from omnistage.entrypoints.async_omni import AsyncOmni
from omnistage.entrypoints.openai.server import BackgroundServer

sys.path.insert(0, str(Path(__file__).parents[1] / "entrypoints"))
from openai_helpers import CHAT, assert_openai_error, wait_for  # noqa: E402

BODY = {"messages": CHAT, "max_tokens": 4, "temperature": 0, "ignore_eos": True}


def crash_next_step(engine: AsyncOmni) -> None:
    """The live engine's next schedule raises: a bug outside any request's own work, which kills the stage's
    loop (the restarted engine is a new one, without it)."""
    worker = engine.orchestrator.workers["lm"][0]
    scheduler = worker.loop.engine.scheduler

    def broken() -> list:
        raise RuntimeError(f"scheduler bug at {hex(id(scheduler))}")

    scheduler.schedule = broken


def health(http: httpx.Client) -> int:
    return http.get("/health").status_code


def test_inline_stage_death_is_restarted_and_health_recovers(tiny_qwen2: str) -> None:
    engine = AsyncOmni.from_model(tiny_qwen2, {"worker_backend": "inline", "max_restarts": 1,
                                              "stages": {"*": {"dtype": "float32"}}})
    try:
        with BackgroundServer(engine) as server, httpx.Client(base_url=server.url, timeout=60) as http:
            expected = http.post("/v1/chat/completions", json=BODY).json()["choices"][0]["message"]["content"]
            crash_next_step(engine)
            err = assert_openai_error(http.post("/v1/chat/completions", json=BODY), 500, "stage 'lm'")
            assert "0x" not in err["message"] and "RuntimeError" not in err["message"], err
            assert "server log" in err["message"]
            assert wait_for(lambda: health(http) == 200 and engine.orchestrator.restarts[("lm", 0)] == 1, 30)
            assert 'omnistage_stage_restarts_total{replica="0",stage="lm"} 1.0' in http.get("/metrics").text
            assert not engine.orchestrator.requests and engine.orchestrator.load["lm"] == [0]
            again = http.post("/v1/chat/completions", json=BODY)
            assert again.status_code == 200 and again.json()["choices"][0]["message"]["content"] == expected

            crash_next_step(engine)  # max_restarts is used up: it stays down, and /health says so
            assert_openai_error(http.post("/v1/chat/completions", json=BODY), 500, "stage 'lm'")
            time.sleep(0.5)
            assert health(http) == 503 and engine.orchestrator.restarts[("lm", 0)] == 1
            assert_openai_error(http.post("/v1/chat/completions", json=BODY), 503, "no live replica")
    finally:
        engine.shutdown()


def test_bad_requests_use_up_no_restart_in_the_process_backend(tiny_qwen2: str) -> None:
    engine = AsyncOmni.from_model(tiny_qwen2, {"worker_backend": "process", "max_restarts": 1,
                                               "stages": {"*": {"dtype": "float32"}}})
    try:
        with BackgroundServer(engine) as server, httpx.Client(base_url=server.url, timeout=60) as http:
            for entry in ({"stop_token_ids": 5}, {"stop": [["a"]]}, {"bad_token_ids": [1000000]},
                          {"logprobs": 2.5}, {"stop_token_ids": [512], "min_tokens": 2}):
                resp = http.post("/v1/chat/completions", json={**BODY, "sampling_params_list": [entry]})
                assert_openai_error(resp, 400, "sampling_params_list[0].")
            assert health(http) == 200 and engine.orchestrator.restarts[("lm", 0)] == 0
            assert http.post("/v1/chat/completions", json=BODY).status_code == 200
    finally:
        engine.shutdown()
