"""The control channel between the orchestrator and a stage worker in another process: typed
msgspec messages over ZMQ, one multipart message each ([message, *inline buffers]).

Payloads (StageInput / StageOutput) ride inline when small; larger ones are put on the link's
connector (shared memory or TCP) and only their key crosses the control channel. A payload is
always put before its key is sent, and the receiver takes every payload it is told about, in
order, so nothing is left on a link except by a dead peer (the link's owner purges those).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import zmq

from omnistage.runtime import serialization
from omnistage.runtime.connector import Key, LinkSpec, ShmConnector, TcpConnector


class Item(msgspec.Struct, array_like=True):
    """One payload: inline (its header, then `nbuf` buffers from the message's frames) or parked
    on the link's connector under `key`."""

    header: bytes | None = None
    nbuf: int = 0
    key: tuple[str, str, int] | None = None


# orchestrator -> worker
class Add(msgspec.Struct, tag="add"):
    item: Item


class Chunk(msgspec.Struct, tag="chunk"):
    request_id: str
    item: Item


class Abort(msgspec.Struct, tag="abort"):
    request_id: str


class Stop(msgspec.Struct, tag="stop"):
    pass


# worker -> orchestrator
class Ready(msgspec.Struct, tag="ready"):
    pid: int
    command_address: str  # where the orchestrator connects to send commands
    inbox_address: str | None = None  # tcp inbox: where the orchestrator pushes payloads
    vocab_size: int | None = None  # an AR stage's vocabulary, for checking requests' token ids at admission
    summary: str = ""  # the start-up log line, logged by the orchestrator's process (the worker's log is quiet)


class Failed(msgspec.Struct, tag="failed"):
    error: str  # why the worker could not start or stopped working


class Outputs(msgspec.Struct, tag="outputs"):
    items: list[Item]
    stats: dict[str, int | float] | None = None


Message = Add | Chunk | Abort | Stop | Ready | Failed | Outputs
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Message)


class WorkerSpec(msgspec.Struct):
    """Everything a stage worker process needs to rebuild its engine and reach the orchestrator."""

    model: str
    deploy: dict[str, Any]  # the deploy config as the user gave it (exclude_unset), JSON-able
    stage: str
    replica: int
    devices: str | None  # as the child sees them (after CUDA_VISIBLE_DEVICES), e.g. "0,1" or "cpu"
    command_address: str  # the worker binds here: "ipc://path", or "tcp://host" for any free port
    event_address: str  # the orchestrator's bound PULL socket; the worker connects
    inbox: LinkSpec  # payloads orchestrator -> worker (worker's end)
    outbox: LinkSpec  # payloads worker -> orchestrator (worker's end)
    inline_max_bytes: int
    parent_pid: int = 0  # exit when this process is gone (0: don't watch, e.g. under Ray)
    curve_key: str = ""  # TCP control sockets: the deployment's CURVE key pair (connector.curve_key)
    sys_path: list[str] = []
    env: dict[str, str] = {}


def send(sock: zmq.Socket, msg: Message, frames: list[Any] = ()) -> None:
    """Sockets that send always connect (the peer binds), so ZMQ queues instead of blocking:
    a send never waits on the peer, alive or not. Callers serialise access to `sock`."""
    sock.send_multipart([_ENCODER.encode(msg), *frames], copy=serialization.payload_nbytes(list(frames)) < 65536)


def recv(sock: zmq.Socket) -> tuple[Message, Iterator[memoryview]]:
    frames = sock.recv_multipart(copy=False)
    return _DECODER.decode(frames[0].buffer), (f.buffer for f in frames[1:])


class Link:
    """One direction of payload traffic and its counters (bytes, transfers, seconds spent)."""

    def __init__(self, connector: ShmConnector | TcpConnector, edge: str, inline_max_bytes: int):
        self.connector, self.edge, self.inline_max_bytes = connector, edge, inline_max_bytes
        self._seq = itertools.count()
        self.bytes = self.count = 0
        self.seconds = 0.0

    def encode(self, obj: Any, request_id: str) -> tuple[Item, list[memoryview]]:
        start = time.perf_counter()
        header, buffers = serialization.pack(obj)
        size = serialization.payload_nbytes(buffers)
        if size <= self.inline_max_bytes:
            item, frames = Item(header=header, nbuf=len(buffers)), buffers
        else:
            key: Key = (request_id, self.edge, next(self._seq))
            self.connector.put_packed(key, header, buffers)
            item, frames = Item(key=key), []
        self.bytes += len(header) + size
        self.count += 1
        self.seconds += time.perf_counter() - start
        return item, frames

    def decode(self, item: Item, frames: Iterator[memoryview], timeout: float = 60.0) -> Any:
        start = time.perf_counter()
        if item.key is None:
            obj = serialization.unpack(item.header, [next(frames) for _ in range(item.nbuf)])
        else:
            obj = self.connector.get(item.key, timeout)
        self.seconds += time.perf_counter() - start  # bytes and transfers are counted by the sender
        return obj

    def counters(self, prefix: str) -> dict[str, float]:
        return {f"{prefix}_bytes": self.bytes, f"{prefix}_transfers": self.count, f"{prefix}_seconds": self.seconds}


def decode_spec(data: bytes) -> WorkerSpec:
    return msgspec.json.decode(data, type=WorkerSpec)


def encode_spec(spec: WorkerSpec) -> bytes:
    return msgspec.json.encode(spec)
