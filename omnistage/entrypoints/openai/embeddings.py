"""`POST /v1/embeddings` (OpenAI's shape) on models whose pipeline pools its prompt (causal LMs: the final hidden
state of the last token or the mean over all tokens, as the deploy config's `stages.lm.options.pooling` says).

Each input is one prefill-only request through the same engine that serves completions, so embedding traffic
batches with generation traffic.
"""

from __future__ import annotations

import base64
import uuid
from typing import Any, Literal

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field, field_validator

from omnistage.entrypoints.openai.protocol import _Strict
from omnistage.entrypoints.openai.serving import check_model, run_admitted
from omnistage.errors import RequestError
from omnistage.types import OmniRequest

MAX_INPUTS = 256
router = APIRouter()


class EmbeddingRequest(_Strict):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None

    @field_validator("input")
    @classmethod
    def _inputs(cls, value: Any) -> Any:
        rows = [value] if isinstance(value, str) or (value and isinstance(value[0], int)) else value
        if not rows or any(len(r) == 0 for r in rows):
            raise ValueError("input must be a non-empty string, token-id list, or list of them")
        if len(rows) > MAX_INPUTS:
            raise ValueError(f"at most {MAX_INPUTS} inputs per request")
        return value

    def prompts(self) -> list[dict[str, Any]]:
        value = self.input
        if isinstance(value, str):
            return [{"prompt": value}]
        if isinstance(value[0], int):
            return [{"prompt_token_ids": list(value)}]
        return [{"prompt": v} if isinstance(v, str) else {"prompt_token_ids": list(v)} for v in value]


def _encoded(vector: np.ndarray, fmt: str) -> list[float] | str:
    vector = vector.astype(np.float32)
    return base64.b64encode(vector.tobytes()).decode() if fmt == "base64" else vector.tolist()


@router.post("/v1/embeddings", response_model=None)
async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
    engine = request.app.state.engine
    model = check_model(request.app.state.model_names, body.model)
    pipeline = getattr(engine, "pipeline", None)
    if not getattr(pipeline, "serves_embeddings", False):
        raise RequestError("this model does not serve embeddings (only causal LMs do)", "model", status=400)
    rid = f"embd-{uuid.uuid4().hex}"
    prompts = body.prompts()
    requests = [OmniRequest(request_id=f"{rid}-{i}", options={"embed": True}, **p) for i, p in enumerate(prompts)]
    outputs = await run_admitted(request, requests)  # admitted like every generation: 429 over the limit
    if isinstance(outputs, Response):  # the client left (499)
        return outputs
    size = len(outputs[0].embedding)
    if body.dimensions is not None and body.dimensions != size:
        raise RequestError(f"this model's embeddings have {size} dimensions; omit 'dimensions' or send {size}",
                           "dimensions")
    data = [{"object": "embedding", "index": i, "embedding": _encoded(out.embedding, body.encoding_format)}
            for i, out in enumerate(outputs)]
    tokens = sum(out.num_prompt_tokens for out in outputs)
    return JSONResponse({"object": "list", "data": data, "model": model,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
