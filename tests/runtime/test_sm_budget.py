"""A stage's `max_sms`: the kernels its thread launches or captures are sized for at most that many
multiprocessors (omnistage.devices.sm_budget), in that stage's thread only."""

import threading

from omnistage import Omni, devices
from omnistage.engine.ar.engine import AREngine
from omnistage.sampling_params import SamplingParams


def test_sm_budget_is_per_thread_and_restored() -> None:
    assert devices.budgeted_sms(132) == 132
    other: list[int] = []
    with devices.sm_budget(66):
        assert devices.budgeted_sms(132) == 66 and devices.budgeted_sms(40) == 40  # never more than the device has
        with devices.sm_budget(None):
            assert devices.budgeted_sms(132) == 132
        assert devices.budgeted_sms(132) == 66
        thread = threading.Thread(target=lambda: other.append(devices.budgeted_sms(132)))
        thread.start()
        thread.join()
    assert other == [132]  # another stage's thread keeps the whole GPU
    assert devices.budgeted_sms(132) == 132


def test_a_stage_builds_and_steps_on_its_budget(tiny_qwen2: str, monkeypatch) -> None:
    """Inline: the engine is built (its CUDA graphs captured) and stepped under the stage's `max_sms`; the
    thread that started the server is not."""
    seen: dict[str, list[int]] = {"built": [], "stepped": []}
    init, step = AREngine.__init__, AREngine.step

    def traced_init(self, *args, **kwargs):
        seen["built"].append(devices.budgeted_sms(1000))
        init(self, *args, **kwargs)

    def traced_step(self):
        seen["stepped"].append(devices.budgeted_sms(1000))
        return step(self)

    monkeypatch.setattr(AREngine, "__init__", traced_init)
    monkeypatch.setattr(AREngine, "step", traced_step)
    deploy = {"worker_backend": "inline", "stages": {"lm": {"max_model_len": 64, "max_sms": 24}}}
    with Omni(tiny_qwen2, deploy) as omni:
        out = omni.generate(["Hello"], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 3
    assert seen["built"] == [24] and seen["stepped"] and set(seen["stepped"]) == {24}
    assert devices.budgeted_sms(1000) == 1000
