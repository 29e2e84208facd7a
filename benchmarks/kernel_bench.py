"""omnistage's kernels and token2wav's pieces alone, one subcommand each (GPU unless said otherwise). Not named
kernels.py: that would shadow the `kernels` package transformers probes for, breaking every script here.

    python benchmarks/kernel_bench.py skinny-gemm --out skinny.jsonl    # decode GEMMs (<= 16 rows) vs cuBLAS
    python benchmarks/kernel_bench.py skinny-gemm --sweep --no-preload  # ... a tiling grid; the K loop built in
    python benchmarks/kernel_bench.py decode-attention --splits 2,4,8   # paged decode attention: 1 pass vs split-K
    python benchmarks/kernel_bench.py draw                              # the fused draw at a codec vocabulary
    python benchmarks/kernel_bench.py dit-flops                         # DiT FLOPs (CPU) and precision bounds
    python benchmarks/kernel_bench.py moe                               # Qwen3-Omni MoE layer: fused vs transformers
    python benchmarks/kernel_bench.py token2wav --tiny                  # streamed windows (CPU with --tiny)

Kernel A/B switches are flags that set the package's module settings (`omnistage.kernels.*`): `--no-pdl`,
`--no-preload` (skinny_gemm.PRELOAD), `--decode-splits N` (paged_attention.MAX_SPLITS), `--no-exact-gemm`
(exact_gemm.ENABLED). Every subcommand prints one JSON line per measurement and with `--out` appends it there.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
from recording import recorder
from torch.utils.flop_counter import FlopCounterMode

from omnistage.engine.ar.sampler import Sampler, SampleRow, TokenHistory
from omnistage.families.qwen2_5_omni import models
from omnistage.families.qwen2_5_omni.dit import DiTSolver
from omnistage.kernels import draw as fused_draw
from omnistage.kernels import exact_gemm, paged_attention, pdl
from omnistage.kernels import skinny_gemm as skinny
from omnistage.kernels.fused import add_rmsnorm, silu_mul
from omnistage.kernels.paged_attention import _sm_count, decode_splits, paged_attention_triton
from omnistage.sampling_params import SamplingParams
from omnistage.types import StageInput


def time_graph(fns: list[Callable[[], object]], replays: int = 20) -> float:
    """Microseconds per call, over `replays` replays of one CUDA graph calling each of `fns` in turn (pass the
    same callable several times, or ones over distinct weight copies so no call finds the last one's in L2)."""
    for fn in fns:  # compiles and warms up outside the capture
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (replays * len(fns))


# ---- skinny-gemm: decode batches' linear layers (Qwen2.5-Omni talker and thinker), each with its consumer op ----
# (model, op, N, K, bias): the released sizes
SHAPES = [
    ("talker", "qkv", 2560, 896, True), ("talker", "o", 896, 1536, False),  # 12 heads, 4 KV heads of 128
    ("talker", "gate_up", 2 * 18944, 896, False), ("talker", "down", 896, 18944, False),
    ("thinker", "qkv", 4608, 3584, True), ("thinker", "o", 3584, 3584, False),
    ("thinker", "gate_up", 2 * 18944, 3584, False), ("thinker", "down", 3584, 18944, False),
    ("talker", "input_proj", 896, 3584, True), ("talker", "head", 8448, 896, False),
    ("thinker", "head", 152064, 3584, False),
]
CALLS = 24


def make_op(op: str, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, norm_w: torch.Tensor,
            residual: torch.Tensor, tiling: skinny.Tiling | None):
    """The layer op and its consumer; tiling None = cuBLAS (torch) path."""
    if op == "head":  # logits handed on as float32
        if tiling is None:
            return lambda: F.linear(x, w).float()
        return lambda: skinny.linear_to_float(x, w, tiling=tiling)
    if op in ("qkv", "input_proj"):
        if tiling is None:
            return lambda: F.linear(x, w, b)
        return lambda: skinny.linear(x, w, b, tiling=tiling)
    if op == "gate_up":
        if tiling is None:
            return lambda: silu_mul(F.linear(x, w))
        return lambda: skinny.gate_up_silu(x, w, tiling=tiling)
    if tiling is None:
        return lambda: add_rmsnorm(F.linear(x, w), residual, norm_w, 1e-6)
    return lambda: add_rmsnorm(skinny.linear(x, w, partial=True, tiling=tiling), residual, norm_w, 1e-6)


def op_inputs(op: str, n: int, k: int, bias: bool, m: int, dev: torch.device) -> tuple:
    """(x, bias, norm weight, residual) for `m` rows of a layer op with an [n, k] weight."""
    width = n // 2 if op == "gate_up" else n
    return (torch.randn(m, k, device=dev, dtype=torch.bfloat16),
            torch.randn(n, device=dev, dtype=torch.bfloat16) if bias else None,
            torch.ones(width, device=dev, dtype=torch.bfloat16),
            torch.randn(m, width, device=dev, dtype=torch.bfloat16))


def time_op(op: str, n: int, k: int, bias: bool, m: int, tiling: skinny.Tiling | None, weights: list) -> float:
    """Microseconds per call: a graph of CALLS calls over distinct weight copies, replayed."""
    x, b, norm_w, residual = op_inputs(op, n, k, bias, m, weights[0].device)
    return time_graph([make_op(op, x, weights[i % len(weights)], b, norm_w, residual, tiling) for i in range(CALLS)])


def check(op: str, n: int, k: int, bias: bool, m: int, tiling: skinny.Tiling | None, w: torch.Tensor) -> float:
    """Largest difference from cuBLAS's result, relative to its largest magnitude (bf16: ~1e-2 expected)."""
    x, b, norm_w, residual = op_inputs(op, n, k, bias, m, w.device)
    want = make_op(op, x, w, b, norm_w, residual, None)()
    got = make_op(op, x, w, b, norm_w, residual, tiling)()
    want, got = (want[0], got[0]) if isinstance(want, tuple) else (want, got)
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()



# ---- decode-attention: one pass over the keys vs split-K (bf16 cache, 16-token pages) ----
PAGE = 16


def run_case(batch: int, heads: int, kv_heads: int, head_dim: int, context: int, args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    dev, pages = torch.device("cuda"), triton.cdiv(context, PAGE)
    kv = torch.randn(2, args.layers, batch * pages * PAGE, kv_heads, head_dim, dtype=torch.bfloat16, device=dev)
    width = triton.cdiv(args.max_model_len, PAGE)  # the graph buffers' block-table width
    tables = torch.zeros(batch, width, dtype=torch.int32, device=dev)
    tables[:, :pages] = torch.randperm(batch * pages, device=dev).view(batch, pages).int()
    seq_lens = torch.full((batch,), context, dtype=torch.long, device=dev)
    cu_q = torch.arange(batch + 1, dtype=torch.int32, device=dev)
    q = torch.randn(batch, heads, head_dim, dtype=torch.bfloat16, device=dev)
    layer = [0]

    def call(splits: int | None) -> torch.Tensor:
        k, v = kv[0, layer[0]], kv[1, layer[0]]
        layer[0] = (layer[0] + 1) % args.layers
        return paged_attention_triton(q, k, v, tables, seq_lens, cu_q, 1, PAGE, head_dim**-0.5, num_splits=splits)

    single_us = time_graph([lambda: call(1)] * args.calls, args.replays)
    split_us = time_graph([lambda: call(None)] * args.calls, args.replays)
    forced = {f"splits{n}_us": round(time_graph([lambda n=n: call(n)] * args.calls, args.replays), 2)
              for n in map(int, filter(None, args.splits.split(",")))}
    layer[0] = 0
    single = call(1)
    layer[0] = 0
    split = call(None)
    return dict(
        batch=batch, heads=heads, kv_heads=kv_heads, head_dim=head_dim, context=context,
        splits=decode_splits(batch, kv_heads, width, PAGE, 32, _sm_count(dev)),
        single_us=round(single_us, 2), split_us=round(split_us, 2),
        max_abs_diff=(single.float() - split.float()).abs().max().item(), **forced,
    )



# ---- draw: the fused draw kernel ----
# the Qwen2.5-Omni talker's sampling, then without top-p, then temperature alone
SETTINGS = {
    "talker": SamplingParams(temperature=0.9, top_k=40, top_p=0.8, repetition_penalty=1.05),
    "top_k_only": SamplingParams(temperature=0.9, top_k=40, repetition_penalty=1.05),
    "temperature_only": SamplingParams(temperature=0.9, repetition_penalty=1.05),
}


def time_draw(params: SamplingParams, rows: int, vocab: int, num_warps: int | None) -> float:
    dev = torch.device("cuda")
    history = TokenHistory(rows + 1, vocab, dev)
    sampler = Sampler(seed=0)
    cols = sampler.columns([SampleRow(params, [1, 2, 3], [4, 5], None, ()) for _ in range(rows)], vocab, dev)
    logits = 3 * torch.randn(rows, vocab, device=dev)
    slots = torch.arange(rows, device=dev)
    noise = torch.empty_like(logits).exponential_()

    def one() -> torch.Tensor:
        return fused_draw.draw(logits, noise, cols.temperature, cols.greedy, cols.top_k, cols.top_p, cols.min_p,
                               cols.repetition, cols.frequency, cols.presence, cols.ban, history.seen,
                               history.counts, slots, record=True, num_warps=num_warps)

    return time_graph([one] * 24)



# ---- dit-flops: token2wav's DiT arithmetic and what it bounds ----


def solve_flops(solver: DiTSolver, config, codes: int) -> int:
    """Operations of one solve of a `codes`-code window (batch 1: its guided and unguided rows)."""
    frames = codes * config.repeats
    meta = torch.device("meta")
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        solver.solve(torch.zeros(1, frames, config.mel_dim, device=meta),
                     torch.zeros(1, codes, dtype=torch.long, device=meta),
                     torch.zeros(1, config.enc_emb_dim, device=meta), torch.zeros(1, 2, config.enc_dim, device=meta))
    return counter.get_total_flops()


def window_codes(decoder: models.Token2Wav, codes: int) -> list[int]:
    """Codes each window of a `codes`-code request solves (look-ahead included), in order."""
    solved, done = [], 0
    while done < codes:
        start, keep_end, end = decoder._plan(StageInput("r", [0] * codes, params={"emitted": done}, final=True))
        solved.append(end - start)
        done = keep_end
    return solved


def matmul_rates(config, rows: int) -> dict[str, float]:
    """TFLOP/s of the DiT's four matmuls together, per precision, at `rows` rows (CUDA graphs of 22 layers)."""
    from omnistage.kernels.exact_gemm import exact_linear

    width, layers = config.hidden_size, config.num_hidden_layers
    ff = width * config.ff_mult
    shapes = [(3 * width, width, False), (width, width, False), (ff, width, True), (width, ff, False)]
    flops = 2 * rows * sum(n * k for n, k, _ in shapes) * layers
    rates = {}
    for name in ("float32", "exact_3xtf32", "tf32", "bfloat16"):
        dtype = torch.bfloat16 if name == "bfloat16" else torch.float32
        inputs = {k: torch.randn(rows, k, device="cuda", dtype=dtype) for _, k, _ in shapes}

        def layer_matmuls(weights: list[tuple], name: str = name, inputs: dict = inputs) -> None:
            for w, b, gelu in weights:
                x = inputs[w.shape[1]]
                if name == "exact_3xtf32":
                    exact_linear(x, w, b, gelu)
                elif gelu:
                    torch._addmm_activation(b, x, w.t(), use_gelu=True)
                else:
                    torch.nn.functional.linear(x, w, b)

        layer_fns = []
        for _ in range(layers):
            weights = [(torch.randn(n, k, device="cuda", dtype=dtype) * k ** -0.5,
                        torch.zeros(n, device="cuda", dtype=dtype), gelu) for n, k, gelu in shapes]
            layer_fns.append(lambda weights=weights: layer_matmuls(weights))
        torch.backends.cuda.matmul.allow_tf32 = name == "tf32"  # for the warm-up and the capture
        try:
            seconds = time_graph(layer_fns, replays=5) * layers / 1e6
        finally:
            torch.backends.cuda.matmul.allow_tf32 = False
        rates[name] = flops / seconds / 1e12
        del layer_fns, inputs
    return rates


# ---- token2wav: streamed windows alone ----
CASES = [(24, 1), (48, 1), (96, 1), (48, 8), (48, 32)]  # (window codes, requests per step)


def build(config, device: torch.device) -> tuple[torch.nn.Module, dict]:
    from transformers import Qwen2_5OmniToken2WavModel

    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2_5OmniToken2WavModel._from_config(config, dtype=torch.float32).eval()
    dit = config.dit_config
    voices = {"Chelsie": {"bos_token": 0, "cond": torch.randn(1, dit.enc_emb_dim),
                          "ref_mel": torch.randn(1, 300, dit.mel_dim)}}
    return model, voices


def step_seconds(decoder: models.Token2Wav, window: int, batch: int, limit: int) -> float:
    done = decoder.left + window
    # a middle window; with kept contexts it starts where it is kept and reads the vocoder's left mel from there
    tail = torch.zeros(1, decoder.dit.mel_dim, decoder.vocoder_context, device=decoder.device)
    inputs = [StageInput(f"r{i}", [(7 * i + j) % limit for j in range(done + window + decoder.right)],
                         params={"voice": "Chelsie", "emitted": done, "mel_tail": tail}, final=False)
              for i in range(batch)]
    if decoder.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    decoder.generate(inputs)  # returns audio on the host: the step is complete
    return time.perf_counter() - start


def one_shot(decoder: models.Token2Wav, limit: int) -> torch.Tensor:
    codes = [(11 * j) % limit for j in range(96)]
    ((tensors, _),) = decoder.generate([StageInput("ref", codes, params={"voice": "Chelsie", "seed": 0}, final=True)])
    return tensors["audio"]




# ---- the subcommands ----


def cmd_skinny_gemm(args: argparse.Namespace) -> None:
    """Skinny GEMMs: each layer op timed as a CUDA graph of CALLS calls over weight copies past the L2 cache."""
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    record = recorder(args.out)
    for model, op, n, k, bias in SHAPES:
        if args.only and f"{model}.{op}" not in args.only.split(","):
            continue
        size = n * k * 2
        copies = max(2, -(-200_000_000 // size))
        weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(min(copies, CALLS))]
        chosen = skinny.choose_tiling(n // 2 if op == "gate_up" else n, k, sms, gate_up=op == "gate_up",
                                      splittable=op in ("o", "down"))  # the others keep whole rows
        best = None
        if args.sweep:
            splits = (1, 2, 4, 8, 16) if op in ("o", "down") else (1,)
            results = []
            grid = [skinny.Tiling(bn, bk, s, warps, stages) for bn, bk, warps, stages, s in itertools.product(
                (16, 32, 64), (128, 256, 512), (4, 8), (3, 4), splits) if s == 1 or k // (bk * s) >= 1]
            if k <= 2048 and op != "gate_up":  # a program's whole slice of K read before the PDL wait
                grid += [skinny.Tiling(bn, max(16, triton.next_power_of_2(-(-k // s))), s, warps, 1, preload=True)
                         for bn, s, warps in itertools.product((16, 32, 64), (1, 2, 4), (4, 8))]
            for t in grid:
                try:
                    us = time_op(op, n, k, bias, 1, t, weights)
                except Exception as exc:  # a tiling past the shared memory, say
                    record(bench="skinny_gemm", model=model, op=op, tiling=t.__dict__, error=str(exc)[:120])
                    continue
                results.append((us, t))
            results.sort(key=lambda r: r[0])
            best = results[0][1]
            record(bench="skinny_gemm", model=model, op=op, summary="sweep",
                   best=[(round(us, 2), t.__dict__) for us, t in results[:5]])
        for m in (int(r) for r in args.rows.split(",")):
            row = {"model": model, "op": op, "n": n, "k": k, "rows": m, "weight_mb": round(size / 1e6, 1),
                   "pdl": pdl.enabled(dev), "preload": skinny.PRELOAD,
                   "cublas_us": round(time_op(op, n, k, bias, m, None, weights), 2), "chosen": chosen.__dict__,
                   "chosen_us": round(time_op(op, n, k, bias, m, chosen, weights), 2),
                   "chosen_rel_err": round(check(op, n, k, bias, m, chosen, weights[0]), 5)}
            if best is not None:
                row |= {"best": best.__dict__, "best_us": round(time_op(op, n, k, bias, m, best, weights), 2)}
            record(bench="skinny_gemm", **row)
        del weights
        torch.cuda.empty_cache()


def cmd_decode_attention(args: argparse.Namespace) -> None:
    record = recorder(args.out)
    for shape in args.shapes.split(","):
        heads, kv_heads, head_dim = map(int, shape.split("/"))
        for batch in map(int, args.batches.split(",")):
            for context in map(int, args.contexts.split(",")):
                record(bench="decode_attention", max_splits=paged_attention.MAX_SPLITS,
                       **run_case(batch, heads, kv_heads, head_dim, context, args))


def cmd_draw(args: argparse.Namespace) -> None:
    record = recorder(args.out)
    for (name, params), rows, warps in itertools.product(SETTINGS.items(), map(int, args.rows.split(",")),
                                                         map(int, args.warps.split(","))):
        record(bench="draw", settings=name, rows=rows, vocab=args.vocab, num_warps=warps or "built-in",
               us=round(time_draw(params, rows, args.vocab, warps or None), 2))


def cmd_dit_flops(args: argparse.Namespace) -> None:
    from transformers import Qwen2_5OmniConfig, Qwen2_5OmniToken2WavModel

    config = Qwen2_5OmniConfig().token2wav_config  # the released token2wav layout
    with torch.device("meta"):
        model = Qwen2_5OmniToken2WavModel._from_config(config, dtype=torch.float32).eval()
    decoder = models.Token2Wav(model, {}, torch.device("meta"), window=args.window, max_window=args.max_window)
    dit = config.dit_config
    record = recorder(args.out)
    floor = solve_flops(decoder.solver, dit, args.codes)
    windows = window_codes(decoder, args.codes)
    scheduled = sum(solve_flops(decoder.solver, dit, codes) for codes in windows)
    audio_s = args.codes * dit.repeats * decoder.HOP / models.SAMPLE_RATE
    record(bench="dit_flops", codes=args.codes, audio_s=audio_s, floor_tflop=round(floor / 1e12, 2),
           windows=windows, scheduled_tflop=round(scheduled / 1e12, 2))
    if not torch.cuda.is_available():
        return
    budget = args.rtf * audio_s  # every request of the wave done this long after it arrived (all at once)
    for name, rate in matmul_rates(dit, args.rows).items():
        seconds = args.requests * floor / (rate * 1e12)
        record(bench="dit_bound", precision=name, rows=args.rows, tflops=round(rate, 1), requests=args.requests,
               solves_s_at_floor=round(seconds, 2), rtf_budget_s=budget, within_budget=seconds <= budget)


def cmd_token2wav(args: argparse.Namespace) -> None:
    """Milliseconds per streamed window step by window, batch and DiT precision; each precision's distance from
    float32 on a one-shot decode (random weights: a trained model's speech may react differently)."""
    from transformers import Qwen2_5OmniConfig

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.tiny:
        from omnistage.testing import tiny_checkpoint

        config = Qwen2_5OmniConfig.from_pretrained(tiny_checkpoint("qwen2_5_omni")).token2wav_config
    else:
        config = Qwen2_5OmniConfig().token2wav_config  # the released token2wav layout
    model, voices = build(config, device)
    limit = config.dit_config.num_embeds - 1
    record = recorder(args.out)
    reference = None
    for name in args.dtypes.split(","):  # float32 first: lower precisions are rounded from its weights
        dtype, tf32 = (torch.float32, True) if name == "tf32" else (getattr(torch, name), False)
        model.code2wav_dit_model.to(dtype)
        audio = one_shot(models.Token2Wav(model, voices, device, tf32=tf32), limit)
        if reference is None:
            reference = audio
        else:
            rms = ((audio - reference).pow(2).mean() / reference.pow(2).mean()).sqrt().item()
            record(bench="dit_precision", dit_dtype=name, relative_rms_vs_float32=round(rms, 5))
        decoders = {}
        for window, batch in CASES:
            if window not in decoders:
                decoders[window] = models.Token2Wav(model, voices, device, window=window, tf32=tf32,
                                                    max_batch=max(b for w, b in CASES if w == window))
                decoders[window].warm_up()
            decoder = decoders[window]
            step_seconds(decoder, window, batch, limit)
            seconds = statistics.median(step_seconds(decoder, window, batch, limit)
                                        for _ in range(3 if batch < 32 else 1))
            audio_s = batch * window * decoder.dit.repeats * decoder.HOP / models.SAMPLE_RATE
            record(bench="token2wav_window", dit_dtype=name, window=window, batch=batch,
                   ms_per_step=round(1000 * seconds, 1), audio_s_per_s=round(audio_s / seconds, 2))


def cmd_moe(args: argparse.Namespace) -> None:
    """Qwen3-Omni's thinker MoE layer (full size, bf16): transformers' block with its expert loop ("eager") and
    with torch's grouped GEMM ("grouped_mm") against `FusedSparseMoe` on the same weights, eager calls (the
    transformers paths sync the host) and, for the fused block, one CUDA graph of calls."""
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as m
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeTextConfig

    from omnistage.families.moe import FusedSparseMoe

    dev = torch.device("cuda")
    record = recorder(args.out)
    blocks = {}
    for impl in ("eager", "grouped_mm"):
        cfg = Qwen3OmniMoeTextConfig(hidden_size=2048, moe_intermediate_size=768, num_experts=128,
                                     num_experts_per_tok=8, norm_topk_prob=True)
        cfg._experts_implementation = impl
        with torch.device(dev):
            blocks[impl] = m.Qwen3OmniMoeThinkerTextSparseMoeBlock(cfg).bfloat16().eval().requires_grad_(False)
    g = torch.Generator(dev).manual_seed(0)
    with torch.no_grad():
        for p in blocks["eager"].parameters():
            p.copy_(torch.randn(p.shape, generator=g, device=dev) * p.shape[-1] ** -0.5)
        blocks["grouped_mm"].load_state_dict(blocks["eager"].state_dict())
    fused = FusedSparseMoe(blocks["eager"])

    def eager_us(fn: Callable[[], object], calls: int = 20) -> float:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e6 / calls

    for tokens in [int(t) for t in args.tokens.split(",")]:
        x = torch.randn(1, tokens, 2048, device=dev, dtype=torch.bfloat16)
        with torch.inference_mode():
            row = {name: round(eager_us(lambda b=block, x=x: b(x)), 1) for name, block in blocks.items()}
            row["fused"] = round(eager_us(lambda x=x: fused(x)), 1)
            row["fused_graph"] = round(time_graph([lambda x=x: fused(x)] * 8), 1)
        record(bench="moe_layer", layer="qwen3_omni_thinker", tokens=tokens, us_per_call=row,
               fused_graph_vs_grouped_mm=round(row["grouped_mm"] / row["fused_graph"], 2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)

    def command(name: str, fn, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        p.add_argument("--out", help="append the JSON lines to this file")
        p.add_argument("--no-pdl", action="store_true", help="Triton kernels without programmatic dependent launch")
        p.set_defaults(fn=fn)
        return p

    p = command("skinny-gemm", cmd_skinny_gemm, "decode GEMMs (<= 16 rows) with their consumer ops: omnistage's "
                "Triton kernels (the built-in tiling, or with --sweep the best of a grid) vs cuBLAS")
    p.add_argument("--rows", default="1,2,4,8,16")
    p.add_argument("--sweep", action="store_true", help="also time a grid of tilings at M=1")
    p.add_argument("--only", default="", help="comma list of model.op, e.g. talker.down")
    p.add_argument("--no-preload", action="store_true",
                   help="skinny_gemm.PRELOAD = False: the built-in tiling runs the K loop after the PDL wait")
    p = command("decode-attention", cmd_decode_attention, "paged decode attention: single pass vs split-K, "
                "a graph of calls over --layers caches")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--contexts", default="256,700,2048")
    p.add_argument("--shapes", default="12/4/128,28/4/128", help="heads/kv_heads/head_dim, comma-separated")
    p.add_argument("--splits", default="", help="also time these forced split counts, comma-separated")
    p.add_argument("--decode-splits", type=int, help="paged_attention.MAX_SPLITS: the launcher's cap on splits")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--max-model-len", type=int, default=32768)
    p.add_argument("--calls", type=int, default=240, help="calls per captured graph")
    p.add_argument("--replays", type=int, default=20)
    p = command("draw", cmd_draw, "the fused draw kernel at a codec head's vocabulary by filters and width")
    p.add_argument("--vocab", type=int, default=8448)
    p.add_argument("--rows", default="1,8,32")
    p.add_argument("--warps", default="0,4,8,16,32", help="program widths to time (0: the built-in choice)")
    p = command("dit-flops", cmd_dit_flops, "token2wav DiT FLOPs per request (CPU is fine) and, on a GPU, the "
                "solves' lower bound per matmul precision")
    p.add_argument("--codes", type=int, default=600, help="codes in the request (50 a second of audio)")
    p.add_argument("--window", type=int, default=48)
    p.add_argument("--max-window", type=int, default=192)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--rtf", type=float, default=0.5)
    p.add_argument("--rows", type=int, default=7680, help="matmul rows for the rates (32 windows of 48 codes)")
    p.add_argument("--no-exact-gemm", action="store_true",
                   help="exact_gemm.ENABLED = False: the exact_3xtf32 row falls back to cuBLAS")
    p = command("token2wav", cmd_token2wav, "token2wav alone (random weights): ms per streamed window step by "
                "window, batch and DiT precision")
    p.add_argument("--tiny", action="store_true", help="the tiny checkpoint's config (CPU)")
    p.add_argument("--dtypes", default="float32,bfloat16", help="DiT precisions: float32, bfloat16, tf32")
    p.add_argument("--no-exact-gemm", action="store_true", help="exact_gemm.ENABLED = False: cuBLAS float32")
    p = command("moe", cmd_moe, "Qwen3-Omni's full-size thinker MoE layer: transformers' expert loop and grouped_mm "
                "against omnistage's fused Triton experts")
    p.add_argument("--tokens", default="1,8,32,64,256,2048")
    args = ap.parse_args()
    pdl.set_enabled(not args.no_pdl)
    if getattr(args, "no_preload", False):
        skinny.PRELOAD = False
    if getattr(args, "decode_splits", None):
        paged_attention.MAX_SPLITS = args.decode_splits
    if getattr(args, "no_exact_gemm", False):
        exact_gemm.ENABLED = False
    args.fn(args)


if __name__ == "__main__":
    main()
