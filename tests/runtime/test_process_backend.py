"""Stage workers in their own processes: the same tokens as HF, replicas that share the load,
a stage killed mid-request that fails only its requests and comes back, start-up errors that
name the stage, and nothing left behind (processes, /dev/shm segments) after shutdown."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from omnistage import Omni, SamplingParams
from omnistage.errors import ConfigError, StageError
from omnistage.types import OmniOutput, OmniRequest

from .two_stage_family import make_two_stage_checkpoint, two_stage_plugin

PROMPTS = ["Hello", "The river ran quietly past the old mill", "Numbers like 1234 appear here.", "Why?"]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def hf_greedy(path: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return [model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(p):].tolist() for p in prompts]


def worker_pids(omni: Omni) -> list[int]:
    return [w.handle.proc.pid for ws in omni.orchestrator.workers.values() for w in ws]


def shm_segments() -> list[Path]:
    return list(Path("/dev/shm").glob(f"omnistage-{os.getpid()}-*"))


def assert_gone(pids: list[int]) -> None:
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert shm_segments() == []


@pytest.fixture(scope="module")
def two_stage_path(tiny_qwen2: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    with two_stage_plugin():
        yield str(make_two_stage_checkpoint(tiny_qwen2, tmp_path_factory.mktemp("two") / "ckpt"))


def test_lm_in_a_process_equals_hf_and_replicas_share_the_load(tiny_qwen2: str) -> None:
    deploy = {"worker_backend": "process", "stages": {"lm": {"max_model_len": 128, "replicas": 2}}}
    with Omni(tiny_qwen2, deploy) as omni:
        prompts = [omni.tokenizer.encode(p) for p in PROMPTS] * 2
        outs = omni.generate(prompts, GREEDY)  # all at once: least-outstanding alternates replicas
        per_replica = omni.orchestrator.replica_stats()["lm"]
        pids = worker_pids(omni)
    assert [o.error for o in outs] == [None] * len(outs)
    assert [o.token_ids for o in outs] == hf_greedy(tiny_qwen2, prompts[:4], 12) * 2
    assert [r["step_outputs"] for r in per_replica] == [4 * 12, 4 * 12], per_replica
    assert all(r["kv_blocks_used"] == 0 and r["outstanding"] == 0 for r in per_replica)
    assert all(r["out_transfers"] > 0 and r["in_bytes"] > 0 for r in per_replica)
    assert_gone(pids)


def test_killed_stage_fails_its_requests_and_restarts(two_stage_path: str) -> None:
    deploy = {"worker_backend": "process", "async_chunk": True, "max_restarts": 1,
              "stages": {"*": {"max_model_len": 512}}}
    long = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)
    short = {"draft": SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
             "refine": SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)}
    omni = Omni(two_stage_path, deploy)
    pids = worker_pids(omni)
    try:
        orch = omni.orchestrator
        done: dict[str, OmniOutput] = {}
        event = threading.Event()

        def sink(out: OmniOutput) -> None:
            if out.finished:
                done[out.request_id] = out
                event.set()

        orch.submit(OmniRequest("victim", prompt="Go on", stage_params={"draft": long, "refine": long}), sink)
        deadline = time.monotonic() + 30
        while orch.replica_stats()["refine"][0].get("num_running", 0) == 0:  # refine is decoding it
            assert time.monotonic() < deadline, orch.replica_stats()
            time.sleep(0.01)
        os.kill(orch.workers["refine"][0].handle.proc.pid, signal.SIGKILL)

        assert event.wait(10), "the request on the killed stage never finished"
        victim = done["victim"]
        assert victim.error_status == 503 and "stage 'refine'" in victim.error and "SIGKILL" in victim.error
        ready, why = orch.health()
        assert not ready and "refine" in why
        assert orch.workers["draft"][0].is_alive()  # the other stage goes on
        stats = orch.replica_stats()["draft"][0]
        assert stats["outstanding"] == 0

        deadline = time.monotonic() + 60  # automatic restart (max_restarts: 1)
        while not orch.health()[0]:
            assert time.monotonic() < deadline, "refine was not restarted"
            time.sleep(0.05)
        assert orch.restarts[("refine", 0)] == 1
        orch.restart_replica("refine", 0)  # and on demand
        pids += worker_pids(omni)
        first, second = omni.generate([[1, 2, 3], [4, 5]], short)
        assert first.error is None and len(first.token_ids) == 5 and second.error is None
    finally:
        omni.shutdown()
    assert_gone(pids)


def test_startup_failure_names_the_stage(tiny_qwen2: str) -> None:
    # the worker process fails while building its engine: a KV cache of one block cannot hold max_model_len
    deploy = {"worker_backend": "process", "startup_timeout_s": 60, "stages": {"lm": {"num_kv_blocks": 1}}}
    before = set(shm_segments())
    with pytest.raises(StageError, match=r"stage 'lm' replica 0 failed to start: its process exited with code 1; "):
        Omni(tiny_qwen2, deploy)
    assert set(shm_segments()) == before


def test_a_device_this_machine_lacks_fails_before_any_worker_starts(tiny_qwen2: str) -> None:
    if torch.cuda.device_count() > 7:
        pytest.skip("this machine has a GPU 7")
    with pytest.raises(ConfigError, match="stage 'lm' is on devices '7'"):
        Omni(tiny_qwen2, {"worker_backend": "process", "stages": {"lm": {"devices": "7"}}})


def test_a_stage_with_no_live_replica_turns_requests_away(tiny_qwen2: str) -> None:
    with Omni(tiny_qwen2, {"worker_backend": "process", "max_restarts": 0}) as omni:
        pids = worker_pids(omni)
        os.kill(pids[0], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while omni.orchestrator.health()[0]:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with pytest.raises(StageError, match="no live replica") as err:
            omni.generate("Hello", GREEDY)
        assert err.value.status == 503
    assert_gone(pids)


@pytest.mark.parametrize(("deploy", "message"), [
    ({"connectors": {"draft->refin": {"type": "shm"}}},
     "connectors.draft->refin: no such edge; did you mean 'draft->refine'?"),
    ({"worker_backend": "process", "connectors": {"*": {"type": "inprocess"}}},
     "connector 'inprocess' cannot link processes"),
])
def test_connector_config_errors(two_stage_path: str, deploy: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        Omni(two_stage_path, deploy)
    assert shm_segments() == []
