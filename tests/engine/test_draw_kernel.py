"""The fused draw kernel (omnistage/kernels/draw.py) draws what torch's draw (`Sampler.on_device`) draws, from the
same noise, and records what `TokenHistory.record` records (on CPU through Triton's interpreter)."""

import pytest
import torch

from omnistage.engine.ar.sampler import Sampler, SampleRow, TokenHistory
from omnistage.kernels import draw as fused_draw
from omnistage.sampling_params import SamplingParams

pytest.importorskip("triton")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def kernel_everywhere(monkeypatch):
    """The kernel whatever the device (CPU: the interpreter)."""
    monkeypatch.setattr(fused_draw, "supported", lambda logits: logits.dim() == 2)


PARAMS = [
    SamplingParams(temperature=0.9, top_k=40, top_p=0.8, repetition_penalty=1.05),  # the Qwen2.5-Omni talker's
    SamplingParams(temperature=0.7, top_p=0.5),  # top-p over the whole vocabulary
    SamplingParams(temperature=1.3, top_k=3),
    SamplingParams(temperature=1.0, min_p=0.2, frequency_penalty=0.4, presence_penalty=0.3),
    SamplingParams(temperature=0.0, repetition_penalty=1.3),  # greedy beside sampled rows
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=0.6, top_k=200, top_p=0.95, min_p=0.05, repetition_penalty=0.8),
    SamplingParams(temperature=1.0),
]


def _rows(params: list[SamplingParams], history: list[tuple[list[int], list[int]]]) -> list[SampleRow]:
    return [SampleRow(p, prompt, out, None, (7, 8) if i % 3 == 0 else ()) for i, (p, (prompt, out))
            in enumerate(zip(params, history, strict=True))]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiles only on CUDA (on CPU the interpreter runs it)")
def test_one_compiled_kernel_serves_every_mix_of_settings(monkeypatch) -> None:
    """After the start-up warm-up, no batch's mix of sampling settings compiles the draw again: each such compile
    stopped the talker for ~3 s, in the first speech request and in the first with a new penalty (run 38a)."""
    from triton.runtime import driver

    vocab = 1000
    Sampler.warm_up(vocab, DEVICE)
    loads, utils = [], driver.active.utils
    load = utils.load_binary
    monkeypatch.setattr(utils, "load_binary", lambda name, *args: (loads.append(name), load(name, *args))[1])
    gen = torch.Generator().manual_seed(0)
    history_lists = [([1, 2, 3], torch.randint(0, vocab, (i,), generator=gen).tolist()) for i in range(len(PARAMS))]
    mixes = [[p] for p in PARAMS] + [PARAMS, PARAMS[3:5], [SamplingParams(temperature=0.0)]]
    for mix in mixes:
        history = TokenHistory(len(mix) + 1, vocab, DEVICE)
        slots = torch.arange(len(mix), device=DEVICE)
        sampler = Sampler(seed=1)
        cols = sampler.columns(_rows(mix, history_lists[: len(mix)]), vocab, DEVICE)
        sampler.draw(torch.randn(len(mix), vocab, generator=gen).to(DEVICE), cols, history, slots)
    torch.cuda.synchronize()
    assert not loads, f"compiled or loaded again: {loads}"


@pytest.mark.parametrize("vocab", [300, 1000])
def test_kernel_draws_what_torch_draws(kernel_everywhere, vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    history_lists = [(torch.randint(0, vocab, (5,), generator=gen).tolist(),
                      torch.randint(0, vocab, (i,), generator=gen).tolist()) for i in range(len(PARAMS))]
    slots = torch.tensor([5, 0, 3, 7, 1, 2, 6, 4], device=DEVICE)
    drawn = {}
    for path in ("torch", "kernel"):
        history = TokenHistory(9, vocab, DEVICE)
        for slot, (prompt, out) in zip(slots.tolist(), history_lists, strict=True):
            history.load(slot, prompt, out)
        sampler = Sampler(seed=3)
        cols = sampler.columns(_rows(PARAMS, history_lists), vocab, DEVICE)
        tokens = []
        for step in range(6):  # draws feed the history the next step reads
            logits = 2.5 * torch.randn(len(PARAMS), vocab, generator=torch.Generator().manual_seed(step)).to(DEVICE)
            if path == "torch":
                seen_counts = history.rows(slots)
                got = sampler.on_device(logits, cols, seen_counts)
                history.record(slots, got)
            else:
                got = sampler.draw(logits, cols, history, slots)
            tokens.append(got.tolist())
        drawn[path] = (tokens, history.seen.clone(), history.counts.clone())
    assert drawn["kernel"][0] == drawn["torch"][0]
    assert torch.equal(drawn["kernel"][1], drawn["torch"][1])
    assert torch.equal(drawn["kernel"][2], drawn["torch"][2])


def test_kernel_keeps_exactly_top_k_and_the_top_p_set(kernel_everywhere) -> None:
    """With distinct logits, top-k keeps the k largest, top-p the shortest prefix of the sorted distribution
    holding p, and no draw falls outside them (many noise draws per row)."""
    vocab, draws = 64, 400
    logits = torch.linspace(-3, 3, vocab)[torch.randperm(vocab, generator=torch.Generator().manual_seed(0))]
    logits = logits.to(DEVICE).expand(draws, vocab).contiguous()
    probs = logits[0].softmax(-1)
    order = probs.argsort(descending=True)
    mass_before = probs[order].cumsum(0) - probs[order]
    for top_k, top_p, allowed in ((5, 1.0, set(order[:5].tolist())),
                                  (vocab, 0.6, set(order[mass_before < 0.6].tolist()))):
        col = torch.full((draws, 1), 1.0, device=DEVICE)
        noise = torch.empty(draws, vocab, device=DEVICE).exponential_(generator=torch.Generator(DEVICE).manual_seed(1))
        got = fused_draw.draw(logits, noise, col, None, col * top_k, col * top_p, col * 0.0, None, None, None, None,
                              None, None, None, record=False)
        assert set(got.tolist()) == allowed  # each kept token drawn at least once in 400 draws, no other


def test_ties_at_the_top_k_boundary_are_kept_and_top_p_applies_to_top_k_mass(kernel_everywhere) -> None:
    """The 5th and 6th largest logits tie: top-k 5 keeps both (as many bfloat16 logits tie); top-p after top-k
    keeps the shortest prefix holding p of the top-k survivors' mass (and a token tied with its last)."""
    vocab, draws = 64, 400
    logits = torch.linspace(-3, 3, vocab)[torch.randperm(vocab, generator=torch.Generator().manual_seed(3))]
    order = logits.argsort(descending=True)
    logits[order[5]] = logits[order[4]]
    logits = logits.to(DEVICE).expand(draws, vocab).contiguous()
    top10 = logits[0, order[:10]].softmax(-1)  # already in descending order
    prefix = order[:10][(top10.cumsum(0) - top10).cpu() < 0.6]
    prefix = order[:10][logits[0, order[:10]].cpu() >= logits[0, prefix].min().cpu()]  # a tie at its end too
    for top_k, top_p, allowed in ((5, 1.0, set(order[:6].tolist())), (10, 0.6, set(prefix.tolist()))):
        col = torch.full((draws, 1), 1.0, device=DEVICE)
        noise = torch.empty(draws, vocab, device=DEVICE).exponential_(generator=torch.Generator(DEVICE).manual_seed(4))
        got = fused_draw.draw(logits, noise, col, None, col * top_k, col * top_p, col * 0.0, None, None, None, None,
                              None, None, None, record=False)
        assert set(got.tolist()) == allowed


def test_greedy_rows_take_the_argmax_of_the_penalised_logits(kernel_everywhere) -> None:
    vocab = 100
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    logits[0, 10], logits[0, 11] = 9.0, 8.0  # 10 repeated: penalised below 11
    history = TokenHistory(2, vocab, DEVICE)
    history.load(0, [10], [])
    sampler = Sampler()
    rows = [SampleRow(SamplingParams(temperature=0.0, repetition_penalty=2.0), [10], [], None, ()),
            SampleRow(SamplingParams(temperature=0.0), [], [], None, ())]
    got = sampler.draw(logits, sampler.columns(rows, vocab, DEVICE), history, torch.tensor([0, 1], device=DEVICE))
    assert got.tolist() == [11, int(logits[1].argmax())]
    assert bool(history.seen[0, 11]) and history.counts[0, 11].item() == 1.0  # recorded


def test_an_engine_decodes_the_same_tokens_with_the_kernel(tiny_qwen2: str, monkeypatch) -> None:
    """Sampled decoding with steps in flight (the device draw: penalties from the token history, filters, bans,
    per-request seeds) gives the same tokens through the kernel as through torch's ops."""
    from omnistage import Omni

    sampled = SamplingParams(max_tokens=16, temperature=0.9, top_k=40, top_p=0.8, repetition_penalty=1.3,
                             frequency_penalty=0.2, presence_penalty=0.1, bad_token_ids=[5, 6, 7], ignore_eos=True)
    params = [sampled.with_overrides(seed=11), sampled.with_overrides(temperature=0.0, top_k=0, seed=12),
              sampled.with_overrides(top_p=0.3, seed=13)]
    prompts = ["Once upon a time", "The weather today", "Numbers: 1, 2, 3"]
    # float32: a bfloat16 model's logits tie often, and at a top-k / top-p boundary the kernel keeps every tied
    # token where torch's sort keeps those it happens to order first
    deploy = {"worker_backend": "inline",  # the patched choice holds in this process only
              "stages": {"lm": {"max_model_len": 128, "dtype": "float32", "advanced": {
                                "overlap_decode": True, "overlap_sampled": True}}}}
    runs, calls = {}, []
    kernel = fused_draw.draw
    monkeypatch.setattr(fused_draw, "draw", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    for use_kernel in (False, True):
        monkeypatch.setattr(fused_draw, "supported", lambda logits, on=use_kernel: on)
        with Omni(tiny_qwen2, deploy) as omni:
            runs[use_kernel] = [o.token_ids for o in omni.generate(prompts, params)]
        assert bool(calls) == use_kernel
    assert runs[True] == runs[False]


@pytest.mark.parametrize("trial", range(8))
def test_kernel_matches_torch_on_random_settings(kernel_everywhere, trial: int) -> None:
    """Random vocabularies and settings per row (filters on or off, top-k past the vocabulary, greedy rows, half
    the vocabulary banned as the talker bans its undecodable ids): the same tokens as torch's draw."""
    gen = torch.Generator().manual_seed(trial)
    vocab, rows = int(torch.randint(50, 3000, (1,), generator=gen)), 4
    params = []
    for _ in range(rows):
        r = torch.rand(6, generator=gen).tolist()
        params.append(SamplingParams(
            temperature=0.0 if r[0] < 0.15 else 0.3 + r[0], top_k=int(r[1] * vocab * 1.2) if r[1] < 0.8 else 0,
            top_p=1.0 if r[2] < 0.3 else max(0.05, r[2]), min_p=0.0 if r[3] < 0.5 else 0.3 * r[3],
            repetition_penalty=1.0 + r[4], frequency_penalty=0.5 * r[5]))
    banned = tuple(range(vocab // 2, vocab)) if trial % 2 else (1, 2)
    lists = [(torch.randint(0, vocab, (5,), generator=gen).tolist(),
              torch.randint(0, vocab, (3,), generator=gen).tolist()) for _ in range(rows)]
    sample_rows = [SampleRow(p, prompt, out, None, banned) for p, (prompt, out) in zip(params, lists, strict=True)]
    logits, slots = (3 * torch.randn(rows, vocab, generator=gen)).to(DEVICE), torch.arange(rows, device=DEVICE)
    drawn = {}
    for path in ("torch", "kernel"):
        history = TokenHistory(rows, vocab, DEVICE)
        for slot, (prompt, out) in enumerate(lists):
            history.load(slot, prompt, out)
        sampler = Sampler(seed=trial)
        cols = sampler.columns(sample_rows, vocab, DEVICE)
        if path == "torch":
            drawn[path] = sampler.on_device(logits, cols, history.rows(slots)).tolist()
        else:
            drawn[path] = sampler.draw(logits, cols, history, slots).tolist()
    assert drawn["kernel"] == drawn["torch"]


if fused_draw.triton is not None:
    import triton
    import triton.language as tl

    @triton.jit
    def _kept_by_top_k_kernel(X, K, Kept, vocab, stride, BLOCK: tl.constexpr):
        """What the draw keeps for top-k alone: each row's keys at or above `_top_k_cut` (padding as the draw
        loads it, -inf)."""
        row = tl.program_id(0)
        ids = tl.arange(0, BLOCK)
        x = tl.load(X + row * stride + ids, mask=ids < vocab, other=float("-inf"))
        key = fused_draw._ordered(x)
        cut = fused_draw._top_k_cut(key, tl.load(K + row).to(tl.int32))
        tl.store(Kept + row * stride + ids, (key >= cut).to(tl.int8), mask=ids < vocab)


def test_top_k_cut_keeps_every_value_at_or_above_the_kth_largest() -> None:
    """The top-k cut keeps exactly the values at or above the k-th largest: the top k, and every
    value tied with the k-th (ties from bfloat16 rounding, a constant row, -inf bans, negative values, k of 1 and
    of the vocabulary less one, a vocabulary that is not a power of two)."""
    gen = torch.Generator().manual_seed(0)
    vocab, one = 1000, 1065353216  # 1.0's bits
    rows = [3 * torch.randn(vocab, generator=gen),
            (3 * torch.randn(vocab, generator=gen)).bfloat16().float(),  # many ties
            torch.full((vocab,), 0.25),
            -torch.rand(vocab, generator=gen) - 1e-3,  # all negative
            torch.where(torch.rand(vocab, generator=gen) < 0.97, float("-inf"), torch.randn(vocab, generator=gen)),
            torch.randint(-3, 3, (vocab,), generator=gen).float(),  # six distinct values
            torch.linspace(-1e-30, 1e-30, vocab),  # tiny and subnormal values
            # neighbouring floats from 1.0 up (keys one apart), shuffled
            (torch.arange(vocab, dtype=torch.int32) + one).view(torch.float32)[torch.randperm(vocab, generator=gen)],
            # each of those twice: at an odd k the k-th largest ties and the next smaller value is one key below
            (torch.arange(vocab, dtype=torch.int32) // 2 + one).view(torch.float32)]
    cases = [(row, k) for k in (1, 2, 7, 40, 333, vocab - 1) for row in rows]
    cases += [(rows[-1], k) for k in range(1, vocab, 14)]  # the pairs row at odd k: a tie at each
    x = torch.stack([row for row, _ in cases]).to(DEVICE)
    ks = torch.tensor([k for _, k in cases], dtype=torch.int32, device=DEVICE)
    kept = torch.zeros_like(x, dtype=torch.int8)
    _kept_by_top_k_kernel[(len(cases),)](x, ks, kept, vocab, x.stride(0), BLOCK=triton.next_power_of_2(vocab))
    expected = x >= torch.stack([row.topk(k).values[-1] for row, k in cases]).to(DEVICE)[:, None]
    wrong = (kept.bool() != expected).any(-1).nonzero()[:, 0].tolist()
    assert not wrong, [ks[i].item() for i in wrong[:5]]
