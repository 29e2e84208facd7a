"""The Ray backend: a two-stage pipeline on a local Ray cluster (started here) gives the same
tokens as the inline backend, with every stage replica a Ray actor and payloads over TCP."""

from __future__ import annotations

import pytest

from omnistage import Omni, SamplingParams

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
        assert [o.error for o in outs] == [None] * 3
        assert [o.token_ids for o in outs] == expected
        assert all(s[0]["in_transfers"] > 0 and s[0]["out_transfers"] > 0 for s in stats.values())
    finally:
        ray.shutdown()
