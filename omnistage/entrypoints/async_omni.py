"""AsyncOmni: the asyncio front of the runtime, with streaming deltas and abort on cancel."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import weakref
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from omnistage.config.deploy import DeployConfig
from omnistage.families.registry import load_pipeline
from omnistage.runtime.launch import start_orchestrator
from omnistage.sampling_params import SamplingParams
from omnistage.types import OmniOutput, OmniRequest


class AsyncOmni:
    def __init__(self, model: str | Path, deploy_config: str | Path | dict | DeployConfig | None = None,
                 overrides: dict[str, Any] | None = None, served_model_name: str | None = None):
        """Load the checkpoint's pipeline and start its stage workers (blocking)."""
        self.pipeline = load_pipeline(model, deploy_config, overrides)
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
        deltas: asyncio.Queue[OmniOutput] = asyncio.Queue()
        sink = _LoopPost.of(asyncio.get_running_loop()).sender(deltas)
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


class _LoopPost:
    """Hands stage outputs from worker threads to one event loop's request queues, one loop wake-up per burst:
    a stage step yields a delta for every request in its batch, and waking the loop (a syscall, then a thread
    switch) once per delta makes the loop's thread fight the stage threads for the interpreter 32 times a step
    at 32 concurrent requests. The first delta of a burst schedules a drain; later ones only join its list."""

    _posts: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopPost] = weakref.WeakKeyDictionary()
    _posts_lock = threading.Lock()

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.lock = threading.Lock()
        self.pending: list[tuple[asyncio.Queue, OmniOutput]] = []

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> _LoopPost:
        with cls._posts_lock:
            post = cls._posts.get(loop)
            if post is None:
                post = cls._posts[loop] = cls(loop)
            return post

    def sender(self, queue: asyncio.Queue) -> Callable[[OmniOutput], None]:
        return lambda out: self.send(queue, out)

    def send(self, queue: asyncio.Queue, out: OmniOutput) -> None:
        with self.lock:
            self.pending.append((queue, out))
            if len(self.pending) > 1:
                return  # a drain is already scheduled
        self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self.lock:
            pending, self.pending = self.pending, []
        for queue, out in pending:
            queue.put_nowait(out)
