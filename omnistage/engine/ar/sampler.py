"""Batched sampling: penalties, temperature, top-k / top-p / min-p, per-request seeds, logprobs.

Every transform is vectorised over the batch; rows that do not use a feature get its neutral
value. Sampling uses the exponential-race form of a categorical draw (argmax p / E, E ~ Exp(1)),
so a seeded request draws its noise from its own generator and gets the same tokens whatever
else is in the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from omnistage.engine.transfer import to_device
from omnistage.engine.types import TokenLogprob
from omnistage.sampling_params import SamplingParams


@dataclass
class SampleRow:
    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    generator: torch.Generator | None
    banned_ids: tuple[int, ...]  # ids that may not be sampled (bad ids; EOS / stop ids before min_tokens)


def _padded(rows: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged id lists as a padded [rows, width] tensor and its validity mask (built in NumPy: filling
    from Python lists is several times faster there, and this runs every step)."""
    width = max(1, max(len(r) for r in rows))
    ids = np.zeros((len(rows), width), dtype=np.int64)
    valid = np.zeros((len(rows), width), dtype=bool)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
        valid[i, : len(r)] = True
    return to_device(torch.from_numpy(ids), device), to_device(torch.from_numpy(valid), device)


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    """One value per row as a [rows, 1] float32 column on `device`."""
    return to_device(torch.tensor(values, dtype=torch.float32), device)[:, None]


def _token_counts(rows: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    ids, valid = _padded(rows, device)
    counts = torch.zeros(len(rows), vocab, dtype=torch.float32, device=device)
    return counts.scatter_add_(1, ids, valid.float())


def apply_penalties(
    logits: torch.Tensor, rows: list[SampleRow], ban_mask: Callable[[tuple[int, ...]], torch.Tensor] | None = None
) -> torch.Tensor:
    """Repetition / frequency / presence penalties, then banned ids to -inf. `ban_mask` maps a row's banned
    ids to its [vocab] bool mask (a cache: the same few sets come back every step)."""
    device, vocab = logits.device, logits.shape[-1]

    if any(r.params.repetition_penalty != 1.0 for r in rows):
        seen = _token_counts([r.prompt_ids + r.output_ids for r in rows], vocab, device) > 0
        penalty = _column([r.params.repetition_penalty for r in rows], device).expand_as(logits)
        scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, scaled, logits)
    if any(r.params.frequency_penalty or r.params.presence_penalty for r in rows):
        counts = _token_counts([r.output_ids for r in rows], vocab, device)
        logits = logits - _column([r.params.frequency_penalty for r in rows], device) * counts
        logits = logits - _column([r.params.presence_penalty for r in rows], device) * (counts > 0).float()
    if any(r.banned_ids for r in rows):
        if ban_mask is not None:
            ban = torch.stack([ban_mask(tuple(r.banned_ids)) for r in rows])
        else:
            ids, valid = _padded([list(r.banned_ids) for r in rows], device)
            ban = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, ids, valid)
        logits = logits.masked_fill(ban, float("-inf"))
    return logits


def _filter(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p, applied on one descending sort."""
    device = logits.device
    logits = logits / _column([r.params.temperature for r in rows], device)
    if all(r.params.top_k <= 0 and r.params.top_p >= 1.0 and r.params.min_p <= 0.0 for r in rows):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=device)[None, :]
    top_k = _column([r.params.top_k if r.params.top_k > 0 else logits.shape[-1] for r in rows], device)
    drop = rank >= top_k
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= _column([r.params.top_p for r in rows], device)
    drop |= probs < _column([r.params.min_p for r in rows], device) * probs[:, :1]
    drop[:, 0] = False  # the most likely token always survives
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


class Sampler:
    max_cached_ban_masks = 256

    def __init__(self, seed: int = 0):
        self.generator: torch.Generator | None = None
        self.seed = seed
        self._ban_masks: dict[tuple[tuple[int, ...], int, torch.device], torch.Tensor] = {}

    def _ban_mask(self, banned: tuple[int, ...], vocab: int, device: torch.device) -> torch.Tensor:
        key = (banned, vocab, device)
        mask = self._ban_masks.get(key)
        if mask is None:
            if len(self._ban_masks) >= self.max_cached_ban_masks:
                self._ban_masks.clear()
            mask = torch.zeros(vocab, dtype=torch.bool)
            mask[list(banned)] = True
            mask = self._ban_masks[key] = mask.to(device)
        return mask

    def __call__(
        self, logits: torch.Tensor, rows: list[SampleRow], argmax: torch.Tensor | None = None
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        """`argmax`: the logits' argmax if already computed (inside a CUDA graph); used as is
        when every row is plain greedy."""
        if argmax is not None and all(r.params.plain_greedy and not r.banned_ids for r in rows):
            return argmax.tolist(), [None] * len(rows)
        logits = logits.float()
        raw_logprobs = logits.log_softmax(dim=-1) if any(r.params.logprobs is not None for r in rows) else None
        logits = apply_penalties(logits, rows, lambda banned: self._ban_mask(banned, logits.shape[-1], logits.device))
        greedy_ids = logits.argmax(dim=-1)
        if all(r.params.greedy for r in rows):
            chosen = greedy_ids
        else:
            temps_safe = [r if not r.params.greedy else _as_unit_temperature(r) for r in rows]
            probs = _filter(logits, temps_safe).softmax(dim=-1)
            noise = self._exponential_noise(probs, rows)
            sampled = (probs / noise).argmax(dim=-1)
            is_greedy = to_device(torch.tensor([r.params.greedy for r in rows]), logits.device)
            chosen = torch.where(is_greedy, greedy_ids, sampled)
        token_ids = chosen.tolist()
        return token_ids, self._logprobs(raw_logprobs, token_ids, rows)

    def _exponential_noise(self, probs: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        if self.generator is None or self.generator.device != probs.device:
            self.generator = torch.Generator(device=probs.device).manual_seed(self.seed)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, row in enumerate(rows):
            if row.generator is not None:
                noise[i].exponential_(generator=row.generator)
        return noise

    @staticmethod
    def _logprobs(
        raw: torch.Tensor | None, token_ids: list[int], rows: list[SampleRow]
    ) -> list[TokenLogprob | None]:
        out: list[TokenLogprob | None] = [None] * len(rows)
        if raw is None:
            return out
        for i, row in enumerate(rows):
            n = row.params.logprobs
            if n is None:
                continue
            top_values, top_ids = raw[i].topk(n) if n else (raw[i][:0], raw[i][:0].long())
            out[i] = TokenLogprob(
                token_id=token_ids[i],
                logprob=raw[i, token_ids[i]].item(),
                top=list(zip(top_ids.tolist(), top_values.tolist(), strict=True)),
            )
        return out


def _as_unit_temperature(row: SampleRow) -> SampleRow:
    """Greedy rows ride through the sampling math with temperature 1 (their draw is discarded)."""
    return SampleRow(row.params.with_overrides(temperature=1.0), [], [], None, ())
