from pathlib import Path

import pytest

from omnistage.testing.qwen3_omni_moe import make_tiny_qwen3_omni_moe


@pytest.fixture(scope="session")
def tiny_qwen3_omni(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Tiny random Qwen3-Omni (thinker, talker + code predictor, code2wav, processor files, voices Ethan and
    Chelsie)."""
    return str(make_tiny_qwen3_omni_moe(Path(tmp_path_factory.mktemp("qwen3_omni_moe"))))
