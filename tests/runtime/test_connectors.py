"""Connectors and the wire format: every connector returns what was put (tensors bit-exact,
dtypes and shapes kept), `get` honours its deadline, `cleanup` and `close` leave nothing behind,
and data from another process is never unpickled."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import msgspec
import pytest
import torch

from omnistage.runtime import serialization
from omnistage.runtime.connector import (
    InProcessConnector,
    LinkSpec,
    ShmConnector,
    TcpConnector,
    curve_key,
    dial_securely,
    open_link,
)
from omnistage.sampling_params import SamplingParams
from omnistage.types import StageInput, StageOutput, TokenLogprob

SHM = Path("/dev/shm")


def payload() -> list:
    torch.manual_seed(0)
    return [
        StageInput("r1", [1, 2, 3], embeds=torch.randn(3, 8), params=SamplingParams(max_tokens=4, stop=["x"]),
                   tensors={"codes": torch.arange(6, dtype=torch.int64).view(2, 3)}, final=False),
        StageOutput("r1", "a", token_ids=[5], logprobs=[TokenLogprob(5, -0.1, [(5, -0.1), (6, -2.0)])],
                    hidden_states={"h": torch.randn(1, 16).to(torch.bfloat16)}, tensors={"none": torch.empty(0, 4)}),
        {"big": torch.randn(256, 1024), "tuple": (1, "a"), 3: None},
    ]


def assert_same(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif hasattr(a, "__dataclass_fields__"):
        assert type(a) is type(b)
        assert_same(vars(a), vars(b))
    else:
        assert a == b


def test_serialization_round_trip_and_contiguous_layout() -> None:
    obj = payload()
    header, buffers = serialization.pack(obj)
    assert_same(obj, serialization.unpack(header, buffers))
    block = memoryview(bytearray(serialization.contiguous_size(header, buffers)))
    serialization.to_contiguous(header, buffers, block)
    assert_same(obj, serialization.unpack(*serialization.from_contiguous(block)))


def test_only_registered_types_cross() -> None:
    class Secret:
        pass

    with pytest.raises(TypeError, match="register it"):
        serialization.pack({"x": Secret()})
    evil = serialization._ENCODER.encode({serialization.TAG: "Popen", "args": ["sh"]})
    with pytest.raises(ValueError, match="unknown wire type 'Popen'"):
        serialization.unpack(evil, [])


@pytest.fixture(params=["inprocess", "shm", "tcp"])
def link(request: pytest.FixtureRequest):
    """(producer end, consumer end) of one link."""
    if request.param == "inprocess":
        end = InProcessConnector()
        yield end, end
        end.close()
        return
    if request.param == "shm":
        prefix = f"omnistage-test-{os.getpid()}-{request.node.name[-12:].strip('[]')}"
        a, b = ShmConnector(prefix, "a", owner=True), ShmConnector(prefix, "b")
    else:
        key = curve_key()
        a, b = open_link(LinkSpec("tcp", "a", key=key)), open_link(LinkSpec("tcp", "b", key=key))
        a.connect(b.address)
        b.connect(a.address)
    yield a, b
    b.close()
    a.close()
    if request.param == "shm":
        assert not list(SHM.glob(f"{prefix}*")), "segments left behind"


def test_put_get_round_trip(link) -> None:
    a, b = link
    obj = payload()
    for i, item in enumerate(obj):
        a.put(("r1", "x->y", i), item)
    got = [b.get(("r1", "x->y", i), timeout=5) for i in reversed(range(len(obj)))]
    assert_same(obj, got[::-1])
    with pytest.raises(TimeoutError):
        b.get(("r1", "x->y", 0), timeout=0.05)  # taken already


def test_get_waits_for_a_late_put(link) -> None:
    a, b = link
    timer = threading.Timer(0.1, a.put, args=(("r2", "e", 0), torch.ones(4)))
    timer.start()
    assert torch.equal(b.get(("r2", "e", 0), timeout=5), torch.ones(4))
    timer.join()


def test_cleanup_drops_one_requests_payloads(link) -> None:
    a, b = link
    a.put(("gone", "e", 0), torch.zeros(8))
    a.put(("kept", "e", 0), torch.ones(8))
    if isinstance(b, TcpConnector):
        b.get(("kept", "e", 0), timeout=5)  # both have arrived (one socket, in order)
        a.put(("kept", "e", 0), torch.ones(8))
    (b if isinstance(b, TcpConnector) else a).cleanup("gone")
    with pytest.raises(TimeoutError):
        b.get(("gone", "e", 0), timeout=0.05)
    assert torch.equal(b.get(("kept", "e", 0), timeout=5), torch.ones(8))


@pytest.mark.parametrize("intruder_key", ["", "another"], ids=["plain-tcp", "another-deployment"])
def test_tcp_link_refuses_peers_without_the_deployment_key(intruder_key: str) -> None:
    """Anything that reaches the port but does not know the key (a plain ZMQ socket, or one holding some
    other key pair) cannot deliver a payload; the real peer still can."""
    import zmq

    from omnistage.runtime import serialization

    key = curve_key()
    receiver, sender = TcpConnector(key=key), TcpConnector(key=key)
    ctx = zmq.Context()
    intruder = ctx.socket(zmq.PUSH)
    intruder.setsockopt(zmq.LINGER, 0)
    dial_securely(intruder, curve_key() if intruder_key else "")
    intruder.connect(receiver.address)
    header, buffers = serialization.pack(torch.zeros(4))
    intruder.send_multipart([msgspec.msgpack.encode(["evil", "e", 0]), header, *buffers])
    sender.connect(receiver.address)
    sender.put(("fine", "e", 0), torch.ones(4))
    assert torch.equal(receiver.get(("fine", "e", 0), timeout=5), torch.ones(4))
    with pytest.raises(TimeoutError):
        receiver.get(("evil", "e", 0), timeout=0.5)
    intruder.close()
    ctx.term()
    sender.close()
    receiver.close()


def test_shm_segments_are_recycled_and_purged() -> None:
    prefix = f"omnistage-test-{os.getpid()}-zc"
    a, b = ShmConnector(prefix, "a", owner=True), ShmConnector(prefix, "b")

    def names() -> list[str]:
        return sorted(p.name.split(".", 2)[2].split(".")[0] for p in SHM.glob(f"{prefix}.*"))

    a.put(("r", "e", 0), torch.arange(1024.0))
    got = b.get(("r", "e", 0), timeout=5)
    assert names() == ["busy"]  # mapped by the reader: tensors live on it (zero-copy)
    assert torch.equal(got, torch.arange(1024.0))
    del got
    assert names() == ["free"]  # the last tensor died: back to the writer
    a.put(("r", "e", 1), torch.ones(1000))
    assert len(names()) == 1 and names() != ["free"]  # reused, not a new segment
    assert torch.equal(b.get(("r", "e", 1), timeout=5), torch.ones(1000))
    a.put(("r", "e", 2), torch.ones(2))
    a.close()  # the owner purges what nobody read
    assert names() == []
