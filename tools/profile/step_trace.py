"""Every engine step of a wave, for finding where a stage waits (a diagnostic: nothing in the package changes).

`AREngine.step`, `GenerationEngine.step` and `Scheduler.schedule` are wrapped while a `StepTrace` is recording.
Each step gives one row: [stage, start ms since the wave's start, duration ms, whether it read an overlapped
decode step in flight, that step's sequences and tokens (else those scheduled: a prefill chunk shows as many
tokens), sequences waiting to be admitted, outputs]. Steps that did nothing are left out.

    python benchmarks/omni_qwen2_5.py --checkpoint /tmp/omni --parts ours --http --concurrency 32 \\
        --timeline tl.jsonl --step-trace          # each wave's timeline line then has "steps"
"""

from __future__ import annotations

import time

from omnistage.engine.ar.engine import AREngine
from omnistage.engine.ar.scheduler import Scheduler
from omnistage.engine.generation.engine import GenerationEngine


class StepTrace:
    def __init__(self) -> None:
        self.rows: list[list] | None = None
        self.start = 0.0
        self._install()

    def begin(self) -> None:
        self.rows, self.start = [], time.perf_counter()

    def take(self) -> list[list]:
        rows, self.rows = self.rows or [], None
        return rows

    def _install(self) -> None:
        trace, schedule = self, Scheduler.schedule

        def traced_schedule(scheduler: Scheduler) -> list:
            batch = schedule(scheduler)
            scheduler.traced_batch = (len(batch), sum(n for _, n in batch))
            return batch

        def wrap(step):
            def traced(engine) -> list:
                if trace.rows is None:
                    return step(engine)
                scheduler = getattr(engine, "scheduler", None)
                if scheduler is not None:
                    scheduler.traced_batch = None
                waiting = len(scheduler.waiting) if scheduler is not None else 0
                in_flight = getattr(engine, "in_flight", None)
                read = (len(in_flight.seqs), len(in_flight.seqs) * in_flight.steps) if in_flight is not None else None
                started = time.perf_counter()
                outputs = step(engine)
                ended = time.perf_counter()
                seqs, tokens = read or getattr(scheduler, "traced_batch", None) or (0, 0)
                if outputs or seqs or ended - started > 1e-3:
                    trace.rows.append([engine.name, round(1000 * (started - trace.start), 2),
                                       round(1000 * (ended - started), 2), read is not None, seqs, tokens, waiting,
                                       len(outputs)])
                return outputs
            return traced

        Scheduler.schedule = traced_schedule
        AREngine.step = wrap(AREngine.step)
        GenerationEngine.step = wrap(GenerationEngine.step)
