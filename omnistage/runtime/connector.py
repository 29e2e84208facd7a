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
import uuid
import weakref
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
    """Payloads stay Python objects in one process; `get` removes what it returns. Also the keyed
    mailbox the TCP connector files received payloads in."""

    def __init__(self) -> None:
        self._items: dict[Key, Any] = {}
        self._cond = threading.Condition()
        self._closed = False

    def put(self, key: Key, payload: Any) -> None:
        with self._cond:
            self._items[key] = payload
            self._cond.notify_all()

    def get(self, key: Key, timeout: float | None = None) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while key not in self._items:
                remaining = None if deadline is None else deadline - time.monotonic()
                if self._closed or (remaining is not None and remaining <= 0):
                    raise TimeoutError(f"no payload for {key} within {timeout}s")
                self._cond.wait(remaining)
            return self._items.pop(key)

    def cleanup(self, request_id: str) -> None:
        with self._cond:
            for key in [k for k in self._items if k[0] == request_id]:
                del self._items[key]

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._items.clear()
            self._cond.notify_all()

    def __len__(self) -> int:
        return len(self._items)


# ---- across processes: payloads go through serialization (header + raw tensor buffers) ---------

SHM_DIR = Path("/dev/shm")
# Fault every page in at map time: one pass in the kernel instead of a fault per 4 KB page.
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


def _tag(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


class ShmConnector:
    """One end of a same-host link over POSIX shared memory (Linux /dev/shm).

    `put` writes one segment per payload, under a temporary name renamed into place, so a reader
    never sees half a payload. `get` maps it and builds tensors on the mapping: zero-copy. Fresh
    shared memory is costly (every page is allocated and zeroed), so segments are recycled: once
    the last tensor on a mapping dies, the reader hands the file back to a few free slots and
    the writer fills one of those next time, paying only the copy.

    Names are `{prefix}.{writer side}.` followed by `{request tag}.{key tag}` (a payload),
    `busy.{id}` (mapped by the reader) or `free.{slot}`, so `cleanup` finds a request's payloads
    and the link's owner purges whatever is left, also after a peer died.
    """

    POOL = 4  # free segments kept per direction

    def __init__(self, prefix: str, side: str, owner: bool = False):
        if not SHM_DIR.is_dir():
            raise OSError("the shm connector needs /dev/shm (Linux); use the tcp connector here")
        self.prefix, self.side, self.owner = prefix, side, owner
        self.peer_side = "b" if side == "a" else "a"
        self._closed = [False]  # shared with recycling finalizers
        self._base = f"{SHM_DIR}/{prefix}"
        self._free_mine, self._free_peer = ([f"{self._base}.{s}.free.{k}" for k in range(self.POOL)]
                                            for s in (side, self.peer_side))

    def _path(self, side: str, key: Key) -> str:
        return f"{self._base}.{side}.{_tag(key[0])}.{_tag(f'{key[1]}|{key[2]}')}"

    def put(self, key: Key, payload: Any) -> None:
        self.put_packed(key, *serialization.pack(payload))

    def put_packed(self, key: Key, header: bytes, buffers: list[memoryview]) -> None:
        size = serialization.contiguous_size(header, buffers)
        path = self._path(self.side, key)
        tmp = path + ".w"
        fd = self._recycled(tmp, size)
        if fd is None:
            fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)
            with mmap.mmap(fd, size, flags=_MAP_FLAGS) as block, memoryview(block) as view:
                serialization.to_contiguous(header, buffers, view)
        except BaseException:
            os.unlink(tmp)
            raise
        finally:
            os.close(fd)
        os.rename(tmp, path)

    def _recycled(self, tmp: str, size: int) -> int | None:
        """Claim a free segment not much larger than `size` (its pages are already there)."""
        for free in self._free_mine:
            try:
                if os.stat(free).st_size <= 4 * size:
                    os.rename(free, tmp)  # only this end takes free segments of its side
                    return os.open(tmp, os.O_RDWR)
            except FileNotFoundError:
                continue
        return None

    def get(self, key: Key, timeout: float | None = None) -> Any:
        path = self._path(self.peer_side, key)
        fd = _wait_open(path, key, timeout)
        try:
            block = mmap.mmap(fd, os.fstat(fd).st_size, flags=_MAP_FLAGS)
        finally:
            os.close(fd)
        busy = f"{self._base}.{self.peer_side}.busy.{uuid.uuid4().hex[:12]}"
        os.rename(path, busy)
        weakref.finalize(block, _recycle, busy, self._free_peer, self._closed)
        header, buffers = serialization.from_contiguous(memoryview(block))
        return serialization.unpack(header, buffers)

    def cleanup(self, request_id: str) -> None:
        for path in SHM_DIR.glob(f"{self.prefix}.*.{_tag(request_id)}.*"):
            path.unlink(missing_ok=True)

    def close(self) -> None:
        """The owner unlinks everything left on the link; the other end leaves what it wrote
        for its peer to read (the owner purges it at the latest)."""
        self._closed[0] = True
        if self.owner:
            for path in SHM_DIR.glob(f"{self.prefix}.*"):
                path.unlink(missing_ok=True)


def _recycle(busy: str, slots: list[str], closed: list[bool]) -> None:
    """The reader's last tensor on a segment died: offer the file to its writer, else free it."""
    try:
        if not closed[0]:
            for slot in slots:
                try:
                    os.link(busy, slot)  # fails if the slot is taken: never overwrites
                    break
                except FileExistsError:
                    continue
        os.unlink(busy)
    except FileNotFoundError:
        pass  # purged meanwhile


def _wait_open(path: str, key: Key, timeout: float | None) -> int:
    """Open a segment, polling until it appears: spin briefly, then sleep in growing steps.
    (The runtime announces payloads after putting them, so there it is found at once.)"""
    start = time.monotonic()
    pause = 20e-6
    while True:
        try:
            return os.open(path, os.O_RDWR)
        except FileNotFoundError:
            waited = time.monotonic() - start
            if timeout is not None and waited >= timeout:
                raise TimeoutError(f"no payload for {key} within {timeout}s") from None
            if waited > 200e-6:
                time.sleep(pause)
                pause = min(pause * 2, 500e-6)


# ---- TCP sockets: CURVE-authenticated and encrypted ---------------------------------------------------
# A deployment's processes share one CURVE key pair, handed to them in their worker specs (never sent over
# the sockets). Every socket that binds a TCP port serves with it and every socket that dials one must know
# its public key: a peer that does not cannot complete the handshake, so it can neither inject commands or
# payloads nor read them. ("" = plain TCP, for tests of that very refusal.)


def curve_key() -> str:
    """A fresh key pair, "public secret" in Z85."""
    public, secret = zmq.curve_keypair()
    return f"{public.decode()} {secret.decode()}"


def serve_securely(sock: zmq.Socket, key: str) -> None:
    """Before `bind`: the socket accepts only peers that know `key`'s public half."""
    if key:
        public, secret = key.split()
        sock.curve_publickey, sock.curve_secretkey, sock.curve_server = public.encode(), secret.encode(), True


def dial_securely(sock: zmq.Socket, key: str) -> None:
    """Before `connect`: the socket proves it knows the server's public key (its own pair is throwaway)."""
    if key:
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
        sock.curve_serverkey = key.split()[0].encode()


class TcpConnector:
    """One end of a link between hosts over ZMQ/TCP (CURVE with the deployment's `key`). Each end binds a
    PULL socket (its `address`) and pushes to its peer's after `connect`. A receiver thread files incoming
    payloads by key; `get` waits for its key and builds tensors on the received frames (no extra copy)."""

    def __init__(self, host: str = "127.0.0.1", advertise: str | None = None, key: str = ""):
        self._ctx = zmq.Context()
        self._key = key
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        serve_securely(self._pull, key)
        port = self._pull.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{advertise or host}:{port}"
        self._push: zmq.Socket | None = None
        self._send_lock = threading.Lock()
        self._received = InProcessConnector()  # frames by key, until `get` takes them
        self._thread = threading.Thread(target=self._receive, name="tcp-connector", daemon=True)
        self._thread.start()

    def connect(self, peer_address: str) -> None:
        push = self._ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.setsockopt(zmq.SNDHWM, 0)
        dial_securely(push, self._key)
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
        frames = self._received.get(key, timeout)
        return serialization.unpack(frames[0].buffer, [f.buffer for f in frames[1:]])

    def cleanup(self, request_id: str) -> None:
        self._received.cleanup(request_id)

    def close(self) -> None:
        self._received.close()
        with self._send_lock:
            if self._push is not None:
                self._push.close(linger=5000)  # what was put still reaches a live peer
        self._ctx.term()  # the receiver thread sees ETERM and closes its socket; term waits for it
        self._thread.join(timeout=5)

    def _receive(self) -> None:
        while True:
            try:
                frames = self._pull.recv_multipart(copy=False)
            except zmq.ZMQError:  # ETERM: closing
                self._pull.close(linger=0)
                return
            self._received.put(tuple(msgspec.msgpack.decode(frames[0].bytes)), frames[1:])


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
    key: str = ""  # tcp: the deployment's CURVE key pair (curve_key)


def open_link(spec: LinkSpec, owner: bool = False) -> ShmConnector | TcpConnector:
    if spec.type == "shm":
        return ShmConnector(spec.prefix, spec.side, owner=owner)
    if spec.type == "tcp":
        end = TcpConnector(spec.host, key=spec.key)
        if spec.peer:
            end.connect(spec.peer)
        return end
    raise ValueError(f"connector type {spec.type!r} cannot link processes; use 'shm' or 'tcp'")
