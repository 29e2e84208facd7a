"""Getting the bytes of one media item: an http(s) URL, a data URL, or raw base64, never more than a limit.

Every failure is a RequestError naming the message part (`part`, e.g. "messages[0].content[1]"): 413 when the
media is larger than the caller's limit, 400 when it cannot be fetched or decoded.
"""

from __future__ import annotations

import base64
import binascii
import re
import urllib.parse
from dataclasses import dataclass

import httpx

from omnistage.errors import RequestError

DEFAULT_TIMEOUT_S = 10.0
_B64_CHARS = re.compile(rb"[^A-Za-z0-9+/=_-]")


@dataclass
class MediaBytes:
    data: bytes
    mime: str | None = None  # from the data URL or the HTTP Content-Type, when given


def too_large(part: str, limit: int, size: int | None = None) -> RequestError:
    got = f" ({size} bytes)" if size is not None else ""
    return RequestError(f"{part}: media is larger than the limit of {limit} bytes{got}", part, status=413)


def bad_media(part: str, what: str) -> RequestError:
    return RequestError(f"{part}: {what}", part, status=400)


def _b64decode(text: str, part: str, max_bytes: int) -> bytes:
    raw = text.encode("ascii", "ignore") if text.isascii() else None
    if raw is None:
        raise bad_media(part, "media data is not base64 (non-ASCII characters)")
    raw = re.sub(rb"\s+", b"", raw)
    # Check the decoded size before decoding, so an oversized payload costs no memory.
    decoded = len(raw) * 3 // 4 - len(raw) + len(raw.rstrip(b"="))
    if decoded > max_bytes:
        raise too_large(part, max_bytes, decoded)
    if _B64_CHARS.search(raw):
        raise bad_media(part, "media data is not base64 (unexpected characters)")
    try:
        if b"-" in raw or b"_" in raw:
            return base64.urlsafe_b64decode(raw + b"=" * (-len(raw) % 4))
        return base64.b64decode(raw + b"=" * (-len(raw) % 4), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise bad_media(part, f"media data is not valid base64: {exc}") from None


def _data_url(url: str, part: str, max_bytes: int) -> MediaBytes:
    header, sep, payload = url[5:].partition(",")
    if not sep:
        raise bad_media(part, "data URL has no ',' before its data")
    params = header.split(";")
    mime = params[0].strip().lower() or None
    if "base64" in (p.strip().lower() for p in params[1:]):
        return MediaBytes(_b64decode(payload, part, max_bytes), mime)
    data = urllib.parse.unquote_to_bytes(payload)
    if len(data) > max_bytes:
        raise too_large(part, max_bytes, len(data))
    return MediaBytes(data, mime)


def _check_url(url: str, part: str) -> None:
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise bad_media(part, f"URL {url[:100]!r} is not an http(s) URL")


def _fetch_error(part: str, url: str, exc: Exception) -> RequestError:
    if isinstance(exc, httpx.TimeoutException):
        return bad_media(part, f"fetching {url[:200]} timed out")
    return bad_media(part, f"could not fetch {url[:200]}: {exc}")


def _status_error(part: str, url: str, response: httpx.Response) -> RequestError:
    return bad_media(part, f"could not fetch {url[:200]}: HTTP {response.status_code}")


def _declared_size(response: httpx.Response) -> int | None:
    try:
        return int(response.headers["content-length"])
    except (KeyError, ValueError):
        return None


def _check_response(response: httpx.Response, part: str, url: str, max_bytes: int) -> None:
    """Refuse an error status or a body announced as too large, before reading it."""
    if response.status_code >= 400:
        raise _status_error(part, url, response)
    declared = _declared_size(response)
    if declared is not None and declared > max_bytes:
        raise too_large(part, max_bytes, declared)


class _Body:
    """A response body collected chunk by chunk, refused as soon as it passes `max_bytes`."""

    def __init__(self, part: str, max_bytes: int):
        self.part, self.max_bytes, self.chunks, self.size = part, max_bytes, [], 0

    def add(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size > self.max_bytes:
            raise too_large(self.part, self.max_bytes)
        self.chunks.append(chunk)

    def media(self, response: httpx.Response) -> MediaBytes:
        return MediaBytes(b"".join(self.chunks), _mime(response))


def _mime(response: httpx.Response) -> str | None:
    value = response.headers.get("content-type")
    if not value:
        return None
    return value.split(";")[0].strip().lower() or None


def fetch_url(url: str, part: str, max_bytes: int, timeout: float = DEFAULT_TIMEOUT_S) -> MediaBytes:
    """GET `url`, streaming, and stop as soon as more than `max_bytes` arrive (or are announced)."""
    _check_url(url, part)
    try:
        with httpx.stream("GET", url, timeout=timeout, follow_redirects=True) as response:
            _check_response(response, part, url, max_bytes)
            body = _Body(part, max_bytes)
            for chunk in response.iter_bytes():
                body.add(chunk)
            return body.media(response)
    except httpx.HTTPError as exc:
        raise _fetch_error(part, url, exc) from None


async def afetch_url(url: str, part: str, max_bytes: int, timeout: float = DEFAULT_TIMEOUT_S) -> MediaBytes:
    """`fetch_url` for an event loop."""
    _check_url(url, part)
    try:
        async with httpx.AsyncClient(timeout=timeout, follow_redirects=True) as client:
            async with client.stream("GET", url) as response:
                _check_response(response, part, url, max_bytes)
                body = _Body(part, max_bytes)
                async for chunk in response.aiter_bytes():
                    body.add(chunk)
                return body.media(response)
    except httpx.HTTPError as exc:
        raise _fetch_error(part, url, exc) from None


def _is_url(source: str) -> bool:
    return source.startswith(("http://", "https://")) or "://" in source[:16]


def load_source(source: str, part: str, max_bytes: int, timeout: float = DEFAULT_TIMEOUT_S) -> MediaBytes:
    """Bytes of `source`: an http(s) URL (fetched), a data URL, or raw base64."""
    if not isinstance(source, str) or not source:
        raise bad_media(part, "media source must be a non-empty string (URL, data URL or base64)")
    if source.startswith("data:"):
        return _data_url(source, part, max_bytes)
    if _is_url(source):
        return fetch_url(source, part, max_bytes, timeout)
    return MediaBytes(_b64decode(source, part, max_bytes))


async def aload_source(source: str, part: str, max_bytes: int, timeout: float = DEFAULT_TIMEOUT_S) -> MediaBytes:
    """`load_source` for an event loop (URLs are fetched without blocking it)."""
    if isinstance(source, str) and _is_url(source) and not source.startswith("data:"):
        return await afetch_url(source, part, max_bytes, timeout)
    return load_source(source, part, max_bytes, timeout)
