"""Connectors move stage payloads between workers, keyed by (request id, edge, chunk index).

The inline backend hands objects over directly; process and multi-host backends put payloads
here (shared memory, TCP) and send only the key over the control channel. Every connector has
the same four operations so an edge's transport is a deploy-config choice.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Protocol

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
