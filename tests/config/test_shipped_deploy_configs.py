"""The deploy configs shipped in configs/ stay valid as the schema evolves."""

from pathlib import Path

import pytest

from omnistage.config.deploy import load_deploy_config

CONFIGS = sorted((Path(__file__).parents[2] / "configs").rglob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_config_loads(path: Path) -> None:
    config = load_deploy_config(path)
    assert config.stages and all(name in ("thinker", "talker", "token2wav", "lm") for name in config.stages)
