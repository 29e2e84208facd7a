"""A tiny Stable Audio Open checkpoint, built locally and cached."""

from __future__ import annotations

import pytest

from omnistage.testing.stable_audio import tiny_stable_audio


@pytest.fixture(scope="session")
def tiny_stable_audio_path() -> str:
    return str(tiny_stable_audio())
