"""How much arithmetic token2wav's DiT does for one request, and what that bounds by matmul precision.

Counts the floating-point operations of the flow-matching solves (torch's FlopCounterMode over omnistage's
DiTSolver on the meta device: shapes only, nothing computed) for a request of `--codes` codes: once for the
floor, every code solved once (no look-ahead solved twice, no padding), and once for the deploy's window
schedule (each window also solves its look-ahead codes). On a GPU it then measures the DiT's four matmuls
(qkv, o, ff up with GELU, ff down; 22 layers' weights in one CUDA graph, `--rows` rows) in each precision:
cuBLAS strict float32 (torch's default), 3xTF32 tensor cores (`omnistage.kernels.exact_gemm`, as exact),
cuBLAS TF32 and cuBLAS bfloat16, and prints how long `--requests` requests' solves take at that rate with the
GPU given to nothing else: a lower bound on the solves' share of a wave of that many requests, to hold against
the RTF target (`--rtf`: each request done within rtf x its audio).

    python benchmarks/dit_flops.py                       # counts only (CPU is fine)
    python benchmarks/dit_flops.py --out flops.jsonl     # on a GPU: with the rates and bounds
"""

from __future__ import annotations

import argparse

import torch
from recording import recorder
from torch.utils.flop_counter import FlopCounterMode

from omnistage.families.qwen2_5_omni import models
from omnistage.families.qwen2_5_omni.dit import DiTSolver
from omnistage.types import StageInput


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
    from graph_timing import time_graph

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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--codes", type=int, default=600, help="codes in the request (50 a second of audio)")
    ap.add_argument("--window", type=int, default=48, help="the deploy's window options (1gpu.yaml's defaults)")
    ap.add_argument("--max-window", type=int, default=192)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--rtf", type=float, default=0.5)
    ap.add_argument("--rows", type=int, default=7680, help="matmul rows for the rates (32 windows of 48 codes)")
    ap.add_argument("--out")
    args = ap.parse_args()
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
    record(part="dit_flops", codes=args.codes, audio_s=audio_s, floor_tflop=round(floor / 1e12, 2),
           windows=windows, scheduled_tflop=round(scheduled / 1e12, 2))
    if not torch.cuda.is_available():
        return
    budget = args.rtf * audio_s  # every request of the wave done this long after it arrived (all at once)
    for name, rate in matmul_rates(dit, args.rows).items():
        seconds = args.requests * floor / (rate * 1e12)
        record(part="dit_bound", precision=name, rows=args.rows, tflops=round(rate, 1), requests=args.requests,
               solves_s_at_floor=round(seconds, 2), rtf_budget_s=budget, within_budget=seconds <= budget,
               device=torch.cuda.get_device_name())


if __name__ == "__main__":
    main()
