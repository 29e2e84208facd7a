"""Tiny Wan2.2 checkpoints (T2V-A14B and I2V-A14B with two experts, TI2V-5B with one DiT), built locally and cached."""

from __future__ import annotations

import pytest

from omnistage.testing.wan import tiny_wan


@pytest.fixture(scope="session")
def tiny_wan_t2v() -> str:
    return str(tiny_wan("t2v"))


@pytest.fixture(scope="session")
def tiny_wan_i2v() -> str:
    return str(tiny_wan("i2v"))


@pytest.fixture(scope="session")
def tiny_wan_ti2v() -> str:
    return str(tiny_wan("ti2v"))
