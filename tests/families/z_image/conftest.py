"""Tiny Z-Image checkpoints (base: scheduler shift 6.0; turbo: Turbo's shift 3.0), built locally and cached."""

from __future__ import annotations

import pytest

from omnistage.testing.z_image import tiny_z_image


@pytest.fixture(scope="session")
def tiny_z_image_base() -> str:
    return str(tiny_z_image("base"))


@pytest.fixture(scope="session")
def tiny_z_image_turbo() -> str:
    return str(tiny_z_image("turbo"))
