"""An `after_sample` hook's graph-safe form (ARModel: `after_sample_rows` / `after_sample_graph`) and the engine's
per-bucket stand-ins for it (cuda_graphs.HookGraphs), on the tiny Qwen3-TTS talker (its code predictor).

On the CPU HookGraphs runs as under `enforce_eager`: the same function on the same static buffers and padded
shapes, so these tests check the formulation and the bookkeeping (which steps replay, the fallback for a seeded
row), not CUDA capture; the GPU tests at the end check captured replays (fresh noise per replay, determinism).
- The static sampling columns (`subtalker_columns`) draw the ids the eager hook's columns (`subtalker_draw`)
  draw from the same noise: greedy rows exactly, sampled rows too (same noise order).
- A replay gives `after_sample`'s codes and next-step additions exactly, greedy, for batches padded to a bucket
  and not; sampled, with the default generator in the same state, the same codes when the batch fills its bucket.
- A step with a seeded row, or more rows than the largest bucket, runs `after_sample` itself.
- Sampled codes follow the filtered distribution: the first code of a frame depends only on the talker state and
  c0, so its exact distribution is known; replays' draws match it (and on CUDA, each replay draws anew).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omnistage.engine.ar.cuda_graphs import CUDACapture, HookGraphs
from omnistage.engine.ar.sampler import choose
from omnistage.families.qwen3_tts.talker import TalkerLM, load_talker, subtalker_columns, subtalker_draw
from omnistage.testing.qwen3_tts import CODEBOOK, Q, make_tiny_qwen3_tts

SIZES = [1, 2, 4]
GREEDY = torch.tensor([0.0, 0.9, 50.0, 1.0])


def _row(do_sample: float, temperature: float, top_k: float, top_p: float) -> torch.Tensor:
    return torch.tensor([do_sample, temperature, top_k, top_p])


# greedy; greedy by temperature 0; plain; top-k; top-p; both; top-k larger than the codebook
MIXED = [GREEDY, _row(1, 0.0, 8, 1.0), _row(1, 1.3, 0, 1.0), _row(1, 0.7, 5, 1.0), _row(1, 1.0, 0, 0.6),
         _row(1, 1.1, 12, 0.8), _row(1, 0.9, 500, 1.0)]


@pytest.fixture(scope="module")
def talker(tmp_path_factory: pytest.TempPathFactory) -> TalkerLM:
    return load_talker(make_tiny_qwen3_tts(Path(tmp_path_factory.mktemp("qwen3_tts"))))


def _static_draw(rows: list[torch.Tensor], logits: torch.Tensor) -> torch.Tensor:
    cols = subtalker_columns(torch.stack(rows).to(logits.device), logits.shape[-1])
    return choose(logits, cols, lambda probs: torch.empty_like(probs).exponential_())


@pytest.mark.parametrize("rows", [MIXED, MIXED[2:3] * 3, [GREEDY] * 3, MIXED[3:6]], ids=["mixed", "unfiltered",
                                                                                          "greedy", "filtered"])
def test_static_columns_draw_what_subtalker_draw_draws(rows: list[torch.Tensor]) -> None:
    logits = torch.randn(len(rows), CODEBOOK, generator=torch.Generator().manual_seed(1))
    for seed in range(20):
        torch.manual_seed(seed)
        expected = subtalker_draw(rows, [None] * len(rows), CODEBOOK, logits.device)(logits)
        torch.manual_seed(seed)
        assert torch.equal(_static_draw(rows, logits), expected)
    greedy = [i for i, r in enumerate(rows) if r[0] == 0 or r[1] == 0]
    assert torch.equal(_static_draw(rows, logits)[greedy], logits.argmax(dim=-1)[greedy])


def _inputs(rows: list[torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    return [{"subtalker": r} for r in rows]


def _frames(talker: TalkerLM, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, talker.talker.config.hidden_size, generator=g), torch.randint(0, CODEBOOK, (n,), generator=g)


def _hooks(talker: TalkerLM) -> HookGraphs:
    return HookGraphs(talker, SIZES, torch.zeros(1, talker.talker.config.hidden_size, device=talker.device))


def test_greedy_replays_give_after_sample_outputs(talker: TalkerLM) -> None:
    hooks = _hooks(talker)
    assert sorted(hooks.graphs) == SIZES
    for n in (1, 3, 4, 2, 3):  # 3 rows replay bucket 4 with a padded row
        hidden, tokens = _frames(talker, n, seed=n)
        inputs = _inputs([GREEDY] * n)
        with torch.no_grad():
            expected = talker.after_sample(hidden, tokens, inputs, [None] * n)
        got = hooks.run(hidden, tokens, inputs, [None] * n)
        codes = got.outputs["codes"]
        assert codes.shape == (n, Q) and torch.equal(codes[:, 0], tokens)
        assert torch.equal(codes, expected.outputs["codes"])
        assert torch.equal(got.next_adds, expected.next_adds)
    assert hooks.num_replays == 5


def test_outputs_outlive_the_next_replay(talker: TalkerLM) -> None:
    """The engine keeps `next_adds` for the sequence's next steps: a replay's results are its own, not views of the
    static outputs the next replay overwrites."""
    hooks = _hooks(talker)
    first = hooks.run(*_frames(talker, 2, seed=1), _inputs([GREEDY] * 2), [None] * 2)
    kept = first.next_adds.clone(), first.outputs["codes"].clone()
    hooks.run(*_frames(talker, 2, seed=2), _inputs([GREEDY] * 2), [None] * 2)
    assert torch.equal(first.next_adds, kept[0]) and torch.equal(first.outputs["codes"], kept[1])


def test_sampled_replays_draw_as_after_sample(talker: TalkerLM) -> None:
    """A full bucket draws the same noise in the same order as `after_sample`: the same codes."""
    hooks = _hooks(talker)
    rows = MIXED[:4]
    hidden, tokens = _frames(talker, 4, seed=5)
    for seed in range(3):
        torch.manual_seed(seed)
        with torch.no_grad():
            expected = talker.after_sample(hidden, tokens, _inputs(rows), [None] * 4)
        torch.manual_seed(seed)
        got = hooks.run(hidden, tokens, _inputs(rows), [None] * 4)
        assert torch.equal(got.outputs["codes"], expected.outputs["codes"])
        assert torch.equal(got.next_adds, expected.next_adds)


def test_seeded_rows_and_large_steps_run_after_sample(talker: TalkerLM) -> None:
    """A seeded request's row continues its own generator, which a replay cannot: the step runs `after_sample`, and
    its codes are what the same generator gives there."""
    hooks = _hooks(talker)
    rows = [MIXED[2], MIXED[3]]
    hidden, tokens = _frames(talker, 2, seed=3)
    generators = [torch.Generator().manual_seed(11), None]
    got = hooks.run(hidden, tokens, _inputs(rows), generators)
    assert hooks.num_replays == 0
    with torch.no_grad():
        expected = talker.after_sample(hidden, tokens, _inputs(rows), [torch.Generator().manual_seed(11), None])
    assert torch.equal(got.outputs["codes"][0], expected.outputs["codes"][0])  # row 1 drew from the default one
    assert not hooks.replays(2, generators) and hooks.replays(4, [None] * 4) and not hooks.replays(5, [None] * 5)
    five = _frames(talker, 5, seed=4)
    assert hooks.run(*five, _inputs([GREEDY] * 5), [None] * 5).outputs["codes"].shape == (5, Q)
    assert hooks.num_replays == 0


def _first_code_distribution(talker: TalkerLM, hidden: torch.Tensor, token: torch.Tensor, temperature: float,
                             top_k: int, top_p: float) -> torch.Tensor:
    """The exact distribution of a frame's first predicted code (codebook 1): its logits' softmax at `temperature`,
    the `top_k` most likely kept, then the fewest of those whose mass reaches `top_p`, renormalised."""
    seen = []

    def draw(logits: torch.Tensor) -> torch.Tensor:
        seen.append(logits)
        return logits.argmax(dim=-1)

    with torch.no_grad():
        talker.talker.code_predictor.predict(hidden[None], talker.embed(token[None]), draw)
    probs, order = (seen[0][0].double().cpu() / temperature).softmax(dim=-1).sort(descending=True)
    probs = probs[:top_k] / probs[:top_k].sum()
    keep = int((probs.cumsum(0) < top_p).sum()) + 1
    out = torch.zeros(CODEBOOK, dtype=torch.float64)
    out[order[:keep]] = probs[:keep] / probs[:keep].sum()
    return out


def _check_first_code_statistics(talker: TalkerLM, hooks: HookGraphs, replays: int) -> None:
    size = max(hooks.sizes)
    hidden, tokens = _frames(talker, 1, seed=9)
    hidden, tokens = hidden.to(talker.device), tokens.to(talker.device)
    row = _row(1, 1.4, 8, 0.95)
    expected = _first_code_distribution(talker, hidden[0], tokens[0], 1.4, 8, 0.95)
    counts = torch.zeros(CODEBOOK)
    rows = _inputs([row] * size)
    draws = []
    for _ in range(replays):
        codes = hooks.run(hidden.expand(size, -1), tokens.expand(size), rows, [None] * size).outputs["codes"]
        draws.append(codes.cpu())
        counts += torch.bincount(codes[:, 1].cpu(), minlength=CODEBOOK)
    freq = counts.double() / counts.sum()
    assert (freq[expected == 0] == 0).all()  # top-k / top-p: nothing outside the kept set
    assert (expected > 0).sum() >= 3  # a distribution worth testing
    # binomial standard error <= 0.5 / sqrt(samples); 5 of them
    assert (freq - expected).abs().max() < 2.5 / counts.sum().sqrt()
    assert len({tuple(d.flatten().tolist()) for d in draws}) > replays // 2  # replays draw anew


def test_sampled_codes_follow_the_filtered_distribution(talker: TalkerLM) -> None:
    torch.manual_seed(0)
    _check_first_code_statistics(talker, _hooks(talker), replays=250)


# ---- captured graphs (GPU) -------------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


def _captured(talker: TalkerLM) -> HookGraphs:
    hidden = torch.zeros(1, talker.talker.config.hidden_size, device="cuda")
    return HookGraphs(talker, SIZES, hidden, CUDACapture(hidden.device))


@pytest.fixture(scope="module")
def cuda_talker(tmp_path_factory: pytest.TempPathFactory) -> TalkerLM:
    return load_talker(make_tiny_qwen3_tts(Path(tmp_path_factory.mktemp("qwen3_tts_cuda"))), device="cuda")


@gpu
def test_captured_greedy_replays_equal_eager_stand_ins(cuda_talker: TalkerLM) -> None:
    graphs, eager = _captured(cuda_talker), _hooks(cuda_talker)
    for n in (1, 3, 4):
        hidden, tokens = (t.cuda() for t in _frames(cuda_talker, n, seed=n))
        a = graphs.run(hidden, tokens, _inputs([GREEDY] * n), [None] * n)
        b = eager.run(hidden, tokens, _inputs([GREEDY] * n), [None] * n)
        assert torch.equal(a.outputs["codes"], b.outputs["codes"]) and torch.equal(a.next_adds, b.next_adds)
    assert graphs.num_replays == 3


@gpu
def test_captured_sampled_replays_are_deterministic_and_distributed(cuda_talker: TalkerLM) -> None:
    graphs = _captured(cuda_talker)
    hidden, tokens = (t.cuda() for t in _frames(cuda_talker, 4, seed=2))
    runs = []
    for _ in range(2):
        torch.manual_seed(3)
        runs.append([graphs.run(hidden, tokens, _inputs(MIXED[:4]), [None] * 4).outputs["codes"] for _ in range(3)])
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))  # the default generator's state decides
    assert not torch.equal(runs[0][0], runs[0][1])  # each replay draws new noise
    torch.manual_seed(0)
    _check_first_code_statistics(cuda_talker, graphs, replays=1000)
