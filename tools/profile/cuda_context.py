"""CUDA-context helpers the tools/profile diagnostics share (kept from the retired graph_crowd.py probe, whose
finding they test for: a process's graph replays slow down once it does other work, until another CUDA context
runs on the device): a graph's replay time, a second context made and poked through the driver API, and a log of
Triton's kernel loads."""

from __future__ import annotations

import ctypes
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import torch


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


