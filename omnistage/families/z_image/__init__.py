"""Z-Image and Z-Image-Turbo (being built)."""

from __future__ import annotations

from typing import Any

from omnistage.families.base import CheckpointInfo


class ZImageFamily:
    name = "z_image"

    def matches(self, info: CheckpointInfo) -> bool:
        return False

    def default_deploy(self, info: CheckpointInfo) -> dict[str, Any]:
        return {}

    def pipeline(self, info: CheckpointInfo, deploy: Any) -> Any:
        raise NotImplementedError
