"""Media from URLs, under a policy: http(s) fetches that never reach internal addresses, file:// under one directory.

A fetch resolves the host itself and refuses it unless every address is public, then connects to the checked
address (the Host header and the TLS name stay the URL's), so a second DNS answer cannot redirect the connection
(rebinding). Redirects are followed by hand, each hop checked alike; the whole fetch, redirects included, has one
deadline, and the body is cut off at the byte limit. A fetch that fails for any reason reads the same to the
client ("could not fetch the media at <part>"): refused, closed, timed out and internal look alike; the log says
which.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
import socket
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from omnistage.errors import RequestError
from omnistage.media.source import Body, MediaBudget, MediaBytes, bad_media, too_large

if TYPE_CHECKING:
    from omnistage.config.deploy import MediaConfig

log = logging.getLogger(__name__)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
# Cloud metadata services; most are link-local or shared space anyway, listed so no range change lets one through.
METADATA_ADDRESSES = frozenset(ipaddress.ip_address(a) for a in (
    "169.254.169.254", "169.254.170.2", "100.100.100.200", "192.0.0.192", "fd00:ec2::254"))
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_INET_ATON = re.compile(r"[0-9a-fx.]+", re.IGNORECASE)  # 2130706433, 0x7f000001, 127.1, 0177.0.0.1
_REDIRECTS = (301, 302, 303, 307, 308)


@dataclass(frozen=True)
class RemotePolicy:
    remote_fetch: bool = True  # http(s) URLs at all
    allowed_domains: tuple[str, ...] = ()  # each allows itself and its subdomains; empty: any public host
    allowed_local_path: str | None = None  # file:// URLs only below this directory; None: never
    fetch_timeout_s: float = 10.0  # one fetch, redirects included
    max_redirects: int = 3
    # Tests only (a local HTTP server): internal addresses fetches may reach anyway. No deploy field sets it.
    allow_internal: frozenset[str] = frozenset()

    @classmethod
    def from_config(cls, media: MediaConfig) -> RemotePolicy:
        return cls(media.remote_fetch, tuple(media.allowed_domains), media.allowed_local_path,
                   media.fetch_timeout_s, media.max_redirects)

    def domain_allowed(self, host: str) -> bool:
        host = host.lower().rstrip(".")
        return not self.allowed_domains or any(host == d or host.endswith("." + d) for d in self.allowed_domains)


class _Unreachable(Exception):
    """Why a fetch failed, for the log only."""


def fetch_failed(part: str) -> RequestError:
    return RequestError(f"could not fetch the media at {part}", part, status=400)


def is_public_address(ip: IPAddress) -> bool:
    """Whether `ip` is a global unicast address that is no metadata service, looking through IPv6 forms that embed
    an IPv4 address (mapped, 6to4, Teredo, NAT64)."""
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:  # the IPv4 address itself, on a dual-stack socket
            return is_public_address(ip.ipv4_mapped)
        embedded = ip.sixtofour or (ip.teredo[1] if ip.teredo else None)
        if embedded is None and ip in _NAT64:
            embedded = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if embedded is not None and not is_public_address(embedded):
            return False
    return ip.is_global and not (ip.is_multicast or ip.is_reserved) and ip not in METADATA_ADDRESSES


def literal_address(host: str) -> IPAddress | None:
    """`host` as an IP address when it is one in any form a resolver accepts (inet_aton's included), else None."""
    host = host.strip("[]").split("%")[0]
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    if _INET_ATON.fullmatch(host):
        try:
            return ipaddress.IPv4Address(socket.inet_aton(host))
        except OSError:
            return None
    return None


async def resolve_host(host: str, port: int) -> list[IPAddress]:
    """Every address DNS gives for `host` (tests replace this function to stand in for DNS)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos]


async def _checked_address(host: str, port: int, policy: RemotePolicy) -> IPAddress:
    literal = literal_address(host)
    addresses = [literal] if literal is not None else await resolve_host(host, port)
    if not addresses:
        raise _Unreachable(f"{host} has no address")
    internal = [a for a in addresses if not is_public_address(a) and str(a) not in policy.allow_internal]
    if internal:
        raise _Unreachable(f"{host} resolves to the non-public address {internal[0]}")
    return addresses[0]


def check_remote(url: str, part: str, policy: RemotePolicy) -> None:
    """What the URL alone decides: not http(s) is a 400; remote media turned off or a host outside the allowed
    domains is a 403 (the client's own input, so saying so reveals nothing)."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise bad_media(part, f"URL {url[:100]!r} is not an http(s) URL")
    if not policy.remote_fetch:
        raise RequestError(f"{part}: this server does not fetch media from URLs; send the data inline", part,
                           status=403)
    if not policy.domain_allowed(parsed.hostname):
        raise RequestError(f"{part}: this server fetches media only from its allowed domains", part, status=403)


async def fetch(url: str, part: str, max_bytes: int, policy: RemotePolicy,
                budget: MediaBudget | None = None) -> MediaBytes:
    """GET `url` under `policy`: at most `max_bytes` (413 beyond), within `policy.fetch_timeout_s` in all.
    Cancelling the caller's task stops the fetch."""
    check_remote(url, part, policy)
    try:
        async with asyncio.timeout(policy.fetch_timeout_s):
            return await _follow(url, part, max_bytes, policy, budget)
    except RequestError:  # over a byte limit
        raise
    except (_Unreachable, httpx.HTTPError, OSError, TimeoutError, ValueError, UnicodeError) as exc:
        log.info("media fetch for %s from %.200s failed: %s: %s", part, url, type(exc).__name__, exc)
        raise fetch_failed(part) from None


async def _follow(url: str, part: str, max_bytes: int, policy: RemotePolicy, budget: MediaBudget | None
                  ) -> MediaBytes:
    # trust_env=False: no proxy from the environment, which would connect on its own terms
    async with httpx.AsyncClient(trust_env=False, follow_redirects=False, timeout=policy.fetch_timeout_s) as client:
        for _ in range(policy.max_redirects + 1):
            target = urllib.parse.urlsplit(url)
            host = target.hostname
            if target.scheme not in ("http", "https") or not host:
                raise _Unreachable(f"redirected to a URL that is not http(s): {url[:200]}")
            if not policy.domain_allowed(host):
                raise _Unreachable(f"redirected to {host}, outside the allowed domains")
            port = target.port or (443 if target.scheme == "https" else 80)
            address = await _checked_address(host, port, policy)
            direct = urllib.parse.urlunsplit((target.scheme, f"[{address}]:{port}" if address.version == 6
                                              else f"{address}:{port}", target.path or "/", target.query, ""))
            named = f"[{host}]" if ":" in host else host
            headers = {"Host": named if target.port is None else f"{named}:{target.port}"}
            async with client.stream("GET", direct, headers=headers, extensions={"sni_hostname": host}) as response:
                if response.status_code in _REDIRECTS and "location" in response.headers:
                    url = urllib.parse.urljoin(url, response.headers["location"])
                    continue
                if not 200 <= response.status_code < 300:
                    raise _Unreachable(f"HTTP {response.status_code}")
                declared = response.headers.get("content-length", "")
                if declared.isdigit() and int(declared) > max_bytes:
                    raise too_large(part, max_bytes, int(declared))
                body = Body(part, max_bytes, budget)
                async for chunk in response.aiter_bytes():
                    body.add(chunk)
                return body.media(response.headers.get("content-type"))
    raise _Unreachable(f"more than {policy.max_redirects} redirects")


def read_local(url: str, part: str, max_bytes: int, policy: RemotePolicy) -> MediaBytes:
    """A file:// URL's file, only below `policy.allowed_local_path` (symlinks resolved first). Blocking."""
    if policy.allowed_local_path is None:
        raise RequestError(f"{part}: this server reads no local media files", part, status=403)
    parsed = urllib.parse.urlsplit(url)
    try:
        if parsed.netloc not in ("", "localhost"):
            raise _Unreachable(f"file URL names the host {parsed.netloc!r}")
        root = Path(policy.allowed_local_path).resolve(strict=True)
        path = Path(urllib.parse.unquote(parsed.path)).resolve(strict=True)
        if not path.is_relative_to(root) or not path.is_file():
            raise _Unreachable(f"{path} is outside {root} or no file")
        with path.open("rb") as f:
            data = f.read(max_bytes + 1)
    except (_Unreachable, OSError, ValueError) as exc:
        log.info("reading local media for %s failed: %s", part, exc)
        raise RequestError(f"could not read the media at {part}", part, status=400) from None
    if len(data) > max_bytes:
        raise too_large(part, max_bytes)
    return MediaBytes(data)
