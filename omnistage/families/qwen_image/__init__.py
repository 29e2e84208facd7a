"""Qwen-Image, Qwen-Image-Edit and Qwen-Image-Edit-Plus (being built)."""

from __future__ import annotations

from typing import Any

from omnistage.families.base import CheckpointInfo


class QwenImageFamily:
    name = "qwen_image"

    def matches(self, info: CheckpointInfo) -> bool:
        return False

    def default_deploy(self, info: CheckpointInfo) -> dict[str, Any]:
        return {}

    def pipeline(self, info: CheckpointInfo, deploy: Any) -> Any:
        raise NotImplementedError
