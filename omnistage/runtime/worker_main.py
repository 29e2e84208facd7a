"""A stage worker in its own process: `python -m omnistage.runtime.worker_main` with a JSON
WorkerSpec on stdin (the Ray backend calls `serve` inside an actor instead).

The child rebuilds the pipeline from (model path, deploy config) itself, builds its stage's
engine on its devices, reports Ready (or Failed with the reason), then runs the same EngineLoop
as the inline worker: a receiver thread turns control messages into loop commands, and each
loop iteration sends its outputs and stats back.
"""

from __future__ import annotations

import gc
import logging
import os
import shutil
import signal
import socket
import sys
import threading
import time
from typing import Any

import zmq

from omnistage.runtime import control
from omnistage.runtime.connector import ShmConnector, dial_securely, open_link, serve_securely


def serve(spec: control.WorkerSpec) -> int:
    """Run one stage replica until told to stop; the process exit code."""
    os.environ.update(spec.env)
    sys.path[:0] = [p for p in spec.sys_path if p not in sys.path]
    host = _host_toward(spec.event_address)
    for end in (spec.inbox, spec.outbox):
        end.host = host if end.host == "auto" else end.host
    ctx = zmq.Context()
    events = ctx.socket(zmq.PUSH)
    events.setsockopt(zmq.SNDHWM, 0)
    events.setsockopt(zmq.LINGER, 5000)  # let the last outputs (or the failure) reach the orchestrator
    if spec.event_address.startswith("tcp://"):
        dial_securely(events, spec.curve_key)
    events.connect(spec.event_address)
    lock = threading.Lock()  # the loop thread and this one both report

    def emit(msg: control.Message, frames: list = ()) -> None:
        with lock:
            control.send(events, msg, frames)

    links: list = []
    stopping = threading.Event()
    receiver: threading.Thread | None = None
    try:
        try:
            from omnistage.families.registry import load_pipeline
            from omnistage.runtime.worker import EngineLoop, ready_summary

            started = time.monotonic()
            engine = load_pipeline(spec.model, spec.deploy).build_engine(spec.stage, spec.devices)
            summary = ready_summary(spec.stage, engine, started)
            links = [open_link(spec.inbox), open_link(spec.outbox)]
        except Exception as exc:
            emit(control.Failed(f"{type(exc).__name__}: {exc}"))
            return 1
        gc.collect()  # what exists now lives as long as the worker: out of the cyclic collector's scans
        gc.freeze()
        inbox = control.Link(links[0], f"->{spec.stage}", spec.inline_max_bytes)
        outbox = control.Link(links[1], f"{spec.stage}->", spec.inline_max_bytes)
        last: dict[str, Any] = {}

        def report(outputs: list, stats: dict[str, Any]) -> None:
            items, frames = [], []
            for out in outputs:
                item, buffers = outbox.encode(out, out.request_id)
                items.append(item)
                frames += buffers
            stats |= outbox.counters("out") | {"in_recv_seconds": inbox.seconds}
            if items or stats != last:
                emit(control.Outputs(items, stats), frames)
                last.clear()
                last.update(stats)

        loop = EngineLoop(spec.stage, engine, report)
        commands = ctx.socket(zmq.PULL)  # handed to the receiver thread, which owns it from here on
        commands.setsockopt(zmq.RCVHWM, 0)
        commands.setsockopt(zmq.LINGER, 0)
        if spec.command_address.startswith("ipc://"):
            commands.bind(spec.command_address)
            command_address = spec.command_address
        else:  # "tcp://auto": any free port on our address toward the orchestrator
            serve_securely(commands, spec.curve_key)
            command_address = f"tcp://{host}:{commands.bind_to_random_port(f'tcp://{host}')}"
        receiver = threading.Thread(target=_receive, args=(commands, inbox, loop, stopping), name="commands",
                                    daemon=True)
        receiver.start()
        if spec.parent_pid:
            threading.Thread(target=_watch_parent, args=(spec.parent_pid, links, spec.event_address),
                             daemon=True).start()
        inbox_address = links[0].address if spec.inbox.type == "tcp" else None
        emit(control.Ready(os.getpid(), command_address, inbox_address, getattr(engine, "vocab_size", None), summary))
        try:
            loop.run()
        except Exception as exc:
            emit(control.Failed(f"{type(exc).__name__}: {exc}"))
            raise
        return 0
    finally:
        stopping.set()
        if receiver is not None:
            receiver.join(timeout=5)
        for end in links:
            end.close()
        events.close()
        ctx.term()


def _receive(sock: zmq.Socket, inbox: control.Link, loop: Any, stopping: threading.Event) -> None:
    """Control messages -> loop commands, until Stop."""
    from omnistage.errors import stage_failure
    from omnistage.runtime.worker import Abort, AddChunk, AddRequest, Fail, Stop
    from omnistage.types import StageOutput

    try:
        while not stopping.is_set():
            if not sock.poll(100):
                continue
            msg, frames = control.recv(sock)
            if isinstance(msg, control.Stop):
                loop.commands.put(Stop())
                return
            if isinstance(msg, control.Abort):
                loop.commands.put(Abort(msg.request_id))
                continue
            try:
                inp = inbox.decode(msg.item, frames)
            except Exception:  # a payload that never arrived fails its request, not the stage
                rid = msg.request_id if isinstance(msg, control.Chunk) else (msg.item.key or ("?",))[0]
                logging.getLogger(__name__).exception("stage %r could not read an input of %r", loop.stage, rid)
                loop.commands.put(Abort(rid))
                loop.commands.put(Fail(StageOutput.failure(rid, loop.stage, stage_failure(loop.stage))))
                continue
            if isinstance(msg, control.Add):
                loop.commands.put(AddRequest(inp))
            else:
                loop.commands.put(AddChunk(msg.request_id, inp))
    finally:
        sock.close()


def _host_toward(address: str) -> str:
    """Our IP address on the route to the orchestrator (loopback when it is on this host)."""
    if not address.startswith("tcp://"):
        return "127.0.0.1"
    peer = address.removeprefix("tcp://").rsplit(":", 1)[0]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((peer, 9))  # UDP connect sends nothing; it only picks the route
        return probe.getsockname()[0]


def _watch_parent(parent_pid: int, links: list, event_address: str) -> None:
    """The orchestrator died without stopping us (SIGKILL): free the links and its socket
    directory (nobody else is left to), and go."""
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    for end in links:
        if isinstance(end, ShmConnector):
            end.owner = True
            end.close()
    if event_address.startswith("ipc://"):
        shutil.rmtree(os.path.dirname(event_address.removeprefix("ipc://")), ignore_errors=True)
    os._exit(0)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the parent stops us
    spec = control.decode_spec(sys.stdin.buffer.read())
    code = serve(spec)  # returns once its messages are flushed and its links closed
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown (torch's is slow); everything is flushed and closed


if __name__ == "__main__":
    main()
