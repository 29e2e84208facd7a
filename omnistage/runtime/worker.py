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
from omnistage.errors import OmniError, stage_failure
from omnistage.types import StageInput, StageOutput

logger = logging.getLogger(__name__)

OutputCallback = Callable[[str, int, list[StageOutput]], None]  # (stage, replica, outputs)
ExitCallback = Callable[[str, int, str], None]  # (stage, replica, why)
Report = Callable[[list[StageOutput], dict[str, Any]], None]  # (outputs, stats) after each iteration


# ---- engine loop commands: what a worker's host queues for its EngineLoop ---------------------------


def ready_summary(stage: str, engine: Any, started: float) -> str:
    """The start-up log line of one stage replica (inline and out-of-process workers alike)."""
    describe = getattr(engine, "describe", None)
    return f"stage {stage!r} ready in {time.monotonic() - started:.1f} s: {describe() if describe else ''}"


def log_ready(stage: str, engine: Any, started: float) -> None:
    logger.info("%s", ready_summary(stage, engine, started))


@dataclass
class AddRequest:
    """A new request for the engine."""

    inp: StageInput

    @property
    def request_id(self) -> str:
        return self.inp.request_id


@dataclass
class AddChunk:
    """A further input chunk of a request the engine already has."""

    request_id: str
    chunk: StageInput


@dataclass
class Abort:
    request_id: str


@dataclass
class Fail:
    """A request's failure found before the engine saw it: `output` (a StageOutput with an error) is
    reported as it is."""

    output: StageOutput


@dataclass
class Batch:
    """Inputs handed over together, applied in order (one stage step's sends: StageWorker.add_many)."""

    commands: list[AddRequest | AddChunk]


@dataclass
class Stop:
    """Shut the engine down and end the loop."""


Command = AddRequest | AddChunk | Abort | Fail | Batch | Stop


class StageWorker(Protocol):
    """Optionally also `add_many(commands)`: AddRequest and AddChunk commands, in order, handed over at
    once (one stage step's sends; the orchestrator uses it where a worker has it)."""

    stage: str
    replica: int
    vocab_size: int | None  # an AR stage's vocabulary (the logits' width) once it is ready; None otherwise

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
                 receive: Callable[[Any], Command] | None = None):
        self.stage, self.engine, self.report = stage, engine, report
        # What the host does with a queued item before it is applied: a Command as it is, or what the host
        # queued in its place (InlineStageWorker wraps inputs written on another CUDA stream).
        self.receive = receive or (lambda command: command)
        self.commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.backlog: collections.deque[Any] = collections.deque()  # taken off `commands`, not applied
        # Loop metrics, reported with the engine's stats: step count and time, outputs per step, and the
        # loop's time outside steps: applying commands (inputs arriving) and reporting (routing outputs on).
        self.steps, self.step_seconds, self.step_outputs = 0, 0.0, 0
        self.command_seconds = self.report_seconds = 0.0

    def run(self) -> None:
        """Until a Stop command. Exceptions (a broken engine) propagate to the host.

        Commands are applied in arrival order, but while the engine has work for at most about as long as its
        last step took (and at least one): a stream of input chunks (a talker fed a row per request per thinker
        step) then shares the thread with steps instead of holding them off until it dries up. An abort does not
        wait in that backlog: it is applied as soon as it is taken off the queue (`_abort_early`)."""
        self.report([], self.stats())
        backlog, last_step = self.backlog, 0.0
        while True:
            outputs: list[StageOutput] = []
            arrived = self._drain(block=not backlog and not self.engine.has_work())
            backlog += arrived
            if any(isinstance(c, Abort) for c in arrived):
                outputs += self._abort_early()
            start = time.perf_counter()
            budget = start + max(self.MIN_APPLY_SECONDS, last_step)
            while backlog:
                command = backlog.popleft()
                if isinstance(command, Stop):
                    self.engine.shutdown()
                    return
                outputs += self._apply(command)
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

    def _apply(self, command: Any) -> list[StageOutput]:
        """A request's command that raises fails that request alone (the engine drops what it holds of it)."""
        match self.receive(command):
            case AddRequest(inp=inp):
                try:
                    self.engine.add_request(inp)
                except Exception as exc:
                    return [self._failed(inp.request_id, exc, "rejected the request")]
            case AddChunk(request_id=request_id, chunk=chunk):
                try:
                    self.engine.add_input_chunk(request_id, chunk)
                except Exception as exc:
                    return [self._failed(request_id, exc, "could not take an input chunk")]
            case Batch(commands=commands):
                return [out for c in commands for out in self._apply(c)]
            case Abort(request_id=request_id):
                try:
                    self.engine.abort(request_id)
                except Exception:
                    logger.exception("stage %r: aborting request %r failed", self.stage, request_id)
            case Fail(output=output):
                return [output]
            case other:
                raise TypeError(f"stage {self.stage!r}: not an engine loop command: {other!r}")
        return []

    def _abort_early(self) -> list[StageOutput]:
        """Apply the backlog's aborts now, and drop the commands of each aborted request queued before its abort
        (behind a stream of chunks an abort would otherwise wait as long as they take, and the request's state
        be freed that late). Commands after an abort (a new request reusing the id) stay, in order."""
        kept: list[Any] = []
        aborted: set[str] = set()  # aborted later in the queue than the command at hand
        for command in reversed(self.backlog):
            if isinstance(command, Abort):
                aborted.add(command.request_id)
            elif (command := _without(command, aborted)) is not None:
                kept.append(command)
        self.backlog.clear()
        self.backlog.extend(reversed(kept))
        return [out for rid in aborted for out in self._apply(Abort(rid))]

    def _failed(self, request_id: str, exc: Exception, what: str) -> StageOutput:
        """The failure of one request: an OmniError's own message (a RequestError says what to fix), else a
        message naming the stage only (the traceback goes to the log)."""
        if isinstance(exc, OmniError):
            message, status = f"stage {self.stage!r} {what}: {exc.message}", exc.status
        else:
            logger.error("stage %r %s (request %r)", self.stage, what, request_id, exc_info=exc)
            message, status = stage_failure(self.stage), 500
        try:
            self.engine.abort(request_id)  # what it may hold of the request
        except Exception:
            logger.exception("stage %r: aborting request %r failed", self.stage, request_id)
        return StageOutput.failure(request_id, self.stage, message, status)

    def _drain(self, block: bool) -> list[Any]:
        commands = [self.commands.get()] if block else []
        while True:
            try:
                commands.append(self.commands.get_nowait())
            except queue.Empty:
                return commands


def _without(command: Any, request_ids: set[str]) -> Any:
    """`command` without the parts for `request_ids` (None: nothing is left of it); other commands as they are."""
    if not request_ids:
        return command
    match command:
        case AddRequest(inp=inp) if inp.request_id in request_ids:
            return None
        case AddChunk(request_id=rid) | Fail(output=StageOutput(request_id=rid)) if rid in request_ids:
            return None
        case Batch(commands=commands):
            kept = [c for c in commands if _without(c, request_ids) is not None]
            return Batch(kept) if kept else None
        case _Written(command=inner):
            inner = _without(inner, request_ids)
            return None if inner is None else _Written(inner, command.tensors, command.event)
    return command


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
        """`why` is for the caller: the worker's host logs the details (an exception's text stays there)."""
        with self.lock:
            ids, self.ids = sorted(self.ids), set()
            self.failed = self.failed or (why, status)
        if ids:
            self.on_outputs(self.stage, self.replica, [StageOutput.failure(
                rid, self.stage, f"stage {self.stage!r} (replica {self.replica}) {why}", status,
            ) for rid in ids])


@dataclass
class _Written:
    """A command (AddRequest, AddChunk, or add_many's Batch) whose inputs' GPU tensors were written on another
    thread's CUDA stream, up to `event`."""

    command: AddRequest | AddChunk | Batch
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
        self.vocab_size: int | None = getattr(engine, "vocab_size", None)
        self._dead = False  # the loop crashed (its thread may still be reporting the death)
        device = getattr(engine, "device", None)
        self.stream = None
        if device is not None and torch.device(device).type == "cuda":
            high = stream_priority == "high" or (stream_priority is None and getattr(engine, "latency_bound", False))
            self.stream = torch.cuda.Stream(device, priority=-1 if high else 0)
            torch.cuda.synchronize(device)  # what building the engine left on the default stream is done
        self.loop = EngineLoop(stage, engine, self._report, receive=self._receive)
        self._stats: dict[str, Any] = self.loop.stats()  # before the thread's first report
        self._stopping = False
        self.thread = threading.Thread(target=self._run, name=f"stage-{stage}-{replica}", daemon=True)
        self.thread.start()

    def add_request(self, inp: StageInput) -> None:
        self.inflight.add(inp.request_id)
        self.loop.commands.put(self._hand_over(AddRequest(inp), [inp]))

    def add_input_chunk(self, request_id: str, chunk: StageInput) -> None:
        self.loop.commands.put(self._hand_over(AddChunk(request_id, chunk), [chunk]))

    def add_many(self, commands: list[AddRequest | AddChunk]) -> None:
        """One hand-over (one event, one wait) for all: per command, the CUDA calls of a hand-over cost more
        than the rest of routing a token when stage threads contend for the interpreter."""
        for command in commands:
            if isinstance(command, AddRequest):
                self.inflight.add(command.request_id)
        inputs = [c.inp if isinstance(c, AddRequest) else c.chunk for c in commands]
        self.loop.commands.put(self._hand_over(Batch(commands), inputs))

    def _hand_over(self, command: AddRequest | AddChunk | Batch,
                   inputs: list[StageInput]) -> AddRequest | AddChunk | Batch | _Written:
        """Called on the sender's thread: mark how far its stream has written the inputs' GPU tensors."""
        tensors = [t for inp in inputs for t in _cuda_tensors(inp)] if self.stream is not None else []
        if not tensors:
            return command
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(tensors[0].device))
        return _Written(command, tensors, event)

    def _receive(self, item: Command | _Written) -> Command:
        """Called on this stage's thread, before its engine sees the input(s)."""
        if not isinstance(item, _Written):
            return item
        # This thread's stream on each device holding them: ours on our device; on another (tensors this stage
        # copies over from there), that device's stream in this thread, where torch runs the copy.
        streams = {device: torch.cuda.current_stream(device) for device in {t.device for t in item.tensors}}
        for stream in streams.values():
            stream.wait_event(item.event)
        # The allocator tracks memory by storage: one record per storage (a step's rows for every request are
        # views of one tensor), not per view.
        for tensor in {id(base): base for base in (t if t._base is None else t._base for t in item.tensors)}.values():
            tensor.record_stream(streams[tensor.device])
        return item.command

    def abort(self, request_id: str) -> None:
        self.inflight.discard(request_id)
        self.loop.commands.put(Abort(request_id))

    def wait_ready(self, timeout: float) -> None:
        return None  # the engine was built before the thread started

    def stats(self) -> dict[str, Any]:
        return dict(self._stats)

    def is_alive(self) -> bool:
        return not self._dead and self.thread.is_alive()

    def shutdown(self) -> None:
        self._stopping = True
        self.loop.commands.put(Stop())
        self.thread.join(timeout=10)
        self.inflight.fail_all("was shut down")

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
            self._dead = True
            self.inflight.fail_all("failed; the server log has the details", status=500)
            try:  # free its device memory before a restart builds the next engine
                self.loop.engine.shutdown()
            except Exception:
                logger.exception("stage %r replica %d: shutting the crashed engine down failed", self.stage,
                                 self.replica)
            if self.on_exit is not None and not self._stopping:
                self.on_exit(self.stage, self.replica, f"{type(exc).__name__}: {exc}")
