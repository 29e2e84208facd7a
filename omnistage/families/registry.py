"""Finds the family that serves a checkpoint, from config.json or model_index.json, and loads its
pipeline declaration with the deploy config (`load_pipeline`).

Families outside omnistage register with `register_family`, or, so that stage worker processes
(which start fresh) find them too, through $OMNISTAGE_FAMILY_PLUGINS="pkg.module:FamilyClass,...".
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from omnistage import envs
from omnistage.config.deploy import DeployConfig, load_deploy_config
from omnistage.errors import ConfigError
from omnistage.families.base import CheckpointInfo, Family, Pipeline


def _families() -> list[Family]:
    # Imported lazily so that importing the registry stays cheap; specific families first.
    from omnistage.families.causal_lm import CausalLMFamily
    from omnistage.families.flux import FluxFamily
    from omnistage.families.qwen2_5_omni import Qwen25OmniFamily
    from omnistage.families.qwen3_omni_moe import Qwen3OmniMoeFamily
    from omnistage.families.qwen3_tts import Qwen3TTSFamily
    from omnistage.families.qwen_image import QwenImageFamily
    from omnistage.families.stable_audio import StableAudioFamily
    from omnistage.families.wan import WanFamily
    from omnistage.families.z_image import ZImageFamily

    return [*_extra_families, *_plugin_families(), Qwen25OmniFamily(), Qwen3OmniMoeFamily(), Qwen3TTSFamily(),
            FluxFamily(), QwenImageFamily(), ZImageFamily(), StableAudioFamily(), WanFamily(), CausalLMFamily()]


_extra_families: list[Family] = []
PLUGINS_ENV = envs.FAMILY_PLUGINS.name


def _plugin_families() -> list[Family]:
    families = []
    for entry in filter(None, (e.strip() for e in envs.FAMILY_PLUGINS.get().split(","))):
        module, _, name = entry.partition(":")
        try:
            families.append(getattr(importlib.import_module(module), name)())
        except (ImportError, AttributeError, TypeError) as exc:
            raise ConfigError(f"${PLUGINS_ENV}: cannot load family {entry!r} (want 'module:Class'): {exc}") from None
    return families


def register_family(family: Family) -> None:
    """Add a family ahead of the built-in ones (plugins and tests)."""
    _extra_families.insert(0, family)


def unregister_family(family: Family) -> None:
    _extra_families.remove(family)


def detect_family(model_path: str | Path) -> tuple[Family, CheckpointInfo]:
    path = Path(model_path)
    if not path.exists():
        raise ConfigError(
            f"model path {str(path)!r} does not exist (model hubs are not contacted; pass a local checkpoint)"
        )
    if not path.is_dir():
        raise ConfigError(f"model path {str(path)!r} is not a directory with a checkpoint")
    info = CheckpointInfo.read(path)
    if info.config is None and info.model_index is None:
        raise ConfigError(f"{str(path)!r} has neither config.json nor model_index.json; is it a checkpoint?")
    for family in _families():
        if family.matches(info):
            return family, info
    found = ", ".join(info.architectures) or info.class_name or "no architecture"
    raise ConfigError(f"{str(path)!r} ({found}) is not a supported model family")


def load_pipeline(
    model: str | Path,
    deploy: str | Path | dict[str, Any] | DeployConfig | None = None,
    overrides: dict[str, Any] | None = None,
) -> Pipeline:
    """The pipeline of the checkpoint at `model`: its family's declaration, with the deploy config (a path,
    a dict or a DeployConfig, plus `overrides`) laid over the family's defaults for that checkpoint."""
    family, info = detect_family(model)
    config = load_deploy_config(deploy, overrides, base=family.default_deploy(info))
    return family.pipeline(info, config)
