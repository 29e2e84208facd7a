"""A test-only family with two AR stages: `draft` writes a continuation, `refine` continues
the draft's tokens. Its handoff streams (async_chunk) or passes the whole draft at the end."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from omnistage.families.base import CheckpointInfo, Edge, StageSpec
from omnistage.families.causal_lm import CausalLMFamily, CausalLMPipeline, build_ar_engine
from omnistage.families.registry import PLUGINS_ENV
from omnistage.sampling_params import SamplingParams
from omnistage.types import OmniRequest, StageInput, StageOutput

MARKER = "omnistage_test_pipeline"


def draft_to_refine(request: OmniRequest, out: StageOutput) -> StageInput | None:
    if not out.token_ids and not out.finished:
        return None
    params = request.stage_params.get("refine") or SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    return StageInput(out.request_id, list(out.token_ids), params=params, final=out.finished)


class TwoStagePipeline(CausalLMPipeline):
    def preprocess(self, request: OmniRequest) -> StageInput:
        params = request.stage_params.get("draft") or SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        return StageInput(request.request_id, self.tokenize(request), params=params)

    def build_engine(self, stage: str, device: str | None = None):
        return build_ar_engine(self, stage, device)


class TwoStageFamily(CausalLMFamily):
    name = "test_two_stage"

    def matches(self, info: CheckpointInfo) -> bool:
        return (info.config or {}).get(MARKER) == "two_stage"

    def pipeline(self, info, deploy):
        base = super().pipeline(info, deploy.model_copy(update={"stages": {}}))
        stages = [StageSpec("draft", "ar"), StageSpec("refine", "ar", outputs=("text",))]
        pipeline = TwoStagePipeline(info.path, deploy, stages, [Edge("draft", "refine", draft_to_refine)])
        pipeline.tokenizer, pipeline.max_model_len = base.tokenizer, base.max_model_len
        return pipeline


def make_two_stage_checkpoint(src: str, dst: Path) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config[MARKER] = "two_stage"
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@contextlib.contextmanager
def two_stage_plugin() -> Iterator[None]:
    """Make the family findable here and in stage worker processes (which start fresh)."""
    before = os.environ.get(PLUGINS_ENV)
    os.environ[PLUGINS_ENV] = f"{TwoStageFamily.__module__}:{TwoStageFamily.__name__}"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(PLUGINS_ENV, None)
        else:
            os.environ[PLUGINS_ENV] = before
