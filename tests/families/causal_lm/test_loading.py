"""Loaded weights are for inference only: none requires grad, so no step or graph capture records autograd
(a float32 model whose weights required grad could not capture its decode graphs on CUDA)."""

from pathlib import Path

import torch

from omnistage.families import hf


def test_loaded_weights_do_not_require_grad(tiny_qwen2: str) -> None:
    model, _ = hf.load_causal_lm(Path(tiny_qwen2), "float32", torch.device("cpu"))
    assert sum(1 for _ in model.parameters()) > 0
    assert [name for name, p in model.named_parameters() if p.requires_grad] == []
