"""AsyncOmni: the asyncio front of the runtime, with streaming deltas and abort on cancel."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from omnistage.config.deploy import DeployConfig
from omnistage.runtime.launch import build_pipeline, start_orchestrator
from omnistage.runtime.messages import OmniOutput, OmniRequest
from omnistage.sampling_params import SamplingParams


class AsyncOmni:
    def __init__(self, model: str | Path, deploy_config: str | Path | dict | DeployConfig | None = None,
                 overrides: dict[str, Any] | None = None, served_model_name: str | None = None):
        """Load the checkpoint's pipeline and start its stage workers (blocking)."""
        self.pipeline = build_pipeline(model, deploy_config, overrides)
        self.orchestrator = start_orchestrator(self.pipeline)
        self.served_model_name = served_model_name or Path(model).name
        self.tokenizer = self.pipeline.tokenizer
        self.max_model_len = self.pipeline.max_model_len
        self.output_modalities = self.pipeline.output_modalities
        self.ar_stages = [s.name for s in self.pipeline.stages if s.kind == "ar"]

    @classmethod
    def from_model(cls, model: str | Path, deploy_config: str | Path | dict | DeployConfig | None = None,
                   overrides: dict[str, Any] | None = None, served_model_name: str | None = None) -> AsyncOmni:
        return cls(model, deploy_config, overrides, served_model_name)

    def default_sampling_params(self) -> SamplingParams:
        return self.pipeline.stage_config(self.pipeline.entry).sampling_params()

    def health(self) -> tuple[bool, str]:
        return self.orchestrator.health()

    def stats(self) -> dict[str, dict]:
        return self.orchestrator.stats()

    async def generate(self, request: OmniRequest) -> AsyncIterator[OmniOutput]:
        """Yield the request's deltas; the last has `finished` set. Raises RequestError before
        yielding anything if the request cannot be served. Leaving early aborts the request in
        every stage."""
        loop = asyncio.get_running_loop()
        deltas: asyncio.Queue[OmniOutput] = asyncio.Queue()
        sink = lambda out: loop.call_soon_threadsafe(deltas.put_nowait, out)
        # Admission runs the family's preprocessing (media fetch and decode, HF processors): off the
        # event loop. If the caller leaves meanwhile, the request is aborted once it is in.
        admitted = asyncio.ensure_future(asyncio.to_thread(self.orchestrator.submit, request, sink))
        try:
            await asyncio.shield(admitted)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await admitted
                self.orchestrator.abort(request.request_id)
            raise
        finished = False
        try:
            while not finished:
                out = await deltas.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.orchestrator.abort(request.request_id)

    async def abort(self, request_id: str) -> None:
        self.orchestrator.abort(request_id)

    def shutdown(self) -> None:
        self.orchestrator.shutdown()
