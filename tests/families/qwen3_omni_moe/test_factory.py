"""The tiny Qwen3-Omni checkpoint: the released layout, deterministic bytes, loaded by transformers and the family."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from omnistage.families.registry import detect_family, load_pipeline
from omnistage.testing.qwen3_omni_moe import CODEBOOK, NUM_CODE_GROUPS, make_tiny_qwen3_omni_moe


def _digest(path: Path) -> str:
    return hashlib.sha256(b"".join(p.read_bytes() for p in sorted(path.iterdir()) if p.is_file())).hexdigest()


def test_released_layout_and_identical_bytes(tiny_qwen3_omni: str, tmp_path: Path) -> None:
    path = Path(tiny_qwen3_omni)
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3OmniMoeForConditionalGeneration"]
    assert {"thinker_config", "talker_config", "code2wav_config"} <= set(config)
    text = config["thinker_config"]["text_config"]
    assert (text["num_experts"], text["num_experts_per_tok"]) == (4, 2)
    talker = config["talker_config"]
    assert talker["num_code_groups"] == config["code2wav_config"]["num_quantizers"] == NUM_CODE_GROUPS
    assert talker["code_predictor_config"]["vocab_size"] == config["code2wav_config"]["codebook_size"] == CODEBOOK
    assert set(talker["speaker_id"]) == {"ethan", "chelsie"}
    for name in ("chat_template.jinja", "tokenizer.json", "processor_config.json", "model.safetensors"):
        assert (path / name).is_file(), name
    assert _digest(make_tiny_qwen3_omni_moe(tmp_path / "again")) == _digest(path)
    family, _ = detect_family(path)
    assert family.name == "qwen3_omni_moe"
    pipeline = load_pipeline(path)
    assert [s.name for s in pipeline.stages] == ["thinker", "talker", "code2wav"]
    assert pipeline.voices == ("Ethan", "Chelsie")
    text = pipeline.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                                  tokenize=False)
    ids = pipeline.tokenizer(text)["input_ids"]
    user, assistant = (pipeline.tokenizer.convert_tokens_to_ids(t) for t in ("user", "assistant"))
    assert user in ids and assistant in ids  # the role words are single tokens, as the talker's prompt needs
