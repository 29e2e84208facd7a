"""The bytes of inline media (a data URL or raw base64), never more than a limit, and the request's byte budget.
URLs are fetched by `remote`.

Every failure is a RequestError naming the message part (`part`, e.g. "messages[0].content[1]"): 413 when the
media is larger than the caller's limit, 400 when it cannot be fetched or decoded.
"""

from __future__ import annotations

import base64
import binascii
import re
import urllib.parse
from dataclasses import dataclass

from omnistage.errors import RequestError

_B64_CHARS = re.compile(rb"[^A-Za-z0-9+/=_-]")


@dataclass
class MediaBytes:
    data: bytes
    mime: str | None = None  # from the data URL or the HTTP Content-Type, when given


def too_large(part: str, limit: int, size: int | None = None) -> RequestError:
    got = f" ({size} bytes)" if size is not None else ""
    return RequestError(f"{part}: media is larger than the limit of {limit} bytes{got} (limits.max_media_bytes)",
                        part, status=413)


def over_limit(part: str, what: str, field: str) -> RequestError:
    """A 413 naming the part and the deploy field of the limit it passed (`limits.<field>`)."""
    return RequestError(f"{part}: {what} (limits.{field})", part, status=413)


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


class MediaBudget:
    """The encoded media bytes of one request, refused (413) once they pass `max_total_bytes`."""

    def __init__(self, max_total_bytes: int):
        self.max_total_bytes, self.spent = max_total_bytes, 0

    def spend(self, size: int, part: str) -> None:
        self.spent += size
        if self.spent > self.max_total_bytes:
            raise RequestError(f"{part}: the request's media are larger than the limit of {self.max_total_bytes} "
                               "bytes in all (limits.max_media_total_bytes)", part, status=413)


class Body:
    """A response body collected chunk by chunk, refused as soon as it passes `max_bytes` (or the budget)."""

    def __init__(self, part: str, max_bytes: int, budget: MediaBudget | None = None):
        self.part, self.max_bytes, self.budget, self.chunks, self.size = part, max_bytes, budget, [], 0

    def add(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size > self.max_bytes:
            raise too_large(self.part, self.max_bytes)
        if self.budget is not None:
            self.budget.spend(len(chunk), self.part)
        self.chunks.append(chunk)

    def media(self, content_type: str | None) -> MediaBytes:
        mime = (content_type or "").split(";")[0].strip().lower() or None
        return MediaBytes(b"".join(self.chunks), mime)


def is_url(source: str) -> bool:
    """A URL to fetch or read (http(s), file, or any other scheme to refuse), not inline data."""
    return not source.startswith("data:") and (source.startswith(("http://", "https://")) or "://" in source[:16])


def inline_source(source: str, part: str, max_bytes: int) -> MediaBytes:
    """Bytes of inline media: a data URL or raw base64."""
    if source.startswith("data:"):
        return _data_url(source, part, max_bytes)
    return MediaBytes(_b64decode(source, part, max_bytes))
