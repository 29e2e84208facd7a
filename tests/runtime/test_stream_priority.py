"""Which CUDA stream priority each inline stage gets by default (launch.stream_priority)."""

from __future__ import annotations

from omnistage.runtime.launch import build_pipeline, stream_priority


def test_a_decoder_fed_by_a_decoder_runs_first_and_a_solver_last(tiny_qwen2_5_omni: str) -> None:
    """The talker decodes many more steps than the thinker it follows, which runs ahead of it: its kernels go
    first; token2wav's long solves fill what is left. A deploy config's choice wins."""
    pipeline = build_pipeline(tiny_qwen2_5_omni, {"stages": {"*": {"max_model_len": 256}}})
    assert {s: stream_priority(pipeline, s) for s in ("thinker", "talker", "token2wav")} == {
        "thinker": "high", "talker": "highest", "token2wav": "normal"}
    chosen = build_pipeline(tiny_qwen2_5_omni, {"stages": {"talker": {"stream_priority": "high"}}})
    assert stream_priority(chosen, "talker") == "high"
