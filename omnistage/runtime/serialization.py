"""Wire format for everything that crosses a process or host boundary: a small msgpack header
(msgspec) plus raw tensor buffers. Never pickle: only plain values and the dataclasses registered
with `wire_type` can be decoded, so a peer can send data but never code.

`pack(obj)` gives (header, buffers); tensors become {"__omni__": "tensor", dtype, shape} in the header
and their bytes go out as separate buffers (views, no copy). `unpack` rebuilds tensors on top of
the received buffers (zero-copy). `to_contiguous` / `from_contiguous` lay both out in one block
(shared memory segments).
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Iterator
from typing import Any

import msgspec
import torch

from omnistage.sampling_params import SamplingParams, StructuredOutput
from omnistage.types import StageInput, StageOutput, TokenLogprob

TAG = "__omni__"  # reserved key marking a typed node in the header
_TYPES: dict[str, type] = {}
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder()


def wire_type(cls: type) -> type:
    """Allow a dataclass to cross process boundaries (engine-specific params, family payloads)."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls.__name__} is not a dataclass")
    _TYPES[cls.__name__] = cls
    return cls


for _cls in (StageInput, StageOutput, TokenLogprob, SamplingParams, StructuredOutput):
    wire_type(_cls)


def pack(obj: Any) -> tuple[bytes, list[memoryview]]:
    buffers: list[memoryview] = []
    return _ENCODER.encode(_encode(obj, buffers)), buffers


def unpack(header: bytes | memoryview, buffers: list[Any]) -> Any:
    return _decode(_DECODER.decode(header), iter(buffers))


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach().to("cpu").contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(-1).view(torch.uint8).numpy())


def _encode(x: Any, buffers: list[memoryview]) -> Any:
    if x is None or isinstance(x, (bool, int, float, str, bytes)):
        return x
    if isinstance(x, torch.Tensor):
        buffers.append(_tensor_bytes(x))
        return {TAG: "tensor", "dtype": str(x.dtype).removeprefix("torch."), "shape": list(x.shape)}
    if isinstance(x, list):
        return [_encode(v, buffers) for v in x]
    if isinstance(x, tuple):
        return {TAG: "tuple", "items": [_encode(v, buffers) for v in x]}
    if isinstance(x, dict):
        if TAG in x:
            raise ValueError(f"dict key {TAG!r} is reserved by the wire format")
        return {k: _encode(v, buffers) for k, v in x.items()}
    name = type(x).__name__
    if _TYPES.get(name) is type(x):
        out = {f.name: _encode(getattr(x, f.name), buffers) for f in dataclasses.fields(x) if f.init}
        out[TAG] = name
        return out
    raise TypeError(f"cannot send a {name} between processes; register it with serialization.wire_type")


def _decode(x: Any, buffers: Iterator[Any]) -> Any:
    """Mirror of _encode: the header is walked in the order it was written, so tensors meet
    their buffers in sequence."""
    if isinstance(x, list):
        return [_decode(v, buffers) for v in x]
    if not isinstance(x, dict):
        return x
    tag = x.get(TAG)
    if tag is None:
        return {k: _decode(v, buffers) for k, v in x.items()}
    if tag == "tensor":
        return _tensor_from(next(buffers), x["dtype"], x["shape"])
    if tag == "tuple":
        return tuple(_decode(v, buffers) for v in x["items"])
    cls = _TYPES.get(tag)
    if cls is None:
        raise ValueError(f"unknown wire type {tag!r}")
    return cls(**{k: _decode(v, buffers) for k, v in x.items() if k != TAG})


def _tensor_from(buffer: Any, dtype_name: str, shape: list[int]) -> torch.Tensor:
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {dtype_name!r}")
    if len(buffer) == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buffer, dtype=dtype).view(shape)  # shares the buffer's memory


# ---- one contiguous block: [magic, n, header length, buffer lengths..., header, buffers (64-aligned)]

_MAGIC = 0x4F4D4E31  # "OMN1"
_ALIGN = 64


def _layout(header_len: int, sizes: list[int]) -> tuple[int, list[int]]:
    pos = 16 + 8 * len(sizes) + header_len
    offsets = []
    for size in sizes:
        pos = (pos + _ALIGN - 1) // _ALIGN * _ALIGN
        offsets.append(pos)
        pos += size
    return max(pos, 1), offsets


def contiguous_size(header: bytes, buffers: list[memoryview]) -> int:
    return _layout(len(header), [b.nbytes for b in buffers])[0]


def to_contiguous(header: bytes, buffers: list[memoryview], out: memoryview) -> None:
    """Write header and buffers into `out` (at least contiguous_size bytes)."""
    sizes = [b.nbytes for b in buffers]
    _, offsets = _layout(len(header), sizes)
    struct.pack_into(f"<IIQ{len(sizes)}Q", out, 0, _MAGIC, len(sizes), len(header), *sizes)
    start = 16 + 8 * len(sizes)
    out[start:start + len(header)] = header
    for buf, off, size in zip(buffers, offsets, sizes, strict=True):
        out[off:off + size] = buf.cast("B")


def from_contiguous(block: memoryview) -> tuple[memoryview, list[memoryview]]:
    """Views of the header and buffers inside `block` (no copy)."""
    magic, n, header_len = struct.unpack_from("<IIQ", block, 0)
    if magic != _MAGIC:
        raise ValueError("not an omnistage payload block")
    sizes = list(struct.unpack_from(f"<{n}Q", block, 16))
    _, offsets = _layout(header_len, sizes)
    start = 16 + 8 * n
    return block[start:start + header_len], [block[o:o + s] for o, s in zip(offsets, sizes, strict=True)]


def payload_nbytes(buffers: list[memoryview]) -> int:
    return sum(b.nbytes for b in buffers)
