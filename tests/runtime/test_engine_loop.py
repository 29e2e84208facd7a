"""The stage loop's order of work: input chunks arriving faster than they are applied share the thread with
engine steps instead of holding them off."""

from __future__ import annotations

import threading
import time

from omnistage.runtime.worker import AddChunk, AddRequest, EngineLoop, Stop
from omnistage.types import StageInput, StageOutput


class TimedEngine:
    """An engine whose chunks take 1 ms to apply and whose steps take 5 ms; it records what ran, in order."""

    device = None

    def __init__(self) -> None:
        self.events: list[str] = []
        self.pending_steps = 0

    def add_request(self, inp: StageInput) -> None:
        self.pending_steps = 50

    def add_input_chunk(self, request_id: str, chunk: StageInput) -> None:
        time.sleep(0.001)
        self.events.append("chunk")

    def abort(self, request_id: str) -> None:
        self.pending_steps = 0

    def has_work(self) -> bool:
        return self.pending_steps > 0

    def step(self) -> list[StageOutput]:
        time.sleep(0.005)
        self.pending_steps -= 1
        self.events.append("step")
        return []

    def stats(self) -> dict[str, int]:
        return {}

    def shutdown(self) -> None:
        pass


def test_a_flood_of_chunks_does_not_hold_off_steps() -> None:
    engine = TimedEngine()
    loop = EngineLoop("talker", engine, report=lambda outputs, stats: None)
    loop.commands.put(AddRequest(StageInput("r")))
    for _ in range(60):  # 60 ms of chunks, all queued before the loop runs
        loop.commands.put(AddChunk("r", StageInput("r", final=False)))
    thread = threading.Thread(target=loop.run)
    thread.start()
    deadline = time.monotonic() + 30
    while engine.events.count("chunk") < 60 and time.monotonic() < deadline:
        time.sleep(0.01)
    loop.commands.put(Stop())
    thread.join(10)
    assert engine.events.count("chunk") == 60, "every chunk is applied, in order"
    first_steps = engine.events[: engine.events.index("chunk") + 30]
    assert first_steps.count("step") >= 3, engine.events[:40]  # not all 60 chunks first, then the steps
    stats = loop.stats()
    assert stats["command_seconds"] > 0.05 and stats["steps"] >= 3


def test_commands_are_applied_by_type() -> None:
    """A Batch applies its commands in order; Fail reports its output as it is; Abort reaches the engine; anything
    else is refused rather than dropped."""
    import pytest

    from omnistage.runtime.worker import Abort, Batch, Fail

    engine = TimedEngine()
    loop = EngineLoop("talker", engine, report=lambda outputs, stats: None)
    assert loop._apply(Batch([AddRequest(StageInput("r")), AddChunk("r", StageInput("r", final=False))])) == []
    assert engine.pending_steps == 50 and engine.events == ["chunk"]
    failure = StageOutput.failure("r", "talker", "could not read its input")
    assert loop._apply(Fail(failure)) == [failure]
    loop._apply(Abort("r"))
    assert engine.pending_steps == 0
    with pytest.raises(TypeError, match="not an engine loop command"):
        loop._apply(("add", StageInput("r")))


class Ledger(TimedEngine):
    """Records which request each command was for: ("add", rid), ("chunk", rid), ("abort", rid)."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[str, str, float]] = []

    def add_request(self, inp: StageInput) -> None:
        super().add_request(inp)
        self.log.append(("add", inp.request_id, time.monotonic()))

    def add_input_chunk(self, request_id: str, chunk: StageInput) -> None:
        super().add_input_chunk(request_id, chunk)
        self.log.append(("chunk", request_id, time.monotonic()))

    def abort(self, request_id: str) -> None:
        self.log.append(("abort", request_id, time.monotonic()))


def test_an_abort_does_not_wait_behind_a_backlog_of_chunks() -> None:
    """A request aborted behind 300 ms of queued chunks is aborted at once: its queued chunks are dropped, the
    other requests' commands are applied in order, and a request reusing the id after the abort is kept."""
    from omnistage.runtime.worker import Abort, Batch

    engine = Ledger()
    loop = EngineLoop("talker", engine, report=lambda outputs, stats: None)
    loop.commands.put(AddRequest(StageInput("a")))
    loop.commands.put(AddRequest(StageInput("b")))
    for _ in range(150):
        loop.commands.put(Batch([AddChunk("a", StageInput("a", final=False)), AddChunk("b", StageInput("b"))]))
    loop.commands.put(Abort("a"))
    loop.commands.put(AddRequest(StageInput("a")))  # the id again, a new request
    loop.commands.put(AddChunk("a", StageInput("a")))
    thread = threading.Thread(target=loop.run)
    start = time.monotonic()
    thread.start()
    def events() -> list[tuple[str, str]]:
        return [e[:2] for e in engine.log]

    assert wait(lambda: events().count(("chunk", "b")) == 150 and events()[-1] == ("chunk", "a"), 30), events()[-5:]
    loop.commands.put(Stop())
    thread.join(10)
    abort_at = next(t for kind, _, t in engine.log if kind == "abort")
    assert abort_at - start < 0.1, "the abort waited behind the chunks"
    seen = events()
    assert seen.count(("chunk", "b")) == 150  # nobody else's command is lost
    assert seen.count(("chunk", "a")) < 10, "the aborted request's queued chunks were applied"
    after = seen[seen.index(("abort", "a")) + 1:]
    assert after.count(("add", "a")) == 1 and after[-1] == ("chunk", "a")  # the new request with the id, in order


def wait(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.005)
    return predicate()
