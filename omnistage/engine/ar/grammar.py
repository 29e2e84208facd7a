"""Structured output: a request's grammar (JSON schema, any JSON object, regex, choice, EBNF/Lark) as a logits mask
applied inside the batched sampler, through xgrammar.

One `Grammars` per engine compiles each distinct grammar once (xgrammar caches compiled grammars too) for the
engine's tokenizer; each constrained sequence owns a `GrammarMatcher` that advances with every token it keeps.
A step fills one bitmask row per constrained sequence and masks only those rows' logits; unconstrained rows are
untouched. Constrained sequences are sampled on the host path (their next mask depends on the token just drawn).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

from omnistage.errors import RequestError


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must match; exactly one field is set (vLLM's StructuredOutputsParams)."""

    json: str | None = None  # a JSON schema, serialised
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None  # EBNF (GBNF) or Lark

    def __post_init__(self) -> None:
        set_fields = [self.json is not None, self.json_object, self.regex is not None, self.choice is not None,
                      self.grammar is not None]
        if sum(set_fields) != 1:
            raise RequestError("structured output takes exactly one of json, json_object, regex, choice, grammar",
                               "structured_outputs")

    @classmethod
    def of(cls, spec: Any, where: str = "structured_outputs") -> StructuredOutput | None:
        """From vLLM's wire shape `{"json": schema | str, "regex": ..., "choice": [...], "grammar": ...,
        "json_object": true}`; None for an empty or absent spec."""
        if spec is None or isinstance(spec, StructuredOutput):
            return spec
        if not isinstance(spec, dict):
            raise RequestError(f"{where} must be an object such as {{\"json\": <schema>}}", where)
        unknown = set(spec) - {"json", "json_object", "regex", "choice", "grammar"}
        if unknown:
            raise RequestError(f"{where}: unknown field(s) {sorted(unknown)}; use json, json_object, regex, choice "
                               "or grammar", where)
        given = {k: v for k, v in spec.items() if v is not None and v is not False}
        if not given:
            return None
        schema = given.get("json")
        if schema is not None and not isinstance(schema, str | dict | bool):
            raise RequestError(f"{where}.json must be a JSON schema (an object)", f"{where}.json")
        choice = given.get("choice")
        if choice is not None and (not isinstance(choice, list) or not choice
                                   or not all(isinstance(c, str) for c in choice)):
            raise RequestError(f"{where}.choice must be a non-empty list of strings", f"{where}.choice")
        for key in ("regex", "grammar"):
            if key in given and not isinstance(given[key], str):
                raise RequestError(f"{where}.{key} must be a string", f"{where}.{key}")
        if "json_object" in given and given["json_object"] is not True:
            raise RequestError(f"{where}.json_object must be true or false", f"{where}.json_object")
        return cls(json=schema if isinstance(schema, str) or schema is None else json.dumps(schema),
                   json_object=given.get("json_object", False), regex=given.get("regex"),
                   choice=tuple(choice) if choice is not None else None, grammar=given.get("grammar"))


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
