"""Greedy tokens through omnistage equal HF transformers `generate`, for every engine feature
that must not change outputs: batching, prefix caching, chunked prefill, preemption, decode bursts, prompt
graphs."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from omnistage import Omni, SamplingParams

TEXTS = [
    "Hello",
    "The river ran quietly past the old mill, and nobody in the village noticed",
    "Numbers like 1234 and 5678 appear here.",
    "A longer prompt that keeps going so that it spans several KV blocks and several prefill chunks, "
    "which is exactly what the engine has to get right when it packs sequences together.",
    "Short one",
    "Why?",
]
MAX_NEW = 24

SETTINGS = {
    "default": {},
    "no_prefix_cache": {"enable_prefix_caching": False},
    "small_chunks": {"max_num_batched_tokens": 16, "block_size": 4},
    "no_chunked_prefill": {"enable_chunked_prefill": False, "max_num_batched_tokens": 16},
    "preemption": {"num_kv_blocks": 36, "block_size": 4, "max_num_batched_tokens": 32},
    "one_seq_at_a_time": {"max_num_seqs": 1},
    "no_overlap": {"advanced": {"overlap_decode": False}},
    "bursts": {"advanced": {"decode_burst": 4}},
    "bursts_preemption": {"advanced": {"decode_burst": 5}, "num_kv_blocks": 36, "block_size": 4,
                          "max_num_batched_tokens": 32},
    "eager_prompts": {"advanced": {"prompt_graph_tokens": 0}},
}


class Greedy(list):
    """HF's greedy tokens per prompt (a list of lists), with each step's logits kept for failure messages."""

    logits: list[torch.Tensor]  # per prompt, [steps, vocab]


def hf_greedy(path: str, prompts: list[list[int]], max_new: int, stop_at_eos: bool) -> Greedy:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    outs = Greedy()
    outs.logits = []
    for ids in prompts:
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=max_new, do_sample=False,
            eos_token_id=eos if stop_at_eos else None, pad_token_id=0, output_logits=True,
            return_dict_in_generate=True,
        )
        gen = out.sequences[0, len(ids):].tolist()
        if stop_at_eos and eos in gen:
            gen = gen[: gen.index(eos) + 1]
        outs.append(gen)
        outs.logits.append(torch.cat(out.logits)[: len(gen)])
    return outs


def assert_same_tokens(got: list[list[int]], expected: Greedy) -> None:
    """Token for token; on a mismatch the message names each prompt's first differing step and how far apart
    HF's logits put the two tokens there (a near-tie is a numerics question, a wide gap a bug)."""
    if got == expected:
        return
    lines = []
    for n, (ours, theirs, logits) in enumerate(zip(got, expected, expected.logits, strict=True)):
        step = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), None)
        if step is None:
            if len(ours) != len(theirs):
                lines.append(f"prompt {n}: {len(ours)} tokens against HF's {len(theirs)}")
            continue
        row = logits[step]
        lines.append(f"prompt {n}, step {step}: token {ours[step]} against HF's {theirs[step]}, HF's logits "
                     f"{row[ours[step]].item():.5f} and {row[theirs[step]].item():.5f} (margin "
                     f"{(row[theirs[step]] - row[ours[step]]).item():.2e})")
    raise AssertionError("greedy tokens differ from HF's:\n" + "\n".join(lines))


@pytest.fixture(scope="module")
def hf_reference(request):
    cache: dict = {}

    def get(path: str, stop_at_eos: bool = False) -> tuple[list[list[int]], list[list[int]]]:
        key = (path, stop_at_eos)
        if key not in cache:
            tok = AutoTokenizer.from_pretrained(path)
            prompts = [tok.encode(t) for t in TEXTS]
            cache[key] = prompts, hf_greedy(path, prompts, MAX_NEW, stop_at_eos)
        return cache[key]

    return get


def deploy(**stage: object) -> dict:
    return {"stages": {"lm": {"max_model_len": 128, "dtype": "float32"} | stage}}  # as HF runs (GPUs: bf16)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_matches_hf(tiny_lm: str, hf_reference, setting: str) -> None:
    prompts, expected = hf_reference(tiny_lm)
    with Omni(tiny_lm, deploy(**SETTINGS[setting])) as omni:
        outs = omni.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True))
        stats = omni.stats()["lm"]
    assert [o.error for o in outs] == [None] * len(outs)
    assert_same_tokens([o.token_ids for o in outs], expected)
    assert all(o.finish_reason == "length" for o in outs)
    if "preemption" in setting:
        assert stats["num_preemptions"] > 0, "the setting was meant to force preemption"
    assert (stats["num_burst_steps"] > 0) == ("bursts" in setting)
    assert (stats["num_overlapped_steps"] > 0) == (setting != "no_overlap")
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0


@pytest.mark.parametrize("burst", [1, 4])
def test_stops_at_eos_like_hf(tiny_qwen2: str, hf_reference, burst: int) -> None:
    prompts, expected = hf_reference(tiny_qwen2, stop_at_eos=True)
    with Omni(tiny_qwen2, deploy(advanced={"decode_burst": burst})) as omni:
        outs = omni.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0))
    assert_same_tokens([o.token_ids for o in outs], expected)


def test_prefix_cache_hits_keep_outputs(tiny_qwen2: str) -> None:
    shared = TEXTS[3]
    prompts = [shared + " first", shared + " second ending", shared]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    with Omni(tiny_qwen2, deploy(enable_prefix_caching=False)) as omni:
        plain = omni.generate(prompts, params)
    with Omni(tiny_qwen2, deploy(block_size=4)) as omni:
        omni.generate(prompts[:1], params)  # warms the cache
        cached = omni.generate(prompts, params)
    assert [o.error for o in cached + plain] == [None] * 6
    assert [o.token_ids for o in cached] == [o.token_ids for o in plain]
    assert all(o.num_cached_tokens >= 40 for o in cached), [o.num_cached_tokens for o in cached]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="prompt graphs are CUDA graphs")
@pytest.mark.parametrize("setting", ["whole", "chunks", "cached_prefix"])
def test_prompt_graphs_keep_outputs(tiny_lm: str, hf_reference, setting: str) -> None:
    """One sequence's prompt steps replay a graph padded to the next token bucket (whole prompts; 16-token
    chunks, the skinny-GEMM path; a remainder after a cached prefix): HF's greedy tokens all the same."""
    prompts, expected = hf_reference(tiny_lm)
    stage = {"max_num_seqs": 1} | ({"max_num_batched_tokens": 16} if setting == "chunks" else {})
    with Omni(tiny_lm, deploy(**stage, block_size=4)) as omni:
        if setting == "cached_prefix":
            omni.generate([prompts[3][:20]], SamplingParams(max_tokens=1, temperature=0))
        outs = omni.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True))
        stats = omni.stats()["lm"]
    assert_same_tokens([o.token_ids for o in outs], expected)
    assert stats["num_prompt_graph_steps"] >= len(prompts)
    if setting == "cached_prefix":
        assert outs[3].num_cached_tokens >= 16


def test_chat_messages_use_the_chat_template(tiny_qwen2: str) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_qwen2)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    expected = hf_greedy(tiny_qwen2, [list(ids)], 12, stop_at_eos=False)[0]  # (a plain list)
    with Omni(tiny_qwen2, deploy()) as omni:
        (out,) = omni.generate([messages], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert out.token_ids == expected
    assert out.num_prompt_tokens == len(ids)
    assert out.text == tok.decode(expected, skip_special_tokens=True)


def test_fused_decoder_serves_llama_style_checkpoints(tiny_lm: str) -> None:
    """The parity tests above run through the fused forward: make sure it is the one in use."""
    from omnistage.families.causal_lm import causal_lm_model

    model = AutoModelForCausalLM.from_pretrained(tiny_lm, dtype=torch.float32)
    assert causal_lm_model(model, model.config).fast_forward is not None


def test_greedy_matches_hf_through_the_triton_kernels(tiny_lm: str, hf_reference, monkeypatch) -> None:
    """The fused decoder's Triton path (skinny GEMMs with split-K partials summed in add+RMSNorm, SiLU-mul in the
    gate-up kernel, rotary and KV write in the QKV GEMM's kernel), forced on (on CPU: Triton's interpreter):
    decode steps and short prefills take it, longer prefills cuBLAS's stand-in; so does the LM head (logits out
    as float32). Tiles small enough for the tiny model's K to split."""
    import omnistage.kernels.fused as fused
    import omnistage.kernels.skinny_gemm as skinny

    pytest.importorskip("triton")
    partial_results = []
    launch = skinny._launch
    monkeypatch.setattr(skinny, "_use_triton", lambda x: x.dim() == 2 and x.shape[0] <= skinny.MAX_ROWS)
    monkeypatch.setattr(skinny, "choose_tiling", lambda *shape, **kw: skinny.Tiling(block_n=16, block_k=16, splits=2))

    head_results, rotary_results = [], []

    def spy(*args, **kwargs):
        y = launch(*args, **kwargs)
        rotary_results.append(kwargs.get("rotary") is not None)
        partial_results.append(y.dim() == 3)
        head_results.append(y.dtype == torch.float32 and kwargs.get("out_dtype") == torch.float32)
        return y

    monkeypatch.setattr(skinny, "_launch", spy)
    monkeypatch.setattr(fused, "_use_triton", lambda x: True)
    prompts, expected = hf_reference(tiny_lm)
    with Omni(tiny_lm, deploy(max_num_seqs=4) | {"worker_backend": "inline"}) as omni:  # the patches reach it
        outs = omni.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True))
    assert_same_tokens([o.token_ids for o in outs], expected)
    assert any(partial_results) and not all(partial_results), "both split-K partials and finished rows should run"
    assert any(head_results), "the LM head should run through the kernel"
    # except Qwen3's, whose per-head norms come between the projection and the rotary
    per_head_norms = AutoConfig.from_pretrained(tiny_lm).model_type == "qwen3"
    assert any(rotary_results) != per_head_norms, "the QKV GEMM should apply the rotary and write the cache"
