"""A thinker-only checkpoint (the released Thinking and Captioner models: `enable_audio_output` false, no talker or
code2wav weights) serves text alone: the thinker's greedy tokens equal transformers', a request for speech is
refused with the modalities it can have."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omnistage import Omni, SamplingParams
from omnistage.errors import RequestError
from omnistage.families.registry import load_pipeline
from omnistage.testing.qwen3_omni_moe import make_tiny_qwen3_omni_moe

MESSAGES = [{"role": "user", "content": "Think about rivers."}]


@pytest.fixture(scope="module")
def thinking(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_qwen3_omni_moe(Path(tmp_path_factory.mktemp("thinking")), variant="thinking"))


def test_thinker_only_checkpoint_serves_text(thinking: str) -> None:
    from transformers import Qwen3OmniMoeForConditionalGeneration, Qwen3OmniMoeProcessor

    assert [s.name for s in load_pipeline(thinking).stages] == ["thinker"]
    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(thinking, dtype=torch.float32).eval()
    assert not hasattr(model, "talker")
    processor = Qwen3OmniMoeProcessor.from_pretrained(thinking)
    ids = processor(text=[processor.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)],
                    return_tensors="pt")["input_ids"]
    with torch.no_grad():
        expected = model.generate(input_ids=ids, thinker_max_new_tokens=6, thinker_min_new_tokens=6,
                                  thinker_do_sample=False, return_audio=False)[0, ids.shape[1]:].tolist()
    with Omni(thinking, {"stages": {"*": {"max_model_len": 256, "dtype": "float32"}}}) as omni:
        (text,) = omni.generate([MESSAGES], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        with pytest.raises(RequestError, match=r"cannot produce \['audio'\]; it produces \['text'\]"):
            omni.generate([MESSAGES], SamplingParams(max_tokens=6), ("text", "audio"))
    assert text.error is None and text.token_ids == expected
