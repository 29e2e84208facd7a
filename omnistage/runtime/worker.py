"""Stage workers host one engine replica and drive its step loop.

The orchestrator talks to a worker only through commands (add, chunk, abort) and receives
outputs through a callback, whatever the backend: the inline worker runs the engine loop in a
thread of the server process; a process or Ray worker (process.py) runs the same loop in a child
and relays commands and outputs over ZMQ. A worker that dies fails its in-flight requests with
an error naming the stage, and reports its exit so the orchestrator can restart it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from omnistage.engine.base import Engine
from omnistage.engine.types import StageInput, StageOutput
from omnistage.errors import OmniError

logger = logging.getLogger(__name__)

OutputCallback = Callable[[str, int, list[StageOutput]], None]  # (stage, replica, outputs)
ExitCallback = Callable[[str, int, str], None]  # (stage, replica, why)
Report = Callable[[list[StageOutput], dict[str, Any]], None]  # (outputs, stats) after each iteration


class StageWorker(Protocol):
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

    def __init__(self, stage: str, engine: Engine, report: Report):
        self.stage, self.engine, self.report = stage, engine, report
        self.commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        # Loop metrics, reported with the engine's stats: step count and time, outputs per step.
        self.steps, self.step_seconds, self.step_outputs = 0, 0.0, 0

    def run(self) -> None:
        """Until a "stop" command. Exceptions (a broken engine) propagate to the host."""
        self.report([], self.stats())
        while True:
            outputs: list[StageOutput] = []
            for kind, arg in self._drain(block=not self.engine.has_work()):
                if kind == "stop":
                    self.engine.shutdown()
                    return
                outputs += self._apply(kind, arg)
            if self.engine.has_work():
                start = time.perf_counter()
                stepped = self.engine.step()
                self.steps += 1
                self.step_seconds += time.perf_counter() - start
                self.step_outputs += len(stepped)
                outputs += stepped
            self.report(outputs, self.stats())

    def stats(self) -> dict[str, Any]:
        return {**self.engine.stats(), "steps": self.steps, "step_seconds": self.step_seconds,
                "step_outputs": self.step_outputs, "commands_queued": self.commands.qsize()}

    def _apply(self, kind: str, arg: Any) -> list[StageOutput]:
        if kind == "add":
            try:
                self.engine.add_request(arg)
            except Exception as exc:  # a bad request must not take the stage down
                return [StageOutput(
                    request_id=arg.request_id, stage=self.stage, finished=True, finish_reason="error",
                    error=f"stage {self.stage!r} rejected the request: {exc}",
                    error_status=exc.status if isinstance(exc, OmniError) else 500,
                )]
        elif kind == "chunk":
            self.engine.add_input_chunk(*arg)
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
            self.on_outputs(self.stage, self.replica, [StageOutput(
                request_id=rid, stage=self.stage, finished=True, finish_reason="error",
                error=f"stage {self.stage!r} (replica {self.replica}) failed: {why}", error_status=status,
            ) for rid in ids])


class InlineStageWorker:
    """One engine, one thread of the server process."""

    def __init__(self, stage: str, replica: int, engine: Engine, on_outputs: OutputCallback,
                 on_exit: ExitCallback | None = None):
        self.stage, self.replica = stage, replica
        self.inflight = InFlight(stage, replica, on_outputs)
        self.on_exit = on_exit
        self._stats: dict[str, Any] = {}
        self.loop = EngineLoop(stage, engine, self._report)
        self._stopping = False
        self.thread = threading.Thread(target=self._run, name=f"stage-{stage}-{replica}", daemon=True)
        self.thread.start()

    def add_request(self, inp: StageInput) -> None:
        self.inflight.add(inp.request_id)
        self.loop.commands.put(("add", inp))

    def add_input_chunk(self, request_id: str, chunk: StageInput) -> None:
        self.loop.commands.put(("chunk", (request_id, chunk)))

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
            self.loop.run()
        except Exception as exc:
            logger.exception("stage %r replica %d crashed", self.stage, self.replica)
            why = f"{type(exc).__name__}: {exc}"
            self.inflight.fail_all(why, status=500)
            if self.on_exit is not None and not self._stopping:
                self.on_exit(self.stage, self.replica, why)
