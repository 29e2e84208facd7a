"""Tensor parallelism on the CPU (gloo, 2 processes): a stage with `tensor_parallel_size: 2` gives TP=1's greedy
tokens, each rank holds only its shard, and bad settings fail with messages that name the field."""

from __future__ import annotations

import time
from pathlib import Path

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from omnistage import Omni, SamplingParams
from omnistage.config.deploy import Advanced, load_deploy_config
from omnistage.errors import ConfigError
from omnistage.families import hf, tensor_parallel
from omnistage.testing import tiny_checkpoint
from omnistage.testing.factory import make_tiny_causal_lm

TEXTS = ["Hello", "The river ran quietly past the old mill, and nobody in the village noticed", "Why?",
         "A longer prompt that spans several KV blocks, so that the ranks' caches are paged the same way."]
PARAMS = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def deploy(tp: int, **stage: object) -> dict:
    return {"stages": {"lm": {"max_model_len": 128, "dtype": "float32", "devices": "cpu",
                              "tensor_parallel_size": tp, "block_size": 4} | stage}}


def greedy(path: str, tp: int, stats: dict | None = None, **stage: object) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(path)
    with Omni(path, deploy(tp, **stage)) as omni:
        outs = omni.generate([tok.encode(t) for t in TEXTS], PARAMS)
        (stats if stats is not None else {}).update(omni.stats()["lm"])
    assert [o.error for o in outs] == [None] * len(TEXTS)
    return [o.token_ids for o in outs]


# qwen2: tied embeddings and q/k/v biases; llama: an untied LM head; qwen3: per-head q/k norms
# qwen3_moe: every rank a slice of every expert, the sparse blocks' outputs all-reduced
@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3", "qwen3_moe"])
def test_tp2_gives_tp1_greedy_tokens(arch: str) -> None:
    path = str(tiny_checkpoint(arch))
    expected = greedy(path, 1)
    assert greedy(path, 2) == expected


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL between two GPUs")
@pytest.mark.parametrize("arch", ["qwen2", "qwen3_moe"])
def test_tp2_over_nccl_gives_one_gpus_greedy_tokens(arch: str) -> None:
    """The same on two GPUs (NCCL; the MoE on the fused kernels), against one GPU's fused decoder and graphs."""
    path = str(tiny_checkpoint(arch))
    assert greedy(path, 2, devices="0,1") == greedy(path, 1, devices="0")


def test_a_vocabulary_that_does_not_split_evenly(tmp_path: Path) -> None:
    """515 rows: rank 1's slice of the embedding and the head is padded, and the padded logits are cut off."""
    path = str(make_tiny_causal_lm(tmp_path / "odd", "qwen2", vocab_size=515))
    assert greedy(path, 2) == greedy(path, 1)


def test_tp2_with_chunked_prefill_and_bursts(tiny_qwen2: str) -> None:
    """Small chunks and decode bursts: several forwards (and logits calls) per engine step on every rank."""
    stage = {"max_num_batched_tokens": 16, "advanced": {"decode_burst": 4}}
    stats: dict = {}
    assert greedy(tiny_qwen2, 2, stats, **stage) == greedy(tiny_qwen2, 1, **stage)
    assert stats["num_burst_steps"] > 0 and stats["num_overlapped_steps"] > 0


def test_each_rank_holds_its_shard(tiny_qwen2: str) -> None:
    model = tensor_parallel.launch_causal_lm(tiny_qwen2, "float32", "cpu", 2, "tp")
    procs = [proc for proc, _ in model.followers]
    try:
        full, config = hf.load_causal_lm(Path(tiny_qwen2), "float32", torch.device("cpu"))
        local = model.local.model
        attn, full_attn = local.model.layers[0].self_attn, full.model.layers[0].self_attn
        assert attn.q_proj.weight.shape[0] * 2 == full_attn.q_proj.weight.shape[0]
        assert attn.o_proj.weight.shape[1] * 2 == full_attn.o_proj.weight.shape[1]
        assert model.kv_spec.num_kv_heads * 2 == config.num_key_value_heads
        torch.testing.assert_close(attn.k_proj.weight, full_attn.k_proj.weight[: attn.k_proj.weight.shape[0]])
        full_bytes = sum(p.numel() * 4 for p in full.parameters())
        assert model.weight_bytes < 0.6 * full_bytes
    finally:
        model.close()
    assert [proc.exitcode for proc in procs] == [0]  # left its loop on `stop`


def test_served_over_http(tiny_qwen2: str) -> None:
    from omnistage.entrypoints.async_omni import AsyncOmni
    from omnistage.entrypoints.openai.server import BackgroundServer

    with Omni(tiny_qwen2, deploy(1)) as omni:
        expected = [o.text for o in omni.generate(TEXTS[:2], PARAMS)]
    engine = AsyncOmni.from_model(tiny_qwen2, deploy(2), served_model_name="tiny")
    try:
        with BackgroundServer(engine, api_key="k") as server:
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="k", max_retries=0)
            got = [client.completions.create(model="tiny", prompt=t, max_tokens=16, temperature=0,
                                             extra_body={"ignore_eos": True}).choices[0].text for t in TEXTS[:2]]
            embedding = torch.tensor(client.embeddings.create(model="tiny", input=TEXTS[1]).data[0].embedding)
    finally:
        engine.shutdown()
    assert got == expected
    # /v1/embeddings (the final hidden state of the prompt's last token, unit length) against transformers
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(tiny_qwen2).encode(TEXTS[1])
    with torch.no_grad():
        last = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0, -1]
    torch.testing.assert_close(embedding, torch.nn.functional.normalize(last, dim=-1), atol=1e-4, rtol=1e-4)


def test_a_dead_follower_fails_requests_and_the_stage_restarts(tiny_qwen2: str, caplog) -> None:
    with Omni(tiny_qwen2, deploy(2)) as omni:
        expected = omni.generate(TEXTS[:1], PARAMS)[0].token_ids
        proc = omni_model(omni).followers[0][0]
        proc.kill()
        proc.join()
        started = time.monotonic()
        failed = omni.generate(TEXTS[:1], PARAMS)[0]
        assert failed.error is not None and time.monotonic() - started < 30
        assert wait_for(lambda: omni.orchestrator.health()[0], 60), "the stage was not restarted"
        assert omni.generate(TEXTS[:1], PARAMS)[0].token_ids == expected  # a fresh group
        assert omni_model(omni).followers[0][0] is not proc
    assert "tensor-parallel rank 1 exited" in caplog.text


def wait_for(check, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.2)
    return False


def omni_model(omni: Omni):
    """The stage's TPModel (inline backend: the engine lives in this process)."""
    workers = omni.orchestrator.workers["lm"]
    return workers[0].loop.engine.runner.model


def test_more_ranks_than_devices_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"stages\.lm.*tensor_parallel_size 2 needs that many devices.*'0'"):
        load_deploy_config({"stages": {"lm": {"tensor_parallel_size": 2, "devices": "0"}}})


def test_ranks_that_do_not_divide_the_heads_are_a_config_error(tiny_qwen2: str) -> None:
    with pytest.raises(ConfigError, match=r"stages\.lm\.tensor_parallel_size: 3 does not divide the model's 4 "
                       r"attention heads"):
        Omni(tiny_qwen2, deploy(3))


def test_a_stage_that_is_not_autoregressive_refuses_ranks() -> None:
    config = load_deploy_config({"stages": {"dit": {"tensor_parallel_size": 2, "devices": "cpu"}}})
    with pytest.raises(ConfigError, match=r"stages\.dit\.tensor_parallel_size: this stage is not autoregressive"):
        config.check_stages({"dit": Advanced})
