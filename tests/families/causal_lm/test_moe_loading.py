"""A sparse MoE causal LM (Qwen3-MoE) in the released per-expert checkpoint layout loads through omnistage's loader
(each expert's gate/up/down tensors into its slices of transformers' fused expert parameters) and gives the
greedy tokens of HF `generate`; a checkpoint missing an expert is refused. With the fused MoE kernels (CUDA; here
forced, through Triton's interpreter) Qwen3-MoE and Qwen2-MoE (its sigmoid-gated shared expert) run the layer loop
on them and still give HF's greedy tokens."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from omnistage import Omni, SamplingParams
from omnistage.errors import ConfigError
from omnistage.kernels import moe
from omnistage.testing.factory import make_tiny_causal_lm

PROMPTS = ["The river ran quietly past the old mill", "Numbers like 1234 appear here."]


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_causal_lm(tmp_path_factory.mktemp("qwen3_moe"), arch="qwen3_moe")


def hf_greedy(path: Path) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    want = []
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids
        out = hf.generate(ids, max_new_tokens=12, do_sample=False, min_new_tokens=12)
        want.append(out[0, ids.shape[1]:].tolist())
    return want


def omni_greedy(path: Path) -> list[list[int]]:
    with Omni(str(path), {"stages": {"*": {"dtype": "float32"}}}) as omni:
        got = omni.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    return [o.token_ids for o in got]


def test_per_expert_checkpoint_gives_hf_greedy_tokens(moe_checkpoint: Path) -> None:
    with safe_open(str(moe_checkpoint / "model.safetensors"), "pt") as f:
        assert "model.layers.0.mlp.experts.3.gate_proj.weight" in f.keys()  # the released layout, not the fused one
    assert omni_greedy(moe_checkpoint) == hf_greedy(moe_checkpoint)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_fused_moe_kernels_give_hf_greedy_tokens(arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    path = make_tiny_causal_lm(tmp_path / arch, arch=arch)
    want = hf_greedy(path)
    calls = {"kernels": 0, "torch": 0}
    kernels, reference = moe.fused_experts, moe.experts_reference

    def counted(name: str, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(moe, "available", lambda device: True)  # CPU: the kernels in Triton's interpreter
    monkeypatch.setattr(moe, "fused_experts", counted("kernels", kernels))
    monkeypatch.setattr(moe, "experts_reference", counted("torch", reference))
    assert omni_greedy(path) == want
    assert calls["kernels"] >= 2 * 12 and calls["torch"] == 0  # every step's 2 MoE layers on the kernels


def test_checkpoint_missing_an_expert_is_refused(moe_checkpoint: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(moe_checkpoint, broken)
    weights = load_file(str(broken / "model.safetensors"))
    del weights["model.layers.1.mlp.experts.2.up_proj.weight"]
    save_file(weights, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="layers.1.mlp.experts.gate_up_proj"):
        Omni(str(broken), {"stages": {"*": {"dtype": "float32"}}})
