"""Structured output: a request's grammar (JSON schema, any JSON object, regex, choice, EBNF/Lark) as a logits mask
applied inside the batched sampler, through xgrammar.

One `Grammars` per engine compiles each distinct grammar once (xgrammar caches compiled grammars too) for the
engine's tokenizer; each constrained sequence owns a `GrammarMatcher` that advances with every token it keeps.
A step fills one bitmask row per constrained sequence and masks only those rows' logits; unconstrained rows are
untouched. Constrained sequences are sampled on the host path (their next mask depends on the token just drawn).
"""

from __future__ import annotations

import json
from typing import Any

import torch

from omnistage.errors import RequestError
from omnistage.sampling_params import StructuredOutput


class Grammars:
    """Compiles grammars for one tokenizer and hands out per-sequence matchers."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...]) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_token_ids) or None)
        self.compiler = xgr.GrammarCompiler(info, max_threads=2)
        self.vocab_size = vocab_size
        self._bitmask: torch.Tensor | None = None

    def compile(self, spec: StructuredOutput) -> Any:
        """The compiled grammar, or a RequestError saying what is wrong with the spec."""
        try:
            # Compact JSON: a model that rambles in whitespace (or random weights) still closes its object.
            if spec.json is not None:
                return self.compiler.compile_json_schema(spec.json, any_whitespace=False)
            if spec.json_object:
                return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if spec.regex is not None:
                return self.compiler.compile_regex(spec.regex)
            if spec.choice is not None:
                alternatives = " | ".join(json.dumps(c) for c in spec.choice)
                return self.compiler.compile_grammar(f"root ::= {alternatives}")
            if spec.grammar.lstrip().startswith(("start:", "?start:")):
                return self.compiler.compile_lark(spec.grammar)
            return self.compiler.compile_grammar(spec.grammar)
        except (RuntimeError, ValueError) as exc:
            message = " ".join(str(exc).split())[:300]
            raise RequestError(f"structured output could not be compiled: {message}", "response_format") from None

    def matcher(self, spec: StructuredOutput) -> Any:
        return self.xgr.GrammarMatcher(self.compile(spec))

    def mask(self, logits: torch.Tensor, rows: list[tuple[int, Any]]) -> None:
        """Mask `logits[row]` in place to the tokens each (row, matcher) allows next."""
        if not rows:
            return
        n = logits.shape[0]
        if self._bitmask is None or self._bitmask.shape[0] < n:
            self._bitmask = self.xgr.allocate_token_bitmask(max(n, 8), self.vocab_size)
        bitmask = self._bitmask[:n]
        for row, matcher in rows:
            matcher.fill_next_token_bitmask(bitmask, row)
        indices = [row for row, _ in rows]
        mask = bitmask.to(logits.device, non_blocking=True)
        self.xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=self.vocab_size, indices=indices)
