"""Stage workers outside the server process: the orchestrator's end of one replica.

A ProcessStageWorker keeps the StageWorker shape: commands go out as typed messages over ZMQ,
payloads over the replica's links (connector.py), and a receiver thread turns the worker's
messages back into output callbacks. Where the replica runs is a Launcher's business: a spawned
Python process pinned to its devices (`worker_backend: process`), or a Ray actor with GPU
resources (`worker_backend: ray`). Either way a replica that dies fails its in-flight requests
with a 503 naming the stage, and reports its exit to the orchestrator.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import weakref
from typing import Any, Protocol

import zmq

from omnistage.errors import StageError, stage_failure
from omnistage.runtime import control
from omnistage.runtime.connector import LinkSpec, dial_securely, open_link, serve_securely
from omnistage.runtime.worker import ExitCallback, InFlight, OutputCallback
from omnistage.types import StageInput, StageOutput

logger = logging.getLogger(__name__)


class Handle(Protocol):
    """A running replica, however it was started."""

    def exit_reason(self) -> str | None:
        """None while it runs; afterwards, how it ended."""
        ...

    def stop(self, grace: float) -> None:
        """Wait up to `grace` seconds for it to exit by itself, then kill it."""
        ...


Launcher = Any  # Callable[[control.WorkerSpec], Handle]


class Subprocess:
    """`python -m omnistage.runtime.worker_main`, spec on stdin, devices through CUDA_VISIBLE_DEVICES."""

    def __init__(self, spec: control.WorkerSpec):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "omnistage.runtime.worker_main"], stdin=subprocess.PIPE,
            env={**os.environ, **spec.env},
        )
        self.proc.stdin.write(control.encode_spec(spec))
        self.proc.stdin.close()

    def exit_reason(self) -> str | None:
        code = self.proc.poll()
        if code is None:
            return None
        if code < 0:
            return f"its process was killed by {signal.Signals(-code).name}"
        return f"its process exited with code {code}"

    def stop(self, grace: float) -> None:
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class RayActor:
    """The same worker loop inside a Ray actor; Ray places it and sets its visible GPUs."""

    def __init__(self, spec: control.WorkerSpec, num_gpus: float, num_cpus: float, scheduling: Any = None):
        """`scheduling`: a Ray scheduling strategy (a placement group's bundle), or None for Ray's choice."""
        import ray

        self._ray = ray
        actor_cls = ray.remote(_StageActor)
        options = {"num_gpus": num_gpus, "num_cpus": num_cpus}
        if scheduling is not None:
            options["scheduling_strategy"] = scheduling
        self.actor = actor_cls.options(**options).remote()
        self.ref = self.actor.run.remote(control.encode_spec(spec).decode())

    def exit_reason(self) -> str | None:
        done, _ = self._ray.wait([self.ref], timeout=0)
        if not done:
            return None
        try:
            return f"its Ray actor returned {self._ray.get(self.ref)}"
        except Exception:
            logger.exception("a Ray stage actor died")  # the reason stays in the log
            return "its Ray actor died"

    def stop(self, grace: float) -> None:
        self._ray.wait([self.ref], timeout=grace)
        self._ray.kill(self.actor)


class _StageActor:
    def run(self, spec_json: str) -> int:
        from omnistage.runtime.worker_main import serve

        return serve(control.decode_spec(spec_json.encode()))


_LIVE: weakref.WeakSet[ProcessStageWorker] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    """A server that exits without shutting its engine down still leaves no child behind."""
    for worker in list(_LIVE):
        worker.shutdown(grace=2.0)


def _exit_on_sigterm() -> None:
    """SIGTERM's default action ends the process before `finally` blocks and atexit run, which
    would orphan the workers (uvicorn re-raises it after its own shutdown). Turn it into
    SystemExit, unless the application handles SIGTERM itself."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _raise_system_exit)


def _raise_system_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


class ProcessStageWorker:
    def __init__(self, stage: str, replica: int, spec: control.WorkerSpec, launch: Launcher,
                 on_outputs: OutputCallback, on_exit: ExitCallback | None = None, bind_host: str | None = None):
        """Start the replica and return at once; `wait_ready` waits for its engine. `spec` carries
        the worker's ends of the links; bind_host None means one host (ipc control sockets)."""
        self.stage, self.replica = stage, replica
        self.inflight = InFlight(stage, replica, on_outputs)
        self.on_exit = on_exit
        self.vocab_size: int | None = None  # set by its Ready message
        self._stats: dict[str, Any] = {}
        self._ready = threading.Event()
        self._dead: str | None = None
        self._failure: str | None = None  # the worker's own account of what went wrong
        self._stopping = False
        self._thread_started = False  # the receiver thread owns (and closes) the events socket
        self._lock = threading.Lock()  # the command socket and links
        self._ctx = zmq.Context()
        self._tmp = tempfile.mkdtemp(prefix="omnistage-")
        self._events = self._ctx.socket(zmq.PULL)
        self._events.setsockopt(zmq.RCVHWM, 0)
        self._events.setsockopt(zmq.LINGER, 0)
        self._commands = self._ctx.socket(zmq.PUSH)
        self._commands.setsockopt(zmq.SNDHWM, 0)
        self._commands.setsockopt(zmq.LINGER, 0)
        if bind_host is None:  # one host: ipc sockets in our private temporary directory
            self._events.bind(f"ipc://{self._tmp}/events")
            spec.event_address, spec.command_address = f"ipc://{self._tmp}/events", f"ipc://{self._tmp}/commands"
        else:
            serve_securely(self._events, spec.curve_key)
            dial_securely(self._commands, spec.curve_key)
            spec.event_address = f"tcp://{bind_host}:{self._events.bind_to_random_port(f'tcp://{bind_host}')}"
            spec.command_address = "tcp://auto"
        # Our ends of the links: we own them (purge what a dead worker leaves behind).
        self._inbox_end = open_link(_peer_end(spec.inbox, bind_host or "127.0.0.1"), owner=True)
        self._outbox_end = open_link(_peer_end(spec.outbox, bind_host or "127.0.0.1"), owner=True)
        if spec.outbox.type == "tcp":
            spec.outbox.peer = self._outbox_end.address
        self.inbox = control.Link(self._inbox_end, f"->{stage}", spec.inline_max_bytes)
        self.outbox = control.Link(self._outbox_end, f"{stage}->", spec.inline_max_bytes)
        self.spec = spec
        _exit_on_sigterm()
        try:
            self.handle: Handle = launch(spec)
        except Exception as exc:
            self._close()
            raise StageError(f"stage {stage!r} replica {replica} could not be launched: {exc}") from exc
        _LIVE.add(self)
        self._thread = threading.Thread(target=self._receive, name=f"stage-{stage}-{replica}-events", daemon=True)
        self._thread.start()
        self._thread_started = True

    # ---- StageWorker --------------------------------------------------------------------------

    def add_request(self, inp: StageInput) -> None:
        self.inflight.add(inp.request_id)
        self._send(control.Add, inp.request_id, inp)

    def add_input_chunk(self, request_id: str, chunk: StageInput) -> None:
        self._send(control.Chunk, request_id, chunk)

    def abort(self, request_id: str) -> None:
        self.inflight.discard(request_id)
        if self._dead is None and self._ready.is_set():
            with self._lock:
                control.send(self._commands, control.Abort(request_id))

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.05):
            if self._dead is not None:
                raise StageError(f"stage {self.stage!r} replica {self.replica} failed to start: {self._dead}")
            if time.monotonic() > deadline:
                self.shutdown(grace=0)
                raise StageError(
                    f"stage {self.stage!r} replica {self.replica} did not report ready within {timeout:g}s "
                    "(raise startup_timeout_s in the deploy config if loading is just slow)"
                )

    def stats(self) -> dict[str, Any]:
        return {**self._stats, **self.inbox.counters("in"), "out_recv_seconds": self.outbox.seconds}

    def is_alive(self) -> bool:
        return self._ready.is_set() and self._dead is None

    def shutdown(self, grace: float = 10.0) -> None:
        if self._stopping:
            return
        self._stopping = True
        if self._dead is None and self._ready.is_set():
            with self._lock:
                control.send(self._commands, control.Stop())
        self.handle.stop(grace)
        self._thread.join(timeout=5)
        self._died("was shut down")
        self._close()
        _LIVE.discard(self)

    def _close(self) -> None:
        with self._lock:
            self._commands.close()
            if not self._thread_started:
                self._events.close()
            for end in (self._inbox_end, self._outbox_end):
                end.close()
        self._ctx.term()
        shutil.rmtree(self._tmp, ignore_errors=True)

    # ---- internals ----------------------------------------------------------------------------

    def _send(self, kind: type, request_id: str, inp: StageInput) -> None:
        if self._dead is not None:
            return  # its requests were failed when it died
        if not self._ready.is_set():  # the orchestrator only routes to ready replicas
            raise StageError(f"stage {self.stage!r} replica {self.replica} is not ready yet", status=503)
        with self._lock:
            item, frames = self.inbox.encode(inp, request_id)
            msg = control.Add(item) if kind is control.Add else control.Chunk(request_id, item)
            control.send(self._commands, msg, frames)

    def _receive(self) -> None:
        """Events from the worker, until it is gone; then fail what it held."""
        try:
            while not self._stopping or self._events.poll(0):
                if not self._events.poll(100):
                    why = self.handle.exit_reason()
                    if why is not None:
                        self._died(why, self._failure)
                        return
                    continue
                msg, frames = control.recv(self._events)
                if isinstance(msg, control.Outputs):
                    self._on_outputs(msg, frames)
                elif isinstance(msg, control.Ready):
                    self.vocab_size = msg.vocab_size
                    if msg.summary:
                        logger.info("%s", msg.summary)
                    with self._lock:
                        self._commands.connect(msg.command_address)
                        if msg.inbox_address:
                            self._inbox_end.connect(msg.inbox_address)
                    self._ready.set()
                elif isinstance(msg, control.Failed):
                    self._failure = msg.error
                    logger.error("stage %r replica %d: %s", self.stage, self.replica, msg.error)
        finally:
            self._events.close()

    def _on_outputs(self, msg: control.Outputs, frames: Any) -> None:
        outputs: list[StageOutput] = []
        for item in msg.items:
            try:
                outputs.append(self.outbox.decode(item, frames))
            except Exception:  # its request fails; the stage goes on
                rid = item.key[0] if item.key else "?"
                logger.exception("stage %r: an output of request %r was lost", self.stage, rid)
                outputs.append(StageOutput.failure(rid, self.stage, stage_failure(self.stage)))
        if msg.stats is not None:
            self._stats = msg.stats
        self.inflight.deliver(outputs)

    def _died(self, why: str, account: str | None = None) -> None:
        """`why`: how it ended (its exit, ours to word); `account`: the worker's own report, which may quote an
        exception, so it goes to the log and to start-up errors, never to a request's caller."""
        detail = f"{why}; {account}" if account else why
        with self._lock:
            if self._dead is not None:
                return
            self._dead = detail
        was_ready = self._ready.is_set()
        if was_ready and not self._stopping:
            logger.error("stage %r replica %d died: %s", self.stage, self.replica, detail)
        self.inflight.fail_all(why if self._stopping else f"stopped: {why}; the server log has the details")
        if was_ready and not self._stopping and self.on_exit is not None:
            self.on_exit(self.stage, self.replica, why)


def _peer_end(worker_end: LinkSpec, host: str) -> LinkSpec:
    """The orchestrator's end of a link whose worker end is `worker_end`."""
    return LinkSpec(worker_end.type, side="a", prefix=worker_end.prefix, host=host, key=worker_end.key)


def new_link(kind: str, host: str = "127.0.0.1", key: str = "") -> LinkSpec:
    """The worker's end of a fresh link (unique shm prefix; tcp ports are picked at bind time, `key` secures them)."""
    return LinkSpec(kind, side="b", prefix=f"omnistage-{os.getpid()}-{uuid.uuid4().hex[:10]}", host=host, key=key)
