"""Stage workers host one engine replica and drive its step loop.

The orchestrator talks to a worker only through commands (add, chunk, abort) and receives
outputs through a callback, so a worker in another process (next backend) keeps the same shape.
The inline backend runs each engine in a thread of the server process.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, Protocol

from omnistage.engine.base import Engine
from omnistage.engine.types import StageInput, StageOutput
from omnistage.errors import OmniError

logger = logging.getLogger(__name__)

OutputCallback = Callable[[str, int, list[StageOutput]], None]  # (stage, replica, outputs)


class StageWorker(Protocol):
    stage: str
    replica: int

    def add_request(self, inp: StageInput) -> None: ...

    def add_input_chunk(self, request_id: str, chunk: StageInput) -> None: ...

    def abort(self, request_id: str) -> None: ...

    def stats(self) -> dict[str, Any]: ...

    def is_alive(self) -> bool: ...

    def shutdown(self) -> None: ...


class InlineStageWorker:
    """One engine, one thread. Commands are queued so the engine is touched by its thread only."""

    def __init__(self, stage: str, replica: int, engine: Engine, on_outputs: OutputCallback):
        self.stage, self.replica = stage, replica
        self.engine = engine
        self.on_outputs = on_outputs
        self.commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._stats: dict[str, Any] = {}
        self.thread = threading.Thread(target=self._loop, name=f"stage-{stage}-{replica}", daemon=True)
        self.thread.start()

    def add_request(self, inp: StageInput) -> None:
        self.commands.put(("add", inp))

    def add_input_chunk(self, request_id: str, chunk: StageInput) -> None:
        self.commands.put(("chunk", (request_id, chunk)))

    def abort(self, request_id: str) -> None:
        self.commands.put(("abort", request_id))

    def stats(self) -> dict[str, Any]:
        return dict(self._stats)

    def is_alive(self) -> bool:
        return self.thread.is_alive()

    def shutdown(self) -> None:
        self.commands.put(("stop", None))
        self.thread.join(timeout=10)

    def _apply(self, kind: str, arg: Any) -> None:
        if kind == "add":
            try:
                self.engine.add_request(arg)
            except Exception as exc:  # a bad request must not take the stage down
                self.on_outputs(self.stage, self.replica, [StageOutput(
                    request_id=arg.request_id, stage=self.stage, finished=True, finish_reason="error",
                    error=f"stage {self.stage!r} rejected the request: {exc}",
                    error_status=exc.status if isinstance(exc, OmniError) else 500,
                )])
        elif kind == "chunk":
            self.engine.add_input_chunk(*arg)
        elif kind == "abort":
            self.engine.abort(arg)

    def _drain(self, block: bool) -> list[tuple[str, Any]]:
        commands = [self.commands.get()] if block else []
        while True:
            try:
                commands.append(self.commands.get_nowait())
            except queue.Empty:
                return commands

    def _loop(self) -> None:
        while True:
            for kind, arg in self._drain(block=not self.engine.has_work()):
                if kind == "stop":
                    self.engine.shutdown()
                    return
                self._apply(kind, arg)
            if self.engine.has_work():
                outputs = self.engine.step()
                if outputs:
                    self.on_outputs(self.stage, self.replica, outputs)
            self._stats = self.engine.stats()
