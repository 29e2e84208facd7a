"""AsyncOmni: the asyncio front of the runtime, with streaming deltas and abort on cancel."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import weakref
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from omnistage.config.deploy import DeployConfig
from omnistage.families.base import Pipeline
from omnistage.families.registry import load_pipeline
from omnistage.media import MediaLimits, RemotePolicy, has_media, prefetch
from omnistage.runtime.launch import start_orchestrator
from omnistage.sampling_params import SamplingParams
from omnistage.types import OmniOutput, OmniRequest


class AsyncOmni:
    def __init__(self, model: str | Path | Pipeline, deploy_config: str | Path | dict | DeployConfig | None = None,
                 overrides: dict[str, Any] | None = None, served_model_name: str | None = None,
                 on_progress: Callable[[str], None] | None = None):
        """Load the checkpoint's pipeline (or take one `load_pipeline` made: the server checks the deploy config
        before it starts serving) and start its stage workers (blocking). `on_progress` hears what is loading,
        one sentence at a time (the server's /health shows it)."""
        if isinstance(model, Pipeline):
            self.pipeline = model
        else:
            if on_progress is not None:
                on_progress("reading the checkpoint and the deploy config")
            self.pipeline = load_pipeline(model, deploy_config, overrides)
        self.orchestrator = start_orchestrator(self.pipeline, on_progress)
        self.served_model_name = served_model_name or Path(self.pipeline.model_path).name
        self.tokenizer = self.pipeline.tokenizer
        self.max_model_len = self.pipeline.max_model_len
        self.output_modalities = self.pipeline.output_modalities
        self.ar_stages = [s.name for s in self.pipeline.stages if s.kind == "ar"]

    @classmethod
    def from_model(cls, model: str | Path | Pipeline, deploy_config: str | Path | dict | DeployConfig | None = None,
                   overrides: dict[str, Any] | None = None, served_model_name: str | None = None,
                   on_progress: Callable[[str], None] | None = None) -> AsyncOmni:
        return cls(model, deploy_config, overrides, served_model_name, on_progress)

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
        sink = _LoopPost.of(loop).sender(deltas)
        # Media URLs are fetched here, on the event loop, before admission: a slow URL holds up only its own
        # request, and cancelling the request cancels its fetches.
        messages = request.messages
        fetched = await self._fetch_media(request)
        # Admission runs the family's preprocessing (media decoding, HF processors) in a worker thread; requests
        # with media have a pool of their own, so a text request never queues behind decoding. If the caller
        # leaves meanwhile, the request is aborted once it is in.
        pool = _admission_pool(media=fetched is not None or bool(request.media) or has_media(messages))
        request.messages = fetched or messages
        try:
            admitted = asyncio.ensure_future(loop.run_in_executor(pool, self.orchestrator.submit, request, sink))
            try:
                await asyncio.shield(admitted)
            except asyncio.CancelledError:
                with contextlib.suppress(Exception):
                    await admitted
                    self.orchestrator.abort(request.request_id)
                raise
        finally:
            request.messages = messages  # the fetched bytes are not kept for the request's lifetime
        finished = False
        try:
            while not finished:
                out = await deltas.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.orchestrator.abort(request.request_id)

    media_policy: RemotePolicy | None = None  # None: the deploy config's `media`; tests set one for local servers

    async def _fetch_media(self, request: OmniRequest) -> list[dict[str, Any]] | None:
        """The request's messages with its media URLs fetched (None if it has none), under the deploy config."""
        deploy = self.pipeline.deploy
        policy = self.media_policy or RemotePolicy.from_config(deploy.media)
        return await prefetch(request.messages, MediaLimits.from_config(deploy.limits), policy)

    async def abort(self, request_id: str) -> None:
        self.orchestrator.abort(request_id)

    def shutdown(self) -> None:
        self.orchestrator.shutdown()


_ADMISSION_POOLS: dict[bool, ThreadPoolExecutor] = {}
_ADMISSION_LOCK = threading.Lock()


def _admission_pool(media: bool) -> ThreadPoolExecutor:
    """The threads that admit requests, one pool for requests with media (decoding) and one for the rest, both
    apart from asyncio's default pool (which other work shares)."""
    with _ADMISSION_LOCK:
        if media not in _ADMISSION_POOLS:
            _ADMISSION_POOLS[media] = ThreadPoolExecutor(
                max_workers=4, thread_name_prefix="omni-admit-media" if media else "omni-admit")
        return _ADMISSION_POOLS[media]


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
