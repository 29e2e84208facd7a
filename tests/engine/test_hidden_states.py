"""Per-step hidden-state outputs (what omni talkers consume) equal HF's, row for row, when a
prompt is prefilled in chunks and then decoded."""

import torch
from transformers import AutoModelForCausalLM

from omnistage.config.deploy import load_deploy_config
from omnistage.families.causal_lm import build_ar_engine
from omnistage.families.registry import detect_family
from omnistage.sampling_params import SamplingParams
from omnistage.types import StageInput


def test_hidden_states_match_hf(tiny_qwen3: str) -> None:
    family, info = detect_family(tiny_qwen3)
    stage = {"max_model_len": 128, "max_num_batched_tokens": 16, "dtype": "float32"}  # as HF runs
    deploy = load_deploy_config({"stages": {"lm": stage}})
    pipeline = family.pipeline(info, deploy)
    engine = build_ar_engine(pipeline, "lm", hidden_state_layers={"embed": 0, "mid": 1, "last": 2})
    prompt = pipeline.tokenizer.encode("A prompt long enough to need two prefill chunks of sixteen tokens each")
    assert len(prompt) > 16
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    engine.add_request(StageInput("a", prompt, params=params, return_hidden_states=True))
    engine.add_request(StageInput("b", prompt[:7], params=params))  # shares the batch, asks for none
    rows: dict[str, list[torch.Tensor]] = {"embed": [], "mid": [], "last": []}
    tokens: list[int] = []
    while engine.has_work():
        for out in engine.step():
            if out.request_id == "b":
                assert not out.hidden_states
                continue
            tokens += out.token_ids
            for name, value in out.hidden_states.items():
                rows[name].append(value)

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32)
    full = prompt + tokens
    with torch.no_grad():
        ref = model.model(torch.tensor([full[:-1]]), output_hidden_states=True).hidden_states
    for name, layer in {"embed": 0, "mid": 1, "last": 2}.items():
        got = torch.cat(rows[name]).cpu()  # the engine's rows are on its device; HF ran on the CPU
        assert got.shape[0] == len(full) - 1  # every computed position once; the last sample is never fed back
        torch.testing.assert_close(got, ref[layer][0], rtol=1e-4, atol=1e-4)
    assert engine.num_overlapped_steps > 0  # decode steps with hidden states ran in flight
