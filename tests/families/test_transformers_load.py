"""omnistage's transformers model loads keep transformers' own modules: none asks for the Hub-kernel swap that
transformers does by default (kernels fetched at load time; offline machines fail, parity would not hold)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from omnistage.testing.z_image import tiny_z_image


@pytest.fixture
def kernel_requests(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    asked: list[bool] = []
    original = PreTrainedModel.set_use_kernels

    def record(self, use_kernels, *args, **kwargs):
        asked.append(bool(use_kernels))
        return original(self, use_kernels, *args, **kwargs)

    monkeypatch.delenv("USE_HUB_KERNELS")  # transformers' default: swap, unless the load says otherwise
    monkeypatch.setattr(PreTrainedModel, "set_use_kernels", record)
    return asked


def test_omni_parts_load_without_hub_kernels(tiny_qwen2_5_omni: str, kernel_requests: list[bool]) -> None:
    from transformers import Qwen2_5OmniConfig, Qwen2_5OmniThinkerForConditionalGeneration

    from omnistage.families.qwen2_5_omni.models import load_part

    path = Path(tiny_qwen2_5_omni)
    config = Qwen2_5OmniConfig.from_pretrained(path).thinker_config
    load_part(Qwen2_5OmniThinkerForConditionalGeneration, path, config, torch.float32, torch.device("cpu"))
    assert kernel_requests == [False]


def test_diffusion_text_encoders_load_without_hub_kernels(kernel_requests: list[bool]) -> None:
    from omnistage.families.z_image.model import ZImageModel

    ZImageModel(tiny_z_image("turbo"), torch.device("cpu"), torch.float32, parts="encoders")
    assert kernel_requests == [False]
