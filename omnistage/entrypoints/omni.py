"""Omni: the synchronous, offline API. Give it many prompts; get one merged result each."""

from __future__ import annotations

import itertools
import queue
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omnistage.config.deploy import DeployConfig
from omnistage.families.registry import load_pipeline
from omnistage.runtime.launch import start_orchestrator
from omnistage.sampling_params import SamplingParams
from omnistage.types import OmniOutput, OmniRequest

Prompt = str | list[int] | list[dict[str, Any]]  # text, token ids, or chat messages
Params = SamplingParams | dict[str, SamplingParams]  # for every stage, or by stage name


class Omni:
    def __init__(self, model: str | Path, deploy_config: str | Path | dict | DeployConfig | None = None,
                 overrides: dict[str, Any] | None = None):
        self.pipeline = load_pipeline(model, deploy_config, overrides)
        self.orchestrator = start_orchestrator(self.pipeline)
        self.tokenizer = self.pipeline.tokenizer
        self._ids = itertools.count()

    def _request(
        self, prompt: Prompt, params: Params | None, modalities: tuple[str, ...], options: dict[str, Any]
    ) -> OmniRequest:
        rid = f"omni-{next(self._ids)}"
        stage_params = params if isinstance(params, dict) else {"*": params} if params is not None else {}
        common = {"request_id": rid, "stage_params": stage_params, "output_modalities": modalities,
                  "options": dict(options)}
        if isinstance(prompt, str):
            return OmniRequest(prompt=prompt, **common)
        if prompt and isinstance(prompt[0], dict):
            return OmniRequest(messages=list(prompt), **common)
        return OmniRequest(prompt_token_ids=list(prompt), **common)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: Params | Sequence[Params] | None = None,
        output_modalities: tuple[str, ...] = ("text",),
        **options: Any,
    ) -> list[OmniOutput]:
        """Run every prompt concurrently (they batch inside the engines); results in input order.
        `options` go to the model family (e.g. `voice="Ethan"` for speech)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], (int, dict))):
            prompts = [prompts]  # one prompt: text, token ids or chat messages
        params = list(sampling_params) if isinstance(sampling_params, Sequence) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts; give one or one each")
        requests = [self._request(p, sp, output_modalities, options) for p, sp in zip(prompts, params, strict=True)]
        done: queue.SimpleQueue[OmniOutput] = queue.SimpleQueue()
        results = {r.request_id: OmniOutput(r.request_id) for r in requests}
        submitted = []
        try:
            for r in requests:
                self.orchestrator.submit(r, done.put)
                submitted.append(r.request_id)
            remaining = len(requests)
            while remaining:
                out = done.get()
                results[out.request_id].merge(out)
                remaining -= out.finished
        except BaseException:
            for rid in submitted:
                self.orchestrator.abort(rid)
            raise
        return [results[r.request_id] for r in requests]

    def stats(self) -> dict[str, dict]:
        return self.orchestrator.stats()

    def shutdown(self) -> None:
        self.orchestrator.shutdown()

    def __enter__(self) -> Omni:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
