"""Load generator for a running OpenAI-compatible server (ours or any other), so serving speed can be compared
side by side.

Modes (a `Mode` says which route a request goes to and what each streamed event carries):
  text   streams /v1/completions: TTFT, TPOT, ITL, throughput;
  audio  streams /v1/chat/completions with modalities text+audio (pcm16) against a speech model: also time to
         first audio, RTF (wall seconds per second of audio produced; below 1 is faster than real time)
         and stalls (where a client playing each chunk as it arrives would have run dry).
A TTS mode (/v1/audio/speech with `stream_format: "sse"`, whose `speech.audio.delta` events carry base64 audio)
is one more Mode: its request builder and its event reader; the measurements are shared.

`--input-len` counts tokens: prompts are cut to that many tokens with the server's tokenizer (POST /tokenize and
/detokenize, as omnistage and vLLM serve them), or with a local one (`--tokenizer PATH`), else approximated by that
many common words (most tokenizers spell each as one token), and the result says which.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import math
import random
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from omnistage import envs

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

PCM16_RATE = 24000  # OpenAI's pcm16: 16-bit little-endian mono at 24 kHz (Qwen2.5-Omni speaks at this rate)
# The openai client's own variable, a fallback after OMNISTAGE_API_KEY (declared here until envs.py has it).


class BenchError(Exception):
    """The benchmark cannot run at all (server unreachable, key refused, bad arguments): one readable line."""


def api_key_from_env() -> str | None:
    return envs.API_KEY.get() or envs.OPENAI_API_KEY.get()


def synthetic_prompts(num: int, words_per_prompt: int, seed: int) -> list[str]:
    """Random-word prompts, each different so a prefix cache cannot make the load trivial."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(max(1, words_per_prompt))) for _ in range(num)]


# ---------------------------------------------------------------- prompts of a number of tokens


class Tokenizer:
    """encode/decode without special tokens, by the server (/tokenize, /detokenize) or a local HF tokenizer."""

    method = "approximate"

    async def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    async def decode(self, ids: list[int]) -> str:
        raise NotImplementedError


class ServerTokenizer(Tokenizer):
    method = "server /tokenize"

    def __init__(self, client: httpx.AsyncClient, base_url: str, headers: dict[str, str], model: str) -> None:
        self.client, self.base_url, self.headers, self.model = client, base_url, headers, model

    async def encode(self, text: str) -> list[int]:
        resp = await self.client.post(f"{self.base_url}/tokenize", headers=self.headers,
                                      json={"model": self.model, "prompt": text, "add_special_tokens": False})
        resp.raise_for_status()
        return list(resp.json()["tokens"])

    async def decode(self, ids: list[int]) -> str:
        resp = await self.client.post(f"{self.base_url}/detokenize", headers=self.headers,
                                      json={"model": self.model, "tokens": ids})
        resp.raise_for_status()
        return resp.json()["prompt"]

    @classmethod
    async def probe(cls, client: httpx.AsyncClient, base_url: str, headers: dict[str, str],
                    model: str) -> ServerTokenizer | None:
        """The server's tokenizer, if it serves /tokenize and /detokenize for `model`."""
        tok = cls(client, base_url, headers, model)
        try:
            await tok.decode(await tok.encode("hello world"))
        except (httpx.HTTPError, KeyError, TypeError, ValueError):
            return None
        return tok


class LocalTokenizer(Tokenizer):
    method = "local tokenizer"

    def __init__(self, path: str) -> None:
        try:
            from transformers import AutoTokenizer

            self.tok = AutoTokenizer.from_pretrained(path)
        except Exception as exc:  # a bad path or a directory without tokenizer files
            raise BenchError(f"cannot load a tokenizer from --tokenizer {path}: "
                             f"{' '.join(str(exc).split())[:200]}") from None
        self.method = f"local tokenizer {path}"

    async def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    async def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)


async def prompt_of_tokens(tok: Tokenizer, words: list[str], num_tokens: int) -> tuple[str, int]:
    """A prompt of random words cut to `num_tokens` tokens, and its length re-tokenized (almost always exactly
    `num_tokens`; a cut inside a multi-token word may re-tokenize one off, which then gets trimmed)."""
    n_words = num_tokens + 8
    while True:
        ids = await tok.encode(" ".join(words[i % len(words)] for i in range(n_words)))
        if len(ids) >= num_tokens or n_words > 8 * num_tokens + 64:
            break
        n_words *= 2
    ids = ids[:num_tokens]
    for _ in range(3):
        text = await tok.decode(ids)
        again = await tok.encode(text)
        if len(again) <= num_tokens:
            return text, len(again)
        ids = again[:num_tokens - (len(again) - num_tokens)]
    return text, len(again)


async def build_prompts(tok: Tokenizer | None, num: int, input_len: int, seed: int) -> tuple[list[str], list[int]]:
    """`num` different prompts of `input_len` tokens (counts as tokenized), or of `input_len` words without a
    tokenizer (counts unknown: empty)."""
    if tok is None:
        return synthetic_prompts(num, input_len, seed), []
    rng = random.Random(seed)
    gate = asyncio.Semaphore(8)

    async def one() -> tuple[str, int]:
        words = [rng.choice(_WORDS) for _ in range(input_len + 8)]
        async with gate:
            return await prompt_of_tokens(tok, words, max(1, input_len))

    built = await asyncio.gather(*(one() for _ in range(num)))
    return [p for p, _ in built], [n for _, n in built]


# ---------------------------------------------------------------- one streamed request


@dataclass
class Piece:
    """What one streamed event carries: text (or token ids without text), audio bytes (pcm16), usage."""

    text: bool = False
    audio: bytes = b""
    usage: dict[str, Any] | None = None


@dataclass
class Mode:
    """A kind of request: `path` and `payload(model, prompt, options)` build it, `read(event)` takes each event."""

    name: str
    path: str
    payload: Callable[[str, str, BenchOptions], dict[str, Any]]
    read: Callable[[dict[str, Any]], Piece]
    audio: bool = False


@dataclass
class BenchOptions:
    output_len: int = 128
    return_token_ids: bool = False
    voice: str | None = None
    sample_rate: int = PCM16_RATE
    playback_buffer_s: float = 0.0


def _text_payload(model: str, prompt: str, opt: BenchOptions) -> dict[str, Any]:
    payload = {"model": model, "prompt": prompt, "max_tokens": opt.output_len, "ignore_eos": True,
               "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    if opt.return_token_ids:
        payload["return_token_ids"] = True
    return payload


def _text_read(obj: dict[str, Any]) -> Piece:
    return Piece(text=any(c.get("text") or c.get("token_ids") for c in obj.get("choices", [])),
                 usage=obj.get("usage"))


def _audio_payload(model: str, prompt: str, opt: BenchOptions) -> dict[str, Any]:
    audio = {"format": "pcm16", **({"voice": opt.voice} if opt.voice else {})}
    payload = {"model": model, "messages": [{"role": "user", "content": prompt}], "modalities": ["text", "audio"],
               "audio": audio, "max_tokens": opt.output_len, "ignore_eos": True, "temperature": 0.0, "stream": True,
               "stream_options": {"include_usage": True}}
    if opt.return_token_ids:
        payload["return_token_ids"] = True
    return payload


def _audio_read(obj: dict[str, Any]) -> Piece:
    piece = Piece(usage=obj.get("usage"))
    for choice in obj.get("choices", []):
        delta = choice.get("delta") or {}
        piece.text = piece.text or bool(delta.get("content") or choice.get("token_ids"))
        data = (delta.get("audio") or {}).get("data")
        if data:
            piece.audio += base64.b64decode(data)
    return piece


MODES = {
    "text": Mode("text", "/v1/completions", _text_payload, _text_read),
    "audio": Mode("audio", "/v1/chat/completions", _audio_payload, _audio_read, audio=True),
}


@dataclass
class RequestResult:
    ok: bool = False
    error: str | None = None
    ttft: float | None = None
    latency: float = 0.0
    itls: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    # audio: (arrival after the request started, seconds of audio) per chunk
    audio_chunks: list[tuple[float, float]] = field(default_factory=list)

    @property
    def ttfa(self) -> float | None:
        return self.audio_chunks[0][0] if self.audio_chunks else None

    @property
    def audio_seconds(self) -> float:
        return sum(d for _, d in self.audio_chunks)


def stalls(chunks: list[tuple[float, float]], buffer_s: float = 0.0) -> list[float]:
    """Where playback runs dry: a player starts `buffer_s` after the first chunk arrives and plays the chunks in
    order; a chunk arriving after the audio before it has all played is a stall of that gap (then playback
    resumes on its arrival). `chunks`: (arrival time, seconds of audio)."""
    gaps: list[float] = []
    play_end: float | None = None
    for arrival, seconds in chunks:
        if play_end is None:
            play_end = arrival + buffer_s
        elif arrival > play_end:
            gaps.append(arrival - play_end)
            play_end = arrival
        play_end += seconds
    return gaps


class StreamError(Exception):
    """An HTTP error status, or an error event, in a streamed response."""


def _server_message(status: int, body: bytes) -> str:
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body.decode(errors="replace")[:200]
    return f"HTTP {status}: {' '.join(str(message).split())}"


async def stream_events(client: httpx.AsyncClient, url: str, payload: dict,
                        headers: dict[str, str] | None = None) -> AsyncIterator[dict[str, Any]]:
    """POST `payload` and yield the JSON events of the server-sent stream until `[DONE]`; an HTTP error status or
    an error event raises StreamError with the server's message."""
    async with client.stream("POST", url, json=payload, headers=headers) as resp:
        if resp.status_code != 200:
            raise StreamError(_server_message(resp.status_code, await resp.aread()))
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


async def _one(client: httpx.AsyncClient, url: str, headers: dict[str, str], payload: dict, mode: Mode,
               sample_rate: int) -> RequestResult:
    """Stream one request; an event carrying text (or, when asked for, token ids) counts as a token arrival, one
    carrying audio as an audio chunk. Token ids matter when tokens may decode to no text (random weights)."""
    result = RequestResult()
    start = last = time.perf_counter()
    try:
        async for obj in stream_events(client, url, payload, headers):
            piece = mode.read(obj)
            now = time.perf_counter()
            if piece.usage:
                result.prompt_tokens = piece.usage.get("prompt_tokens", 0)
                result.output_tokens = piece.usage.get("completion_tokens", 0)
            if piece.text:
                if result.ttft is None:
                    result.ttft = now - start
                else:
                    result.itls.append(now - last)
                last = now
            if piece.audio:
                result.audio_chunks.append((now - start, len(piece.audio) / 2 / sample_rate))
    except StreamError as exc:
        result.error = str(exc)
        return result
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.latency = time.perf_counter() - start
    result.ok = (result.ttfa if mode.audio else result.ttft) is not None
    if not result.ok:
        result.error = "stream ended without any audio" if mode.audio else "stream ended without any text"
    return result


# ---------------------------------------------------------------- summaries


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


def _ratio_summary(values: list[float]) -> dict[str, float | None]:
    """mean / median / max (the worst request, for a ratio where lower is better, as RTF)."""
    if not values:
        return {"mean": None, "median": None, "max": None}
    arr = np.asarray(values)
    return {"mean": round(float(arr.mean()), 4), "median": round(float(np.median(arr)), 4),
            "max": round(float(arr.max()), 4)}


def _audio_report(done: list[RequestResult], duration: float, buffer_s: float) -> dict[str, Any]:
    gaps = [stalls(r.audio_chunks, buffer_s) for r in done]
    audio_s = sum(r.audio_seconds for r in done)
    return {
        "ttfa_ms": _summary([r.ttfa for r in done if r.ttfa is not None]),
        "rtf": _ratio_summary([r.latency / r.audio_seconds for r in done if r.audio_seconds > 0]),
        "total_audio_s": round(audio_s, 3),
        "audio_throughput": round(audio_s / duration, 4) if duration else None,  # audio seconds per wall second
        "playback_buffer_ms": round(buffer_s * 1000, 3),
        "requests_with_stalls": sum(1 for g in gaps if g),
        "stalls": sum(len(g) for g in gaps),
        "stall_ms": _summary([x for g in gaps for x in g]),
        "stall_total_ms_per_request": _summary([sum(g) for g in gaps]),
    }


# ---------------------------------------------------------------- the run


def _connect_failure(exc: BaseException) -> str:
    """Why a connection failed, from the OS error under httpx's ("All connection attempts failed")."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ConnectionRefusedError) or "refused" in str(seen).lower():
            return "connection refused"
        if isinstance(seen, OSError) and seen.strerror:
            return seen.strerror.lower()
        seen = seen.__cause__ or seen.__context__
    return " ".join(str(exc).split()) or "no answer"


async def _preflight(client: httpx.AsyncClient, base_url: str, headers: dict[str, str]) -> list[str]:
    """The served model names; an unreachable server or a refused key is a BenchError saying what to do."""
    try:
        resp = await client.get(f"{base_url}/v1/models", headers=headers)
    except httpx.ConnectError as exc:
        reason = _connect_failure(exc)
        raise BenchError(f"cannot connect to {base_url} ({reason}); is the server running? "
                         "Start it (omnistage serve MODEL) or fix --base-url") from None
    except httpx.HTTPError as exc:
        raise BenchError(f"cannot reach {base_url}: {type(exc).__name__} {' '.join(str(exc).split())}") from None
    if resp.status_code == 401:
        told = "the API key was refused" if "Authorization" in headers else "no API key was sent"
        raise BenchError(f"{base_url} answered 401: {told}; pass --api-key KEY or set OMNISTAGE_API_KEY "
                         f"(or OPENAI_API_KEY) [{_server_message(401, resp.content)}]")
    if resp.status_code != 200:
        raise BenchError(f"GET {base_url}/v1/models: {_server_message(resp.status_code, resp.content)}")
    try:
        return [card["id"] for card in resp.json()["data"]]
    except (ValueError, KeyError, TypeError):
        raise BenchError(f"{base_url}/v1/models did not answer an OpenAI model list; is --base-url right?") from None


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
    mode: str = "text",
    tokenizer: str | None = None,
    voice: str | None = None,
    sample_rate: int = PCM16_RATE,
    playback_buffer_s: float = 0.0,
    preflight: bool | None = None,
) -> dict[str, Any]:
    """Async form of `run_bench`, for callers already inside an event loop. `return_token_ids` uses omnistage's
    extension so that tokens without text still count (other servers may reject it). `preflight` (default: only
    without `model`) asks /v1/models first, so an unreachable server or a refused key is one BenchError rather
    than every request failing. `tokenizer`: a local tokenizer directory to count `input_len` tokens with (it
    wins over the server's /tokenize); with neither, prompts are `input_len` words."""
    if mode not in MODES:
        raise BenchError(f"unknown mode {mode!r}; the modes are {', '.join(MODES)}")
    if num_prompts < 1 or input_len < 1 or output_len < 1:
        raise BenchError("--num-prompts, --input-len and --output-len must be at least 1")
    kind = MODES[mode]
    base_url = base_url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    concurrency = concurrency or num_prompts
    rng = random.Random(seed)
    options = BenchOptions(output_len, return_token_ids, voice, sample_rate, playback_buffer_s)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0), limits=limits) as client:
        if preflight or (preflight is None and model is None):
            served = await _preflight(client, base_url, headers)
            if not served and model is None:
                raise BenchError(f"{base_url} serves no model")
            model = model or served[0]
        tok: Tokenizer | None = LocalTokenizer(tokenizer) if tokenizer else None
        tok = tok or await ServerTokenizer.probe(client, base_url, headers, model)
        prompts, prompt_lens = await build_prompts(tok, num_prompts, input_len, seed)
        gate = asyncio.Semaphore(concurrency)

        async def limited(prompt: str) -> RequestResult:
            async with gate:
                return await _one(client, f"{base_url}{kind.path}", headers, kind.payload(model, prompt, options),
                                  kind, sample_rate)

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
    report: dict[str, Any] = {
        "base_url": base_url,
        "model": model,
        "mode": mode,
        "num_prompts": num_prompts,
        "concurrency": concurrency,
        "request_rate": request_rate if math.isfinite(request_rate) else "inf",
        "input_len": input_len,
        "input_len_method": tok.method if tok is not None else
        "approximate: that many common words (no /tokenize on the server and no --tokenizer)",
        "mean_input_tokens": round(sum(prompt_lens) / len(prompt_lens), 2) if prompt_lens else None,
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
    if kind.audio:
        report["audio"] = _audio_report(done, duration, playback_buffer_s)
    return report


def run_bench(base_url: str, model: str | None = None, **options: Any) -> dict[str, Any]:
    """`bench_serve` from synchronous code: send `num_prompts` streaming requests (at most `concurrency` in flight;
    Poisson arrivals at `request_rate` req/s unless inf) and return the measurements as a JSON-ready dict. Options
    as for `bench_serve`."""
    return asyncio.run(bench_serve(base_url, model, **options))


# ---------------------------------------------------------------- the command line


def add_bench_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`omnistage bench serve`'s flags on `parser` (its func: `main`)."""
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", help="default: the first model the server lists")
    parser.add_argument("--mode", default="text", choices=list(MODES),
                        help="text: streamed /v1/completions; audio: streamed chat with text+audio (pcm16) from a "
                        "speech model, measuring time to first audio, RTF and playback stalls")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--concurrency", type=int, help="max requests in flight (default: all)")
    parser.add_argument("--request-rate", type=float, default=math.inf, help="req/s, Poisson arrivals (default inf)")
    parser.add_argument("--input-len", type=int, default=128,
                        help="prompt length in tokens (counted by the server's /tokenize, or --tokenizer; without "
                        "either, that many words)")
    parser.add_argument("--tokenizer", metavar="PATH", help="a local tokenizer to count --input-len with")
    parser.add_argument("--output-len", type=int, default=128, help="max_tokens of each reply (ignore_eos)")
    parser.add_argument("--api-key", help="default: $OMNISTAGE_API_KEY, else $OPENAI_API_KEY")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--return-token-ids", action="store_true",
                        help="count tokens that decode to no text (omnistage's extension; random-weight models)")
    parser.add_argument("--voice", help="audio mode: the voice (default: the model's first)")
    parser.add_argument("--sample-rate", type=int, default=PCM16_RATE,
                        help="audio mode: the rate of the pcm16 the server streams (OpenAI's: 24000)")
    parser.add_argument("--playback-buffer-ms", type=float, default=0.0,
                        help="audio mode: how long the simulated player buffers before it starts playing")
    parser.set_defaults(func=main)
    return parser


def main(args: argparse.Namespace) -> int:
    """Run the benchmark and print its JSON; a benchmark that cannot run prints one `error:` line (exit 2)."""
    try:
        result = run_bench(
            args.base_url, model=args.model, num_prompts=args.num_prompts, concurrency=args.concurrency,
            request_rate=args.request_rate, input_len=args.input_len, output_len=args.output_len,
            api_key=args.api_key or api_key_from_env(), seed=args.seed, mode=args.mode, tokenizer=args.tokenizer,
            return_token_ids=args.return_token_ids, voice=args.voice, sample_rate=args.sample_rate,
            playback_buffer_s=args.playback_buffer_ms / 1000.0, preflight=True,
        )
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2))
    if result["input_len_method"].startswith("approximate"):
        print("note: --input-len approximated as words: the server has no /tokenize; pass --tokenizer PATH "
              "to count tokens", file=sys.stderr)
    if not result["completed"] and result["error_samples"]:
        print(f"error: every request failed, e.g. {result['error_samples'][0]}", file=sys.stderr)
    return 0 if result["completed"] else 1
