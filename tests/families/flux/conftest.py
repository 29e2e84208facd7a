"""Tiny FLUX.1 checkpoints (dev: guidance embedding, dynamic shift; schnell: neither), built locally and cached."""

from __future__ import annotations

import pytest

from omnistage.testing.flux import tiny_flux


@pytest.fixture(scope="session")
def tiny_flux_dev() -> str:
    return str(tiny_flux("dev"))


@pytest.fixture(scope="session")
def tiny_flux_schnell() -> str:
    return str(tiny_flux("schnell"))
