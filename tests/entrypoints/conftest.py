"""Fixtures that run the REAL HTTP server (uvicorn in a thread, free port) over either a scripted
FakeEngine (fast; exercises every server path, including failures) or a real AsyncOmni on a tiny
checkpoint. Both servers require API_KEY, so auth is always on."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from openai_helpers import API_KEY, FakeEngine, Served

from omnistage.entrypoints.openai.server import BackgroundServer


@pytest.fixture(scope="session")
def fake_served() -> Iterator[Served]:
    engine = FakeEngine()
    with BackgroundServer(engine, api_key=API_KEY) as server:
        yield Served(engine, server, "fake")


@pytest.fixture(scope="session")
def real_engine(tiny_qwen2: str) -> Iterator[Any]:
    from omnistage.entrypoints.async_omni import AsyncOmni

    # float32 as the HF reference runs (on a GPU the default would be bfloat16, whose greedy tokens can part)
    engine = AsyncOmni.from_model(tiny_qwen2, {"stages": {"*": {"dtype": "float32"}}}, served_model_name="tiny-qwen2")
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def real_served(real_engine: Any, tiny_qwen2: str) -> Iterator[Served]:
    with BackgroundServer(real_engine, api_key=API_KEY) as server:
        yield Served(real_engine, server, "real", {"path": tiny_qwen2})


@pytest.fixture(scope="session", params=["fake", "real"])
def served(request: pytest.FixtureRequest) -> Served:
    """Every behaviour test runs against both engines."""
    return request.getfixturevalue(f"{request.param}_served")
