"""Connectors move stage payloads between workers, keyed by (request id, edge, chunk index).

The inline backend hands objects over directly (InProcessConnector); the process and Ray
backends put large payloads on a link between the orchestrator and a stage worker (shared
memory on one host, ZMQ/TCP across hosts) and send only the key over the control channel.
Every connector has the same four operations so a link's transport is a deploy-config choice.
Objects crossing processes go through `serialization` (typed header + raw tensor bytes).
"""

from __future__ import annotations

import hashlib
import mmap
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import msgspec
import zmq

from omnistage.runtime import serialization

Key = tuple[str, str, int]  # (request_id, edge "src->dst", chunk index)


class Connector(Protocol):
    def put(self, key: Key, payload: Any) -> None: ...

    def get(self, key: Key, timeout: float | None = None) -> Any:
        """The payload under `key`, waiting up to `timeout` seconds; TimeoutError after that."""
        ...

    def cleanup(self, request_id: str) -> None:
        """Drop every payload of a finished or aborted request."""
        ...

    def close(self) -> None: ...


class InProcessConnector:
    """Payloads stay Python objects in one process; `get` removes what it returns."""

    def __init__(self) -> None:
        self._items: dict[Key, Any] = {}
        self._cond = threading.Condition()

    def put(self, key: Key, payload: Any) -> None:
        with self._cond:
            self._items[key] = payload
            self._cond.notify_all()

    def get(self, key: Key, timeout: float | None = None) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while key not in self._items:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"no payload for {key} within {timeout}s")
                self._cond.wait(remaining)
            return self._items.pop(key)

    def cleanup(self, request_id: str) -> None:
        with self._cond:
            for key in [k for k in self._items if k[0] == request_id]:
                del self._items[key]

    def close(self) -> None:
        with self._cond:
            self._items.clear()

    def __len__(self) -> int:
        return len(self._items)


# ---- across processes: payloads go through serialization (header + raw tensor buffers) ---------

SHM_DIR = Path("/dev/shm")


def _tag(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


class ShmConnector:
    """One end of a same-host link over POSIX shared memory (Linux /dev/shm).

    `put` writes one segment per payload (written under a temporary name, then renamed, so a
    reader never sees half a payload). `get` maps it, unlinks the name at once and builds tensors
    on the mapping: zero-copy, and the memory goes back to the OS when the last tensor dies.
    Names are `{prefix}.{side}.{request tag}.{key tag}`, so `cleanup` finds a request's payloads
    and the link's owner can purge everything a dead peer left behind.
    """

    def __init__(self, prefix: str, side: str, owner: bool = False):
        if not SHM_DIR.is_dir():
            raise OSError("the shm connector needs /dev/shm (Linux); use the tcp connector here")
        self.prefix, self.side, self.owner = prefix, side, owner
        self.peer_side = "b" if side == "a" else "a"

    def _path(self, side: str, key: Key) -> Path:
        return SHM_DIR / f"{self.prefix}.{side}.{_tag(key[0])}.{_tag(f'{key[1]}|{key[2]}')}"

    def put(self, key: Key, payload: Any) -> None:
        self.put_packed(key, *serialization.pack(payload))

    def put_packed(self, key: Key, header: bytes, buffers: list[memoryview]) -> None:
        size = serialization.contiguous_size(header, buffers)
        path = self._path(self.side, key)
        tmp = path.with_name(path.name + ".w")
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            with mmap.mmap(fd, size) as block, memoryview(block) as view:
                serialization.to_contiguous(header, buffers, view)
        except BaseException:
            os.unlink(tmp)
            raise
        finally:
            os.close(fd)
        os.rename(tmp, path)

    def get(self, key: Key, timeout: float | None = None) -> Any:
        path = self._path(self.peer_side, key)
        fd = _wait_open(path, key, timeout)
        try:
            block = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
            os.unlink(path)
        header, buffers = serialization.from_contiguous(memoryview(block))
        return serialization.unpack(header, buffers)

    def cleanup(self, request_id: str) -> None:
        for path in SHM_DIR.glob(f"{self.prefix}.*.{_tag(request_id)}.*"):
            path.unlink(missing_ok=True)

    def close(self) -> None:
        """Unlink what this end wrote and nobody read; the owner unlinks the whole link."""
        pattern = f"{self.prefix}.*" if self.owner else f"{self.prefix}.{self.side}.*"
        for path in SHM_DIR.glob(pattern):
            path.unlink(missing_ok=True)


def _wait_open(path: Path, key: Key, timeout: float | None) -> int:
    """Open a segment, polling until it appears (announced payloads are there at once)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    pause = 20e-6
    while True:
        try:
            return os.open(path, os.O_RDWR)
        except FileNotFoundError:
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"no payload for {key} within {timeout}s") from None
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)


class TcpConnector:
    """One end of a link between hosts over ZMQ/TCP. Each end binds a PULL socket (its `address`)
    and pushes to its peer's after `connect`. A receiver thread files incoming payloads by key;
    `get` waits for its key and builds tensors on the received frames (no extra copy)."""

    def __init__(self, host: str = "127.0.0.1", advertise: str | None = None):
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        port = self._pull.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{advertise or host}:{port}"
        self._push: zmq.Socket | None = None
        self._send_lock = threading.Lock()
        self._items: dict[Key, list[zmq.Frame]] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._receive, name="tcp-connector", daemon=True)
        self._thread.start()

    def connect(self, peer_address: str) -> None:
        push = self._ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.setsockopt(zmq.SNDHWM, 0)
        push.connect(peer_address)
        self._push = push

    def put(self, key: Key, payload: Any) -> None:
        self.put_packed(key, *serialization.pack(payload))

    def put_packed(self, key: Key, header: bytes, buffers: list[memoryview]) -> None:
        if self._push is None:
            raise RuntimeError("TcpConnector.put before connect(peer_address)")
        frames = [_KEY_ENCODER.encode(list(key)), header, *buffers]
        with self._send_lock:
            self._push.send_multipart(frames, copy=serialization.payload_nbytes(buffers) < 65536)

    def get(self, key: Key, timeout: float | None = None) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while key not in self._items:
                remaining = None if deadline is None else deadline - time.monotonic()
                if self._closed or (remaining is not None and remaining <= 0):
                    raise TimeoutError(f"no payload for {key} within {timeout}s")
                self._cond.wait(remaining)
            frames = self._items.pop(key)
        return serialization.unpack(frames[0].buffer, [f.buffer for f in frames[1:]])

    def cleanup(self, request_id: str) -> None:
        with self._cond:
            for key in [k for k in self._items if k[0] == request_id]:
                del self._items[key]

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._items.clear()
            self._cond.notify_all()
        with self._send_lock:
            if self._push is not None:
                self._push.close(linger=0)
        self._ctx.term()  # the receiver thread sees ETERM and closes its socket; term waits for it
        self._thread.join(timeout=5)

    def _receive(self) -> None:
        while True:
            try:
                frames = self._pull.recv_multipart(copy=False)
            except zmq.ZMQError:  # ETERM: closing
                self._pull.close(linger=0)
                return
            key = tuple(msgspec.msgpack.decode(frames[0].bytes))
            with self._cond:
                self._items[key] = frames[1:]
                self._cond.notify_all()


_KEY_ENCODER = msgspec.msgpack.Encoder()


# ---- choosing a connector -------------------------------------------------------------------------


@dataclass
class LinkSpec:
    """How one end opens its side of a link (JSON-able, so it can travel to a child)."""

    type: str  # "shm" | "tcp"
    side: str  # "a" (orchestrator) | "b" (stage worker)
    prefix: str = ""  # shm: segment name prefix
    host: str = "127.0.0.1"  # tcp: address to bind (and that the peer dials)
    peer: str | None = None  # tcp: the other end's address, when known up front


def open_link(spec: LinkSpec, owner: bool = False) -> ShmConnector | TcpConnector:
    if spec.type == "shm":
        return ShmConnector(spec.prefix, spec.side, owner=owner)
    if spec.type == "tcp":
        end = TcpConnector(spec.host)
        if spec.peer:
            end.connect(spec.peer)
        return end
    raise ValueError(f"connector type {spec.type!r} cannot link processes; use 'shm' or 'tcp'")
