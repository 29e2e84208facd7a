"""LoRA adapters on Wan2.2's experts (tiny checkpoints, float32 on the CPU). On T2V-A14B a request's `lora` puts an
adapter on the high-noise expert (`path` / `scale`), the low-noise one (`path_2` / `scale_2`) or both, and the
frames equal diffusers' WanPipeline with the same files loaded by `load_lora_weights` (the second with
`load_into_transformer_2=True`), the high-noise one scaled by its saved metadata (lora_alpha != rank); so do
I2V-A14B's with both and TI2V-5B's one DiT with `path`. Requests of different adapter states never share a
forward; each expert keeps at most `max_loras` adapters; paths outside the root, missing files and `path_2` on a
one-DiT checkpoint are 400s, also over HTTP.

Tolerance: the parity tests' ATOL (same ops on both sides, only batched kernels may round otherwise)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import httpx
import numpy as np
import pytest
from diffusers import WanImageToVideoPipeline, WanPipeline

from omnistage.engine.diffusion import DiffusionEngine, DiffusionParams
from omnistage.errors import RequestError
from omnistage.families.registry import load_pipeline
from omnistage.testing.lora import make_tiny_lora
from omnistage.types import OmniRequest

from .test_parity import ATOL, T2V, TI2V, diffusers_frames, picture
from .test_parity import run as run_with_images

HIGH, LOW = 0.7, 1.5  # the scales the cases run at
CASES = {  # request lora -> (scale on the high-noise expert, scale on the low-noise expert), None: no adapter
    "plain": (None, (None, None)),
    "high": ({"path": "high", "scale": HIGH}, (HIGH, None)),
    "low": ({"path_2": "low", "scale_2": LOW}, (None, LOW)),
    "both": ({"name": "lightning", "path": "high", "scale": HIGH, "path_2": "low/pytorch_lora_weights.safetensors",
              "scale_2": LOW}, (HIGH, LOW)),
}


def deploy(**options) -> dict:
    return {"worker_backend": "inline",
            "stages": {"*": {"dtype": "float32", "devices": "cpu", "max_num_seqs": 8, "options": options}}}


def with_lora(case: str, **changes) -> DiffusionParams:
    return replace(T2V, lora=CASES[case][0], **changes)


def differs(a: np.ndarray, b: np.ndarray) -> bool:
    """Far beyond the tolerance: the comparisons within it can fail."""
    return float(np.abs(a - b).max()) > 100 * ATOL


def run(pipeline, engine: DiffusionEngine, requests: dict[str, DiffusionParams]
        ) -> tuple[dict[str, np.ndarray], dict[str, object], list[set[str]]]:
    """Adds `requests` at once and steps to the end: each one's frames, failures, and the requests of each step."""
    for rid, p in requests.items():
        engine.add_request(pipeline.preprocess(OmniRequest(rid, prompt=p.prompt, output_modalities=("video",),
                                                           options={"diffusion": p})))
    videos, failures, steps = {}, {}, []
    while engine.has_work():
        outs = engine.step()
        steps.append({o.request_id for o in outs if o.error is None})
        for out in outs:
            if out.error is not None:
                failures[out.request_id] = out
            elif out.finished:
                videos[out.request_id] = out.tensors["video"].numpy()
    return videos, failures, steps


@pytest.fixture(scope="module")
def loras(tiny_wan_t2v: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`high`: trained on the high-noise expert, saved with lora_alpha 4 at rank 2 (metadata: scaled by 2);
    `low`: on the low-noise expert."""
    root = tmp_path_factory.mktemp("loras")
    make_tiny_lora(tiny_wan_t2v, root / "high", seed=1, lora_alpha=4)
    make_tiny_lora(tiny_wan_t2v, root / "low", seed=2, component="transformer_2")
    (root / "empty").mkdir()
    return root


@pytest.fixture(scope="module")
def t2v(tiny_wan_t2v: str, loras: Path) -> tuple:
    pipeline = load_pipeline(tiny_wan_t2v, deploy(lora_root=str(loras)))
    return pipeline, pipeline.build_engine("dit")


@pytest.fixture(scope="module")
def alone(t2v) -> dict[str, np.ndarray]:
    """Each case run alone, one after the other in one engine (each switches the adapter state of the last)."""
    return {case: run(*t2v, {case: with_lora(case)})[0][case] for case in ("high", "low", "both", "plain")}


def reference(path: str, loras: Path, high: float | None, low: float | None) -> WanPipeline:
    """diffusers' pipeline with the files loaded as its docs load a two-expert LoRA."""
    ref = WanPipeline.from_pretrained(path)
    ref.set_progress_bar_config(disable=True)
    if high is not None:
        ref.load_lora_weights(loras / "high", adapter_name="high")
        ref.transformer.set_adapters(["high"], [high])
    if low is not None:
        ref.load_lora_weights(loras / "low", adapter_name="low", load_into_transformer_2=True)
        ref.transformer_2.set_adapters(["low"], [low])
    return ref


@pytest.mark.parametrize("case", list(CASES))
def test_lora_on_each_expert_gives_diffusers_frames(tiny_wan_t2v: str, loras: Path, alone, case: str) -> None:
    want = diffusers_frames(reference(tiny_wan_t2v, loras, *CASES[case][1]), T2V)
    np.testing.assert_allclose(alone[case], want, rtol=0, atol=ATOL)
    if case != "plain":  # each adapter shows in the frames (the low-noise expert runs the last of the 4 steps)
        assert differs(alone[case], alone["plain"])


@pytest.mark.parametrize(("variant", "lora"), [("i2v", {"path": "high", "path_2": "low", "scale_2": LOW}),
                                                ("ti2v", {"path": "high", "scale": HIGH})], ids=["i2v", "ti2v"])
def test_image_to_video_loras_give_diffusers_frames(request: pytest.FixtureRequest, tmp_path: Path, variant: str,
                                                    lora: dict) -> None:
    """I2V-A14B with adapters on both experts, TI2V-5B's one DiT with `path` as for any one-DiT model."""
    path = request.getfixturevalue(f"tiny_wan_{variant}")
    make_tiny_lora(path, tmp_path / "high", seed=3)
    if variant == "i2v":
        make_tiny_lora(path, tmp_path / "low", seed=4, component="transformer_2")
    p = replace(T2V, guidance_scale=3.5, guidance_scale_2=1.5) if variant == "i2v" else TI2V
    image, pipeline = picture(seed=1), load_pipeline(path, deploy(lora_root=str(tmp_path)))
    videos, _ = run_with_images(pipeline, pipeline.build_engine("dit"), {0: {"a": (replace(p, lora=lora), image)}})
    ref = WanImageToVideoPipeline.from_pretrained(path)
    ref.set_progress_bar_config(disable=True)
    ref.load_lora_weights(tmp_path / "high", adapter_name="high")
    ref.transformer.set_adapters(["high"], [lora.get("scale", 1.0)])
    if "path_2" in lora:
        ref.load_lora_weights(tmp_path / "low", adapter_name="low", load_into_transformer_2=True)
        ref.transformer_2.set_adapters(["low"], [lora["scale_2"]])
    want = diffusers_frames(ref, p, image)
    np.testing.assert_allclose(videos["a"], want, rtol=0, atol=ATOL)
    ref.disable_lora()
    assert differs(diffusers_frames(ref, p, image), want)


def test_metadata_scales_the_adapter(t2v, loras: Path, alone) -> None:
    """Without its saved lora_alpha the high-noise adapter would act at scale 1 per unit: twice the scale given
    reads the same as the metadata's alpha / rank of 2, so the frames are those of scale 2 x HIGH, unscaled."""
    from safetensors.torch import load_file, save_file

    bare = loras / "high-bare"
    bare.mkdir(exist_ok=True)
    save_file(load_file(loras / "high" / "pytorch_lora_weights.safetensors"), bare / "a.safetensors")
    videos, failures, _ = run(*t2v, {"bare": replace(T2V, lora={"path": "high-bare", "scale": 2 * HIGH})})
    assert not failures
    np.testing.assert_allclose(videos["bare"], alone["high"], rtol=0, atol=ATOL)


def test_requests_of_different_adapters_never_share_a_forward(t2v, alone) -> None:
    pipeline, engine = t2v
    requests = {"plain": with_lora("plain"), "high": with_lora("high"), "both": with_lora("both"),
                "both-2": with_lora("both", seed=11), "low": with_lora("low")}
    videos, failures, steps = run(pipeline, engine, requests)
    assert not failures
    for case in ("plain", "high", "low", "both"):
        np.testing.assert_allclose(videos[case], alone[case], rtol=0, atol=ATOL)
    assert differs(videos["both-2"], videos["both"])
    state = {rid: engine.lora.key(p.lora) for rid, p in requests.items()}
    assert all(len({state[rid] for rid in step}) <= 1 for step in steps)  # one adapter state per forward
    assert {"both", "both-2"} in steps  # the same adapters and scales: batched


def test_each_expert_keeps_at_most_max_loras(tiny_wan_t2v: str, loras: Path) -> None:
    """max_loras 1: a request for another adapter on an expert unloads that expert's last one; loading it back
    gives the same frames. The low-noise file fits the high-noise expert too (one architecture)."""
    pipeline = load_pipeline(tiny_wan_t2v, deploy(lora_root=str(loras), max_loras=1))
    engine = pipeline.build_engine("dit")
    p = replace(T2V, num_inference_steps=2)
    first = run(pipeline, engine, {"a": replace(p, lora={"path": "high", "path_2": "low"})})[0]["a"]
    other = run(pipeline, engine, {"b": replace(p, lora={"path": "low", "path_2": "high"})})[0]["b"]
    assert [len(loaded) for loaded in engine.lora.loaded] == [1, 1]
    assert [len(t.peft_config) for t in engine.model.transformers] == [1, 1]  # unloaded from the DiT too
    again = run(pipeline, engine, {"c": replace(p, lora={"path": "high", "path_2": "low"})})[0]["c"]
    np.testing.assert_allclose(again, first, rtol=0, atol=ATOL)
    assert differs(other, first)


def test_bad_loras_are_400s(tiny_wan_t2v: str, tiny_wan_ti2v: str, loras: Path, tmp_path: Path) -> None:
    outside = make_tiny_lora(tiny_wan_t2v, tmp_path / "evil")
    pipeline = load_pipeline(tiny_wan_t2v, deploy(lora_root=str(loras)))
    engine = pipeline.build_engine("dit")
    requests = {"escape": ({"path": "high", "path_2": "../" * 8 + str(outside).lstrip("/")}, "lora.path_2"),
                "absolute": ({"path_2": str(outside)}, "lora.path_2"),
                "missing": ({"path": "nope", "path_2": "low"}, "lora.path"),
                "empty-dir": ({"path_2": "empty"}, "lora.path_2")}
    _, failures, _ = run(pipeline, engine, {rid: replace(T2V, lora=lora) for rid, (lora, _) in requests.items()})
    assert {rid: out.error_status for rid, out in failures.items()} == dict.fromkeys(requests, 400)
    assert "inside the server's LoRA directory" in failures["escape"].error
    for rid, (_, field) in requests.items():
        assert field in failures[rid].error, failures[rid].error
    # a one-DiT checkpoint has no second expert to put path_2's adapter on
    ti2v = load_pipeline(tiny_wan_ti2v, deploy(lora_root=str(loras)))
    _, failures, _ = run(ti2v, ti2v.build_engine("dit"), {"a": replace(TI2V, lora={"path_2": "low"})})
    assert failures["a"].error_status == 400 and "this model has one DiT" in failures["a"].error
    for lora, field in (({"name": "x"}, "lora"), ({"path": "high", "scale_2": 11}, "lora.scale_2"),
                        ({"path": "high", "path_3": "low"}, "lora")):
        with pytest.raises(RequestError) as info:
            replace(T2V, lora=lora).check()
        assert info.value.param == field and info.value.status == 400


def test_two_expert_lora_over_http(tiny_wan_t2v: str, loras: Path) -> None:
    """/v1/videos/sync takes the lora object as a JSON string (form fields); a bad path_2 is a 400 naming it."""
    from omnistage.entrypoints.async_omni import AsyncOmni
    from omnistage.entrypoints.openai.server import BackgroundServer

    engine = AsyncOmni.from_model(tiny_wan_t2v, deploy(lora_root=str(loras)), served_model_name="wan")
    fields = {"prompt": "a fox", "size": "48x32", "num_frames": "5", "num_inference_steps": "2", "seed": "3",
              "max_sequence_length": "32"}
    try:
        with BackgroundServer(engine) as server, httpx.Client(base_url=server.url, timeout=120) as client:
            bad = client.post("/v1/videos/sync", data={**fields, "lora": json.dumps({"path_2": "../low"})})
            assert bad.status_code == 400, bad.text
            assert "lora.path_2" in bad.json()["error"]["message"], bad.text
            mp4s = [client.post("/v1/videos/sync", data={**fields, **lora}) for lora in
                    ({}, {"lora": json.dumps({"path": "high", "path_2": "low", "scale_2": 0.5})})]
            assert all(r.status_code == 200 and r.headers["content-type"] == "video/mp4" for r in mp4s)
            assert mp4s[0].content != mp4s[1].content
    finally:
        engine.shutdown()
