"""The tiny checkpoint factory must produce real, offline-loadable, deterministic HF checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from omnistage.testing import make_tiny_causal_lm, make_tokenizer

EXPECTED_ARCH = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}


def _arch_of(path: str) -> str:
    return json.loads((Path(path) / "config.json").read_text())["model_type"]


def test_loads_with_auto_classes(tiny_lm: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_lm)
    tok = AutoTokenizer.from_pretrained(tiny_lm)
    assert model.config.vocab_size == len(tok) and 400 <= len(tok) <= 600
    assert model.config.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>") == tok.eos_token_id
    assert tok.pad_token == "<|endoftext|>"
    assert model.config.tie_word_embeddings == (_arch_of(tiny_lm) != "llama")
    assert next(model.parameters()).dtype == torch.float32


def test_files_are_real_safetensors(tiny_lm: str) -> None:
    root = Path(tiny_lm)
    config = json.loads((root / "config.json").read_text())
    assert config["architectures"] == [EXPECTED_ARCH[config["model_type"]]]
    assert (config["hidden_size"], config["num_hidden_layers"], config["head_dim"]) == (64, 2, 16)
    with safe_open(str(root / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
        assert "model.embed_tokens.weight" in names
        assert ("lm_head.weight" in names) == (not config["tie_word_embeddings"])
        assert f.get_tensor("model.embed_tokens.weight").shape == (config["vocab_size"], 64)
    gen = json.loads((root / "generation_config.json").read_text())
    assert gen["eos_token_id"] == config["eos_token_id"] and gen["do_sample"] is False


def test_tokenizer_round_trip_and_chat_template(tiny_qwen2: str) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_qwen2)
    text = "The keeper counted 112 steps; café, naïve — ok?\n\tDone!"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode()), "BPE merges should compress the text"
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
    ]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = tok.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=False)
    assert no_prompt == "<|im_start|>system\nBe brief.<|im_end|>\n"
    # Special tokens are single ids, so the engine can detect <|im_end|> as a stop token.
    assert tok.encode("<|im_start|>user<|im_end|>")[0] == tok.convert_tokens_to_ids("<|im_start|>")


def test_build_is_deterministic(tmp_path: Path) -> None:
    a = make_tiny_causal_lm(tmp_path / "a", arch="llama", seed=3)
    b = make_tiny_causal_lm(tmp_path / "b", arch="llama", seed=3)
    for name in ["model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"]:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    c = make_tiny_causal_lm(tmp_path / "c", arch="llama", seed=4)
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    tok_only = make_tokenizer(tmp_path / "t")
    assert (tok_only / "tokenizer.json").read_bytes() == (a / "tokenizer.json").read_bytes()


def test_config_overrides(tmp_path: Path) -> None:
    path = make_tiny_causal_lm(tmp_path, arch="qwen3", num_hidden_layers=1)
    assert AutoModelForCausalLM.from_pretrained(path).config.num_hidden_layers == 1
    with pytest.raises(ValueError, match="unknown arch"):
        make_tiny_causal_lm(tmp_path / "x", arch="gpt2")


def test_greedy_generation_is_varied_and_peaky(tiny_lm: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_lm).eval()
    tok = AutoTokenizer.from_pretrained(tiny_lm)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "Tell me about the lighthouse."}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    with torch.no_grad():
        out = model.generate(
            ids, max_new_tokens=20, do_sample=False, output_scores=True, return_dict_in_generate=True
        )
    new = out.sequences[0, ids.shape[1] :].tolist()
    assert len(new) == 20  # special tokens are made unlikely, so greedy runs to the length limit
    assert len(set(new)) >= 4, new
    top2 = torch.stack(out.scores)[:, 0].topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min() > 1e-4  # no near-ties that could flip between kernels
