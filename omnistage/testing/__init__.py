"""Test/demo helpers: tiny random-weight checkpoints of real architectures, built offline."""

from omnistage.testing.factory import make_tiny_causal_lm, make_tokenizer, tiny_checkpoint
from omnistage.testing.qwen2_5_omni import make_tiny_qwen2_5_omni

__all__ = ["make_tiny_causal_lm", "make_tiny_qwen2_5_omni", "make_tokenizer", "tiny_checkpoint"]
