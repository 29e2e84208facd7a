"""Turns sampled ids into text deltas, one token at a time, and finds stop strings.

Decoding a growing window (a few tokens of left context + the unread tail) keeps spacing right
for tokenizers that merge across token boundaries, and waits while a multi-byte character is
incomplete (the decoder yields U+FFFD); at the finish what is still held is flushed, replacement
characters and all, so the whole text equals the tokenizer's decode of the output ids. Text that
could be the start of a stop string is held back until it is known not to be one, so a stop string
never reaches a streaming client.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_CONTEXT_TOKENS = 5


def backend_decode(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str] | None:
    """The Rust tokenizer's own decode, where transformers' fast tokenizer would only forward to it: its
    `decode` first runs each id through generic type conversion, which costs more than the decoding (this runs
    twice per token per request on the engine's thread). None for any other tokenizer."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend as Fast
    except ImportError:  # transformers 4
        from transformers import PreTrainedTokenizerFast as Fast
    backend = getattr(tokenizer, "_tokenizer", None)
    kind = type(tokenizer)
    if (backend is None or not isinstance(tokenizer, Fast) or kind.decode is not Fast.decode
            or kind._decode is not Fast._decode or getattr(tokenizer, "clean_up_tokenization_spaces", True)):
        return None
    return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: list[int],
        skip_special_tokens: bool = True,
        stop: list[str] | tuple[str, ...] = (),
        include_stop: bool = False,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = list(stop)
        self.include_stop = include_stop
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        self.emitted = 0
        self.stopped = False
        self._backend_decode = backend_decode(tokenizer, skip_special_tokens)

    def _decode(self, ids: list[int]) -> str:
        if self._backend_decode is not None:
            return self._backend_decode(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> bool:
        """Append one token; True if the text now contains a stop string (text is cut there)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return False
        search_from = max(self.emitted, len(self.text) - self.holdback)
        self.text += full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._cut_at_stop(search_from)

    def _cut_at_stop(self, search_from: int) -> bool:
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, search_from)) != -1]
        if not hits:
            return False
        index, stop = min(hits)
        self.text = self.text[: index + (len(stop) if self.include_stop else 0)]
        self.stopped = True
        return True

    def _flush(self) -> None:
        """The finish: bytes of an unfinished character held back while running come out as decode spells
        them (U+FFFD), so the text equals `tokenizer.decode(output_ids)`."""
        if self.stopped or self.read_offset == len(self.ids):
            return
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        search_from = max(self.emitted, len(self.text) - self.holdback)
        if len(full) > len(prefix):
            self.text += full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self._cut_at_stop(search_from)

    def take(self, final: bool) -> str:
        """Text not yet handed out; while running, keeps back what may begin a stop string and the bytes of an
        unfinished character; `final` hands out everything."""
        if final:
            self._flush()
        end = len(self.text) if final or not self.stop else max(self.emitted, len(self.text) - self.holdback)
        delta, self.emitted = self.text[self.emitted : end], end
        return delta
