"""Structured output masks: whatever the logits say, greedy decoding under the mask can only spell what the
grammar allows, and ends when it is complete."""

from __future__ import annotations

import json

import pytest
import torch

from omnistage.engine.ar.grammar import Grammars, StructuredOutput
from omnistage.errors import RequestError

pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def grammars(tiny_qwen2: str) -> tuple[Grammars, object]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_qwen2)
    return Grammars(tok, len(tok), (tok.eos_token_id,)), tok


def _decode_under(grammars: Grammars, tok, spec: StructuredOutput, seed: int, steps: int = 400) -> str:
    gen = torch.Generator().manual_seed(seed)
    matcher, ids = grammars.matcher(spec), []
    for _ in range(steps):
        logits = torch.randn(3, grammars.vocab_size, generator=gen)  # row 1 constrained, 0 and 2 not
        before = logits[[0, 2]].clone()
        grammars.mask(logits, [(1, matcher)])
        assert torch.equal(logits[[0, 2]], before)
        token = int(logits[1].argmax())
        assert matcher.accept_token(token)
        if matcher.is_terminated():
            break
        ids.append(token)
    assert matcher.is_terminated()
    return tok.decode(ids)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_json_schema_output_validates(grammars, seed: int) -> None:
    g, tok = grammars
    # strict=False: xgrammar's JSON strings admit raw control characters, which Python's strict parser refuses
    value = json.loads(_decode_under(g, tok, StructuredOutput.of({"json": SCHEMA}), seed), strict=False)
    assert set(value) == {"name", "age"} and isinstance(value["name"], str) and 0 <= value["age"] <= 99


def test_choice_and_regex(grammars) -> None:
    g, tok = grammars
    assert _decode_under(g, tok, StructuredOutput.of({"choice": ["yes", "no"]}), 0) in ("yes", "no")
    out = _decode_under(g, tok, StructuredOutput.of({"regex": "[0-9]{3}-[a-z]{2}"}), 0)
    assert len(out) == 6 and out[:3].isdigit() and out[3] == "-"
    text = _decode_under(g, tok, StructuredOutput.of({"json_object": True}), 3)
    assert isinstance(json.loads(text, strict=False), dict)


def test_bad_specs_are_request_errors(grammars) -> None:
    g, _ = grammars
    with pytest.raises(RequestError, match="exactly one"):
        StructuredOutput(json="{}", regex="a")
    with pytest.raises(RequestError, match="choice must be a non-empty list"):
        StructuredOutput.of({"choice": []})
    with pytest.raises(RequestError, match="could not be compiled"):
        g.compile(StructuredOutput.of({"regex": "(unclosed"}))
