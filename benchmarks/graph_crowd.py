"""Does a CUDA graph's replay slow down once the process captures another graph? (run 35: the talker's batch-1
burst graph replays 8.90 ms alone, 9.30 once any other graph, even one of a single kernel, was captured after it;
letting that graph go did not bring the 8.90 back.) The same question on a decode-like chain in plain torch, so
it can be asked of the driver without omnistage: each case runs in a fresh process, a list of steps, and times the
chain's replay after each.

    python benchmarks/graph_crowd.py --out benchmarks/results/graph_crowd-h200-DATE.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

CASES = {  # name: (steps, environment); "first:S" is taken before the timed chain is captured; "timed:short" times
    # one step of the chain, "timed:adds" 2,000 one-element additions
    "default": ("graph,graph,drop,recapture", {}),
    "graph_first": ("first:graph,graph", {}),
    "chain_first": ("first:chain,graph", {}),
    "one_step_chain": ("timed:short,graph", {}),
    "adds": ("timed:adds,graph,graph", {}),
    "recapture_kept": ("graph,recapture_kept", {}),
    "profiled": ("profile,graph,profile", {}),
    "instantiation": ("captured,instantiate,graph", {}),
    "upload": ("graph,upload,fresh_stream,upload", {}),
    "reinstantiate": ("graph,reinstantiate", {}),
    "short_first": ("first:short,graph", {}),
    "adds_first": ("first:adds,graph", {}),
    "time_only": ("sleep,eager,sleep,graph", {}),
    "other_process": ("other_process,graph", {}),
    "other_context": ("other_context,graph", {}),
    "other_process_after": ("graph,other_process,other_context", {}),
    "big_alloc": ("big_alloc,graph", {}),
    "own_context": ("graph,own_context,graph,own_context", {}),
    "deferred": ("timed:deferred,captured,chain_deferred,instantiate_all,graph", {}),
    "own_stream": ("own,own,recapture", {}),
    "shared_pool": ("pool,pool", {}),
    "stream_only": ("stream,eager,graph", {}),
    "replayed": ("replayed,replayed", {}),
    "eager_loading": ("graph", {"CUDA_MODULE_LOADING": "EAGER"}),
    "two_chains": ("chain,graph", {}),
}


def add_chain(torch, kernels: int = 2000):
    """A chain of `kernels` one-element additions: a replay's time is little more than its kernel boundaries."""
    x = torch.zeros(1, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=torch.cuda.Stream(), capture_error_mode="thread_local"):
        for _ in range(kernels):
            x.add_(1)
    graph.keep = x
    return graph


def chain_graph(torch, layers: int = 24, steps: int = 8, width: int = 2048, instantiate: bool = True):
    """`steps` x `layers` x (4 skinny matmuls over distinct weights, 3 elementwise ops): ~1.4 GB of weights read
    a replay, ~1,300 kernels, batch 1 (a decode burst's shape, not its arithmetic)."""
    dev, dt = torch.device("cuda"), torch.bfloat16
    ws = [[torch.randn(o, i, device=dev, dtype=dt) * 0.02 for o, i in
           ((width + 512, width), (width, width), (8 * width, width), (width, 4 * width))] for _ in range(layers)]
    x = torch.randn(1, width, device=dev, dtype=dt)

    def run():
        h = x
        for _ in range(steps):
            for qkv, o, up, down in ws:
                a = torch.nn.functional.linear(h, qkv)[:, :width]
                h = h + torch.nn.functional.linear(a, o)
                g, u = torch.nn.functional.linear(h, up).chunk(2, dim=-1)
                h = h + torch.nn.functional.linear(torch.nn.functional.silu(g) * u, down)
        return h

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph(keep_graph=True)  # kept: "reinstantiate" instantiates it again
    with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
        run()
    if instantiate:
        graph.instantiate()
    graph.keep = (ws, x)  # the memory its replays read lives as long as it does
    return graph, run


def replay_ms(torch, graph, replays: int = 100, stream=None) -> tuple[float, str]:
    stream = stream or torch.cuda.current_stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        graph.replay()
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
    clocks = gpu_clocks()  # while the replays run
    end.synchronize()
    return round(start.elapsed_time(end) / replays, 4), clocks


def gpu_clocks() -> str:
    """nvidia-smi's SM and memory clocks, power, temperature and throttle reasons now (is a slow replay a slow
    clock?)."""
    query = "clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active"
    done = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True,
                          text=True)
    return done.stdout.strip() or done.stderr.strip()[-200:]


def upload(torch, graph, stream) -> None:
    """cuGraphUpload: the graph's executable set up on the device in `stream` ahead of a launch there."""
    import ctypes

    driver = ctypes.CDLL("libcuda.so.1")
    err = driver.cuGraphUpload(ctypes.c_void_p(graph.raw_cuda_graph_exec()), ctypes.c_void_p(stream.cuda_stream))
    if err:
        raise RuntimeError(f"cuGraphUpload failed: {err}")


def kernel_ms(torch, graph, replays: int = 10) -> float:
    """Device time of the kernels a replay runs, summed (CUPTI): what a replay would take with no gaps."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    return round(sum(e.self_device_time_total for e in prof.key_averages()) / 1000 / replays, 4)


def other_context(device_index: int, how: str = "thread") -> None:
    """A CUDA context other than this process's (torch's primary one) made on the device, given a little work,
    and destroyed: "thread" from a thread of this process (driver API), "process" by a child process."""
    if how == "process":
        subprocess.run([sys.executable, "-c", f"import torch; torch.zeros(1, device='cuda:{device_index}')"],
                       check=True)
        return
    import ctypes
    import threading

    def run() -> None:
        cu = ctypes.CDLL("libcuda.so.1")
        dev, ctx, ptr = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
        steps = [lambda: cu.cuInit(0), lambda: cu.cuDeviceGet(ctypes.byref(dev), device_index),
                 lambda: cu.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev),
                 lambda: cu.cuMemAlloc_v2(ctypes.byref(ptr), 4), lambda: cu.cuMemsetD8_v2(ptr, 0, 4),
                 lambda: cu.cuCtxSynchronize(), lambda: cu.cuMemFree_v2(ptr), lambda: cu.cuCtxDestroy_v2(ctx)]
        for i, step in enumerate(steps):
            if err := step():
                raise RuntimeError(f"CUDA driver call {i} failed: {err}")

    errors = []

    def target() -> None:
        try:
            run()
        except Exception as e:  # noqa: BLE001 - raised again in the caller's thread
            errors.append(e)

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]


def as_row(ms_and_clocks: tuple[float, str]) -> dict:
    return dict(zip(("ms", "clocks"), ms_and_clocks, strict=True))


def one_case(steps: str) -> list[dict]:
    """In this process: the chain's replay time alone, then after each step."""
    import torch

    kept, x = [], torch.zeros(1, device="cuda")

    def tiny(**kwargs) -> torch.cuda.CUDAGraph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, **kwargs):
            x.add_(1)
        kept.append(g)
        return g

    before = [s.removeprefix("first:") for s in steps.split(",") if s.startswith("first:")]
    for step in before:
        first = {"graph": tiny, "short": lambda: chain_graph(torch, steps=1)[0], "adds": lambda: add_chain(torch),
                 "chain": lambda: chain_graph(torch)[0]}[step]()
        if not kept or kept[-1] is not first:
            kept.append(first)
    timed = next((s.removeprefix("timed:") for s in steps.split(",") if s.startswith("timed:")), "chain")
    graph = {"chain": lambda: chain_graph(torch)[0], "short": lambda: chain_graph(torch, steps=1)[0],
             "adds": lambda: add_chain(torch), "deferred": lambda: chain_graph(torch, instantiate=False)[0]}[timed]()
    stream = torch.cuda.current_stream()
    out = [] if timed == "deferred" else [{"after": "nothing", "other_graphs": len(kept),
                                             **as_row(replay_ms(torch, graph))}]
    for step in (s for s in steps.split(",") if not s.startswith(("first:", "timed:"))):
        if step == "graph":  # torch's defaults: its shared capture stream, global capture mode, a new pool
            tiny()
        elif step == "own":  # as omnistage's runners capture: a stream of its own, thread-local mode
            tiny(stream=torch.cuda.Stream(), capture_error_mode="thread_local")
        elif step == "pool":
            tiny(pool=graph.pool())
        elif step == "replayed":
            tiny().replay()
        elif step == "stream":
            torch.cuda.Stream()
        elif step == "eager":
            x.add_(1)
        elif step == "drop":
            kept.clear()
        elif step == "recapture":  # the chain captured anew, after the others (the old one let go)
            graph = chain_graph(torch)[0]
        elif step == "recapture_kept":  # the same, the old one kept
            kept.append(graph)
            graph = chain_graph(torch)[0]
        elif step == "sleep":
            time.sleep(10)
        elif step == "other_process":  # another process on the GPU captures a graph and exits
            code = "import torch; x = torch.zeros(1, device='cuda'); g = torch.cuda.CUDAGraph()\n" \
                   "with torch.cuda.graph(g): x.add_(1)"
            subprocess.run([sys.executable, "-c", code], check=True)
        elif step == "other_context":  # another process only makes a CUDA context and exits
            subprocess.run([sys.executable, "-c", "import torch; torch.zeros(1, device='cuda')"], check=True)
        elif step == "own_context":  # this process makes a second CUDA context, runs a memset in it, destroys it
            other_context(torch.cuda.current_device())
        elif step == "big_alloc":  # 20 GB taken and given back to the driver
            y = torch.empty(20 << 30, dtype=torch.uint8, device="cuda")
            del y
            torch.cuda.empty_cache()
        elif step == "captured":  # captured, not instantiated
            g = torch.cuda.CUDAGraph(keep_graph=True)
            with torch.cuda.graph(g):
                x.add_(1)
            kept.append(g)
        elif step == "instantiate":  # the last one kept
            kept[-1].instantiate()
        elif step == "chain_deferred":  # another chain, captured, not instantiated
            kept.append(chain_graph(torch, instantiate=False)[0])
        elif step == "instantiate_all":  # "timed:deferred": the timed chain, then the others, only now
            for g in [graph, *kept]:
                g.instantiate()
        elif step == "reinstantiate":  # the timed chain's executable made anew from its kept graph
            graph.instantiate()
        elif step == "upload":
            upload(torch, graph, stream)
        elif step == "fresh_stream":  # the timed chain replayed on a new stream from here on
            stream = torch.cuda.Stream()
        elif step == "chain":  # a second chain, as big as the first
            kept.append(chain_graph(torch)[0])
        torch.cuda.synchronize()
        if step in ("captured", "chain_deferred") and timed == "deferred":
            continue  # nothing instantiated yet to time
        if step == "profile":  # the kernels' own time, summed (the profiler may change what follows)
            out.append({"after": step, "other_graphs": len(kept), "kernel_ms": kernel_ms(torch, graph)})
            continue
        out.append({"after": step, "other_graphs": len(kept), **as_row(replay_ms(torch, graph, stream=stream))})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--steps", help="(internal) run these steps in this process and print the timings")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.steps is not None:
        print(json.dumps(one_case(args.steps)))
        return
    for name in args.cases.split(","):
        steps, env = CASES[name]
        done = subprocess.run([sys.executable, __file__, "--steps", steps], env={**os.environ, **env},
                              capture_output=True, text=True, timeout=300)
        if done.returncode:
            print(done.stderr[-2000:], file=sys.stderr)
            continue
        row = {"part": "graph_crowd", "case": name, "env": env, "timings": json.loads(done.stdout.splitlines()[-1])}
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
