"""GenerationEngine with models whose batches stay in flight (`launch` -> InFlight).

The device is the test's own (no GPU here): two streams, as token2wav uses them. Each launch queues a busy mark
(its solve) on the first and a done mark (its vocoder) on the second, after its busy mark; a mark passes when
something waits on it, and with it every mark it comes after. The model streams windows of two tokens and
outputs the tokens each window covered, so every output says which launch made it.
"""

from __future__ import annotations

import pytest
import torch

from omnistage.engine.generation.engine import GenerationEngine, InFlight
from omnistage.types import StageInput


class Queue:
    def __init__(self) -> None:
        self.last: dict[str, Mark] = {}  # per stream
        self.waits: list[str] = []

    def mark(self, name: str, stream: str, *after: Mark) -> Mark:
        previous = [self.last[stream]] if stream in self.last else []
        self.last[stream] = Mark(self, name, [*previous, *after])
        return self.last[stream]


class Mark:
    def __init__(self, queue: Queue, name: str, after: list[Mark]):
        self.queue, self.name, self.after, self.passed = queue, name, after, False

    def query(self) -> bool:
        return self.passed

    def synchronize(self) -> None:
        self.queue.waits.append(self.name)
        self._pass()

    def _pass(self) -> None:
        for mark in self.after:
            mark._pass()
        self.passed = True


class Windows:
    """Windows of WINDOW tokens (a final request's rest as a last one); each launch: a busy mark, then done."""

    WINDOW = 2

    def __init__(self, queue: Queue, broken: set[int] = frozenset()):
        self.queue, self.broken, self.launches = queue, broken, []

    def ready(self, inp: StageInput) -> bool:
        return len(inp.token_ids) - inp.params.get("emitted", 0) >= self.WINDOW or inp.final

    def launch(self, inputs: list[StageInput]) -> InFlight:
        n = len(self.launches)
        windows = []
        for inp in inputs:
            start = inp.params.get("emitted", 0)
            inp.params["emitted"] = min(len(inp.token_ids), start + self.WINDOW)
            windows.append(inp.token_ids[start : inp.params["emitted"]])
        self.launches.append([inp.request_id for inp in inputs])
        finished = [inp.final and inp.params["emitted"] == len(inp.token_ids) for inp in inputs]

        def collect() -> list[dict[str, torch.Tensor]]:
            if n in self.broken:
                raise RuntimeError(f"launch {n} broke")
            return [{"tokens": torch.tensor(w)} for w in windows]

        busy = self.queue.mark(f"busy{n}", "solve")
        return InFlight(finished, busy, self.queue.mark(f"done{n}", "vocoder", busy), collect)


def request(rid: str, tokens: list[int], final: bool = False) -> StageInput:
    return StageInput(rid, tokens, params={}, final=final)


def chunk(rid: str, tokens: list[int], final: bool = False) -> StageInput:
    return StageInput(rid, tokens, final=final)


def landed(outputs) -> list[tuple[str, list[int], bool]]:
    return [(o.request_id, o.tensors["tokens"].tolist(), o.finished) for o in outputs]


def test_next_launch_waits_for_the_busy_mark_and_outputs_leave_in_launch_order() -> None:
    queue = Queue()
    model = Windows(queue)
    engine = GenerationEngine("t", model)
    engine.add_request(request("a", [1, 2]))
    assert engine.step() == [] and model.launches == [["a"]]  # queued, nothing landed yet
    engine.add_input_chunk("a", chunk("a", [3, 4], final=True))
    assert engine.step() == [] and model.launches == [["a"]]  # the first launch is still busy: wait, no launch
    assert queue.waits == ["busy0"]
    assert engine.step() == []  # its second window launches while the first one's vocoder may still run
    assert model.launches == [["a"], ["a"]] and "a" not in engine.requests  # finished at launch
    assert queue.waits == ["busy0"] and engine.has_work()  # outputs still to hand out
    assert engine.step() == []  # the newest launch is busy: no launch before it is past that
    assert landed(engine.step()) == [("a", [1, 2], False)]  # nothing to launch: the oldest's done mark
    assert landed(engine.step()) == [("a", [3, 4], True)]
    assert queue.waits == ["busy0", "busy1", "done0", "done1"]
    assert not engine.has_work()


def test_requests_arriving_during_a_busy_launch_join_the_next_batch() -> None:
    queue = Queue()
    model = Windows(queue)
    engine = GenerationEngine("t", model)
    engine.add_request(request("a", [1, 2]))
    engine.step()
    engine.add_request(request("b", [5, 6], final=True))
    engine.add_request(request("c", [7, 8], final=True))
    engine.step()  # waits for launch 0's busy mark
    engine.step()
    assert model.launches == [["a"], ["b", "c"]]


def test_abort_drops_the_outputs_of_work_in_flight() -> None:
    queue = Queue()
    engine = GenerationEngine("t", Windows(queue))
    engine.add_request(request("a", [1, 2, 3, 4]))
    engine.add_request(request("b", [5, 6], final=True))
    engine.step()
    engine.abort("a")
    outputs = []
    while engine.has_work():
        outputs += engine.step()
    assert landed(outputs) == [("b", [5, 6], True)]
    assert engine.requests == {}


def test_a_launch_that_fails_to_land_fails_only_its_requests() -> None:
    queue = Queue()
    model = Windows(queue, broken={0})
    engine = GenerationEngine("t", model)
    engine.add_request(request("a", [1, 2, 3, 4]))
    engine.step()
    engine.step()  # busy
    engine.add_request(request("b", [5, 6], final=True))
    outputs = []
    while engine.has_work():
        outputs += engine.step()
    assert model.launches == [["a"], ["a", "b"]]  # a's second window was in flight when its first failed
    errors = [o for o in outputs if o.error]
    assert [(o.request_id, o.finished, o.error_status) for o in errors] == [("a", True, 500)]
    # the caller hears which stage failed, never the exception (the log has it)
    assert errors[0].error == "stage 't' failed on this step; the server log has the details"
    assert [(o.request_id, o.tensors["tokens"].tolist()) for o in outputs if not o.error] == [("b", [5, 6])]
    assert not engine.has_work() and engine.requests == {}


class Waited:
    """A model with `generate` only: each batch's outputs in hand when the call returns."""

    def __init__(self, model: Windows):
        self.model, self.ready = model, model.ready

    def generate(self, inputs: list[StageInput]) -> list[tuple[dict[str, torch.Tensor], bool]]:
        flight = self.model.launch(inputs)
        flight.done.synchronize()
        return list(zip(flight.collect(), flight.finished, strict=True))


@pytest.mark.parametrize("waited", [False, True])
def test_a_batch_that_raises_fails_its_requests_and_the_engine_goes_on(waited: bool) -> None:
    class Broken(Windows):
        def launch(self, inputs):
            if inputs[0].request_id == "bad":
                raise ValueError("cannot decode these codes")
            return super().launch(inputs)

    model = Broken(Queue())
    engine = GenerationEngine("t", Waited(model) if waited else model, max_num_seqs=1)
    engine.add_request(request("bad", [1, 2], final=True))
    engine.add_request(request("good", [3, 4], final=True))
    outputs = []
    while engine.has_work():
        outputs += engine.step()
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("bad", "error"), ("good", "stop")]
    assert outputs[0].error == "stage 't' failed on this step; the server log has the details"
    assert outputs[1].error is None
