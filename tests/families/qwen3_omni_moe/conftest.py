from pathlib import Path

import pytest
import torch

import omnistage.families.qwen3_omni_moe as family
from omnistage.testing.qwen3_omni_moe import make_tiny_qwen3_omni_moe


@pytest.fixture(scope="session")
def tiny_qwen3_omni(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Tiny random Qwen3-Omni (thinker, talker + code predictor, code2wav, processor files, voices Ethan and
    Chelsie)."""
    return str(make_tiny_qwen3_omni_moe(Path(tmp_path_factory.mktemp("qwen3_omni_moe"))))


@pytest.fixture
def caught_codes(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """The talker's frames on their way to code2wav (the real edge runs)."""
    caught: list[torch.Tensor] = []
    edge = family.talker_to_code2wav

    def spy(pipeline, request, out):
        if "codes" in out.tensors:
            caught.append(out.tensors["codes"])
        return edge(pipeline, request, out)

    monkeypatch.setattr(family, "talker_to_code2wav", spy)
    return caught
