"""The shipped deploy configs (one GPU, two GPUs) load and fit the family's stages; the family's defaults."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omnistage.config.deploy import Advanced, load_deploy_config
from omnistage.engine.ar.engine import ARAdvanced
from omnistage.families.base import CheckpointInfo
from omnistage.families.qwen3_omni_moe import CONFIGS, Code2WavOptions, Qwen3OmniMoeFamily

STAGES = {"thinker": ARAdvanced, "talker": ARAdvanced, "code2wav": Advanced}


@pytest.mark.parametrize("name", ["1gpu.yaml", "2gpu.yaml"])
def test_shipped_configs_load(name: str) -> None:
    config = load_deploy_config(CONFIGS / name)
    assert set(config.stages) == set(STAGES)
    config.check_stages(STAGES, options={"code2wav": Code2WavOptions})
    assert config.stage("code2wav").options["window"] > 0 and config.async_chunk  # speech streams
    devices = {s: config.stage(s).devices for s in STAGES}
    assert devices == ({"thinker": "0", "talker": "1", "code2wav": "1"} if name == "2gpu.yaml" else
                       {"thinker": "0", "talker": "0", "code2wav": "0"})


@pytest.mark.skipif(torch.cuda.is_available(), reason="the defaults without a GPU")
def test_cpu_defaults(tiny_qwen3_omni: str, tmp_path: Path) -> None:
    """Without a GPU every stage runs on the CPU (no devices, no GPU dtype); a thinker-only checkpoint keeps the
    thinker's section alone."""
    family = Qwen3OmniMoeFamily()
    deploy = family.default_deploy(CheckpointInfo.read(Path(tiny_qwen3_omni)))
    assert set(deploy["stages"]) == set(STAGES)
    assert all("devices" not in s and "dtype" not in s for s in deploy["stages"].values())
    (tmp_path / "config.json").write_text('{"architectures": ["Qwen3OmniMoeForConditionalGeneration"], '
                                          '"enable_audio_output": false}')
    assert set(family.default_deploy(CheckpointInfo.read(tmp_path))["stages"]) == {"thinker"}
