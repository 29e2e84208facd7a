"""Why does a CUDA graph's replay slow down in a process that does other things? Run 34 found the talker's batch-1
burst graph 4% slower once graphs for other batch sizes were captured; run 35 found one capture of one kernel
enough, and then the same in plain torch: a decode-like chain of ~1,500 kernels (skinny cuBLAS matmuls streaming
23 GB a replay) replays ~7% slower (9.15 -> 9.78 ms on an H200) once the process captures another graph or runs a
kernel on another stream, the kernels' own time unchanged; another CUDA context running once on the device ends it
(`other_context`). Each case runs in a process of its own: a list of steps (methods of `Probe`), the timed graph's
replay time after each, with nvidia-smi's clocks. Results: benchmarks/results/omni_qwen2_5.md, "Run 35" and
"Run 36" (after a reset none of a request's kinds of work restart the chain's slow state, where the talker's own
steps restart its graph's: `talker_interference.py --stepwise`).

    python benchmarks/graph_crowd.py --out benchmarks/results/graph_crowd-h200-DATE.jsonl
    python benchmarks/graph_crowd.py --cases side_work,own_context
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from torch.profiler import ProfilerActivity, profile

from omnistage.kernels.skinny_gemm import linear

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
    # what else, besides a capture, puts a process in the slow state (serving captures nothing)?
    "side_work": ("side_work", {}),
    "concurrent": ("concurrent", {}),
    "pinned_copies": ("pinned_copies", {}),
    "priority_stream": ("priority_stream", {}),
    "cross_stream_event": ("cross_stream_event", {}),
    "cublas": ("cublas", {}),
    "new_segment": ("new_segment", {}),
    "side_work_one_connection": ("side_work,concurrent", {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}),
    "side_work_32_connections": ("side_work,concurrent", {"CUDA_DEVICE_MAX_CONNECTIONS": "32"}),
    "threads_after_reset": ("own_context,thread_work,thread_stream_work,priority_stream,side_replay,thread_capture",
                            {}),
    "request_like_after_reset": ("own_context,d2h_event,cublas_side,pdl_eager,pdl_side", {}),
    # run 36: what a request does that the steps above do not
    "request_like_after_reset_2": ("own_context,side_copies,side_event_record,record_stream,pdl_graph_side,"
                                   "pdl_graph_concurrent", {}),
    "old_graphs_after_reset": ("first:graph,first:short,own_context,first_here,first_side,first_short_side", {}),
    "old_streams_after_reset": ("side_work,own_context,same_side_work,chain_stream_work", {}),
    "kept_context": ("side_work,second_context,poke,side_work,poke,concurrent,poke", {}),
    "request_like_after_reset_3": ("own_context,cudnn_side,lt_side,carveout_side,triton_new_side,thread_concurrent",
                                   {}),
    "triton_after_reset": ("triton_first,own_context,triton_same_side,own_context,triton_new_here,own_context,"
                           "triton_new_side_small,own_context,triton_old_reload", {}),
    "triton_init_after_reset": ("own_context,triton_first,own_context,triton_new_side_small", {}),
    "copies_after_reset": ("own_context,pinned_copies,own_context,pageable_h2d,own_context,pageable_d2h,own_context,"
                           "list_to_device,own_context,item,own_context,pageable_h2d_side", {}),
    "prefill_like_after_reset": ("own_context,index_copy_here,own_context,index_copy_side,own_context,"
                                 "index_copy_high,own_context,embeds_like_high", {}),
    "side_work_after_reset": ("side_work,own_context,side_work,own_context,concurrent", {}),
    "deferred": ("timed:deferred,captured,chain_deferred,instantiate_all,graph", {}),
    "own_stream": ("own,own,recapture", {}),
    "shared_pool": ("pool,pool", {}),
    "stream_only": ("stream,eager,graph", {}),
    "replayed": ("replayed,replayed", {}),
    "eager_loading": ("graph", {"CUDA_MODULE_LOADING": "EAGER"}),
    "two_chains": ("chain,graph", {}),
}


@triton.jit
def _add_kernel(x_ptr, n, VALUE: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offsets, tl.load(x_ptr + offsets, mask=offsets < n) + VALUE, mask=offsets < n)


def add_value(x: torch.Tensor, value: int) -> None:
    """x += value by a Triton kernel: each new `value` compiles and loads a module of its own."""
    _add_kernel[(triton.cdiv(x.numel(), 128),)](x, x.numel(), VALUE=value, BLOCK=128)


def log_triton_loads(record: Callable[..., None]) -> None:
    """record(part="triton_load", kernel=NAME) whenever Triton loads a compiled kernel's module onto the device
    (run 36: does a request load any? None did; every load came at start-up)."""
    from triton.runtime import driver

    utils = driver.active.utils
    load = utils.load_binary

    def logged(name, *args, **kwargs):
        record(part="triton_load", kernel=name, t=round(time.perf_counter(), 4))
        return load(name, *args, **kwargs)

    utils.load_binary = logged


def add_chain(kernels: int = 2000):
    """A chain of `kernels` one-element additions: a replay's time is little more than its kernel boundaries."""
    x = torch.zeros(1, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=torch.cuda.Stream(), capture_error_mode="thread_local"):
        for _ in range(kernels):
            x.add_(1)
    graph.keep = x
    return graph


def chain_graph(layers: int = 24, steps: int = 8, width: int = 2048, instantiate: bool = True):
    """`steps` x `layers` x (4 skinny matmuls over distinct weights, 3 elementwise ops): 2.9 GB of weights read a
    step (23 GB a replay), ~1,500 kernels, batch 1 (a decode burst's shape, not its arithmetic)."""
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
    graph.capture_stream = stream
    return graph, run


def replay_ms(graph: torch.cuda.CUDAGraph, replays: int = 100, stream: torch.cuda.Stream | None = None,
              meanwhile: Callable[[], object] | None = None) -> float:
    """Milliseconds a replay of `graph`, `replays` queued back to back on `stream` (after one to warm up);
    `meanwhile()` is called while they run."""
    stream = stream or torch.cuda.current_stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        graph.replay()
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
    if meanwhile is not None:
        meanwhile()
    end.synchronize()
    return round(start.elapsed_time(end) / replays, 4)


def gpu_clocks() -> str:
    """nvidia-smi's SM and memory clocks, power, temperature and throttle reasons now (is a slow replay a slow
    clock?)."""
    query = "clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active"
    done = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True,
                          text=True)
    return done.stdout.strip() or done.stderr.strip()[-200:]


def upload(graph, stream) -> None:
    """cuGraphUpload: the graph's executable set up on the device in `stream` ahead of a launch there."""
    driver = ctypes.CDLL("libcuda.so.1")
    err = driver.cuGraphUpload(ctypes.c_void_p(graph.raw_cuda_graph_exec()), ctypes.c_void_p(stream.cuda_stream))
    if err:
        raise RuntimeError(f"cuGraphUpload failed: {err}")


def kernel_ms(graph, replays: int = 10) -> float:
    """Device time of the kernels a replay runs, summed (CUPTI): what a replay would take with no gaps."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    return round(sum(e.self_device_time_total for e in prof.key_averages()) / 1000 / replays, 4)


class SecondContext:
    """A CUDA context of this process's own beside torch's primary one, made and used on a thread of its own (the
    driver API: torch never sees it). `poke()` runs a 4-byte memset in it and waits, so the GPU switches to it and
    back; `close()` destroys it."""

    def __init__(self, device_index: int) -> None:
        self.requests, self.replies = queue.Queue(), queue.Queue()
        self.thread = threading.Thread(target=self._serve, args=(device_index,), daemon=True)
        self.thread.start()
        self._reply()

    def _serve(self, device_index: int) -> None:
        dev, ctx, ptr = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()

        def calls(*fns) -> None:
            for fn in fns:
                if err := fn():
                    raise RuntimeError(f"CUDA driver call failed: {err}")

        try:
            cu = ctypes.CDLL("libcuda.so.1")
            calls(lambda: cu.cuInit(0), lambda: cu.cuDeviceGet(ctypes.byref(dev), device_index),
                  lambda: cu.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev), lambda: cu.cuMemAlloc_v2(ctypes.byref(ptr), 4))
            self.replies.put(None)
            while self.requests.get() == "poke":
                calls(lambda: cu.cuMemsetD8_v2(ptr, 0, 4), lambda: cu.cuCtxSynchronize())
                self.replies.put(None)
            calls(lambda: cu.cuMemFree_v2(ptr), lambda: cu.cuCtxDestroy_v2(ctx))
            self.replies.put(None)
        except Exception as e:  # noqa: BLE001 - raised again in the caller's thread
            self.replies.put(e)

    def _reply(self) -> None:
        if (error := self.replies.get()) is not None:
            raise error

    def poke(self) -> None:
        self.requests.put("poke")
        self._reply()

    def close(self) -> None:
        if not self.thread.is_alive():  # it failed (raised in poke) and ended
            return
        self.requests.put("close")
        self._reply()
        self.thread.join()


def other_context(device_index: int, how: str = "thread") -> None:
    """A CUDA context other than this process's (torch's primary one) made on the device, given a little work,
    and destroyed: "thread" from a thread of this process (driver API), "process" by a child process."""
    if how == "process":
        subprocess.run([sys.executable, "-c", f"import torch; torch.zeros(1, device='cuda:{device_index}')"],
                       check=True)
        return
    second = SecondContext(device_index)
    second.poke()
    second.close()


def timed_row(graph, stream=None) -> dict:
    """The replay time of `graph` with nvidia-smi's clocks read while the replays run."""
    clocks = []
    ms = replay_ms(graph, stream=stream, meanwhile=lambda: clocks.append(gpu_clocks()))
    return {"ms": ms, "clocks": clocks[0]}


class Probe:
    """One process's timed graph (`timed`: "chain", "short", "adds", or "deferred": a chain captured but not yet
    instantiated), the graphs kept beside it, and one method per step, named as the step."""

    def __init__(self, timed: str, first: list[str]) -> None:
        self.memory = []
        self.x = torch.zeros(1, device="cuda")
        self.replay_stream = torch.cuda.current_stream()
        makers = {"graph": self.tiny_graph, "chain": lambda: chain_graph()[0],
                  "short": lambda: chain_graph(steps=1)[0], "adds": lambda: add_chain(),
                  "deferred": lambda: chain_graph(instantiate=False)[0]}
        self.kept = [makers[name]() for name in first]  # "first:NAME": graphs captured before the timed one
        self.timed_graph = makers[timed]()

    def tiny_graph(self, keep_graph: bool = False, **capture):
        """A graph of one one-element addition (`capture`: torch.cuda.graph's stream, pool, capture mode)."""
        graph = torch.cuda.CUDAGraph(keep_graph=keep_graph)
        with torch.cuda.graph(graph, **capture):
            self.x.add_(1)
        return graph

    def on_side_stream(self, fn, priority: int = 0, stream=None) -> None:
        """`fn()` on `stream`, by default a new one (kept as `last_side`)."""
        self.last_side = stream or torch.cuda.Stream(priority=priority)
        with torch.cuda.stream(self.last_side):
            fn()

    def in_thread(self, fn) -> None:
        """`fn()` from a new host thread (as omnistage's inline stage workers launch), synchronized there."""
        worker = threading.Thread(target=lambda: (fn(), torch.cuda.synchronize()))
        worker.start()
        worker.join()

    # captures and graphs
    def graph(self) -> None:  # torch's defaults: its shared capture stream, global capture mode, a new pool
        self.kept.append(self.tiny_graph())

    def own(self) -> None:  # as omnistage's runners capture: a stream of its own, thread-local mode
        self.kept.append(self.tiny_graph(stream=torch.cuda.Stream(), capture_error_mode="thread_local"))

    def pool(self) -> None:  # in the timed graph's memory pool
        self.kept.append(self.tiny_graph(pool=self.timed_graph.pool()))

    def replayed(self) -> None:
        self.graph()
        self.kept[-1].replay()

    def captured(self) -> None:  # captured, not instantiated
        self.kept.append(self.tiny_graph(keep_graph=True))

    def instantiate(self) -> None:  # the last graph kept
        self.kept[-1].instantiate()

    def chain(self) -> None:  # a second chain, as big as the first
        self.kept.append(chain_graph()[0])

    def chain_deferred(self) -> None:  # another chain, captured, not instantiated
        self.kept.append(chain_graph(instantiate=False)[0])

    def instantiate_all(self) -> None:  # "timed:deferred": the timed chain, then the others, only now
        for graph in [self.timed_graph, *self.kept]:
            graph.instantiate()

    def drop(self) -> None:
        self.kept.clear()

    def recapture(self) -> None:  # the chain captured anew, after the others (the old one let go)
        self.timed_graph = chain_graph()[0]

    def recapture_kept(self) -> None:  # the same, the old one kept
        self.kept.append(self.timed_graph)
        self.recapture()

    def reinstantiate(self) -> None:  # the timed chain's executable made anew from its kept graph
        self.timed_graph.instantiate()

    def upload(self) -> None:
        upload(self.timed_graph, self.replay_stream)

    def fresh_stream(self) -> None:  # the timed chain replayed on a new stream from here on
        self.replay_stream = torch.cuda.Stream()

    def first_here(self) -> None:  # the first graph kept ("first:graph", captured before any reset), replayed here
        self.kept[0].replay()

    def first_side(self) -> None:  # the same on another stream
        self.on_side_stream(self.kept[0].replay)

    def first_short_side(self) -> None:  # "first:short" (a cuBLAS graph from before a reset) on another stream
        self.on_side_stream(self.kept[1].replay)

    def thread_capture(self) -> None:
        self.in_thread(self.own)

    def side_replay(self) -> None:  # a graph replayed on another stream
        self.graph()
        self.on_side_stream(self.kept[-1].replay)

    # work outside graphs
    def stream(self) -> None:  # a stream made, no work on it
        torch.cuda.Stream()

    def eager(self) -> None:
        self.x.add_(1)

    def side_work(self) -> None:  # a kernel on another stream
        self.on_side_stream(self.eager)

    def same_side_work(self) -> None:  # a kernel on the last side stream again (one that worked before a reset)
        self.on_side_stream(self.eager, stream=self.last_side)

    def chain_stream_work(self) -> None:  # a kernel on the stream the timed chain was warmed up and captured on
        self.on_side_stream(self.eager, stream=self.timed_graph.capture_stream)

    def thread_work(self) -> None:  # a kernel from another host thread, on its current stream
        self.in_thread(self.eager)

    def thread_stream_work(self) -> None:
        self.in_thread(lambda: self.on_side_stream(self.eager))

    def priority_stream(self) -> None:
        self.on_side_stream(self.eager, priority=-1)

    def concurrent(self) -> None:  # the timed chain on this stream while additions run on another
        self.timed_graph.replay()
        self.on_side_stream(lambda: [self.x.add_(1) for _ in range(2000)])

    def cross_stream_event(self) -> None:  # another stream waits on this one's event, then works
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.x.add_(1)
        torch.cuda.current_stream().wait_stream(side)

    def cublas(self) -> None:  # an eager matmul on this stream
        a = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
        a @ a.T

    def cublas_side(self) -> None:
        self.on_side_stream(self.cublas)

    def pdl_eager(self) -> None:  # omnistage's skinny GEMM (launched with PDL) outside a graph
        linear(torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16),
               torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16))

    def pdl_side(self) -> None:
        self.on_side_stream(self.pdl_eager)

    def pdl_graph_side(self) -> None:  # a graph of omnistage's PDL-launched GEMMs replayed on another stream
        x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
        linear(x, w)  # compiled outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=torch.cuda.Stream(), capture_error_mode="thread_local"):
            for _ in range(64):
                x = linear(x, w)
        graph.keep = (x, w)
        self.kept.append(graph)
        self.on_side_stream(graph.replay)

    def pdl_graph_concurrent(self) -> None:  # that graph on another stream while the timed chain runs
        self.timed_graph.replay()
        self.on_side_stream(lambda: [self.kept[-1].replay() for _ in range(20)])

    def cudnn_side(self) -> None:  # a float32 cuDNN convolution on another stream (the vocoder's kind of work)
        conv = torch.nn.Conv1d(512, 512, 7, padding=3, device="cuda")
        self.on_side_stream(lambda: conv(torch.randn(1, 512, 2048, device="cuda")))

    def lt_side(self) -> None:  # a cuBLASLt matmul with a bias+GELU epilogue (the DiT's up projection)
        x, w, b = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16) for shape in ((256, 1024), (2048, 1024),
                                                                                         (2048,)))
        self.on_side_stream(lambda: torch._addmm_activation(b, x, w.t(), use_gelu=True))

    def carveout_side(self) -> None:  # a cuBLAS matmul under an SM carveout (token2wav's solves) on another stream
        before = torch._C._get_sm_carveout_experimental()
        torch._C._set_sm_carveout_experimental(32)
        try:
            self.cublas_side()
        finally:
            torch._C._set_sm_carveout_experimental(before)

    def triton_new_side(self) -> None:  # a Triton kernel compiled and loaded now, launched on another stream
        from omnistage.kernels.block_attention import block_attention
        qkv = torch.randn(2, 96, 3, 16, 64, device="cuda", dtype=torch.bfloat16)
        self.on_side_stream(lambda: block_attention(qkv, 24, 1, 0, None, None, None))

    def triton_first(self) -> None:  # a small Triton kernel compiled and launched here, before any reset
        add_value(self.x, 0)

    def triton_same_side(self) -> None:  # that kernel (loaded before the reset) launched on another stream
        self.on_side_stream(lambda: add_value(self.x, 0))

    def triton_new_here(self) -> None:  # a new variant of it compiled, loaded and launched on this stream
        self.variants = getattr(self, "variants", 0) + 1
        add_value(self.x, self.variants)

    def triton_new_side_small(self) -> None:  # a new variant on another stream
        self.variants = getattr(self, "variants", 0) + 1
        self.on_side_stream(lambda: add_value(self.x, self.variants))

    def triton_old_reload(self) -> None:  # variant 0's module loaded again (Triton's in-memory handle dropped)
        for kernels in _add_kernel.device_caches.values():
            for kernel in kernels[0].values():
                kernel.module = kernel._run = None  # the next launch loads it again (_init_handles)
        add_value(self.x, 0)

    def thread_concurrent(self) -> None:  # another host thread works on its stream while the timed chain replays
        stream = torch.cuda.Stream()

        def work() -> None:
            with torch.cuda.stream(stream):
                for _ in range(200):
                    self.cublas()
        worker = threading.Thread(target=lambda: (work(), torch.cuda.synchronize()))
        worker.start()
        for _ in range(5):
            self.timed_graph.replay()
        worker.join()

    def side_copies(self) -> None:  # host to device, device to host and device to device, on another stream
        host = torch.zeros(1 << 20, pin_memory=True)

        def copies() -> None:
            dev = host.to("cuda", non_blocking=True)
            dev.clone().copy_(dev)
            host.copy_(dev, non_blocking=True)

        self.on_side_stream(copies)

    def record_stream(self) -> None:  # a tensor made here, used on another stream, freed (as stage hand-offs do):
        # the caching allocator records an event on that stream and waits for it before reusing the block
        y = torch.ones(1 << 20, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            y.mul_(2)
        y.record_stream(side)
        del y
        torch.ones(1 << 20, device="cuda")  # may reuse the block once the recorded event has passed

    def side_event_record(self) -> None:  # an event recorded on another stream after work, waited on here
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            self.x.add_(1)
            done = torch.cuda.Event()
            done.record()
        torch.cuda.current_stream().wait_event(done)

    def pinned_copies(self) -> None:  # pinned host memory, a copy each way without blocking
        host = torch.zeros(1 << 20, pin_memory=True)
        host.copy_(host.to("cuda", non_blocking=True), non_blocking=True)

    def pageable_h2d(self) -> None:  # a copy from pageable host memory (the driver stages it)
        torch.randn(1 << 16).to("cuda")

    def pageable_d2h(self) -> None:
        torch.ones(1 << 16, device="cuda").cpu()

    def list_to_device(self) -> None:  # torch.tensor(list, device="cuda"): a small pageable copy
        torch.tensor([1, 2, 3], device="cuda")

    def item(self) -> None:  # a scalar read back
        torch.ones(1, device="cuda").sum().item()

    def pageable_h2d_side(self) -> None:
        self.on_side_stream(self.pageable_h2d)

    def index_copy_here(self) -> None:  # rows written into a [158, 3584] bfloat16 buffer by index (on this stream)
        embeds = torch.zeros(158, 3584, device="cuda", dtype=torch.bfloat16)
        embeds.index_copy_(0, torch.arange(156, device="cuda"), torch.randn(156, 3584, device="cuda").bfloat16())

    def index_copy_side(self) -> None:
        self.on_side_stream(self.index_copy_here)

    def index_copy_high(self) -> None:  # on a high-priority stream, as the talker's
        self.on_side_stream(self.index_copy_here, priority=-1)

    def embeds_like_high(self) -> None:  # the talker's prefill input, op for op (run 36e), on a high-priority stream
        table = torch.randn(8448, 3584, device="cuda", dtype=torch.bfloat16)

        def ops() -> None:
            embeds = torch.nn.functional.embedding(torch.arange(158).pin_memory().to("cuda", non_blocking=True),
                                                   table)
            rows = torch.tensor(list(range(156))).pin_memory().to("cuda", non_blocking=True)
            values = torch.stack(list(torch.randn(156, 1, 3584)))[:, 0].to(device="cuda", dtype=embeds.dtype)
            embeds.index_copy_(0, rows, values)
        self.on_side_stream(ops, priority=-1)

    def d2h_event(self) -> None:  # a copy to pinned memory and a timing event waited on
        torch.empty(1 << 16, pin_memory=True).copy_(torch.ones(1 << 16, device="cuda"), non_blocking=True)
        done = torch.cuda.Event(enable_timing=True)
        done.record()
        done.synchronize()

    # memory, time, other contexts
    def new_segment(self) -> None:  # the caching allocator asks the driver for 3 GB more, kept
        self.memory.append(torch.empty(3 << 30, dtype=torch.uint8, device="cuda"))

    def big_alloc(self) -> None:  # 20 GB taken and given back to the driver
        torch.empty(20 << 30, dtype=torch.uint8, device="cuda")
        torch.cuda.empty_cache()

    def sleep(self) -> None:
        time.sleep(10)

    def other_process(self) -> None:  # another process on the GPU captures a graph and exits
        subprocess.run([sys.executable, "-c", "import torch; x = torch.zeros(1, device='cuda')\n"
                        "with torch.cuda.graph(torch.cuda.CUDAGraph()): x.add_(1)"], check=True)

    def other_context(self) -> None:  # another process only makes a CUDA context and exits
        other_context(torch.cuda.current_device(), "process")

    def own_context(self) -> None:  # this process makes a second CUDA context, runs a memset in it, destroys it
        other_context(torch.cuda.current_device())

    def second_context(self) -> None:  # a second context made and kept, no work in it yet
        self.second = SecondContext(torch.cuda.current_device())

    def poke(self) -> None:  # a memset in the kept second context
        self.second.poke()


def one_case(steps: str) -> list[dict]:
    """In this process: the timed graph's replay time alone, then after each step ("profile": the kernels' own
    time instead)."""
    names = steps.split(",")
    timed = next((s.removeprefix("timed:") for s in names if s.startswith("timed:")), "chain")
    probe = Probe(timed, [s.removeprefix("first:") for s in names if s.startswith("first:")])
    out = [] if timed == "deferred" else [{"after": "nothing", "other_graphs": len(probe.kept),
                                           **timed_row(probe.timed_graph)}]
    for step in (s for s in names if not s.startswith(("first:", "timed:"))):
        if step != "profile":
            getattr(probe, step)()
        torch.cuda.synchronize()
        if timed == "deferred" and step in ("captured", "chain_deferred"):
            continue  # nothing instantiated yet to time
        row = {"after": step, "other_graphs": len(probe.kept)}
        if step == "profile":  # the profiler may change what follows: a case of its own
            out.append({**row, "kernel_ms": kernel_ms(probe.timed_graph)})
        else:
            out.append({**row, **timed_row(probe.timed_graph, probe.replay_stream)})
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
