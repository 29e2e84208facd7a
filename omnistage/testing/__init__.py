"""Test/demo helpers: tiny random-weight checkpoints of real architectures, built offline."""

from omnistage.testing.factory import make_tiny_causal_lm, make_tokenizer, tiny_checkpoint

__all__ = ["make_tiny_causal_lm", "make_tokenizer", "tiny_checkpoint"]
