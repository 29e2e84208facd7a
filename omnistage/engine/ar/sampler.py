"""Batched sampling: penalties, temperature, top-k / top-p / min-p, per-request seeds, logprobs.

Every transform is vectorised over the batch; rows that do not use a feature get its neutral
value. Sampling uses the exponential-race form of a categorical draw (argmax p / E, E ~ Exp(1)),
so a seeded request draws its noise from its own generator and gets the same tokens whatever
else is in the batch. Penalties see earlier tokens either through the rows' own lists (a step the host
samples) or through a device-side TokenHistory (steps kept in flight, which never wait for the host).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from omnistage.engine.transfer import host_list, to_device
from omnistage.kernels import draw as fused_draw
from omnistage.sampling_params import SamplingParams
from omnistage.types import TokenLogprob

logger = logging.getLogger(__name__)


# A row's logprob when computing it raised: its token was drawn (the generators moved on), so the row's request
# fails alone instead of the batch being drawn again.
ROW_FAILED = TokenLogprob(token_id=-1, logprob=float("nan"))


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


@dataclass
class SamplingColumns:
    """A batch's sampling parameters as [rows, 1] device columns (None: no row uses that feature), built
    once per batch; a decode batch that keeps its members reuses them step after step."""

    temperature: torch.Tensor  # greedy rows ride along at 1 (their draw is discarded)
    greedy: torch.Tensor | None  # [rows] bool; None when no row is greedy
    all_greedy: bool
    top_k: torch.Tensor | None
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None
    repetition: torch.Tensor | None
    frequency: torch.Tensor | None
    presence: torch.Tensor | None
    ban: torch.Tensor | None  # [rows, vocab] bool
    generators: tuple[torch.Generator | None, ...]  # a seeded row's own noise source

    @classmethod
    def build(cls, rows: list[SampleRow], vocab: int, device: torch.device,
              ban_mask: Callable[[tuple[int, ...]], torch.Tensor] | None = None) -> SamplingColumns:
        params = [r.params for r in rows]

        def column(values: list[float], used: bool = True) -> torch.Tensor | None:
            return _column(values, device) if used else None

        greedy = [p.greedy for p in params]
        filters = any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params)
        ban = None
        if any(r.banned_ids for r in rows):
            if ban_mask is not None:
                ban = torch.stack([ban_mask(tuple(r.banned_ids)) for r in rows])
            else:
                ids, valid = _padded([list(r.banned_ids) for r in rows], device)
                ban = torch.zeros(len(rows), vocab, dtype=torch.bool, device=device).scatter_(1, ids, valid)
        return cls(
            temperature=_column([1.0 if p.greedy else p.temperature for p in params], device),
            greedy=to_device(torch.tensor(greedy), device) if any(greedy) else None,
            all_greedy=all(greedy),
            top_k=column([p.top_k if p.top_k > 0 else vocab for p in params], filters),
            top_p=column([p.top_p for p in params], filters),
            min_p=column([p.min_p for p in params], filters),
            repetition=column([p.repetition_penalty for p in params],
                              any(p.repetition_penalty != 1.0 for p in params)),
            frequency=column([p.frequency_penalty for p in params], any(p.frequency_penalty for p in params)),
            presence=column([p.presence_penalty for p in params], any(p.presence_penalty for p in params)),
            ban=ban,
            generators=tuple(r.generator for r in rows),
        )

    @property
    def needs_history(self) -> bool:
        """Whether penalties need the rows' earlier tokens."""
        return self.repetition is not None or self.frequency is not None or self.presence is not None


def penalize(logits: torch.Tensor, cols: SamplingColumns, seen: torch.Tensor | None, counts: torch.Tensor | None
             ) -> torch.Tensor:
    """Repetition (over prompt and output: `seen`, [rows, vocab] bool), frequency and presence penalties (over
    the output: `counts`, [rows, vocab] float), then banned ids to -inf."""
    if cols.repetition is not None:
        scaled = torch.where(logits > 0, logits / cols.repetition, logits * cols.repetition)
        logits = torch.where(seen, scaled, logits)
    if cols.frequency is not None:
        logits = logits - cols.frequency * counts
    if cols.presence is not None:
        logits = logits - cols.presence * (counts > 0).float()
    if cols.ban is not None:
        logits = logits.masked_fill(cols.ban, float("-inf"))
    return logits


def choose(logits: torch.Tensor, cols: SamplingColumns, noise: Callable[[torch.Tensor], torch.Tensor]
           ) -> torch.Tensor:
    """Penalised logits -> token ids on the device: greedy rows their argmax, the others an exponential-race
    draw (`noise(probs)`: Exp(1) noise shaped like probs) from the filtered distribution."""
    greedy_ids = logits.argmax(dim=-1)
    if cols.all_greedy:
        return greedy_ids
    probs = _filter(logits, cols).softmax(dim=-1)
    sampled = (probs / noise(probs)).argmax(dim=-1)
    return sampled if cols.greedy is None else torch.where(cols.greedy, greedy_ids, sampled)


def apply_penalties(
    logits: torch.Tensor, rows: list[SampleRow], ban_mask: Callable[[tuple[int, ...]], torch.Tensor] | None = None
) -> torch.Tensor:
    """Penalties and bans from the rows' own token lists. `ban_mask` maps a row's banned ids to its [vocab]
    bool mask (a cache: the same few sets come back every step)."""
    cols = SamplingColumns.build(rows, logits.shape[-1], logits.device, ban_mask)
    return penalize(logits, cols, *history_from_lists(rows, cols, logits.shape[-1], logits.device))


def history_from_lists(rows: list[SampleRow], cols: SamplingColumns, vocab: int, device: torch.device
                       ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(seen, counts) built from the rows' prompt and output lists, as far as the penalties need them."""
    seen = counts = None
    if cols.repetition is not None:
        seen = _token_counts([r.prompt_ids + r.output_ids for r in rows], vocab, device) > 0
    if cols.frequency is not None or cols.presence is not None:
        counts = _token_counts([r.output_ids for r in rows], vocab, device)
    return seen, counts


def _filter(logits: torch.Tensor, cols: SamplingColumns) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p, applied on one descending sort."""
    logits = logits / cols.temperature
    if cols.top_k is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    drop = rank >= cols.top_k
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= (mass_before >= cols.top_p) & (cols.top_p < 1.0)  # top_p 1 keeps all, even past float rounding
    drop |= probs < cols.min_p * probs[:, :1]
    drop[:, 0] = False  # the most likely token always survives
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


class TokenHistory:
    """Each decoding sequence's earlier tokens as device rows, for penalties without host lists: `seen`
    (prompt and output ids, for the repetition penalty) and `counts` (output ids, for frequency and
    presence). A sequence holds a slot while it decodes; the sampled tokens are recorded on the device as they
    are drawn, so a step launched before the host read the last one still sees it. Allocated on the first
    penalised request: slots x vocab x 5 bytes (64 x 152k: 49 MB)."""

    def __init__(self, num_slots: int, vocab: int, device: torch.device):
        self.seen = torch.zeros(num_slots, vocab, dtype=torch.bool, device=device)
        self.counts = torch.zeros(num_slots, vocab, dtype=torch.float32, device=device)
        self.free = list(range(num_slots))

    def load(self, slot: int, prompt_ids: list[int], output_ids: list[int]) -> None:
        device, vocab = self.seen.device, self.seen.shape[1]
        self.seen[slot] = _token_counts([prompt_ids + output_ids], vocab, device)[0] > 0
        self.counts[slot] = _token_counts([output_ids], vocab, device)[0]

    def rows(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.seen.index_select(0, slots), self.counts.index_select(0, slots)

    def record(self, slots: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Mark `token_ids` seen and count them in their rows. Flat scatters, not advanced-index puts: an
        accumulating `index_put_` checks its indices' range on the host (a device sync) in some torch builds."""
        flat = slots * self.seen.shape[1] + token_ids
        self.seen.view(-1).scatter_(0, flat, True)
        self.counts.view(-1).scatter_add_(0, flat, torch.ones_like(flat, dtype=self.counts.dtype))


class StaticDraw:
    """The device-side draw a captured decode-burst graph runs: the sampling columns and history slots of up to
    `rows` sequences in fixed buffers, loaded before each replay. Every feature is on; a row that does not use
    one holds its neutral value (top-k = vocab, top-p 1, penalties 1 / 0, nothing banned), which draws exactly
    what the columns without that feature draw. Padded rows record into the history's spare `pad_slot`."""

    def __init__(self, sampler: Sampler, history: TokenHistory, rows: int, vocab: int, pad_slot: int):
        device = history.seen.device
        self.sampler, self.history, self.vocab, self.pad_slot = sampler, history, vocab, pad_slot

        def column(value: float) -> torch.Tensor:
            return torch.full((rows, 1), value, dtype=torch.float32, device=device)

        self.cols = SamplingColumns(
            temperature=column(1.0), greedy=torch.zeros(rows, dtype=torch.bool, device=device), all_greedy=False,
            top_k=column(vocab), top_p=column(1.0), min_p=column(0.0), repetition=column(1.0),
            frequency=column(0.0), presence=column(0.0),
            ban=torch.zeros(rows, vocab, dtype=torch.bool, device=device), generators=(),
        )
        self.slots = torch.full((rows,), pad_slot, dtype=torch.long, device=device)
        self._loaded: tuple[SamplingColumns, torch.Tensor | None, int] | None = None
        self._neutral = {"greedy": False, "top_k": vocab, "top_p": 1.0, "min_p": 0.0, "repetition": 1.0,
                         "frequency": 0.0, "presence": 0.0, "ban": False}

    def load(self, cols: SamplingColumns, slots: torch.Tensor | None, n: int) -> None:
        """A batch's columns (and history slots; None: it needs no history) into rows 0..n-1 (device copies,
        skipped when the same batch comes back)."""
        if self._loaded is not None and self._loaded[0] is cols and self._loaded[1] is slots and self._loaded[2] == n:
            return
        self.cols.temperature[:n].copy_(cols.temperature)
        for name, neutral in self._neutral.items():
            source, target = getattr(cols, name), getattr(self.cols, name)[:n]
            target.copy_(source) if source is not None else target.fill_(neutral)
        self.slots[:n].copy_(slots) if slots is not None else self.slots[:n].fill_(self.pad_slot)
        self.slots[n:].fill_(self.pad_slot)  # padded rows never write a real sequence's history
        self._loaded = (cols, slots, n)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [size, vocab] -> ids [size], recorded into the history (the same arithmetic as `on_device`)."""
        size = logits.shape[0]
        c = self.cols
        cols = SamplingColumns(c.temperature[:size], c.greedy[:size], False, c.top_k[:size], c.top_p[:size],
                               c.min_p[:size], c.repetition[:size], c.frequency[:size], c.presence[:size],
                               c.ban[:size], ())
        return self.sampler.draw(logits, cols, self.history, self.slots[:size])


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
            return host_list(argmax), [None] * len(rows)
        logits = logits.float()
        raw_logprobs = logits.log_softmax(dim=-1) if any(r.params.logprobs is not None for r in rows) else None
        cols = self.columns(rows, logits.shape[-1], logits.device)
        logits = penalize(logits, cols, *history_from_lists(rows, cols, logits.shape[-1], logits.device))
        token_ids = host_list(choose(logits, cols, lambda probs: self._exponential_noise(probs, cols.generators)))
        return token_ids, self._logprobs(raw_logprobs, token_ids, rows)

    @staticmethod
    def warm_up(vocab: int, device: torch.device) -> None:
        """Compile the fused draw at start-up, not in a request: one kernel serves every mix of settings, and
        compiling it inside the first speech request would stop the talker for seconds."""
        logits = torch.zeros(1, vocab, device=device)
        if fused_draw.supported(logits):
            fused_draw.draw(logits, None, torch.ones(1, 1, device=device), *[None] * 11, record=False)

    def columns(self, rows: list[SampleRow], vocab: int, device: torch.device) -> SamplingColumns:
        return SamplingColumns.build(rows, vocab, device, lambda banned: self._ban_mask(banned, vocab, device))

    def on_device(self, logits: torch.Tensor, cols: SamplingColumns, history: tuple[torch.Tensor, torch.Tensor]
                  | None) -> torch.Tensor:
        """Token ids for a batch, left on the device (no host sync): what an overlapped decode step feeds to the
        next one. The same arithmetic and noise as `__call__`."""
        seen, counts = history if history is not None else (None, None)
        logits = penalize(logits.float(), cols, seen, counts)
        return choose(logits, cols, lambda probs: self._exponential_noise(probs, cols.generators))

    def draw(self, logits: torch.Tensor, cols: SamplingColumns, history: TokenHistory | None,
             slots: torch.Tensor) -> torch.Tensor:
        """`on_device`, and the tokens recorded into `history` at `slots` when penalties need it. A small
        vocabulary on CUDA takes one kernel for all of it (`omnistage.kernels.draw`); the noise is drawn as
        `on_device` draws it, so both consume the generators alike."""
        logits = logits.float()
        if fused_draw.supported(logits):
            noise = None if cols.all_greedy else self._exponential_noise(logits, cols.generators)
            seen, counts = (history.seen, history.counts) if cols.needs_history else (None, None)
            return fused_draw.draw(logits, noise, cols.temperature, cols.greedy, cols.top_k, cols.top_p, cols.min_p,
                                   cols.repetition, cols.frequency, cols.presence, cols.ban, seen, counts, slots,
                                   record=cols.needs_history)
        tokens = self.on_device(logits, cols, history.rows(slots) if cols.needs_history else None)
        if cols.needs_history:
            history.record(slots, tokens)
        return tokens

    def device_generator(self, device: torch.device) -> torch.Generator:
        """The noise source of rows without their own seed (one per sampler, seeded once)."""
        if self.generator is None or self.generator.device != device:
            self.generator = torch.Generator(device=device).manual_seed(self.seed)
        return self.generator

    def _exponential_noise(self, probs: torch.Tensor, generators: tuple[torch.Generator | None, ...]
                           ) -> torch.Tensor:
        noise = torch.empty_like(probs).exponential_(generator=self.device_generator(probs.device))
        for i, generator in enumerate(generators):
            if generator is not None:
                noise[i].exponential_(generator=generator)
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
            try:
                top_values, top_ids = raw[i].topk(n) if n else (raw[i][:0], raw[i][:0].long())
                out[i] = TokenLogprob(
                    token_id=token_ids[i],
                    logprob=raw[i, token_ids[i]].item(),
                    top=list(zip(top_ids.tolist(), top_values.tolist(), strict=True)),
                )
            except Exception:
                logger.exception("the logprobs of a row failed")
                out[i] = ROW_FAILED
        return out
