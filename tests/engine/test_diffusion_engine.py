"""DiffusionEngine and the flow-match scheduler, with a toy model whose rows are independent (so batching must not
change any value) and whose every call is recorded (so the tests see what each forward held)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.flux.pipeline_flux import calculate_shift

from omnistage.config.deploy import ConfigError
from omnistage.engine.diffusion import DiffusionEngine, DiffusionParams
from omnistage.engine.schedulers import FlowMatch, FlowMatchConfig
from omnistage.types import StageInput

CONFIGS = [
    dict(shift=3.0, use_dynamic_shifting=True),  # FLUX.1-dev
    dict(shift=1.0),  # FLUX.1-schnell
    dict(shift=3.0),  # SD3
    dict(shift=3.0, use_dynamic_shifting=True, time_shift_type="linear"),
    dict(shift=1.0, shift_terminal=0.02),
]


@pytest.mark.parametrize("config", CONFIGS)
def test_schedule_is_diffusers_bit_for_bit(config: dict) -> None:
    ref = FlowMatchEulerDiscreteScheduler(**config)
    mine = FlowMatch(FlowMatchConfig.from_diffusers(dict(ref.config)))
    for steps in (2, 4, 28, 50):
        for seq in (64, 256, 1000, 4096):
            # As diffusers' FLUX pipeline calls it: explicit linspace sigmas and mu from the token count.
            ref.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=calculate_shift(seq))
            schedule = mine.schedule(steps, image_seq_len=seq)
            assert torch.equal(schedule.sigmas, ref.sigmas)
            assert torch.equal(schedule.timesteps, ref.timesteps)


def test_unsupported_scheduler_options_are_refused() -> None:
    with pytest.raises(ConfigError, match="use_karras_sigmas not supported yet"):
        FlowMatchConfig.from_diffusers({"use_karras_sigmas": True})


def test_euler_step_per_row_is_diffusers_step() -> None:
    ref = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True)
    mine = FlowMatch(FlowMatchConfig.from_diffusers(dict(ref.config)))
    schedule = mine.schedule(5, image_seq_len=300)
    ref.set_timesteps(sigmas=np.linspace(1.0, 1 / 5, 5), mu=calculate_shift(300))
    torch.manual_seed(0)
    x, v = torch.randn(3, 7, 4), torch.randn(3, 7, 4)
    rows = torch.tensor([0, 2, 4])  # each row at its own step
    got = FlowMatch.step(x, v, schedule.sigmas[rows], schedule.sigmas[rows + 1])
    for r, i in enumerate(rows.tolist()):
        ref._step_index = i
        want = ref.step(v[r:r + 1], ref.timesteps[i], x[r:r + 1], return_dict=False)[0]
        assert torch.equal(got[r:r + 1], want)


# ---------------------------------------------------------------- the engine, with a toy model


class Toy:
    """Latents [n, 4]; conditioning: one row of 4 values per prompt. Velocity mixes latents, conditioning and
    timestep row by row; decode turns 3 of the 4 values into a 1x1 image."""

    device = torch.device("cpu")
    dtype = torch.float32

    def __init__(self, zero_velocity: bool = False, fail_at_call: int | None = None):
        self.zero_velocity, self.fail_at_call = zero_velocity, fail_at_call
        self.calls: list[dict] = []  # per velocity call: rows and their timesteps
        self.encoded: list[list[str]] = []
        self.flow = FlowMatch(FlowMatchConfig(shift=3.0))

    def batch_key(self, p: DiffusionParams) -> tuple:
        return (p.height, p.width)

    def schedule(self, p: DiffusionParams):
        return self.flow.schedule(p.num_inference_steps)

    def noise_shape(self, p: DiffusionParams) -> tuple[int, ...]:
        return (4,)

    def pack(self, noise: torch.Tensor, key: tuple) -> torch.Tensor:
        return noise

    def cfg_scale(self, p: DiffusionParams) -> float | None:
        scale = p.true_cfg_scale or 1.0  # unresolved params: no true CFG unless asked for
        return scale if scale > 1 and p.negative_prompt is not None else None

    def encode(self, prompts: list[str], params: list[DiffusionParams], inputs: list[dict]) -> dict[str, torch.Tensor]:
        self.encoded.append(list(prompts))
        rows = [[float(sum(map(ord, p)) % 7) + i for i in range(4)] for p in prompts]
        return {"c": torch.tensor(rows) / 10}

    def velocity(self, latents, timesteps, cond, key):
        self.calls.append({"rows": len(latents), "timesteps": timesteps.tolist()})
        if self.fail_at_call == len(self.calls):
            raise RuntimeError("device on fire")
        if self.zero_velocity:
            return torch.zeros_like(latents)
        return torch.sin(latents) - cond["c"] + timesteps[:, None] / 1000

    def decode(self, latents, key):
        return latents[:, :3].reshape(-1, 1, 1, 3).clone()


def params(steps: int = 4, seed: int = 0, **kw) -> DiffusionParams:
    return DiffusionParams(**{"prompt": "cat", "width": 8, "height": 8, "num_inference_steps": steps, "seed": seed,
                              **kw})


def reference(model: Toy, p: DiffusionParams) -> torch.Tensor:
    """The request alone, the loop written out with diffusers' scheduler."""
    ref = FlowMatchEulerDiscreteScheduler(shift=3.0)
    ref.set_timesteps(sigmas=np.linspace(1.0, 1 / p.num_inference_steps, p.num_inference_steps))
    x = torch.randn((p.n, 4), generator=torch.Generator("cpu").manual_seed(p.seed))
    cond = model.encode([p.prompt], [p], [{}])["c"].repeat(p.n, 1)
    uncond = model.encode([p.negative_prompt], [p], [{}])["c"].repeat(p.n, 1) if model.cfg_scale(p) else None
    for t in ref.timesteps:
        tt = t.expand(p.n)
        v = torch.sin(x) - cond + tt[:, None] / 1000
        if uncond is not None:
            neg = torch.sin(x) - uncond + tt[:, None] / 1000
            v = neg + p.true_cfg_scale * (v - neg)
        x = ref.step(v, t, x, return_dict=False)[0]
    return x[:, :3].reshape(-1, 1, 1, 3)


def add(engine: DiffusionEngine, rid: str, p: DiffusionParams) -> None:
    engine.add_request(StageInput(rid, params=p.as_wire()))


def run(engine: DiffusionEngine, joins: dict[int, list[tuple[str, DiffusionParams]]] | None = None,
        aborts: dict[int, list[str]] | None = None) -> tuple[list, dict]:
    """Steps until idle; before step k, adds `joins[k]` and aborts `aborts[k]`. Returns (outputs per step, final
    output per request)."""
    per_step, final, k = [], {}, 0
    while engine.has_work() or (joins and any(s >= k for s in joins)):
        for rid, p in (joins or {}).get(k, []):
            add(engine, rid, p)
        for rid in (aborts or {}).get(k, []):
            engine.abort(rid)
        outs = engine.step()
        per_step.append(outs)
        final.update({o.request_id: o for o in outs if o.finished})
        k += 1
    return per_step, final


def test_request_joins_at_a_step_boundary_and_leaves_when_done() -> None:
    model = Toy()
    engine = DiffusionEngine("dit", model, max_num_seqs=8)
    a, b = params(steps=5, seed=1), params(steps=2, seed=2, prompt="dog")
    per_step, final = run(engine, joins={0: [("a", a)], 2: [("b", b)]})
    # a alone for 2 steps; b joins at step 2 and leaves after step 3; a finishes alone at step 4
    assert [c["rows"] for c in model.calls] == [1, 1, 2, 2, 1]
    assert [[o.request_id for o in outs if o.finished] for outs in per_step] == [[], [], [], ["b"], ["a"]]
    # rows of one forward at different steps: each gets its own schedule's timestep
    ta, tb = model.flow.schedule(5).timesteps.tolist(), model.flow.schedule(2).timesteps.tolist()
    assert model.calls[2]["timesteps"] == [ta[2], tb[0]]
    assert model.calls[3]["timesteps"] == [ta[3], tb[1]]
    for rid, p in (("a", a), ("b", b)):
        torch.testing.assert_close(final[rid].tensors["images"], reference(model, p), rtol=0, atol=1e-6)
    assert engine.stats()["num_running"] == engine.stats()["num_waiting"] == 0


def test_progress_is_a_delta_per_step() -> None:
    engine = DiffusionEngine("dit", Toy())
    per_step, _ = run(engine, joins={0: [("a", params(steps=3))]})
    outs = [o for step in per_step for o in step]
    assert [o.tensors["progress"].tolist() for o in outs] == [[[1, 3]], [[2, 3]], [[3, 3]]]
    assert [o.num_output_tokens for o in outs] == [1, 2, 3]
    assert [o.finished for o in outs] == [False, False, True]
    assert ["images" in o.tensors for o in outs] == [False, False, True]
    assert outs[-1].finish_reason == "stop"


def test_seed_draws_the_latents_diffusers_draws_whatever_the_batch() -> None:
    """With zero velocity the image is the initial noise: torch.randn([n, ...]) from one CPU generator."""
    model = Toy(zero_velocity=True)
    engine = DiffusionEngine("dit", model)
    _, final = run(engine, joins={0: [("other", params(steps=3, seed=5))], 1: [("a", params(seed=42, n=3))]})
    noise = torch.randn((3, 4), generator=torch.Generator("cpu").manual_seed(42))
    assert torch.equal(final["a"].tensors["images"], noise[:, :3].reshape(3, 1, 1, 3))
    assert not torch.equal(final["a"].tensors["images"][0], final["a"].tensors["images"][1])


def test_cfg_runs_both_branches_in_one_forward() -> None:
    model = Toy()
    engine = DiffusionEngine("dit", model)
    g = params(steps=3, seed=3, n=2, negative_prompt="blurry", true_cfg_scale=4.0)
    plain = params(steps=3, seed=4)
    _, final = run(engine, joins={0: [("g", g), ("plain", plain)]})
    assert model.encoded[0] == ["cat", "blurry", "cat"]  # one encode for the admitted requests' branches
    assert [c["rows"] for c in model.calls] == [2 + 1 + 2] * 3  # positive rows, then the negative branch
    torch.testing.assert_close(final["g"].tensors["images"], reference(model, g), rtol=0, atol=1e-6)
    torch.testing.assert_close(final["plain"].tensors["images"], reference(model, plain), rtol=0, atol=1e-6)


def test_max_num_seqs_counts_images() -> None:
    model = Toy()
    engine = DiffusionEngine("dit", model, max_num_seqs=3)
    run(engine, joins={0: [("a", params(steps=2, n=2)), ("b", params(steps=2, n=2)), ("c", params(steps=2))]})
    # b (2 images) does not fit beside a; c, behind it, does not overtake it
    assert [c["rows"] for c in model.calls] == [2, 2, 3, 3]


def test_a_request_of_another_shape_waits_for_the_batch_to_drain() -> None:
    model = Toy()
    engine = DiffusionEngine("dit", model)
    big = params(steps=2, width=16)
    run(engine, joins={0: [("a", params(steps=3))], 1: [("big", big), ("late", params(steps=1))]})
    # big waits for a; late (a's shape) waits behind big rather than overtaking it
    assert [c["rows"] for c in model.calls] == [1, 1, 1, 1, 1, 1]
    assert engine.stats()["num_steps"] == 6


def test_abort_between_steps_drops_the_request() -> None:
    model = Toy()
    engine = DiffusionEngine("dit", model)
    per_step, final = run(engine, joins={0: [("a", params(steps=4)), ("b", params(steps=4, seed=9))],
                                         1: [("w", params(steps=2, width=16))]},
                          aborts={2: ["a", "w"]})
    seen = [[o.request_id for o in outs] for outs in per_step]
    assert seen == [["a", "b"], ["a", "b"], ["b"], ["b"]]
    assert set(final) == {"b"}
    assert [c["rows"] for c in model.calls] == [2, 2, 1, 1]
    torch.testing.assert_close(final["b"].tensors["images"], reference(model, params(steps=4, seed=9)),
                               rtol=0, atol=1e-6)
    assert not engine.has_work()


def test_a_failed_step_fails_its_batch_not_the_engine() -> None:
    model = Toy(fail_at_call=2)
    engine = DiffusionEngine("dit", model)
    per_step, final = run(engine, joins={0: [("a", params(steps=3)), ("b", params(steps=3))],
                                         3: [("c", params(steps=1))]})
    assert [o.finish_reason for o in per_step[1]] == ["error", "error"]
    assert "device on fire" in per_step[1][0].error
    assert final["c"].finish_reason == "stop"


def test_bad_params_fail_the_request() -> None:
    engine = DiffusionEngine("dit", Toy())
    add(engine, "bad", params(n=0))
    (out,) = engine.step()
    assert out.finish_reason == "error" and out.error_status == 400 and "n must be" in out.error
