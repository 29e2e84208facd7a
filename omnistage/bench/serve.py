"""Load generator for a running OpenAI-compatible server (ours or any other), so serving speed can be
compared side by side: streams /v1/completions and measures TTFT, TPOT, ITL and throughput."""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

# Common English words: most tokenizers spell each as one token, so a prompt of N words is about N tokens.
_WORDS = (
    "the of and to in is was for on that with as by at from his it an were are which this be or has had not "
    "first one their its new after who they have her she two been other when there all during into school "
    "time may years more most only over city some world would where later up such used many can state about "
    "national out known university united then made because between water life year part well through "
    "under while long family film team music war high house game group work since each number small book "
    "river light north south east west early great little old good open road town name people public line "
    "story power point order place field child sound paper garden market window table letter summer"
).split()


def synthetic_prompts(num: int, words_per_prompt: int, seed: int) -> list[str]:
    """Random-word prompts, each different so a prefix cache cannot make the load trivial."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(max(1, words_per_prompt))) for _ in range(num)]


@dataclass
class RequestResult:
    ok: bool = False
    error: str | None = None
    ttft: float | None = None
    latency: float = 0.0
    itls: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0


class StreamError(Exception):
    """An HTTP error status, or an error event, in a streamed response."""


async def stream_events(client: httpx.AsyncClient, url: str, payload: dict,
                        headers: dict[str, str] | None = None) -> AsyncIterator[dict[str, Any]]:
    """POST `payload` and yield the JSON events of the server-sent stream until `[DONE]`; an HTTP error status or
    an error event raises StreamError with the server's message."""
    async with client.stream("POST", url, json=payload, headers=headers) as resp:
        if resp.status_code != 200:
            raise StreamError(f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:200]}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                return
            obj = json.loads(data)
            if "error" in obj:
                raise StreamError(str(obj["error"].get("message")))
            yield obj


async def _one(client: httpx.AsyncClient, url: str, headers: dict[str, str], payload: dict) -> RequestResult:
    """Stream one completion; a chunk carrying text (or, when asked for, token ids) counts as a token
    arrival. Token ids matter when tokens may decode to no text, e.g. random-weight models."""
    result = RequestResult()
    start = last = time.perf_counter()
    try:
        async for obj in stream_events(client, url, payload, headers):
            if obj.get("usage"):
                result.prompt_tokens = obj["usage"]["prompt_tokens"]
                result.output_tokens = obj["usage"]["completion_tokens"]
            if any(c.get("text") or c.get("token_ids") for c in obj.get("choices", [])):
                now = time.perf_counter()
                if result.ttft is None:
                    result.ttft = now - start
                else:
                    result.itls.append(now - last)
                last = now
    except StreamError as exc:
        result.error = str(exc)
        return result
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.latency = time.perf_counter() - start
    result.ok = result.ttft is not None
    if not result.ok:
        result.error = "stream ended without any text"
    return result


def _summary(values_s: list[float]) -> dict[str, float | None]:
    """mean / median / p99 in milliseconds (None when there is nothing to summarise)."""
    if not values_s:
        return {"mean": None, "median": None, "p99": None}
    ms = np.asarray(values_s) * 1000.0
    return {
        "mean": round(float(ms.mean()), 3),
        "median": round(float(np.median(ms)), 3),
        "p99": round(float(np.percentile(ms, 99)), 3),
    }


async def _served_model(client: httpx.AsyncClient, base_url: str, headers: dict[str, str]) -> str:
    resp = await client.get(f"{base_url}/v1/models", headers=headers)
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


async def bench_serve(
    base_url: str,
    model: str | None = None,
    num_prompts: int = 100,
    concurrency: int | None = None,
    request_rate: float = math.inf,
    input_len: int = 128,
    output_len: int = 128,
    api_key: str | None = None,
    seed: int = 0,
    return_token_ids: bool = False,
) -> dict[str, Any]:
    """Async form of `run_bench`, for callers already inside an event loop. `return_token_ids` uses
    omnistage's extension so that tokens without text still count (other servers may reject it)."""
    base_url = base_url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    concurrency = concurrency or num_prompts
    rng = random.Random(seed)
    prompts = synthetic_prompts(num_prompts, input_len, seed)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0), limits=limits) as client:
        model = model or await _served_model(client, base_url, headers)
        gate = asyncio.Semaphore(concurrency)

        async def limited(prompt: str) -> RequestResult:
            payload = {
                "model": model,
                "prompt": prompt,
                "max_tokens": output_len,
                "ignore_eos": True,
                "temperature": 0.0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            if return_token_ids:
                payload["return_token_ids"] = True
            async with gate:
                return await _one(client, f"{base_url}/v1/completions", headers, payload)

        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(limited(prompt)))
            if math.isfinite(request_rate) and request_rate > 0:
                await asyncio.sleep(rng.expovariate(request_rate))  # Poisson arrivals
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start

    done = [r for r in results if r.ok]
    errors = [r.error for r in results if not r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens for r in done)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.ttft is not None and r.output_tokens > 1]
    return {
        "base_url": base_url,
        "model": model,
        "num_prompts": num_prompts,
        "concurrency": concurrency,
        "request_rate": request_rate if math.isfinite(request_rate) else "inf",
        "input_len_words": input_len,
        "output_len": output_len,
        "completed": len(done),
        "errors": len(errors),
        "error_samples": list(dict.fromkeys(errors))[:5],
        "duration_s": round(duration, 4),
        "mean_prompt_tokens": round(in_tokens / len(done), 2) if done else None,
        "total_output_tokens": out_tokens,
        "request_throughput": round(len(done) / duration, 4) if duration else None,
        "output_token_throughput": round(out_tokens / duration, 3) if duration else None,
        "total_token_throughput": round((in_tokens + out_tokens) / duration, 3) if duration else None,
        "ttft_ms": _summary([r.ttft for r in done if r.ttft is not None]),
        "tpot_ms": _summary(tpots),
        "itl_ms": _summary([x for r in done for x in r.itls]),
        "e2e_latency_ms": _summary([r.latency for r in done]),
    }


def run_bench(base_url: str, model: str | None = None, **options: Any) -> dict[str, Any]:
    """`bench_serve` from synchronous code: send `num_prompts` streaming completions (at most
    `concurrency` in flight; Poisson arrivals at `request_rate` req/s unless inf) and return the
    measurements as a JSON-ready dict. Options as for `bench_serve`."""
    return asyncio.run(bench_serve(base_url, model, **options))
