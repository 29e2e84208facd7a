"""Test/demo helpers: tiny random-weight checkpoints of real architectures, built offline.

The names below load on first use, so that `omnistage.testing.layouts` imports without torch."""

from __future__ import annotations

from typing import Any

__all__ = ["make_tiny_causal_lm", "make_tiny_qwen2_5_omni", "make_tokenizer", "tiny_checkpoint"]


def __getattr__(name: str) -> Any:
    if name == "make_tiny_qwen2_5_omni":
        from omnistage.testing.qwen2_5_omni import make_tiny_qwen2_5_omni

        return make_tiny_qwen2_5_omni
    if name in __all__:
        from omnistage.testing import factory

        return getattr(factory, name)
    raise AttributeError(f"module 'omnistage.testing' has no attribute {name!r}")
