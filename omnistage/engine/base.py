"""The contract every engine keeps, whatever it computes (AR, diffusion, one-shot generation)."""

from __future__ import annotations

from typing import Protocol

import torch

from omnistage.types import StageInput, StageOutput


class Engine(Protocol):
    """Runs one stage. `step()` never waits on the network; a request waiting for input chunks
    does not block others. Per-request state is freed on finish or abort."""

    def add_request(self, inp: StageInput) -> None: ...

    def add_input_chunk(self, request_id: str, chunk: StageInput) -> None: ...

    def abort(self, request_id: str) -> None: ...

    def has_work(self) -> bool: ...

    def step(self) -> list[StageOutput]: ...

    def stats(self) -> dict[str, int]: ...

    def shutdown(self) -> None: ...

    def describe(self) -> str:
        """One line for the start-up log: where it runs and what it holds (precision, cache, graphs)."""
        ...

    @property
    def device(self) -> torch.device | None:
        """Where the stage computes (None: nowhere in particular), so a host can give it its own CUDA stream."""
        ...
