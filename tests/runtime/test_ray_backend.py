"""The Ray backend: a two-stage pipeline on a local Ray cluster (started here) gives the same
tokens as the inline backend, with every stage replica a Ray actor and payloads over TCP. On a
machine with a GPU the two stages share it (one placement-group bundle, half a GPU each), as the
one-GPU deploy configs' stages share cuda:0."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omnistage import Omni, SamplingParams
from omnistage.errors import ConfigError
from omnistage.families.registry import load_pipeline
from omnistage.runtime.launch import ray_gpu_shares

from .two_stage_family import make_two_stage_checkpoint, two_stage_plugin

ray = pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'omnistage[ray]'")


@pytest.fixture(scope="module")
def two_stage_path(tiny_qwen2: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    with two_stage_plugin():
        yield str(make_two_stage_checkpoint(tiny_qwen2, tmp_path_factory.mktemp("two") / "ckpt"))


def test_two_stages_on_ray_equal_inline(two_stage_path: str) -> None:
    params = {"draft": SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
              "refine": SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)}
    prompts = [[1, 2, 3, 4], [9, 8, 7], [5]]
    base = {"async_chunk": True, "stages": {"*": {"max_model_len": 128, "block_size": 4}}}
    with Omni(two_stage_path, base) as omni:
        expected = [o.token_ids for o in omni.generate(prompts, params)]
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        with Omni(two_stage_path, base | {"worker_backend": "ray"}) as omni:
            outs = omni.generate(prompts, params)
            stats = omni.orchestrator.replica_stats()
            groups = [g["bundles"] for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
        assert groups == ([{0: {"CPU": 2.0, "GPU": 1.0}}] if torch.cuda.is_available() else [])  # one GPU, shared
        assert all(g["state"] == "REMOVED" for g in ray.util.placement_group_table().values())  # given back
        assert [o.error for o in outs] == [None] * 3
        assert [o.token_ids for o in outs] == expected
        assert all(s[0]["in_transfers"] > 0 and s[0]["out_transfers"] > 0 for s in stats.values())
    finally:
        ray.shutdown()


def test_gpu_layout_shares_a_gpu_per_device_id_and_replica(two_stage_path: str) -> None:
    """Device ids are a layout on Ray: the stages of replica r naming the same first id share one GPU in equal
    parts; further replicas get GPUs of their own; CPU stages and GPU-less clusters reserve none."""
    def layout(stages: dict, has_gpus: bool = True):
        return ray_gpu_shares(load_pipeline(two_stage_path, {"stages": stages}), has_gpus)

    assert layout({}) == ([("0", 0)], {("draft", 0): (0, 0.5), ("refine", 0): (0, 0.5)})
    assert layout({}, has_gpus=False) == ([], {})
    assert layout({"refine": {"devices": "cpu"}}) == ([("0", 0)], {("draft", 0): (0, 1.0)})
    assert layout({"draft": {"devices": "0"}, "refine": {"devices": "1,2"}}) == (
        [("0", 0), ("1", 0)], {("draft", 0): (0, 1.0), ("refine", 0): (1, 1.0)})
    bundles, shares = layout({"draft": {"replicas": 3}})
    assert bundles == [("0", 0), ("0", 1), ("0", 2)]
    assert shares == {("draft", 0): (0, 0.5), ("draft", 1): (1, 1.0), ("draft", 2): (2, 1.0), ("refine", 0): (0, 0.5)}


def test_the_shipped_omni_configs_fit_their_gpus_on_ray(tiny_qwen2_5_omni: str) -> None:
    """1gpu.yaml's three stages fit one GPU (thirds that Ray can add up to at most 1), 2gpu.yaml's two."""
    configs = Path(__file__).parents[2] / "configs" / "qwen2_5_omni"
    bundles, shares = ray_gpu_shares(load_pipeline(tiny_qwen2_5_omni, configs / "1gpu.yaml"), has_gpus=True)
    assert bundles == [("0", 0)] and {f for _, f in shares.values()} == {0.3333}
    bundles, shares = ray_gpu_shares(load_pipeline(tiny_qwen2_5_omni, configs / "2gpu.yaml"), has_gpus=True)
    assert len(bundles) == 2 and shares[("talker", 0)] == (bundles.index(("1", 0)), 1.0)


def test_a_layout_wider_than_the_cluster_fails_at_once_naming_it(two_stage_path: str) -> None:
    """A cluster with one GPU (declared: Ray counts GPUs as resources) asked for two: a ConfigError that names
    the layout before any actor starts, not actors waiting forever for a GPU."""
    ray.init(num_cpus=4, num_gpus=1, include_dashboard=False, log_to_driver=False)
    try:
        deploy = {"worker_backend": "ray", "stages": {"refine": {"devices": "1"}, "*": {"max_model_len": 128}}}
        with pytest.raises(ConfigError, match=r"need 2 GPUs \(GPU 0 \(device '0', replica 0\): draft; GPU 1 "
                                              r"\(device '1', replica 0\): refine\) but the cluster has 1"):
            Omni(two_stage_path, deploy)
        assert ray.util.placement_group_table() == {}  # nothing reserved
    finally:
        ray.shutdown()
