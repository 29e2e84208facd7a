"""Where media may be fetched from: never internal addresses (in any spelling, through DNS or a redirect), only
allowed domains, local files only under the allowed directory; one deadline per fetch; uniform errors; fetches
stop when cancelled. Against real HTTP servers on 127.0.0.1 and 127.0.0.2; only DNS is stood in for."""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import time

import pytest

from omnistage.config.deploy import LimitsConfig, MediaConfig, load_deploy_config
from omnistage.entrypoints.cli import build_parser, serve_overrides
from omnistage.errors import ConfigError, RequestError
from omnistage.media import MediaBytes, MediaLimits, RemotePolicy, aload_part, load_part, prefetch, remote

Image = pytest.importorskip("PIL.Image", reason="media tests need the omni extra (pip install 'omnistage[omni]')")

LOCAL = frozenset({"127.0.0.1"})  # the test server's address: what tests let a fetch reach
PART = "messages[0].content[1]"
UNIFORM = f"could not fetch the media at {PART}"

def _png() -> bytes:
    import io

    out = io.BytesIO()
    Image.new("RGB", (1, 1)).save(out, format="PNG")
    return out.getvalue()


PNG = _png()


def part_of(kind: str, url: str) -> dict:
    return {"type": kind, kind: {"url": url}}


@pytest.fixture(autouse=True)
def _files(media_server, other_server) -> None:
    media_server.files["pic.png"] = other_server.files["pic.png"] = PNG


def image_size(url: str, policy: RemotePolicy) -> tuple[int, int]:
    return load_part(part_of("image_url", url), PART, policy=policy).value.size


def refused(part: dict, policy: RemotePolicy | None = None) -> RequestError:
    with pytest.raises(RequestError) as err:
        load_part(part, PART, policy=policy)
    return err.value


@pytest.mark.parametrize("host", [
    "127.0.0.1", "localhost", "0x7f000001", "2130706433", "127.1", "0177.0.0.1", "[::1]", "[::ffff:127.0.0.1]",
    "[::ffff:7f00:1]", "0.0.0.0", "[::]", "10.0.0.1", "192.168.1.1", "172.16.0.1", "100.64.0.1", "169.254.169.254",
    "[fe80::1]", "[fd00:ec2::254]", "224.0.0.1", "[ff02::1]", "[64:ff9b::7f00:1]", "[2002:7f00:1::]",
])
@pytest.mark.parametrize("kind", ["image_url", "audio_url", "video_url"])
def test_internal_addresses_are_refused_uniformly(media_server, host: str, kind: str) -> None:
    before = len(media_server.requests)
    err = refused(part_of(kind, f"http://{host}:{media_server.port}/files/pic.png"))
    assert (err.status, err.message) == (400, UNIFORM)
    assert len(media_server.requests) == before  # not even connected


def test_failures_read_alike(media_server) -> None:
    """Closed port, 404, timeout and an internal address: one message; only the log tells them apart."""
    open_policy = RemotePolicy(allow_internal=LOCAL, fetch_timeout_s=0.5)
    closed = refused(part_of("image_url", "http://127.0.0.1:1/x.png"), open_policy)
    missing = refused(part_of("image_url", media_server.url("files/nope.png")), open_policy)
    slow = refused(part_of("image_url", media_server.url("slow/x")), open_policy)
    internal = refused(part_of("image_url", media_server.url("files/pic.png")))
    assert {(e.status, e.message) for e in (closed, missing, slow, internal)} == {(400, UNIFORM)}
    assert image_size(media_server.url("files/pic.png"), open_policy) == (1, 1)


@pytest.mark.parametrize("target", [
    "http://127.0.0.2:{other}/files/pic.png", "http://0x7f000002:{other}/files/pic.png", "http://[::1]:{port}/files/pic.png",
    "http://169.254.169.254/latest/meta-data/", "http://10.1.2.3/a.png", "file:///etc/passwd", "ftp://example.com/a",
])
def test_every_redirect_hop_is_checked(media_server, other_server, target: str) -> None:
    """The first hop may reach the test server; where it redirects may not (127.0.0.2 really serves the file)."""
    media_server.redirects["hop"] = target.format(other=other_server.port, port=media_server.port)
    before = len(other_server.requests)
    err = refused(part_of("image_url", media_server.url("redirect/hop")), RemotePolicy(allow_internal=LOCAL))
    assert (err.status, err.message) == (400, UNIFORM)
    assert len(other_server.requests) == before
    # the same hop allowed: the redirect is followed to the file
    other = RemotePolicy(allow_internal=LOCAL | {"127.0.0.2"})
    if "{other}" in target:
        assert image_size(media_server.url("redirect/hop"), other) == (1, 1)


def test_redirect_limit(media_server) -> None:
    for i in range(4):
        media_server.redirects[f"r{i}"] = media_server.url(f"redirect/r{i + 1}")
    media_server.redirects["r4"] = "/files/pic.png"  # relative: resolved against the hop's URL
    url = media_server.url("redirect/r0")
    for hops, ok in ((5, True), (4, False)):
        policy = RemotePolicy(allow_internal=LOCAL, max_redirects=hops)
        if ok:
            assert load_part(part_of("image_url", url), PART, policy=policy).value.size == (1, 1)
        else:
            assert refused(part_of("image_url", url), policy).message == UNIFORM


@pytest.fixture
def dns(monkeypatch) -> dict[str, list[str]]:
    """Stand in for DNS only: names map to addresses; every lookup is recorded under "calls"."""
    table: dict[str, list[str]] = {"calls": []}

    async def resolve(host: str, port: int) -> list:
        table["calls"].append(host)
        return [ipaddress.ip_address(a) for a in table.get(host, [])]

    monkeypatch.setattr(remote, "resolve_host", resolve)
    return table


def test_allowed_domains(media_server, dns) -> None:
    dns["media.example.com"] = ["127.0.0.1"]
    policy = RemotePolicy(allowed_domains=("example.com",), allow_internal=LOCAL)
    url = f"http://media.example.com:{media_server.port}/files/pic.png"
    assert load_part(part_of("image_url", url), PART, policy=policy).value.size == (1, 1)
    # resolved once, by us, and connected to that address with the URL's name as Host
    assert dns["calls"] == ["media.example.com"]
    assert media_server.requests[-1] == ("/files/pic.png", f"media.example.com:{media_server.port}")
    for host in ("other.org", "evil-example.com", "example.com.evil.org"):
        err = refused(part_of("image_url", f"http://{host}:{media_server.port}/files/pic.png"), policy)
        assert err.status == 403 and "allowed domains" in err.message and PART in err.message
    assert dns["calls"] == ["media.example.com"]  # refused without a lookup
    # an allowed domain that redirects elsewhere
    media_server.redirects["away"] = f"http://other.org:{media_server.port}/files/pic.png"
    url = f"http://media.example.com:{media_server.port}/redirect/away"
    assert refused(part_of("image_url", url), policy).message == UNIFORM


def test_public_names_resolving_inside_are_refused(media_server, dns) -> None:
    """A name that resolves to an internal address (or to several, one internal: rebinding) is refused before
    connecting, and the fetch never asks DNS a second time."""
    dns["rebind.example.com"] = ["93.184.216.34", "127.0.0.1"]
    dns["inside.example.com"] = ["127.0.0.1"]
    dns["nowhere.example.com"] = []
    before = len(media_server.requests)
    for host in ("rebind.example.com", "inside.example.com", "nowhere.example.com"):
        err = refused(part_of("video_url", f"http://{host}:{media_server.port}/files/pic.png"))
        assert (err.status, err.message) == (400, UNIFORM)
    assert len(media_server.requests) == before
    assert dns["calls"] == ["rebind.example.com", "inside.example.com", "nowhere.example.com"]


def test_total_deadline_with_a_trickling_server(media_server) -> None:
    """A byte every 0.1 s never trips a per-read timeout; the fetch's one deadline ends it."""
    start = time.monotonic()
    err = refused(part_of("audio_url", media_server.url("trickle/a")), RemotePolicy(allow_internal=LOCAL,
                                                                                    fetch_timeout_s=0.6))
    assert (err.status, err.message) == (400, UNIFORM)
    assert time.monotonic() - start < 2.0


async def _until(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.05)


async def test_cancelling_stops_the_fetch(media_server) -> None:
    policy = RemotePolicy(allow_internal=LOCAL, fetch_timeout_s=60)
    task = asyncio.ensure_future(aload_part(part_of("image_url", media_server.url("trickle/c")), PART, policy=policy))
    await _until(lambda: media_server.trickling == 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await _until(lambda: media_server.trickling == 0)  # the server saw the connection close


async def test_prefetch(media_server) -> None:
    policy = RemotePolicy(allow_internal=LOCAL, fetch_timeout_s=60)
    text = {"type": "text", "text": "hi"}
    messages = [{"role": "user", "content": [text, part_of("image_url", media_server.url("files/pic.png")),
                                             {"type": "input_audio", "input_audio": {"data": "AAAA"}},
                                             part_of("video_url", media_server.url("stream/pic.png"))]}]
    fetched = await prefetch(messages, MediaLimits(), policy)
    content = fetched[0]["content"]
    assert content[0] is text and content[2] is messages[0]["content"][2]  # inline parts untouched
    assert [c[c["type"]]["url"] for c in (content[1], content[3])] == [MediaBytes(PNG, "application/octet-stream")] * 2
    assert messages[0]["content"][1]["image_url"]["url"].startswith("http")  # the caller's messages unchanged
    assert await prefetch([{"role": "user", "content": "no media"}, {"role": "user", "content": [text]}],
                          MediaLimits(), policy) is None
    # too many parts: 413 naming the first part over the limit, before any fetch
    before = len(media_server.requests)
    with pytest.raises(RequestError) as err:
        await prefetch(messages, MediaLimits(max_parts=2), policy)
    assert err.value.status == 413 and "messages[0].content[3]" in err.value.message
    assert "max_media_parts" in err.value.message and len(media_server.requests) == before
    # the request's media in all over its budget
    with pytest.raises(RequestError) as err:
        await prefetch(messages, MediaLimits(max_total_bytes=len(PNG) + 10), policy)
    assert err.value.status == 413 and "max_media_total_bytes" in err.value.message
    # one failure cancels the other fetches
    slow = [{"role": "user", "content": [part_of("image_url", media_server.url("trickle/p")),
                                         part_of("image_url", media_server.url("files/gone.png"))]}]
    with pytest.raises(RequestError) as err:
        await prefetch(slow, MediaLimits(), policy)
    assert err.value.message == "could not fetch the media at messages[0].content[1]"
    await _until(lambda: media_server.trickling == 0)


def test_remote_fetch_off(media_server) -> None:
    before = len(media_server.requests)
    err = refused(part_of("image_url", media_server.url("files/pic.png")), RemotePolicy(remote_fetch=False,
                                                                                         allow_internal=LOCAL))
    assert err.status == 403 and "does not fetch media from URLs" in err.message
    assert len(media_server.requests) == before
    data_url = "data:image/png;base64," + base64.b64encode(PNG).decode()
    assert load_part(part_of("image_url", data_url), PART, policy=RemotePolicy(remote_fetch=False)).value.size == (1, 1)


def test_local_files_only_under_the_allowed_path(tmp_path) -> None:
    root = tmp_path / "media"
    root.mkdir()
    (root / "pic.png").write_bytes(PNG)
    (root / "passwd").symlink_to("/etc/passwd")
    (tmp_path / "outside.png").write_bytes(PNG)
    url = f"file://{root}/pic.png"
    err = refused(part_of("image_url", url))  # the default: no local files at all
    assert err.status == 403 and "local media files" in err.message
    policy = RemotePolicy(allowed_local_path=str(root))
    assert load_part(part_of("image_url", url), PART, policy=policy).value.size == (1, 1)
    for bad in (f"file://{root}/passwd", f"file://{root}/../outside.png", f"file://{tmp_path}/outside.png",
                f"file://{root}/missing.png", f"file://{root}", f"file://otherhost{root}/pic.png"):
        err = refused(part_of("image_url", bad), policy)
        assert (err.status, err.message) == (400, f"could not read the media at {PART}")
    with pytest.raises(RequestError) as err:
        load_part(part_of("image_url", url), PART, MediaLimits(max_bytes=len(PNG) - 1), policy=policy)
    assert err.value.status == 413


@pytest.mark.parametrize(("address", "public"), [
    ("8.8.8.8", True), ("2606:4700::1111", True), ("127.0.0.1", False), ("::1", False), ("::ffff:10.0.0.1", False),
    ("::ffff:8.8.8.8", True), ("169.254.169.254", False), ("100.100.100.200", False), ("192.0.0.192", False),
    ("fd00:ec2::254", False), ("224.0.0.251", False), ("240.0.0.1", False), ("255.255.255.255", False),
    ("64:ff9b::a00:1", False), ("2001:0:4136:e378:8000:63bf:f5ff:fffe", False),  # Teredo, client 10.0.0.1
])
def test_address_classes(address: str, public: bool) -> None:
    assert remote.is_public_address(ipaddress.ip_address(address)) is public


def test_numeric_hosts() -> None:
    for host in ("0x7f000001", "2130706433", "127.1", "0177.0.0.1", "127.0.0.1", "[::ffff:127.0.0.1]"):
        address = remote.literal_address(host)
        assert address is not None and not remote.is_public_address(address), host
    assert remote.literal_address("example.com") is None and remote.literal_address("cafe.bad") is None


def test_deploy_config_and_flags(tmp_path) -> None:
    assert RemotePolicy.from_config(MediaConfig()) == RemotePolicy()
    assert MediaLimits.from_config(LimitsConfig()) == MediaLimits()  # one set of defaults
    args = build_parser().parse_args(["serve", "m", "--allowed-media-domains", "Images.Example.com", "cdn.org",
                                      "--no-remote-media", "--allowed-local-media-path", str(tmp_path)])
    deploy = load_deploy_config(None, serve_overrides(args))
    assert deploy.media.allowed_domains == ["images.example.com", "cdn.org"]
    assert deploy.media.remote_fetch is False and deploy.media.allowed_local_path == str(tmp_path)
    assert load_deploy_config(None, serve_overrides(build_parser().parse_args(["serve", "m"]))).media == MediaConfig()
    for bad in ({"allowed_domains": ["http://x.com/"]}, {"allowed_local_path": "relative/dir"},
                {"allowed_local_path": str(tmp_path / "missing")}, {"fetch_timeout_s": 0}, {"remote": False}):
        with pytest.raises(ConfigError, match="media"):
            load_deploy_config({"media": bad})
