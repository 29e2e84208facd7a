"""One kernel for a decode step's whole draw over a small vocabulary (a codec head's few thousand ids).

`Sampler.on_device` in torch is ~45 small kernels per step: penalties, a full-vocabulary radix sort for top-k
and top-p, two softmaxes, argmaxes, the history's scatters. At batch 1 each costs a launch whatever it does, a
visible share of a small talker's step. Here one program per row holds the row's logits in registers and

- applies the repetition, frequency and presence penalties (reading the row's token history by slot) and bans,
- takes the greedy id, then divides by the temperature,
- finds top-k's set by bisection on the values' ordered bits for a cut with exactly k values above it (stopping
  there; with ties at the k-th value it ends on that value), and top-p's threshold (the smallest value whose
  strictly larger values hold less than top-p of the top-k mass) among top-k's survivors when they are few
  (packed through a small scratch buffer, each weighed against all the others), else by bisection; so
  nothing is sorted,
- keeps min-p's tokens (the most likely one survives every filter, as in torch's),
- draws by the same exponential race as torch (argmax of exp(x - max) / noise; the softmax's common divisor
  cannot change the argmax), with the noise torch drew for the step,
- and records the token in the row's history.

Where torch's draw sorts, this one compares with thresholds: tokens tied at a top-k or top-p boundary are all
kept (torch keeps those its sort happens to order first; bfloat16 logits tie often), and sums and exponentials
round differently, so a draw can also differ when a token's top-p mass sits within rounding of the threshold.
Tests pin it to torch's draw on float32 logits.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is needed only on CUDA
    triton = None

MAX_VOCAB = 16384  # a row in one program's registers; larger vocabularies (a text LM's head) keep torch's draw
ENABLED = True  # False: torch's draw everywhere (benchmarks compare with it)
CANDIDATES = 64  # top-k survivors up to this many: top-p's threshold among them, not by bisection


def supported(logits: torch.Tensor) -> bool:
    return (ENABLED and triton is not None and logits.is_cuda and logits.dim() == 2
            and logits.shape[1] <= MAX_VOCAB and logits.stride(1) == 1)


if triton is not None:

    @triton.jit
    def _ordered(x):
        """float32 -> int32 with the same order (negative floats' magnitude bits flipped)."""
        bits = x.to(tl.int32, bitcast=True)
        return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)

    @triton.jit
    def _top_k_cut(key, k):
        """A cut with exactly k of `key` at or above it (the top k, whatever the k-th largest is), found by
        bisection on the keys' bits; it stops as soon as it meets one, and otherwise (ties at the k-th largest)
        ends on the k-th largest itself after 32 steps. (A five-way search, four counts packed into one int64
        reduction a step, takes fewer steps, but each costs more than it saves.)"""
        lo, hi = tl.full((), -2147483648, tl.int64), tl.full((), 2147483648, tl.int64)
        count = k + 1
        while (hi - lo > 1) & (count != k):
            mid = lo + (hi - lo) // 2
            count = tl.sum((key >= mid.to(tl.int32)).to(tl.int32), 0)
            enough = count >= k
            lo, hi = tl.where(enough, mid, lo), tl.where(enough, hi, mid)
        return lo.to(tl.int32)

    # `features` bits: which of a batch's sampling features any row uses. Runtime flags, not constexprs, so one
    # compiled kernel serves every combination: a request with a new mix of settings does not stop the stage for
    # the seconds a compile takes.
    _REPETITION, _FREQUENCY, _PRESENCE, _BAN = tl.constexpr(1), tl.constexpr(2), tl.constexpr(4), tl.constexpr(8)
    _GREEDY, _RECORD, _FILTER, _SAMPLE = tl.constexpr(16), tl.constexpr(32), tl.constexpr(64), tl.constexpr(128)

    @triton.jit(do_not_specialize=["features"])
    def _draw_kernel(Logits, Noise, Out, Temperature, Greedy, TopK, TopP, MinP, Repetition, Frequency, Presence,
                     Ban, Seen, Counts, Slots, CandidateKeys, CandidateWeights, vocab, stride_logits, stride_noise,
                     stride_ban, stride_history, features, CANDIDATES: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        ids = tl.arange(0, BLOCK)
        valid = ids < vocab
        x = tl.load(Logits + row * stride_logits + ids, mask=valid, other=float("-inf"))
        history = tl.full((), 0, tl.int64)
        if (features & (_REPETITION | _FREQUENCY | _PRESENCE | _RECORD)) != 0:
            history = tl.load(Slots + row).to(tl.int64) * stride_history
        if (features & _REPETITION) != 0:
            seen = tl.load(Seen + history + ids, mask=valid, other=0) != 0
            penalty = tl.load(Repetition + row)
            x = tl.where(seen, tl.where(x > 0, x / penalty, x * penalty), x)
        if (features & (_FREQUENCY | _PRESENCE)) != 0:
            counts = tl.load(Counts + history + ids, mask=valid, other=0.0)
            if (features & _FREQUENCY) != 0:
                x = x - tl.load(Frequency + row) * counts
            if (features & _PRESENCE) != 0:
                x = x - tl.load(Presence + row) * (counts > 0).to(tl.float32)
        if (features & _BAN) != 0:
            banned = tl.load(Ban + row * stride_ban + ids, mask=valid, other=0) != 0
            x = tl.where(banned, float("-inf"), x)
        token = tl.argmax(x, 0, tie_break_left=True)
        if (features & _SAMPLE) != 0:
            x = x / tl.load(Temperature + row)
            top = tl.max(x, 0)
            keep = valid
            if (features & _FILTER) != 0:
                key = _ordered(x)
                k = tl.load(TopK + row).to(tl.int32)
                if k < vocab:  # the keys at or above the k-th largest
                    keep = keep & (key >= _top_k_cut(key, k))
                weight = tl.where(keep, tl.exp(x - top), 0.0)
                p = tl.load(TopP + row)
                if p < 1.0:  # the smallest key whose strictly larger keys hold less than p of the mass
                    mass = p * tl.sum(weight, 0)
                    survivors = tl.sum(keep.to(tl.int32), 0)
                    if survivors <= CANDIDATES:  # top-k's few: each survivor's heavier ones weighed directly
                        at = row * CANDIDATES + tl.cumsum(keep.to(tl.int32), 0) - 1  # packed, in vocabulary order
                        tl.store(CandidateKeys + at, key, mask=keep)
                        tl.store(CandidateWeights + at, weight, mask=keep)
                        tl.debug_barrier()  # the program's stores visible to all its threads
                        c = row * CANDIDATES + tl.arange(0, CANDIDATES)
                        c_ok = tl.arange(0, CANDIDATES) < survivors
                        c_key = tl.load(CandidateKeys + c, mask=c_ok, other=-2147483648)
                        c_weight = tl.load(CandidateWeights + c, mask=c_ok, other=0.0)
                        heavier = tl.sum(tl.where(c_key[None, :] > c_key[:, None], c_weight[None, :], 0.0), 1)
                        cut = tl.min(tl.where(c_ok & (heavier < mass), c_key, 2147483647), 0)
                    else:
                        lo, hi = tl.full((), -2147483649, tl.int64), tl.full((), 2147483647, tl.int64)
                        for _ in tl.static_range(32):
                            mid = lo + (hi - lo) // 2
                            below = tl.sum(tl.where(key > mid.to(tl.int32), weight, 0.0), 0) < mass
                            lo, hi = tl.where(below, lo, mid), tl.where(below, mid, hi)
                        cut = hi.to(tl.int32)
                    keep = keep & (key >= cut)
                # p / p_max = exp(x - max). The most likely token survives every filter (k >= 1, p > 0, min-p <= 1).
                keep = keep & (weight >= tl.load(MinP + row))
            score = tl.where(keep, tl.exp(x - top), -1.0)
            noise = tl.load(Noise + row * stride_noise + ids, mask=valid, other=1.0)
            sampled = tl.argmax(score / noise, 0, tie_break_left=True)
            greedy = tl.full((), False, tl.int1)
            if (features & _GREEDY) != 0:
                greedy = tl.load(Greedy + row) != 0
            token = tl.where(greedy, token, sampled)
        tl.store(Out + row, token.to(tl.int64))
        if (features & _RECORD) != 0:
            tl.store(Seen + history + token, tl.full((), 1, tl.int1))
            tl.atomic_add(Counts + history + token, 1.0)  # padded rows share one slot


_UNUSED: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _unused(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """One element of `dtype` on `device`: the pointer an unused feature's argument gets (never read)."""
    if (device, dtype) not in _UNUSED:
        _UNUSED[device, dtype] = torch.zeros(1, dtype=dtype, device=device)
    return _UNUSED[device, dtype]


def draw(logits: torch.Tensor, noise: torch.Tensor | None, temperature: torch.Tensor,
         greedy: torch.Tensor | None, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
         min_p: torch.Tensor | None, repetition: torch.Tensor | None, frequency: torch.Tensor | None,
         presence: torch.Tensor | None, ban: torch.Tensor | None, seen: torch.Tensor | None,
         counts: torch.Tensor | None, slots: torch.Tensor | None, record: bool, num_warps: int | None = None
         ) -> torch.Tensor:
    """Token ids [rows] for float32 logits [rows, vocab]. Columns are [rows, 1] float32 (None: no row uses the
    feature; `greedy` [rows] bool, None: no row is greedy, `noise` None: every row is). `seen` / `counts`: the
    token history's whole tables, [slots, vocab], read at `slots` [rows]; `record` marks each drawn token there.
    Top-k, top-p and min-p come together (all given or none). `num_warps`: the program's width (benchmarks)."""
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.long, device=logits.device)
    block = triton.next_power_of_2(vocab)
    history = seen if seen is not None else counts
    # which features any row uses, as the kernel's `features` bits (1, 2, 4, ... in this order)
    on = (repetition is not None, frequency is not None, presence is not None, ban is not None, greedy is not None,
          record, top_k is not None, noise is not None)
    features = sum(1 << bit for bit, used in enumerate(on) if used)
    floats, flags, longs = (_unused(logits.device, dtype) for dtype in (torch.float32, torch.bool, torch.long))

    def given(t: torch.Tensor | None, unused: torch.Tensor) -> torch.Tensor:
        return t if t is not None else unused  # an unused feature's pointer, of its dtype: one kernel signature

    # an unused table's row stride as the logits': Triton specialises on a stride's divisibility (kept: it lets
    # the row loads vectorise), so an unused one must not differ from a used one
    strides = [t.stride(0) if t is not None else logits.stride(0) for t in (logits, noise, ban, history)]
    filtered = top_p is not None  # top-p's scratch: the rows' survivors of top-k, packed
    keys = torch.empty(rows, CANDIDATES if filtered else 1, dtype=torch.int32, device=logits.device)
    weights = torch.empty(rows, CANDIDATES if filtered else 1, dtype=torch.float32, device=logits.device)
    _draw_kernel[(rows,)](
        logits, given(noise, floats), out, temperature, given(greedy, flags), given(top_k, floats),
        given(top_p, floats), given(min_p, floats), given(repetition, floats), given(frequency, floats),
        given(presence, floats), given(ban, flags), given(seen, flags), given(counts, floats), given(slots, longs),
        keys, weights, vocab, *strides, features,
        CANDIDATES=CANDIDATES, BLOCK=block, num_warps=num_warps or max(4, min(16, block // 1024)),
    )
    return out
