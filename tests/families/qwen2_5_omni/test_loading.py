"""The thinker, talker and token2wav load as inference weights: none requires grad, so no step or graph capture
records autograd (run 44 found a capture that did)."""

from pathlib import Path

import torch
from transformers import (
    Qwen2_5OmniConfig,
    Qwen2_5OmniTalkerForConditionalGeneration,
    Qwen2_5OmniThinkerForConditionalGeneration,
)

from omnistage.families.qwen2_5_omni import models


def test_loaded_parts_do_not_require_grad(tiny_qwen2_5_omni: str) -> None:
    path, cpu = Path(tiny_qwen2_5_omni), torch.device("cpu")
    config = Qwen2_5OmniConfig.from_pretrained(path)
    parts = {
        "thinker": models.load_part(Qwen2_5OmniThinkerForConditionalGeneration, path, config.thinker_config,
                                    torch.float32, cpu),
        "talker": models.load_part(Qwen2_5OmniTalkerForConditionalGeneration, path, config.talker_config,
                                   torch.float32, cpu),
        "token2wav": models.load_token2wav(path, config.token2wav_config, cpu),
    }
    for name, model in parts.items():
        assert sum(1 for _ in model.parameters()) > 0, name
        assert [n for n, p in model.named_parameters() if p.requires_grad] == [], name
