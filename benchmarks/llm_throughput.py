"""AR engine vs HF transformers on one GPU, one process, one run (Qwen2.5-7B architecture, random bf16).

References, measured the way a user would run them: `generate` (sdpa, dynamic cache), `generate`
with a static cache (transformers compiles the decode step), static batches, and continuous batching
(`generate_batch`). omnistage runs the *same* model object (same weights) through its AR engine.
Also checks, on that full-size model, that the fast path's logits match HF's within bf16 tolerance
and that CUDA-graph decoding gives the same greedy tokens as eager decoding.

    python benchmarks/llm_throughput.py --out results.jsonl [--parts parity,hf,ours] [--tiny]

Prints and appends one JSON line per measurement; benchmarks/results/llm_throughput.md is written
from those lines.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
import traceback

import torch
from switches import add_kernel_switches, apply_kernel_switches

from omnistage.engine.ar.engine import AREngine, AREngineConfig
from omnistage.families.causal_lm import causal_lm_model
from omnistage.families.hf import ATTN_IMPL
from omnistage.sampling_params import SamplingParams
from omnistage.types import StageInput

PROMPT_LEN, OUTPUT_LEN = 128, 256
REPEATS = 3


def qwen2_7b_config(tiny: bool):
    from transformers import Qwen2Config

    if tiny:
        return Qwen2Config(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=1000, max_position_embeddings=4096)
    return Qwen2Config(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768, rope_theta=1e6,
                       rms_norm_eps=1e-6, tie_word_embeddings=False)


def random_qwen2(tiny: bool) -> tuple[torch.nn.Module, object]:
    """The benchmark model: the 7B architecture (or a tiny one) with seeded random bf16 weights on the GPU."""
    from transformers import Qwen2ForCausalLM

    config = qwen2_7b_config(tiny)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(config).eval()
    torch.set_default_dtype(torch.float32)
    return model, config


class Recorder:
    def __init__(self, path: str | None, kernels: dict | None = None):
        self.path, self.kernels = path, kernels or {}

    def __call__(self, **row) -> None:
        row["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        if self.kernels:
            row["kernels"] = self.kernels
        line = json.dumps(row)
        print(line, flush=True)
        if self.path:
            with open(self.path, "a") as f:
                f.write(line + "\n")


def sync() -> None:
    torch.cuda.synchronize()


def timed(fn, repeats: int = REPEATS) -> tuple[float, float, float]:
    """Median, min and max wall seconds of `fn` over `repeats` runs (warm-up is the caller's)."""
    times = []
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times), min(times), max(times)


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 10, (n, PROMPT_LEN), generator=g).tolist()


# ---- HF references --------------------------------------------------------------------------


def hf_generate(model, batch: int, record: Recorder, vocab: int, static_cache: bool = False) -> None:
    ids = torch.tensor(prompts(batch, vocab), device="cuda")
    kw = dict(max_new_tokens=OUTPUT_LEN, min_new_tokens=OUTPUT_LEN, do_sample=False, pad_token_id=0)
    if static_cache:
        kw["cache_implementation"] = "static"
    if static_cache:
        model.generate(ids, **kw)  # compiles the decode step
    model.generate(ids, **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
    # HF's eager runs take minutes of device time each: one timed run; the compiled path gets two.
    med, lo, hi = timed(lambda: model.generate(ids, **kw), repeats=2 if static_cache else 1)
    name = "hf_generate_static_cache_compiled" if static_cache else "hf_generate"
    record(part=name, batch=batch, seconds=round(med, 3), seconds_min=round(lo, 3), seconds_max=round(hi, 3),
           output_tok_per_s=round(batch * OUTPUT_LEN / med, 1))


def hf_continuous_batching(model, n: int, record: Recorder, vocab: int) -> None:
    from transformers import GenerationConfig

    reqs = prompts(n, vocab)
    gc = GenerationConfig(max_new_tokens=OUTPUT_LEN, min_new_tokens=OUTPUT_LEN, do_sample=False,
                          eos_token_id=-1, pad_token_id=0)
    model.generate_batch(inputs=reqs[:4], generation_config=gc)
    outputs = {}
    med, _, _ = timed(lambda: outputs.update(out=model.generate_batch(inputs=reqs, generation_config=gc)), repeats=1)
    generated = sum(len(o.generated_tokens) for o in outputs["out"].values())
    record(part="hf_continuous_batching", requests=n, generated_tokens=generated, seconds=round(med, 3),
           output_tok_per_s=round(generated / med, 1))


# ---- omnistage ------------------------------------------------------------------------------


def build_engine(model, config, max_num_seqs: int, enforce_eager: bool = False, util: float = 0.85) -> AREngine:
    model.set_attn_implementation(ATTN_IMPL)
    cfg = AREngineConfig(max_model_len=1024, max_num_seqs=max_num_seqs, max_num_batched_tokens=8192,
                         gpu_memory_utilization=util, enforce_eager=enforce_eager)
    return AREngine("lm", causal_lm_model(model, config), cfg, tokenizer=None, eos_token_ids=())


def run_requests(engine: AREngine, reqs: list[list[int]], max_tokens: int = OUTPUT_LEN) -> dict:
    """Submit all requests at once and step until done; returns tokens and timings."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(reqs))}
    first: dict[str, float] = {}
    start = time.perf_counter()
    for i, r in enumerate(reqs):
        engine.add_request(StageInput(str(i), r, params=params))
    while engine.has_work():
        for out in engine.step():
            if out.request_id not in first:
                first[out.request_id] = time.perf_counter()
            tokens[out.request_id] += out.token_ids
    end = time.perf_counter()
    return {"tokens": [tokens[str(i)] for i in range(len(reqs))], "seconds": end - start,
            "ttft": [first[str(i)] - start for i in range(len(reqs))], "end": end, "first": first}


def ours(model, config, record: Recorder, vocab: int, tiny: bool) -> None:
    torch.cuda.reset_peak_memory_stats()
    engine = build_engine(model, config, max_num_seqs=256)
    stats = engine.stats()
    record(part="omnistage_engine_ready", kv_blocks=stats["kv_blocks_total"], graphs=sorted(engine.runner.graphs),
           memory_allocated_gb=round(torch.cuda.memory_allocated() / 2**30, 2))
    one = prompts(1, vocab, seed=1)
    run_requests(engine, one, 8)  # warm-up
    runs = [run_requests(engine, one) for _ in range(REPEATS)]
    secs = sorted(r["seconds"] for r in runs)
    decode = sorted((r["end"] - r["first"]["0"]) / (OUTPUT_LEN - 1) for r in runs)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bound_steps = 4.8e12 / weight_bytes  # HBM datasheet bandwidth / bytes read per decode step
    record(part="omnistage_batch1", batch=1, seconds=round(secs[1], 3), seconds_min=round(secs[0], 3),
           seconds_max=round(secs[-1], 3), output_tok_per_s=round(OUTPUT_LEN / secs[1], 1),
           decode_tok_per_s=round(1 / decode[1], 1), ttft_s=round(runs[1]["ttft"][0], 4),
           roofline_fraction=round((1 / decode[1]) / bound_steps, 3), weight_gb=round(weight_bytes / 1e9, 2))
    for n in (32, 128, 256):
        reqs = prompts(n, vocab, seed=2)
        run_requests(engine, reqs[: min(n, 8)], 8)
        results = [run_requests(engine, reqs) for _ in range(2)]
        secs = sorted(r["seconds"] for r in results)
        record(part="omnistage_batch", requests=n, seconds=round(secs[0], 3), seconds_max=round(secs[-1], 3),
               output_tok_per_s=round(n * OUTPUT_LEN / secs[0], 1),
               ttft_p50_s=round(statistics.median(results[0]["ttft"]), 3),
               peak_memory_gb=round(torch.cuda.max_memory_allocated() / 2**30, 2))
    engine.shutdown()
    del engine
    torch.cuda.empty_cache()


def parity(model, config, record: Recorder, vocab: int) -> None:
    """Fast-path logits vs HF sdpa, and CUDA-graph vs eager greedy tokens, on the same weights."""
    reqs = prompts(8, vocab, seed=3)
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        ref = model(torch.tensor(reqs[:1], device="cuda")).logits[0, -1].float()
    engine = build_engine(model, config, max_num_seqs=8, util=0.5)
    from omnistage.engine.ar.sequence import Sequence

    seq = Sequence("p", list(reqs[0]), SamplingParams(), max_tokens=1, arrival=0)
    engine.block_manager.allocate(seq, len(seq.token_ids))
    got = engine.runner.execute([(seq, len(seq.token_ids))]).logits[0]
    engine.block_manager.free_blocks(seq)
    diff = (got - ref).abs()
    record(part="parity_logits_vs_hf", max_abs_diff=round(diff.max().item(), 4),
           mean_abs_diff=round(diff.mean().item(), 5), logit_std=round(ref.std().item(), 4),
           same_argmax=bool(got.argmax() == ref.argmax()))
    graph_tokens = run_requests(engine, reqs, 64)["tokens"]
    engine.shutdown()
    del engine
    eager = build_engine(model, config, max_num_seqs=8, enforce_eager=True, util=0.5)
    eager_tokens = run_requests(eager, reqs, 64)["tokens"]
    eager.shutdown()
    del eager
    torch.cuda.empty_cache()
    same = sum(a == b for a, b in zip(graph_tokens, eager_tokens, strict=True))
    record(part="parity_cuda_graph_vs_eager", sequences=len(reqs), identical_sequences=same, tokens_each=64)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--parts", default="parity,ours,hf")
    ap.add_argument("--tiny", action="store_true")
    add_kernel_switches(ap)
    args = ap.parse_args()
    kernels = apply_kernel_switches(args)  # A/B: the module settings the flags name, recorded in each row
    record = Recorder(args.out, kernels)
    model, config = random_qwen2(args.tiny)
    vocab = config.vocab_size
    parts = args.parts.split(",")
    steps = []
    if "parity" in parts:
        steps.append(lambda: parity(model, config, record, vocab))
    if "ours" in parts:
        steps.append(lambda: ours(model, config, record, vocab, args.tiny))
    if "cb" in parts:
        steps.append(lambda: (model.set_attn_implementation("sdpa"), hf_continuous_batching(model, 256, record, vocab)))
    if "hf" in parts:
        def hf() -> None:
            model.set_attn_implementation("sdpa")
            hf_generate(model, 1, record, vocab)
            hf_generate(model, 128, record, vocab)
            hf_continuous_batching(model, 256, record, vocab)
            hf_generate(model, 1, record, vocab, static_cache=True)
        steps.append(hf)
    for step in steps:
        try:
            step()
        except Exception:
            traceback.print_exc()
            record(part="error", trace=traceback.format_exc()[-2000:])
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    # No global inference mode: the HF references run exactly as a user would call them (generate
    # manages its own grad mode; generate_batch fails silently on inference-mode weights).
    with torch.no_grad():
        main()
