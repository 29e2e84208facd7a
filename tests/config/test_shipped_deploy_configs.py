"""The deploy configs shipped in configs/ stay valid as the schema evolves, and each family's copy inside the
package (what a server without --deploy-config loads) is the same file byte for byte."""

import re
from pathlib import Path

import pytest

from omnistage.config.deploy import Advanced, load_deploy_config
from omnistage.engine.ar.engine import ARAdvanced
from omnistage.families.qwen2_5_omni import CONFIGS as OMNI_PACKAGED
from omnistage.families.qwen2_5_omni import Token2WavAdvanced, Token2WavOptions
from omnistage.families.qwen3_omni_moe import CONFIGS as OMNI3_PACKAGED
from omnistage.families.qwen3_omni_moe import Code2WavOptions

ROOT = Path(__file__).parents[2]
CONFIGS = sorted((ROOT / "configs").rglob("*.yaml"))
PACKAGED = {"qwen2_5_omni": OMNI_PACKAGED, "qwen3_omni_moe": OMNI3_PACKAGED}
KINDS = {"thinker": ARAdvanced, "talker": ARAdvanced, "token2wav": Token2WavAdvanced, "lm": ARAdvanced,
         "code2wav": Advanced}
OPTIONS = {"token2wav": Token2WavOptions, "code2wav": Code2WavOptions}


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_config_loads(path: Path) -> None:
    config = load_deploy_config(path)
    assert config.stages and all(name in KINDS for name in config.stages)
    config.check_stages({name: KINDS[name] for name in config.stages},
                        options={name: OPTIONS[name] for name in config.stages if name in OPTIONS})


@pytest.mark.parametrize("family", sorted(PACKAGED))
def test_user_facing_configs_are_the_packaged_ones(family: str) -> None:
    packaged = sorted(p.name for p in PACKAGED[family].glob("*.yaml"))
    shipped = sorted(p.name for p in (ROOT / "configs" / family).glob("*.yaml"))
    assert packaged == shipped and packaged
    for name in packaged:
        assert (ROOT / "configs" / family / name).read_bytes() == (PACKAGED[family] / name).read_bytes(), (
            f"configs/{family}/{name} differs from {PACKAGED[family] / name}: copy the package's file over it")


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_configs_hold_settings_not_history(path: Path) -> None:
    text = path.read_text()
    history = r"run [0-9]+[a-z]?\b|RTF|H200|[0-9] ?ms\b|[0-9] s\b"  # measurements live in benchmarks/results/
    assert not re.search(history, text), path
