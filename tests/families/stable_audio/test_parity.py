"""Stable Audio through omnistage's diffusion engine equals diffusers' StableAudioPipeline on the same tiny
checkpoint, seed, prompt, clip and steps (without CFG, with CFG and its null negative, with a negative prompt, from
audio_start > 0); a request's clip does not depend on what else runs with it; and the family detects the checkpoint,
resolves diffusers' defaults and refuses clips the model cannot make.

Tolerance: float32 on the CPU, both sides run the same ops and the same seeded Brownian noise; only batched kernels
(T5 over more prompts, the DiT and VAE over more rows) may round differently, so samples (|x| ~ 1) agree to ATOL."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from diffusers import StableAudioPipeline

from omnistage.engine.diffusion import DiffusionEngine, DiffusionParams
from omnistage.errors import RequestError
from omnistage.families.registry import load_pipeline
from omnistage.families.stable_audio import StableAudioAudioPipeline
from omnistage.testing.stable_audio import MAX_SECONDS, SAMPLE_RATE, WINDOW
from omnistage.types import OmniRequest, StageOutput

ATOL = 5e-5  # the SDE solver carries rounding from step to step (the latents start at sigma 500)
DEPLOY = {"worker_backend": "inline", "stages": {"*": {"dtype": "float32", "devices": "cpu"}}}
PLAIN = DiffusionParams(prompt="a dog barking in the rain", num_inference_steps=6, guidance_scale=1.0, seed=3,
                        audio_start=0.0, audio_length=0.5)
CFG = replace(PLAIN, guidance_scale=7.0, seed=5)  # no negative prompt: diffusers' zero negative conditioning
NEGATIVE = replace(PLAIN, guidance_scale=4.0, negative_prompt="low quality, noise", seed=11)
LATER = replace(NEGATIVE, audio_start=0.25, audio_length=0.6, seed=2)  # the clip cut from 0.25 s of the window


@pytest.fixture(scope="module")
def reference(tiny_stable_audio_path: str) -> StableAudioPipeline:
    pipe = StableAudioPipeline.from_pretrained(tiny_stable_audio_path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def pipeline(tiny_stable_audio_path: str) -> StableAudioAudioPipeline:
    return load_pipeline(tiny_stable_audio_path, DEPLOY)


@pytest.fixture(scope="module")
def engine(pipeline: StableAudioAudioPipeline) -> DiffusionEngine:
    return pipeline.build_engine("dit")


def diffusers_audio(ref: StableAudioPipeline, p: DiffusionParams) -> np.ndarray:
    return ref(p.prompt, negative_prompt=p.negative_prompt, audio_start_in_s=p.audio_start,
               audio_end_in_s=p.audio_start + p.audio_length, num_inference_steps=p.num_inference_steps,
               guidance_scale=p.guidance_scale, generator=torch.Generator("cpu").manual_seed(p.seed),
               output_type="np").audios


def request(rid: str, p: DiffusionParams) -> OmniRequest:
    return OmniRequest(rid, prompt=p.prompt, output_modalities=("audio",), options={"diffusion": p})


def run(pipeline: StableAudioAudioPipeline, engine: DiffusionEngine, joins: dict[int, dict[str, DiffusionParams]]
        ) -> tuple[dict[str, np.ndarray], list[tuple[int, StageOutput]]]:
    """Steps the engine; before step k adds the requests of `joins[k]` (through the family's preprocessing).
    Returns each finished request's clip [1, channels, samples] and every (engine step, delta)."""
    clips, deltas, k = {}, [], 0
    while engine.has_work() or any(s >= k for s in joins):
        for rid, p in joins.get(k, {}).items():
            engine.add_request(pipeline.preprocess(request(rid, p)))
        for out in engine.step():
            assert out.error is None, out.error
            deltas.append((k, out))
            if out.finished:
                clips[out.request_id] = out.tensors["audio"].numpy()
        k += 1
    return clips, deltas


@pytest.mark.parametrize("p", [PLAIN, CFG, NEGATIVE, LATER], ids=["plain", "cfg", "negative", "start"])
def test_audio_matches_diffusers(pipeline, engine, reference, p) -> None:
    clips, _ = run(pipeline, engine, {0: {"a": p}})
    want = diffusers_audio(reference, p)
    samples = int((p.audio_start + p.audio_length) * SAMPLE_RATE) - int(p.audio_start * SAMPLE_RATE)
    assert clips["a"].shape == want.shape == (1, 2, samples)
    np.testing.assert_allclose(clips["a"], want, rtol=0, atol=ATOL)
    # the tolerance is far below what another seed or prompt changes: the comparison can fail
    assert np.abs(diffusers_audio(reference, replace(p, seed=p.seed + 1)) - want).max() > 1000 * ATOL
    assert np.abs(diffusers_audio(reference, replace(p, prompt="waves on a beach")) - want).max() > 1000 * ATOL


def test_guidance_negative_prompt_and_start_change_the_audio(reference) -> None:
    """Each conditioning the parity cases cover moves the clip (so matching them is not matching a no-op)."""
    base = diffusers_audio(reference, NEGATIVE)
    for other in (replace(NEGATIVE, guidance_scale=1.0), replace(NEGATIVE, negative_prompt=None),
                  replace(NEGATIVE, negative_prompt="birds singing"), replace(NEGATIVE, audio_length=0.4)):
        got = diffusers_audio(reference, other)
        n = min(got.shape[-1], base.shape[-1])
        assert np.abs(got[..., :n] - base[..., :n]).max() > 1000 * ATOL, other
    # seconds_start conditions the whole window: the same samples of it differ when the clip starts later
    later = diffusers_audio(reference, replace(NEGATIVE, audio_start=0.1, audio_length=0.4))
    whole = diffusers_audio(reference, replace(NEGATIVE, audio_length=0.5))[..., int(0.1 * SAMPLE_RATE):]
    assert np.abs(later - whole).max() > 1000 * ATOL


def test_batched_matches_alone(pipeline, engine, reference) -> None:
    """Requests of one clip span share every forward, joining at different steps with other seeds, CFG or not;
    one of another span queues until they finish. Each clip equals its request run alone (and diffusers')."""
    target = replace(NEGATIVE, seed=21)
    alone, _ = run(pipeline, engine, {0: {"t": target}})
    joins = {0: {"t": target, "plain": replace(PLAIN, prompt="rain on a tin roof", seed=8)},
             2: {"cfg": replace(CFG, num_inference_steps=3, seed=1)},
             3: {"long": replace(PLAIN, audio_length=0.75, seed=4, num_inference_steps=2)}}
    steps_before = engine.num_steps
    batched, deltas = run(pipeline, engine, joins)
    # t and plain (6 steps from step 0) and cfg (3 steps from step 2) share forwards: 6 steps; long then runs 2
    assert engine.num_steps - steps_before == 6 + 2
    first = {rid: min(k for k, d in deltas if d.request_id == rid) for rid in batched}
    last = {rid: max(k for k, d in deltas if d.request_id == rid) for rid in batched}
    assert first["cfg"] == 2 and first["long"] > max(last["t"], last["plain"], last["cfg"])
    np.testing.assert_allclose(batched["t"], alone["t"], rtol=0, atol=ATOL)
    for rid, p in {k: v for step in joins.values() for k, v in step.items()}.items():
        np.testing.assert_allclose(batched[rid], diffusers_audio(reference, p), rtol=0, atol=ATOL, err_msg=rid)


def test_detection_defaults_and_output(tiny_stable_audio_path, pipeline, engine) -> None:
    assert isinstance(pipeline, StableAudioAudioPipeline)
    assert [(s.name, s.kind) for s in pipeline.stages] == [("dit", "diffusion")]
    assert pipeline.output_modalities == ("audio",)
    assert pipeline.audio_sample_rate == SAMPLE_RATE
    longest = WINDOW * 32 / SAMPLE_RATE  # the DiT's window times the VAE's hop
    assert pipeline.max_audio_seconds == longest
    # diffusers' StableAudioPipeline defaults: 100 steps, CFG 7, the clip from 0 s to the end of the window
    p = pipeline.request_params(OmniRequest("r", prompt="x", output_modalities=("audio",)))
    assert (p.num_inference_steps, p.guidance_scale, p.audio_start, p.audio_length) == (100, 7.0, 0.0, longest)
    p = pipeline.request_params(request("r", DiffusionParams(audio_start=0.25)))
    assert p.audio_length == longest - 0.25
    # the output as callers see it: time-major stereo float32 at the VAE's rate, and the steps as progress
    _, deltas = run(pipeline, engine, {0: {"a": replace(PLAIN, num_inference_steps=2)}})
    out = pipeline.to_output("dit", deltas[-1][1])
    assert out.audio.shape == (int(0.5 * SAMPLE_RATE), 2) and out.audio.dtype == np.float32
    assert out.sample_rate == SAMPLE_RATE and out.progress == (2, 2)
    np.testing.assert_array_equal(out.audio, deltas[-1][1].tensors["audio"][0].T.numpy())
    assert out.num_prompt_tokens == len(pipeline_tokens(engine, PLAIN.prompt))
    assert pipeline.to_output("dit", deltas[0][1]).audio is None


def pipeline_tokens(engine: DiffusionEngine, prompt: str) -> list[int]:
    tokenizer = engine.model.tokenizer
    return tokenizer(prompt, truncation=True, max_length=tokenizer.model_max_length).input_ids


@pytest.mark.parametrize(("change", "param", "words"), [
    ({"audio_length": 1.5}, "audio_length", "at most 1 s"),
    ({"audio_start": 0.75, "audio_length": 0.5}, "audio_length", "at most 1 s"),
    ({"audio_start": MAX_SECONDS + 1.0}, "audio_start", f"[0, {MAX_SECONDS}]"),
    ({"audio_length": 1e-5}, "audio_length", "shorter than one sample"),
    ({"audio_length": -1.0}, "audio_length", "positive"),
    ({"n": 2}, "n", "one clip per request"),
])
def test_bad_clips_are_refused(pipeline, change, param, words) -> None:
    with pytest.raises(RequestError, match=None) as info:
        pipeline.preprocess(request("r", replace(PLAIN, **change)))
    assert info.value.param == param and words in info.value.message, info.value.message


def test_encode_stage_gives_the_same_audio(tiny_stable_audio_path, reference) -> None:
    """With `stages.encode` the T5 and projection run in a stage of their own (batching the ready requests'
    prompts, the null negative included); each clip, through the Python API, equals diffusers'."""
    import asyncio

    from omnistage.entrypoints.async_omni import AsyncOmni

    cases = {"plain": PLAIN, "cfg": CFG, "start": LATER}
    split = {**DEPLOY, "stages": {**DEPLOY["stages"], "encode": {"max_num_seqs": 8}}}
    engine = AsyncOmni.from_model(tiny_stable_audio_path, split)
    assert [s.name for s in engine.pipeline.stages] == ["encode", "dit"]

    async def one(rid: str, p: DiffusionParams) -> tuple[str, np.ndarray]:
        clip = None
        async for out in engine.generate(request(rid, p)):
            assert out.error is None, out.error
            clip = out.audio if out.audio is not None else clip
        return rid, clip

    async def every() -> dict[str, np.ndarray]:
        return dict(await asyncio.gather(*(one(rid, p) for rid, p in cases.items())))

    try:
        clips = asyncio.run(every())
    finally:
        engine.shutdown()
    for rid, p in cases.items():
        np.testing.assert_allclose(clips[rid], diffusers_audio(reference, p)[0].T, rtol=0, atol=ATOL, err_msg=rid)
