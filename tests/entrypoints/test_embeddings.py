"""/v1/embeddings on a real server with the official client: one vector per input, of the model's hidden size,
equal to transformers' final hidden state (last token, normalised), the same whether sent alone or batched with
generation; mean pooling as configured; errors for what cannot be served."""

from __future__ import annotations

import base64

import numpy as np
import openai
import pytest
import torch
from openai_helpers import CHAT, Served, assert_openai_error

from omnistage.entrypoints.openai.embeddings import router
from omnistage.entrypoints.openai.server import BackgroundServer, ServerOptions


@pytest.fixture(scope="module")
def reference(tiny_qwen2: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_qwen2)

    def hidden(text: str) -> torch.Tensor:
        ids = tok(text, return_tensors="pt").input_ids
        with torch.no_grad():
            return model(ids, output_hidden_states=True).hidden_states[-1][0]

    return hidden


def _client(served: Served) -> openai.OpenAI:
    if not any(getattr(r, "path", None) == "/v1/embeddings" for r in served.server.server.config.app.routes):
        served.server.server.config.app.include_router(router)
    return served.client()


def test_embeddings_equal_transformers(real_served: Served, reference) -> None:
    client = _client(real_served)
    texts = ["The river runs.", "A stone, a light, the wind.", "x"]  # "x": one token, like a decode step
    out = client.embeddings.create(model=real_served.model, input=texts)
    assert [d.index for d in out.data] == [0, 1, 2] and out.usage.prompt_tokens > 0
    for text, item in zip(texts, out.data, strict=True):
        want = torch.nn.functional.normalize(reference(text)[-1], dim=-1)
        torch.testing.assert_close(torch.tensor(item.embedding), want, rtol=1e-4, atol=1e-5)
    single = client.embeddings.create(model=real_served.model, input=texts[1]).data[0].embedding
    np.testing.assert_allclose(single, out.data[1].embedding, rtol=1e-5, atol=1e-6)
    raw = client.embeddings.create(model=real_served.model, input=texts[1], encoding_format="base64")
    packed = raw.data[0].embedding
    decoded = np.frombuffer(base64.b64decode(packed), np.float32) if isinstance(packed, str) else np.array(packed)
    np.testing.assert_allclose(decoded, single, rtol=1e-5, atol=1e-6)
    # generation beside it is unchanged and the cache is freed
    assert client.chat.completions.create(model=real_served.model, messages=CHAT, max_tokens=3).choices[0]
    assert real_served.wait_idle()


def test_mean_pooling_as_configured(tiny_qwen2: str, reference) -> None:
    from omnistage.entrypoints.async_omni import AsyncOmni

    deploy = {"stages": {"lm": {"dtype": "float32", "options": {"pooling": "mean", "normalize": False}}}}
    engine = AsyncOmni.from_model(tiny_qwen2, deploy, served_model_name="m")
    try:
        with BackgroundServer(engine) as server:
            server.server.config.app.include_router(router)
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
            for _ in range(2):  # the second time the prompt's blocks are cached: mean pooling must not use them
                got = client.embeddings.create(model="m", input="The river runs over the stones.").data[0]
                torch.testing.assert_close(torch.tensor(got.embedding), reference(
                    "The river runs over the stones.").mean(0), rtol=1e-4, atol=1e-5)
    finally:
        engine.shutdown()


def test_bad_requests(real_served: Served) -> None:
    _client(real_served)
    http = real_served.http()
    assert_openai_error(http.post("/v1/embeddings", json={"model": real_served.model, "input": []}), 400, "input")
    assert_openai_error(http.post("/v1/embeddings", json={"model": real_served.model, "input": "x",
                                                          "dimensions": 3}), 400, "dimensions")
    assert_openai_error(http.post("/v1/embeddings", json={"model": real_served.model, "input": [10**9]}), 400)


def test_inputs_count_against_the_admission_limit(tiny_qwen2: str) -> None:
    """Each input is a generation the server admits: more inputs than it runs at once is a 400 saying so, and
    a request that fits is served (and released: a second one fits too)."""
    from omnistage.entrypoints.async_omni import AsyncOmni

    engine = AsyncOmni.from_model(tiny_qwen2, {"stages": {"lm": {"dtype": "float32"}}}, served_model_name="m")
    try:
        with BackgroundServer(engine, options=ServerOptions(max_queued_requests=2)) as server:
            server.server.config.app.include_router(router)
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
            with pytest.raises(openai.BadRequestError, match="at most 2 at once"):
                client.embeddings.create(model="m", input=["a", "b", "c"])
            for _ in range(2):
                assert len(client.embeddings.create(model="m", input=["a", "b"]).data) == 2
    finally:
        engine.shutdown()
