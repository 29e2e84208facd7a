"""Qwen2.5-Omni (tiny, real server): a bad talker entry of `sampling_params_list` is a 400 naming its path and
never reaches (or kills) the talker; a misspelled stage in the Python API's per-stage params is a 400 listing
the real stages; an aborted speech request frees every stage's state within a second, whenever it is aborted."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from omnistage.entrypoints.openai.server import BackgroundServer
from omnistage.errors import RequestError
from omnistage.sampling_params import SamplingParams
from omnistage.types import OmniRequest

sys.path.insert(0, str(Path(__file__).parents[1] / "entrypoints"))
from openai_helpers import assert_openai_error  # noqa: E402

pytest.importorskip("torchvision", reason="Qwen2.5-Omni's processor needs torchvision (installed by scripts/test)")

SPEECH = {"messages": [{"role": "user", "content": "Hi there!"}], "modalities": ["text", "audio"],
          "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def omni(tiny_qwen2_5_omni: str) -> Iterator[tuple[Any, httpx.Client]]:
    from omnistage.entrypoints.async_omni import AsyncOmni

    engine = AsyncOmni.from_model(tiny_qwen2_5_omni, {"stages": {
        # on the CPU even beside a GPU: the disconnect test needs a reply that takes longer than its client waits
        "*": {"max_model_len": 512, "dtype": "float32", "devices": "cpu"},
        "talker": {"default_sampling_params": {"max_tokens": 300, "temperature": 0}}}}, served_model_name="omni")
    with BackgroundServer(engine) as server, httpx.Client(base_url=server.url, timeout=120) as http:
        yield engine, http
    engine.shutdown()


def speaks(http: httpx.Client) -> None:
    out = http.post("/v1/chat/completions", json={**SPEECH, "max_tokens": 3, "sampling_params_list": [{}, {
        "max_tokens": 6}]})
    assert out.status_code == 200, out.text
    assert out.json()["choices"][0]["message"]["audio"]["data"]


def unharmed(engine: Any, http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    assert not any(engine.orchestrator.restarts.values())
    speaks(http)


@pytest.mark.parametrize(("entries", "param", "why"), [
    ([{}, {"stop_token_ids": 5}], "sampling_params_list[1].stop_token_ids", "must be a list of integer token ids"),
    ([{}, {"stop_token_ids": None, "skip_special_tokens": 0}], "sampling_params_list[1].skip_special_tokens",
     "must be true or false"),
    ([{}, {"bad_token_ids": [10**6]}], "sampling_params_list[1].bad_token_ids", "token ids must be in [0, "),
    ([{}, {}, {"seed": 2**64}], "sampling_params_list[2].seed", "must be in"),
    ([{"logprobs": 2.5}], "sampling_params_list[0].logprobs", "must be an integer or null"),
])
def test_bad_stage_entries_are_refused_and_the_talker_lives(omni, entries: list, param: str, why: str) -> None:
    engine, http = omni
    resp = http.post("/v1/chat/completions", json={**SPEECH, "max_tokens": 3, "sampling_params_list": entries})
    err = assert_openai_error(resp, 400, why)
    assert err["param"] == param and err["message"].startswith(f"{param}: "), err
    unharmed(engine, http)


def test_a_misspelled_stage_in_the_python_api_is_an_error(omni) -> None:
    engine, http = omni
    request = OmniRequest("api", messages=[{"role": "user", "content": "Hi"}], output_modalities=("text", "audio"),
                          stage_params={"talkr": SamplingParams(max_tokens=3)})
    with pytest.raises(RequestError) as info:
        engine.orchestrator.submit(request, lambda out: None)
    assert info.value.status == 400
    assert "no stage 'talkr'" in info.value.message and "thinker, talker, token2wav" in info.value.message
    assert "did you mean 'talker'?" in info.value.message
    assert not engine.orchestrator.requests


def freed(engine: Any) -> bool:
    """No stage holds anything of any request: the orchestrator, every engine's stats, and the engines' own
    tables (sequences, KV blocks, token2wav's requests and launched windows)."""
    orch = engine.orchestrator
    if orch.requests or any(any(loads) for loads in orch.load.values()):
        return False
    for stats in engine.stats().values():
        if any(stats.get(k, 0) for k in ("num_running", "num_waiting", "kv_blocks_used", "num_in_flight")):
            return False
    for workers in orch.workers.values():
        e = workers[0].loop.engine
        if getattr(e, "seqs", None) or getattr(e, "requests", None) or getattr(e, "launched", None):
            return False
        if hasattr(e, "block_manager") and e.block_manager.num_used:
            return False
        if workers[0].inflight.ids:
            return False
    return True


def seconds_to_free(engine: Any) -> float:
    start = time.monotonic()
    while not freed(engine):
        assert time.monotonic() - start < 5, engine.stats()
        time.sleep(0.01)
    return time.monotonic() - start


@pytest.mark.parametrize("events", [1, 4, 40, 150])
def test_an_aborted_speech_request_frees_every_stage_within_a_second(omni, events: int) -> None:
    """Closed after `events` stream events: while the thinker writes, once the talker speaks, deep into the
    audio."""
    engine, http = omni
    seen = 0
    with http.stream("POST", "/v1/chat/completions", json={**SPEECH, "max_tokens": 200, "stream": True}) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            seen += line.startswith("data: ")
            if seen >= events:
                break
    assert seen == events
    assert seconds_to_free(engine) < 1.0
    speaks(http)


def test_a_disconnected_speech_request_frees_every_stage_within_a_second(omni) -> None:
    engine, http = omni
    with pytest.raises(httpx.ReadTimeout):
        http.post("/v1/chat/completions", json={**SPEECH, "max_tokens": 200}, timeout=0.5)
    assert seconds_to_free(engine) < 1.0
    speaks(http)
