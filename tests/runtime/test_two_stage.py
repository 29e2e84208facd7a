"""The stage graph end to end: a two-stage pipeline gives the same tokens as running its two
models one after the other in HF, streamed between stages or not, and abort reaches both;
with every stage in this process (inline) and with each stage in its own process."""

from __future__ import annotations

import asyncio
import contextlib
import gc

import pytest
import torch
from transformers import AutoModelForCausalLM

from omnistage import AsyncOmni, Omni, SamplingParams
from omnistage.types import OmniRequest

from .two_stage_family import make_two_stage_checkpoint, two_stage_plugin

PROMPTS = ["Tell me a story", "The number seven", "Blue"]
BACKENDS = ["inline", "process"]


@pytest.fixture(scope="module")
def two_stage_path(tiny_qwen2: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    with two_stage_plugin():
        yield str(make_two_stage_checkpoint(tiny_qwen2, tmp_path_factory.mktemp("two") / "ckpt"))


def hf_chain(path: str, prompts: list[list[int]], draft_len: int, refine_len: int) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)

    def greedy(ids: list[int], n: int) -> list[int]:
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
        return out[0, len(ids):].tolist()

    return [greedy(greedy(p, draft_len), refine_len) for p in prompts]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("async_chunk", [False, True])
def test_two_stages_equal_hf_chain(two_stage_path: str, async_chunk: bool, backend: str) -> None:
    deploy = {"worker_backend": backend, "async_chunk": async_chunk,
              "stages": {"*": {"max_model_len": 128, "block_size": 4}}}
    stage_params = {
        "draft": SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
        "refine": SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
    }
    with Omni(two_stage_path, deploy) as omni:
        prompts = [omni.tokenizer.encode(p) for p in PROMPTS]
        results = omni.generate(prompts, stage_params)
        stats = omni.stats()
    assert [r.error for r in results] == [None] * 3
    assert [r.token_ids for r in results] == hf_chain(two_stage_path, prompts, 10, 6)
    assert all(s["kv_blocks_used"] == 0 for s in stats.values())


@pytest.mark.parametrize("backend", BACKENDS)
def test_abort_reaches_every_stage(two_stage_path: str, backend: str) -> None:
    deploy = {"worker_backend": backend, "async_chunk": True, "stages": {"*": {"max_model_len": 512}}}
    engine = AsyncOmni(two_stage_path, deploy)
    try:
        long = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
        request = OmniRequest(request_id="long", prompt="Go on and on", stage_params={"draft": long, "refine": long})

        async def consume_a_little() -> None:
            # refine emits nothing until the draft finishes; wait until both stages hold blocks
            agen = engine.generate(request)
            task = asyncio.ensure_future(agen.__anext__())
            for _ in range(200):
                await asyncio.sleep(0.02)
                stats = engine.stats()
                if stats["draft"]["kv_blocks_used"] and stats["refine"]["kv_blocks_used"]:
                    break
            assert stats["refine"]["kv_blocks_used"] > 0, stats
            task.cancel()  # what a client disconnect does to the server's consumer
            with contextlib.suppress(asyncio.CancelledError):
                await task

        asyncio.run(consume_a_little())
        for _ in range(100):
            stats = engine.stats()
            if all(s["kv_blocks_used"] == 0 and s["num_running"] == 0 for s in stats.values()):
                break
            asyncio.run(asyncio.sleep(0.05))
        assert all(s["kv_blocks_used"] == 0 and s["num_running"] == 0 for s in stats.values()), stats
    finally:
        engine.shutdown()


def test_one_steps_sends_reach_a_stage_together(two_stage_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The draft's outputs of one step (three requests) reach refine in one hand-over, results unchanged; an
    input still waiting in that hand-over when its request fails is dropped rather than sent after the abort."""
    from omnistage.runtime.orchestrator import _RequestState
    from omnistage.runtime.worker import AddChunk, AddRequest
    from omnistage.types import StageInput

    deploy = {"worker_backend": "inline", "async_chunk": True, "stages": {"*": {"max_model_len": 128}}}
    stage_params = {"draft": SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
                    "refine": SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)}
    with Omni(two_stage_path, deploy) as omni:
        orchestrator = omni.orchestrator
        refine = orchestrator.workers["refine"][0]
        batches: list[int] = []
        add_many = refine.add_many
        monkeypatch.setattr(refine, "add_many", lambda commands: (batches.append(len(commands)), add_many(commands)))
        prompts = [omni.tokenizer.encode(p) for p in PROMPTS]
        results = omni.generate(prompts, stage_params)
        assert [r.token_ids for r in results] == hf_chain(two_stage_path, prompts, 10, 6)
        assert max(batches) == 3 and len(batches) < sum(batches), batches  # hand-overs < inputs handed over

        kept, dropped = StageInput("kept"), StageInput("dropped")
        state = _RequestState(OmniRequest(request_id="dropped", prompt="x"), sink=lambda out: None, stages=[],
                              pending_outputs=set())
        orchestrator._outbox = {refine: [AddRequest(kept), AddRequest(dropped), AddChunk("dropped", dropped)]}
        orchestrator._release(state, abort=True)
        assert orchestrator._outbox[refine] == [AddRequest(kept)]
        orchestrator._outbox = None


def test_a_stage_refusing_a_hand_over_fails_those_requests_only(two_stage_path: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from omnistage.errors import StageError

    deploy = {"worker_backend": "inline", "async_chunk": True, "stages": {"*": {"max_model_len": 128}}}
    stage_params = {"draft": SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
                    "refine": SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)}
    with Omni(two_stage_path, deploy) as omni:
        refine = omni.orchestrator.workers["refine"][0]
        add_many, refused = refine.add_many, []

        def refuse_first(commands: list) -> None:
            if not refused:
                refused.append(commands)
                raise StageError("refine is full", status=503)
            add_many(commands)

        monkeypatch.setattr(refine, "add_many", refuse_first)
        prompts = [omni.tokenizer.encode(p) for p in PROMPTS]
        results = omni.generate(prompts, stage_params)
        failed = [r for r in results if r.error]
        assert len(failed) == len(refused[0]) and all("refine is full" in r.error for r in failed)
        expected = hf_chain(two_stage_path, prompts, 10, 6)
        assert all(r.token_ids == e for r, e in zip(results, expected, strict=True) if not r.error)
        monkeypatch.setattr(refine, "add_many", add_many)
        again = omni.generate(prompts[:1], stage_params)
        assert again[0].error is None and again[0].token_ids == hf_chain(two_stage_path, prompts[:1], 10, 6)[0]
        assert all(s["num_running"] == 0 for s in omni.stats().values())


def test_start_up_objects_leave_the_collectors_scans(two_stage_path: str) -> None:
    """Once every stage is ready, what start-up made (models, tokenizers, engines) is frozen out of the cyclic
    collector's scans: a full collection while serving, which holds every stage's thread, then does not walk
    them. Inline, so the engine is an object of this process (a GPU machine's default backend is a process
    per stage)."""
    gc.unfreeze()
    try:
        deploy = {"worker_backend": "inline", "stages": {"*": {"max_model_len": 128, "block_size": 4}}}
        with Omni(two_stage_path, deploy) as omni:
            engine = omni.orchestrator.workers["draft"][0].loop.engine
            assert gc.get_freeze_count() > 0
            assert not any(obj is engine for obj in gc.get_objects())  # no longer among the scanned
    finally:
        gc.unfreeze()
