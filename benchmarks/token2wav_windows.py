"""Qwen2.5-Omni's token2wav alone: time per streamed window by window size, batch and DiT precision.

The released token2wav layout with random weights, built in memory (no checkpoint needed). Each step decodes
one steady-state window per request (left context + window + look-ahead codes, flow matching replayed from
CUDA graphs captured at start-up, then the vocoder) and reports milliseconds per step and seconds of audio per
second. Side by side, one steady-state flow-matching solve through transformers' `DiT.sample` (what `generate`
runs) and through omnistage's solver. For each DiT precision other than float32 (bfloat16; tf32: float32 weights
with TensorFloat-32 matmuls) it also reports the relative RMS distance of a 96-code one-shot decode from the
float32 one (random weights: the speech a trained model makes may react differently).

    python benchmarks/token2wav_windows.py --out t2w.jsonl              # GPU
    python benchmarks/token2wav_windows.py --tiny                       # the tiny checkpoint's config (CPU)
    python benchmarks/token2wav_windows.py --lengths --dtypes bfloat16  # one window's solve by its length
    python benchmarks/token2wav_windows.py --vocoder                    # the vocoder by precision (GPU)
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
from recording import recorder

from omnistage.families.qwen2_5_omni import models
from omnistage.types import StageInput

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


def first_use_rows(model, voices: dict, device: torch.device, record) -> None:
    """Host and device milliseconds of eager vocoder passes at batch 1: each length new, then the same lengths
    again; for cuDNN on (torch's default) and off."""
    decoder = models.Token2Wav(model, voices, device, window=48, max_window=192)
    decoder.warm_up()
    lengths = [112, 113, 130, 157, 190, 210]
    for cudnn in (True, False):
        torch.backends.cudnn.enabled = cudnn
        for when in ("first", "again"):
            for frames in lengths:
                # cuDNN off gets lengths of its own (+1000), so its "first" passes are new lengths too
                mel = torch.randn(1, decoder.dit.mel_dim, frames + (0 if cudnn else 1000), device=device)
                torch.cuda.synchronize()
                start = time.perf_counter()
                decoder._vocode(mel)
                host = time.perf_counter() - start
                torch.cuda.synchronize()
                record(part="vocoder_first_use", cudnn=cudnn, when=when, frames=mel.shape[-1],
                       host_ms=round(1e3 * host, 2), synced_ms=round(1e3 * (time.perf_counter() - start), 2))
    torch.backends.cudnn.enabled = True


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--dtypes", default="float32,tf32,bfloat16",
                    help="DiT precisions; tf32: float32 weights, TF32 matmuls")
    ap.add_argument("--out")
    ap.add_argument("--contexts", default="kept,solved",
                    help="kept: windows continue the previous window's kept context (the default); solved: each "
                         "window solves its left context again")
    ap.add_argument("--profile", action="store_true",
                    help="instead: per precision, CUDA kernel time of one eager step, solve vs vocoder")
    ap.add_argument("--profile-batch", type=int, default=32, help="windows in the --profile step")
    ap.add_argument("--profile-window", type=int, default=48, help="codes per window in the --profile step")
    ap.add_argument("--lengths", action="store_true",
                    help="instead: one continuing window's solve (graph replay) and vocoder pass at batch 1 for each "
                         "window length the default windows grow through, up to --max-window, with and without "
                         "the deploy's SM carveout")
    ap.add_argument("--max-window", type=int, default=384)
    ap.add_argument("--max-batch", type=int, default=1, help="--lengths: batch sizes to capture graphs for")
    ap.add_argument("--vocoder", action="store_true",
                    help="instead: the vocoder alone (graph replay) by mel frames and batch in float32 with cuDNN's "
                         "TF32 off, as torch leaves it, and in bfloat16; each one's distance from the first")
    ap.add_argument("--first-use", action="store_true",
                    help="instead: an eager vocoder pass (a request's last window) at mel lengths not seen before, "
                         "then again, with cuDNN on and off: what a new length costs the first time")
    args = ap.parse_args()
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

    if args.first_use:
        first_use_rows(model, voices, device, record)
        return
    if args.vocoder:
        vocoder_rows(model, voices, device, record)
        return
    if args.lengths:
        for name in args.dtypes.split(","):
            length_rows(model, voices, device, name, limit, args.max_window, record, args.max_batch)
        return
    if args.profile:
        for name in args.dtypes.split(","):
            profile_step(model, voices, device, name, limit, record, args.profile_batch, args.profile_window)
        return
    reference = None
    for name in args.dtypes.split(","):  # float32 first: lower precisions are rounded from its weights
        dtype, tf32 = (torch.float32, True) if name == "tf32" else (getattr(torch, name), False)
        model.code2wav_dit_model.to(dtype)
        audio = one_shot(models.Token2Wav(model, voices, device, tf32=tf32), limit)
        if reference is None:
            reference = audio
        else:
            rms = ((audio - reference).pow(2).mean() / reference.pow(2).mean()).sqrt().item()
            record(part="dit_precision", dit_dtype=name, relative_rms_vs_float32=round(rms, 5))
        for context in args.contexts.split(","):
            decoders = {}
            for window, batch in CASES:
                if window not in decoders:
                    decoders[window] = models.Token2Wav(model, voices, device, window=window, tf32=tf32,
                                                        max_batch=max(b for w, b in CASES if w == window),
                                                        kept_context=context == "kept")
                    decoders[window].warm_up()
                decoder = decoders[window]
                step_seconds(decoder, window, batch, limit)
                seconds = statistics.median(step_seconds(decoder, window, batch, limit)
                                            for _ in range(3 if batch < 32 else 1))
                audio_s = batch * window * decoder.dit.repeats * decoder.HOP / models.SAMPLE_RATE
                record(part="token2wav_window", dit_dtype=name, context=context, window=window, left=decoder.left,
                       right=decoder.right, batch=batch, ms_per_step=round(1000 * seconds, 1),
                       audio_s_per_s=round(audio_s / seconds, 2))
        for batch in (1, 8):  # the same steady-state solve through transformers' DiT `sample` (what generate runs)
            seconds = statistics.median(hf_sample_seconds(model, voices, 24 + 48 + 12, batch, limit, tf32)
                                        for _ in range(3))
            solved_again = decoders[48]
            if solved_again.kept_context:
                solved_again = models.Token2Wav(model, voices, device, window=48, tf32=tf32, kept_context=False)
            ours = statistics.median(solve_seconds(solved_again, 84, batch, limit) for _ in range(3))
            record(part="dit_solve", dit_dtype=name, codes=84, batch=batch,
                   transformers_sample_ms=round(1000 * seconds, 1), omnistage_ms=round(1000 * ours, 1))


def profile_step(model, voices: dict, device: torch.device, name: str, limit: int, record, batch: int = 32,
                 window: int = 48) -> None:
    """Where a step of `batch` windows of `window` codes spends device time: kernels by total time (eager, so
    kernels keep their ops' names; their sum against a graph replay's time shows what launches cost), and the
    solve's and vocoder's shares."""
    from torch.profiler import ProfilerActivity, profile

    dtype, tf32 = (torch.float32, True) if name == "tf32" else (getattr(torch, name), False)
    model.code2wav_dit_model.to(dtype)
    decoder = models.Token2Wav(model, voices, device, window=window, tf32=tf32, use_graphs=False, max_batch=batch)
    step_seconds(decoder, window, batch, limit)  # warm-up
    activities = [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        seconds = step_seconds(decoder, window, batch, limit)
    table = prof.key_averages().table(sort_by="self_cuda_time_total" if device.type == "cuda" else
                                      "self_cpu_time_total", row_limit=30)
    print(f"== {name}: eager batch-{batch} step {1000 * seconds:.0f} ms\n{table}", flush=True)
    solve = solve_seconds(decoder, window + decoder.left + decoder.right, batch, limit)
    mel = torch.zeros(batch, decoder.dit.mel_dim, window * decoder.dit.repeats + 2 * decoder.vocoder_context,
                      device=device)
    record(part="token2wav_profile", dit_dtype=name, batch=batch, window=window, eager_step_ms=round(1000 * seconds, 1),
           eager_solve_ms=round(1000 * solve, 1), eager_vocoder_ms=round(1000 * vocode_seconds(decoder, mel), 1))


def length_rows(model, voices: dict, device: torch.device, name: str, limit: int, max_window: int, record,
                max_batch: int = 1) -> None:
    """Milliseconds of one continuing window's solve and vocoder pass by window length (what a request's last
    window costs after the talker is done), the matmuls with all SMs and with 32 left free; `max_batch`: the
    batch sizes graphs are captured for (a server's: 32), though each pass here solves one window."""
    dtype, tf32 = (torch.float32, True) if name == "tf32" else (getattr(torch, name), False)
    model.code2wav_dit_model.to(dtype)
    for carveout in (0, 32):
        decoder = models.Token2Wav(model, voices, device, window=48, first_window=24, max_window=max_window,
                                   tf32=tf32, max_batch=max_batch, cublas_sm_carveout=carveout)
        decoder.warm_up()
        for codes in sorted({codes for codes, _ in decoder.window_shapes()}):  # the graphs' lengths on CUDA
            solve = statistics.median(solve_seconds(decoder, codes, 1, limit) for _ in range(5))
            frames = (codes - decoder.right) * decoder.dit.repeats + 2 * decoder.vocoder_context
            mel = torch.zeros(1, decoder.dit.mel_dim, frames, device=device)
            vocoder = statistics.median(vocode_seconds(decoder, mel) for _ in range(5))
            record(part="token2wav_length", dit_dtype=name, carveout=carveout, codes=codes, max_batch=max_batch,
                   solve_ms=round(1000 * solve, 2), vocoder_ms=round(1000 * vocoder, 2))


def vocoder_rows(model, voices: dict, device: torch.device, record, shapes=((80, 1), (128, 1), (224, 1), (416, 1),
                                                                            (128, 8), (128, 32))) -> None:
    """The vocoder alone by precision: milliseconds a pass (graph replay) for each (mel frames, batch), the
    window shapes of the default schedule (24, 48, 96, 192 codes and 16 frames of context a side), and the
    relative RMS distance of each precision's waveform from strict float32's on the same mel."""
    torch.manual_seed(1)
    mel = (torch.randn(1, model.config.dit_config.mel_dim, 416, device=device) - 4).cumsum(-1) / 20 - 4
    reference = None
    precisions = [("float32_strict", False, "float32"), ("float32", None, "float32"), ("bfloat16", None, "bfloat16")]
    for name, cudnn_tf32, dtype in precisions if device.type == "cuda" else precisions[:1]:
        default = torch.backends.cudnn.allow_tf32
        torch.backends.cudnn.allow_tf32 = default if cudnn_tf32 is None else cudnn_tf32
        try:
            decoder = models.Token2Wav(model, voices, device, window=48, vocoder_dtype=dtype, max_batch=32)
            for frames in sorted({frames for frames, _ in shapes} if device.type == "cuda" else ()):  # all batches
                decoder.vocode.capture(torch.zeros(1, mel.shape[1], frames, device=device))
            with torch.inference_mode():
                wave = decoder.vocode(mel)[0].clone()
            if reference is None:
                reference = wave
            rms = ((wave - reference).pow(2).mean() / reference.pow(2).mean()).sqrt().item()
            for frames, batch in shapes:
                batch_mel = mel[:, :, :frames].expand(batch, -1, -1).contiguous()
                ms = 1000 * statistics.median(vocode_seconds(decoder, batch_mel) for _ in range(5))
                record(part="vocoder_precision", precision=name, cudnn_allow_tf32=torch.backends.cudnn.allow_tf32,
                       frames=frames, batch=batch, vocoder_ms=round(ms, 2), relative_rms_vs_strict=round(rms, 5))
        finally:
            torch.backends.cudnn.allow_tf32 = default


def vocode_seconds(decoder: models.Token2Wav, mel: torch.Tensor) -> float:
    """One vocoder pass after a warm-up one (a graph replay where one was captured for mel's shape)."""
    with torch.inference_mode():
        decoder.vocode(mel)
        if decoder.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        decoder.vocode(mel)
        if decoder.device.type == "cuda":
            torch.cuda.synchronize()
    return time.perf_counter() - start


def hf_sample_seconds(model, voices: dict, codes: int, batch: int, limit: int, tf32: bool) -> float:
    dit = model.code2wav_dit_model
    dtype, device = next(dit.parameters()).dtype, next(dit.parameters()).device
    voice = voices["Chelsie"]
    cond, ref_mel = (voice[k].to(device, dtype).expand(batch, *voice[k].shape[1:]) for k in ("cond", "ref_mel"))
    ids = torch.tensor([[(5 * j) % limit for j in range(codes)]] * batch, device=device)
    with torch.inference_mode(), models.tf32_matmuls() if tf32 else contextlib.nullcontext():
        dit.sample(cond, ref_mel, ids)  # warm-up
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        dit.sample(cond, ref_mel, ids)
        if device.type == "cuda":
            torch.cuda.synchronize()
    return time.perf_counter() - start


def solve_seconds(decoder: models.Token2Wav, codes: int, batch: int, limit: int) -> float:
    """One flow-matching solve (a graph replay when captured), without the vocoder."""
    speaker, features = decoder.speakers["Chelsie"]
    ids = torch.tensor([[(5 * j) % limit for j in range(codes)]] * batch, device=decoder.device)
    noise = torch.randn(batch, codes * decoder.dit.repeats, decoder.dit.mel_dim, device=decoder.device,
                        dtype=decoder.dit_dtype)
    frames = torch.full((batch,), noise.shape[1], device=decoder.device)
    inputs = (noise, ids, speaker.expand(batch, -1), features.expand(batch, -1, -1), frames)
    if decoder.kept_context:  # continuing windows: the kept context read, the next one handed on
        kept = torch.zeros(batch, *decoder.solver.kept_shape(), device=decoder.device, dtype=decoder.dit_dtype)
        inputs += (kept, torch.ones(batch, dtype=torch.long, device=decoder.device), frames)
    with torch.inference_mode():
        decoder.solve(*inputs)
        if decoder.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        decoder.solve(*inputs)
        if decoder.device.type == "cuda":
            torch.cuda.synchronize()
    return time.perf_counter() - start

if __name__ == "__main__":
    main()
