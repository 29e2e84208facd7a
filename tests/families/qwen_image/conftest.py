"""Tiny Qwen-Image checkpoints (text-to-image, Edit, Edit-Plus), built locally and cached."""

from __future__ import annotations

import pytest

from omnistage.testing.qwen_image import tiny_qwen_image


@pytest.fixture(scope="session")
def tiny_qwen_image_t2i() -> str:
    return str(tiny_qwen_image("t2i"))


@pytest.fixture(scope="session")
def tiny_qwen_image_edit() -> str:
    return str(tiny_qwen_image("edit"))


@pytest.fixture(scope="session")
def tiny_qwen_image_edit_plus() -> str:
    return str(tiny_qwen_image("edit-plus"))
