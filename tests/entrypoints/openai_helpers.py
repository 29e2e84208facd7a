"""Shared pieces of the server tests: a scripted FakeEngine, a handle on a running server, assertions.
(Not a conftest so test modules can import it by a unique name.)"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import torch

from omnistage.entrypoints.openai.server import BackgroundServer
from omnistage.errors import RequestError
from omnistage.sampling_params import SamplingParams
from omnistage.types import OmniOutput, OmniRequest, TokenLogprob

API_KEY = "test-key"
CHAT = [{"role": "user", "content": "Tell me about the river."}]
CHAT_FAIL = [{"role": "user", "content": "please FAIL"}]
AUDIO_CHUNK = 160


def wait_for(predicate: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def assert_openai_error(resp: httpx.Response, status: int, *words: str) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    for word in words:
        assert word in err["message"], err["message"]
    return err


def assert_still_serving(served: Served) -> None:
    out = served.client().chat.completions.create(model=served.model, messages=CHAT, max_tokens=3)
    assert out.choices[0].message.content and out.usage.completion_tokens == 3


def sse_events(resp: httpx.Response) -> list[str]:
    return [line[len("data: ") :] for line in resp.iter_lines() if line.startswith("data: ")]


class FakeEngine:
    """Scripted stand-in for AsyncOmni. Prompt tokens: one per word. Output token k is id 100+k spelled
    " w<k>"; with "audio" among a request's output modalities each delta also carries samples. A prompt
    containing FAIL gets a stage error after two tokens; RAISE makes generate raise an unexpected
    exception. `running` tracks live requests so tests can see aborts."""

    served_model_name = "fake-model"
    max_model_len = 64
    output_modalities = ("text",)
    tokenizer = None

    def __init__(self, delay: float = 0.002) -> None:
        self.delay = delay
        self.running: set[str] = set()
        self.requests: list[OmniRequest] = []
        self.aborted: list[str] = []
        self.ready = True

    def default_sampling_params(self) -> SamplingParams:
        return SamplingParams()

    def health(self) -> tuple[bool, str]:
        return self.ready, "ok" if self.ready else "stopped"

    def stats(self) -> dict[str, dict]:
        n = len(self.running)
        return {"fake": {"num_running": n, "num_waiting": 0, "kv_blocks_used": n, "kv_blocks_total": 16}}

    @staticmethod
    def _prompt(request: OmniRequest) -> tuple[str, int]:
        if request.messages is not None:
            if not request.messages:
                raise RequestError("messages must not be empty")
            text = " ".join(str(m.get("content")) for m in request.messages)
            return text, len(text.split()) + 3
        if request.prompt_token_ids is not None:
            return "", len(request.prompt_token_ids)
        return request.prompt or "", len((request.prompt or "").split())

    async def generate(self, request: OmniRequest) -> AsyncIterator[OmniOutput]:
        params: SamplingParams = request.stage_params["*"]
        text, n_prompt = self._prompt(request)
        if "RAISE" in text:
            raise RuntimeError("scripted crash")
        budget = self.max_model_len - n_prompt
        if params.max_tokens is not None and params.max_tokens > budget:
            raise RequestError(
                f"prompt ({n_prompt} tokens) + max_tokens ({params.max_tokens}) exceeds max_model_len "
                f"({self.max_model_len})",
                param="max_tokens",
            )
        self.requests.append(request)
        self.running.add(request.request_id)
        max_tokens = params.max_tokens or budget
        emitted = ""
        try:
            for k in range(max_tokens):
                await asyncio.sleep(self.delay)
                piece = f" w{k}"
                if "FAIL" in text and k == 2:
                    yield OmniOutput(
                        request.request_id,
                        finished=True,
                        finish_reason="error",
                        error="stage 'fake' failed: boom",
                    )
                    return
                stop = next((s for s in params.stop if s in emitted + piece), None)
                if stop is not None:
                    piece = (emitted + piece).split(stop)[0][len(emitted) :]
                lp = None
                if params.logprobs is not None:
                    top = [(100 + k + j, -0.5 - j) for j in range(params.logprobs)]
                    lp = [TokenLogprob(100 + k, -0.5, top)]
                last = stop is not None or k == max_tokens - 1
                emitted += piece
                yield OmniOutput(
                    request.request_id,
                    text=piece,
                    token_ids=[100 + k],
                    logprobs=lp,
                    finished=last,
                    finish_reason=("stop" if stop is not None else "length") if last else None,
                    num_prompt_tokens=n_prompt,
                    num_output_tokens=k + 1,
                    **self._audio(request, k),
                )
                if last:
                    return
        finally:
            self.running.discard(request.request_id)

    @staticmethod
    def _audio(request: OmniRequest, k: int) -> dict[str, Any]:
        """With "audio" requested, every token comes with AUDIO_CHUNK samples of a ramp at 16 kHz."""
        if "audio" not in request.output_modalities:
            return {}
        return {"audio": (torch.linspace(-0.5, 0.5, AUDIO_CHUNK) * (k + 1) / 8).numpy(), "sample_rate": 16000}

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def shutdown(self) -> None:
        self.ready = False


@dataclass
class Served:
    """A running server plus ways to talk to it."""

    engine: Any
    server: BackgroundServer
    kind: str
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def model(self) -> str:
        return self.engine.served_model_name

    def client(self, **kw: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0, **kw)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)

    def idle(self) -> bool:
        return all(s["num_running"] == 0 and s["kv_blocks_used"] == 0 for s in self.engine.stats().values())

    def wait_idle(self, timeout: float = 5.0) -> bool:
        return wait_for(self.idle, timeout)
