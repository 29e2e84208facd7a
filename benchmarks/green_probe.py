"""Probe (temporary): do CUDA green contexts keep a big kernel stream off some SMs so a latency-bound chain
of small kernels on another stream is not delayed?"""
import time

import torch
from torch.cuda import green_contexts as gc

print(torch.__version__, torch.version.cuda, [n for n in dir(gc.GreenContext) if not n.startswith("_")], flush=True)
dev = torch.device("cuda")
sms = torch.cuda.get_device_properties(0).multi_processor_count
print("SMs", sms)
a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
w = torch.randn(896, 4864, device=dev, dtype=torch.bfloat16)
w2 = torch.randn(4864, 896, device=dev, dtype=torch.bfloat16)
x0 = torch.randn(32, 896, device=dev, dtype=torch.bfloat16)


def big(n=40):
    for _ in range(n):
        torch.mm(a, a)


def chain(x, n=200):
    for _ in range(n):
        x = torch.nn.functional.gelu(x @ w) @ w2 * 0.01 + x
    return x


def timed_chain(stream, reps=5):
    out = []
    for _ in range(reps):
        with torch.cuda.stream(stream):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            chain(x0)
            e.record()
        e.synchronize()
        out.append(s.elapsed_time(e))
    return sorted(out)[len(out) // 2]


hi = torch.cuda.Stream(priority=-1)
normal = torch.cuda.Stream()
torch.cuda.synchronize()
print("chain alone ms", timed_chain(hi))
start = time.perf_counter()
with torch.cuda.stream(normal):
    big()
torch.cuda.synchronize()
print("big alone ms", 1000 * (time.perf_counter() - start))


def contended(big_stream, label, graph=None):
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.cuda.stream(big_stream):
        if graph is not None:
            for _ in range(4):
                graph.replay()
        else:
            big(160)
    t = timed_chain(hi, reps=5)
    big_stream.synchronize()
    print(label, "chain ms", t, "big(160) ms", 1000 * (time.perf_counter() - start), flush=True)


contended(normal, "normal stream:")
for n in (sms - 16, sms - 32, sms // 2):
    try:
        ctx = gc.GreenContext.create(num_sms=n, device_id=0)
        if hasattr(ctx, "Stream"):
            gs = ctx.Stream()
        else:
            ctx.set_context()
            gs = torch.cuda.Stream()
            ctx.pop_context()
        contended(gs, f"green {n} SMs:")
        g = torch.cuda.CUDAGraph()
        cs = torch.cuda.Stream()
        with torch.cuda.graph(g, stream=cs):
            big(40)
        contended(gs, f"green {n} SMs, graph captured on a normal stream:", g)
        contended(normal, "same graph on a normal stream:", g)
    except Exception as exc:  # noqa: BLE001
        print("green", n, "failed:", type(exc).__name__, exc, flush=True)
