"""Stage workers host one engine replica and drive its step loop.

The orchestrator talks to a worker only through commands (add, chunk, abort) and receives
outputs through a callback, whatever the backend: the inline worker runs the engine loop in a
thread of the server process; a process or Ray worker (process.py) runs the same loop in a child
and relays commands and outputs over ZMQ. A worker that dies fails its in-flight requests with
an error naming the stage, and reports its exit so the orchestrator can restart it.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from omnistage.devices import on_device
from omnistage.engine.base import Engine
from omnistage.errors import OmniError
from omnistage.types import StageInput, StageOutput

logger = logging.getLogger(__name__)

OutputCallback = Callable[[str, int, list[StageOutput]], None]  # (stage, replica, outputs)
ExitCallback = Callable[[str, int, str], None]  # (stage, replica, why)
Report = Callable[[list[StageOutput], dict[str, Any]], None]  # (outputs, stats) after each iteration


class StageWorker(Protocol):
    """Optionally also `add_many(commands)`: ("add", inp) and ("chunk", (request_id, chunk)) commands, in order,
    handed over at once (one stage step's sends; the orchestrator uses it where a worker has it)."""

    stage: str
    replica: int

    def add_request(self, inp: StageInput) -> None: ...

    def add_input_chunk(self, request_id: str, chunk: StageInput) -> None: ...

    def abort(self, request_id: str) -> None: ...

    def wait_ready(self, timeout: float) -> None:
        """Block until the engine is up; StageStartupError naming the stage if it cannot start."""
        ...

    def stats(self) -> dict[str, Any]: ...

    def is_alive(self) -> bool: ...

    def shutdown(self) -> None: ...


class EngineLoop:
    """Applies queued commands, steps the engine while it has work, and reports each iteration's
    outputs and stats. Only the loop's thread touches the engine."""

    MIN_APPLY_SECONDS = 0.002  # commands applied per iteration while the engine has work: at least this long

    def __init__(self, stage: str, engine: Engine, report: Report,
                 receive: Callable[[Any], StageInput] | None = None):
        self.stage, self.engine, self.report = stage, engine, report
        self.receive = receive or (lambda inp: inp)  # what the host does with an input before the engine sees it
        self.commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self.backlog: collections.deque[tuple[str, Any]] = collections.deque()  # taken off `commands`, not applied
        # Loop metrics, reported with the engine's stats: step count and time, outputs per step, and the
        # loop's time outside steps: applying commands (inputs arriving) and reporting (routing outputs on).
        self.steps, self.step_seconds, self.step_outputs = 0, 0.0, 0
        self.command_seconds = self.report_seconds = 0.0

    def run(self) -> None:
        """Until a "stop" command. Exceptions (a broken engine) propagate to the host.

        Commands are applied in arrival order, but while the engine has work for at most about as long as its
        last step took (and at least one): a stream of input chunks (a talker fed a row per request per thinker
        step) then shares the thread with steps instead of holding them off until it dries up."""
        self.report([], self.stats())
        backlog, last_step = self.backlog, 0.0
        while True:
            outputs: list[StageOutput] = []
            backlog += self._drain(block=not backlog and not self.engine.has_work())
            start = time.perf_counter()
            budget = start + max(self.MIN_APPLY_SECONDS, last_step)
            while backlog:
                kind, arg = backlog.popleft()
                if kind == "stop":
                    self.engine.shutdown()
                    return
                outputs += self._apply(kind, arg)
                if backlog and time.perf_counter() > budget and self.engine.has_work():
                    break
            self.command_seconds += time.perf_counter() - start
            if self.engine.has_work():
                start = time.perf_counter()
                stepped = self.engine.step()
                last_step = time.perf_counter() - start
                self.steps += 1
                self.step_seconds += last_step
                self.step_outputs += len(stepped)
                outputs += stepped
            start = time.perf_counter()
            self.report(outputs, self.stats())
            self.report_seconds += time.perf_counter() - start

    def stats(self) -> dict[str, Any]:
        return {**self.engine.stats(), "steps": self.steps, "step_seconds": self.step_seconds,
                "step_outputs": self.step_outputs, "command_seconds": self.command_seconds,
                "report_seconds": self.report_seconds,
                "commands_queued": self.commands.qsize() + len(self.backlog)}

    def _apply(self, kind: str, arg: Any) -> list[StageOutput]:
        if kind == "add":
            arg = self.receive(arg)
            try:
                self.engine.add_request(arg)
            except Exception as exc:  # a bad request must not take the stage down
                return [StageOutput.failure(
                    arg.request_id, self.stage, f"stage {self.stage!r} rejected the request: {exc}",
                    exc.status if isinstance(exc, OmniError) else 500,
                )]
        elif kind == "chunk":
            self.engine.add_input_chunk(arg[0], self.receive(arg[1]))
        elif kind == "many":  # commands handed over together (InlineStageWorker.add_many)
            return [out for k, a in self.receive(arg) for out in self._apply(k, a)]
        elif kind == "abort":
            self.engine.abort(arg)
        elif kind == "fail":  # a StageOutput with an error, found before the engine saw the request
            return [arg]
        return []

    def _drain(self, block: bool) -> list[tuple[str, Any]]:
        commands = [self.commands.get()] if block else []
        while True:
            try:
                commands.append(self.commands.get_nowait())
            except queue.Empty:
                return commands


class InFlight:
    """Requests a worker holds, so that its death can fail exactly those."""

    def __init__(self, stage: str, replica: int, on_outputs: OutputCallback):
        self.stage, self.replica, self.on_outputs = stage, replica, on_outputs
        self.ids: set[str] = set()
        self.lock = threading.Lock()
        self.failed: tuple[str, int] | None = None  # (why, status) once the worker is gone

    def add(self, request_id: str) -> None:
        with self.lock:
            self.ids.add(request_id)
            late = self.failed is not None
        if late:  # raced with the worker's death; the caller holds the orchestrator's lock
            threading.Thread(target=self.fail_all, args=self.failed, daemon=True).start()

    def discard(self, request_id: str) -> None:
        with self.lock:
            self.ids.discard(request_id)

    def deliver(self, outputs: list[StageOutput]) -> None:
        with self.lock:
            for out in outputs:
                if out.finished:
                    self.ids.discard(out.request_id)
        if outputs:
            self.on_outputs(self.stage, self.replica, outputs)

    def fail_all(self, why: str, status: int = 503) -> None:
        with self.lock:
            ids, self.ids = sorted(self.ids), set()
            self.failed = self.failed or (why, status)
        if ids:
            self.on_outputs(self.stage, self.replica, [StageOutput.failure(
                rid, self.stage, f"stage {self.stage!r} (replica {self.replica}) failed: {why}", status,
            ) for rid in ids])


@dataclass
class _Written:
    """Inputs (an input, or add_many's commands) whose GPU tensors were written on another thread's CUDA stream,
    up to `event`."""

    inp: StageInput | list[tuple[str, Any]]
    tensors: list[torch.Tensor]
    event: torch.cuda.Event


def _cuda_tensors(inp: StageInput) -> list[torch.Tensor]:
    values = [*inp.tensors.values(), inp.embeds, inp.embed_adds, inp.embed_add_default, inp.rope_positions]
    return [t for t in values if isinstance(t, torch.Tensor) and t.is_cuda]


class InlineStageWorker:
    """One engine, one thread of the server process, and on a GPU its own CUDA stream.

    Stages sharing a GPU in one process then overlap: one stage's long kernels (a whole flow-matching
    solve) do not hold up another's short decode steps, as they would on one stream, or across
    processes under the GPU's time slicing. Latency-bound engines (autoregressive decoding: many short
    kernels a request waits on, step after step) get a high-priority stream, so their kernels take the next
    free multiprocessors ahead of a long solve's queue. GPU tensors handed over from another stage are read only
    after the stream that wrote them got there (an event, no host wait), and the allocator is told
    this stream uses them, so their memory is not reused before it has read them."""

    def __init__(self, stage: str, replica: int, engine: Engine, on_outputs: OutputCallback,
                 on_exit: ExitCallback | None = None, stream_priority: str | None = None):
        self.stage, self.replica = stage, replica
        self.inflight = InFlight(stage, replica, on_outputs)
        self.on_exit = on_exit
        self._stats: dict[str, Any] = {}
        device = getattr(engine, "device", None)
        self.stream = None
        if device is not None and torch.device(device).type == "cuda":
            high = stream_priority == "high" or (stream_priority is None and getattr(engine, "latency_bound", False))
            self.stream = torch.cuda.Stream(device, priority=-1 if high else 0)
            torch.cuda.synchronize(device)  # what building the engine left on the default stream is done
        self.loop = EngineLoop(stage, engine, self._report, receive=self._receive)
        self._stopping = False
        self.thread = threading.Thread(target=self._run, name=f"stage-{stage}-{replica}", daemon=True)
        self.thread.start()

    def add_request(self, inp: StageInput) -> None:
        self.inflight.add(inp.request_id)
        self.loop.commands.put(("add", self._hand_over(inp)))

    def add_input_chunk(self, request_id: str, chunk: StageInput) -> None:
        self.loop.commands.put(("chunk", (request_id, self._hand_over(chunk))))

    def add_many(self, commands: list[tuple[str, Any]]) -> None:
        """One hand-over (one event, one wait) for all: per command, the CUDA calls of a hand-over cost more
        than the rest of routing a token when stage threads contend for the interpreter."""
        for kind, arg in commands:
            if kind == "add":
                self.inflight.add(arg.request_id)
        inputs = [arg if kind == "add" else arg[1] for kind, arg in commands]
        tensors = [t for inp in inputs for t in _cuda_tensors(inp)] if self.stream is not None else []
        self.loop.commands.put(("many", self._written(commands, tensors) if tensors else commands))

    def _hand_over(self, inp: StageInput) -> StageInput | _Written:
        """Called on the sender's thread: mark how far its stream has written the input's GPU tensors."""
        tensors = _cuda_tensors(inp) if self.stream is not None else []
        return self._written(inp, tensors) if tensors else inp

    @staticmethod
    def _written(inp: StageInput | list[tuple[str, Any]], tensors: list[torch.Tensor]) -> _Written:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(tensors[0].device))
        return _Written(inp, tensors, event)

    def _receive(self, arg: StageInput | list | _Written) -> StageInput | list:
        """Called on this stage's thread, before its engine sees the input(s)."""
        if not isinstance(arg, _Written):
            return arg
        # This thread's stream on each device holding them: ours on our device; on another (tensors this stage
        # copies over from there), that device's stream in this thread, where torch runs the copy.
        streams = {device: torch.cuda.current_stream(device) for device in {t.device for t in arg.tensors}}
        for stream in streams.values():
            stream.wait_event(arg.event)
        # The allocator tracks memory by storage: one record per storage (a step's rows for every request are
        # views of one tensor), not per view.
        for tensor in {id(base): base for base in (t if t._base is None else t._base for t in arg.tensors)}.values():
            tensor.record_stream(streams[tensor.device])
        return arg.inp

    def abort(self, request_id: str) -> None:
        self.inflight.discard(request_id)
        self.loop.commands.put(("abort", request_id))

    def wait_ready(self, timeout: float) -> None:
        return None  # the engine was built before the thread started

    def stats(self) -> dict[str, Any]:
        return dict(self._stats)

    def is_alive(self) -> bool:
        return self.thread.is_alive()

    def shutdown(self) -> None:
        self._stopping = True
        self.loop.commands.put(("stop", None))
        self.thread.join(timeout=10)
        self.inflight.fail_all("the stage was shut down")

    def _report(self, outputs: list[StageOutput], stats: dict[str, Any]) -> None:
        self._stats = stats
        self.inflight.deliver(outputs)

    def _run(self) -> None:
        try:
            device = self.stream.device if self.stream is not None else None
            with on_device(device), torch.cuda.stream(self.stream) if device is not None else contextlib.nullcontext():
                self.loop.run()
        except Exception as exc:
            logger.exception("stage %r replica %d crashed", self.stage, self.replica)
            why = f"{type(exc).__name__}: {exc}"
            self.inflight.fail_all(why, status=500)
            if self.on_exit is not None and not self._stopping:
                self.on_exit(self.stage, self.replica, why)
