"""`omnistage` command line: serve a model, benchmark a server, build a tiny checkpoint, run a demo.

Start-up failures a user can fix (bad path, unsupported model, bad deploy config) print one line,
`error: ...`, and exit 2; tracebacks are kept for real bugs.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from typing import Any

import yaml

from omnistage import envs
from omnistage.errors import ConfigError, OmniError
from omnistage.testing.factory import CAUSAL_LM_ARCHS

EXIT_USAGE = 2

# `serve` shortcut flags, each the deploy-config field it sets on every stage (`stages.*.<field>`).
_STAGE_FLAGS = ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "dtype")


def _fail(exc: BaseException) -> int:
    message = " ".join(str(getattr(exc, "message", None) or exc).split())
    print(f"error: {message}", file=sys.stderr)
    return EXIT_USAGE


def _scalar(text: str) -> Any:
    """`--set` values are YAML scalars (8, 0.9, true, null, bf16); anything YAML rejects stays a string."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def serve_overrides(args: argparse.Namespace) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    for field in _STAGE_FLAGS:
        if getattr(args, field) is not None:
            overrides[f"stages.*.{field}"] = getattr(args, field)
    if args.enforce_eager:
        overrides["stages.*.enforce_eager"] = True
    for item in args.set or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set expects KEY=VALUE (e.g. stages.*.max_num_seqs=8), got {item!r}")
        overrides[key.strip()] = _scalar(value)
    return overrides


def _serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        overrides = serve_overrides(args)
        from omnistage.entrypoints.async_omni import AsyncOmni

        engine = AsyncOmni.from_model(
            args.model,
            deploy_config=args.deploy_config,
            overrides=overrides or None,
            served_model_name=args.served_model_name[0] if args.served_model_name else None,
        )
    except (OmniError, OSError) as exc:
        return _fail(exc)
    from omnistage.entrypoints.openai.server import run_server

    run_server(engine, host=args.host, port=args.port, api_key=args.api_key, log_level=args.log_level,
               served_model_names=args.served_model_name)
    return 0


def _bench_serve(args: argparse.Namespace) -> int:
    from omnistage.bench.serve import run_bench

    result = run_bench(
        args.base_url,
        model=args.model,
        num_prompts=args.num_prompts,
        concurrency=args.concurrency,
        request_rate=args.request_rate,
        input_len=args.input_len,
        output_len=args.output_len,
        api_key=args.api_key,
        seed=args.seed,
    )
    print(json.dumps(result, indent=2))
    return 0 if result["completed"] else 1


def _make_tiny(args: argparse.Namespace) -> int:
    from omnistage.testing import make_tiny_causal_lm

    print(make_tiny_causal_lm(args.out_dir, arch=args.arch))
    return 0


def _wait_healthy(url: str, timeout: float = 60.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise OmniError(f"server at {url} did not become healthy within {timeout:.0f}s")
        time.sleep(0.1)


def _stream_chat(url: str, model: str, prompt: str, max_tokens: int) -> None:
    """Print a streamed answer as it comes, then its token count, time to first token and rate."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="demo")
    start, ttft, tokens = time.perf_counter(), None, 0
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.content:
                ttft = ttft if ttft is not None else time.perf_counter() - start
                print(choice.delta.content, end="", flush=True)
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    total = time.perf_counter() - start
    ttft_ms = f"{ttft * 1000:.1f} ms" if ttft is not None else "n/a"
    print(f"\n[{tokens} tokens, TTFT {ttft_ms}, total {total * 1000:.1f} ms, {tokens / total:.1f} tok/s]")


def _stream_speech(url: str, model: str, prompt: str, max_tokens: int, audio_out: str, sample_rate: int) -> None:
    """A streamed text + speech answer: text printed as it comes, PCM16 audio chunks gathered into a WAV file,
    then the time to the first text and the first audio."""
    import base64
    import wave

    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="demo")
    start, first_text, first_audio, chunks, pcm = time.perf_counter(), None, None, 0, bytearray()
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        modalities=["text", "audio"],
        audio={"voice": "Chelsie", "format": "pcm16"},
        stream=True,
        # thinker: the reply's length; talker: at most 150 codec codes (3 s of audio), as random weights
        # rarely sample the end code
        extra_body={"sampling_params_list": [{"max_tokens": max_tokens}, {"max_tokens": 150}]},
    )
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            if delta.content:
                first_text = first_text if first_text is not None else time.perf_counter() - start
                print(delta.content, end="", flush=True)
            audio = getattr(delta, "audio", None) or (delta.model_extra or {}).get("audio")
            if audio:
                first_audio = first_audio if first_audio is not None else time.perf_counter() - start
                pcm += base64.b64decode(audio["data"] if isinstance(audio, dict) else audio.data)
                chunks += 1
    total = time.perf_counter() - start
    with wave.open(audio_out, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(sample_rate)
        out.writeframes(bytes(pcm))
    ms = {name: f"{t * 1000:.0f} ms" if t is not None else "n/a" for name, t in
          (("text", first_text), ("audio", first_audio))}
    seconds = len(pcm) / 2 / sample_rate
    print(f"\n[first text {ms['text']}, first audio {ms['audio']}, {seconds:.2f} s of audio in {chunks} chunks, "
          f"total {total * 1000:.0f} ms; wrote {audio_out}]")


DEMO_ARCHS = (*CAUSAL_LM_ARCHS, "qwen2_5_omni")


def _demo(args: argparse.Namespace) -> int:
    """End to end on a random-weight tiny model: real server, real OpenAI client, streamed answer (for a
    model that speaks: streamed text and speech, the speech written to a WAV file)."""
    from omnistage.entrypoints.async_omni import AsyncOmni
    from omnistage.entrypoints.openai.server import BackgroundServer
    from omnistage.testing import tiny_checkpoint

    t_load = time.perf_counter()
    try:
        engine = AsyncOmni.from_model(tiny_checkpoint(args.arch))
    except (OmniError, OSError) as exc:
        return _fail(exc)
    load_s = time.perf_counter() - t_load
    print(f"loaded tiny {args.arch} checkpoint in {load_s:.1f}s (random weights, so the answer is gibberish)")
    try:
        with BackgroundServer(engine, port=args.port) as server:
            _wait_healthy(server.url)
            print(f"server up at {server.url}\n> {args.prompt}")
            if "audio" in engine.output_modalities:
                _stream_speech(server.url, engine.served_model_name, args.prompt, args.max_tokens, args.audio_out,
                               engine.pipeline.audio_sample_rate)
            else:
                _stream_chat(server.url, engine.served_model_name, args.prompt, args.max_tokens)
    finally:
        engine.shutdown()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omnistage", description="Serve any-to-any models behind an OpenAI API.")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    serve.add_argument("model", help="model directory (HF checkpoint)")
    serve.add_argument("--deploy-config", help="deploy config YAML (placement, sizing, sampling defaults)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--api-key", default=envs.API_KEY.get(), help="require this Bearer key on /v1/*"
    )
    serve.add_argument("--served-model-name", nargs="+", metavar="NAME",
                       help="model name(s) clients may send; /v1/models lists them all and responses report the "
                            "first when a request names none (default: from the model path)")
    serve.add_argument("--max-model-len", type=int)
    serve.add_argument("--max-num-seqs", type=int)
    serve.add_argument("--max-num-batched-tokens", type=int)
    serve.add_argument("--dtype", help="e.g. bfloat16, float16, float32")
    serve.add_argument("--enforce-eager", action="store_true", help="disable CUDA graphs")
    serve.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="deploy-config override, dotted key, YAML value (repeatable): stages.*.max_num_seqs=8",
    )
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.set_defaults(func=_serve)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    bserve = bench.add_parser("serve", help="load-test a running server; prints JSON")
    bserve.add_argument("--base-url", default="http://127.0.0.1:8000")
    bserve.add_argument("--model", help="default: the first model the server lists")
    bserve.add_argument("--num-prompts", type=int, default=100)
    bserve.add_argument("--concurrency", type=int, help="max requests in flight (default: all)")
    bserve.add_argument("--request-rate", type=float, default=math.inf, help="req/s, Poisson arrivals (default inf)")
    bserve.add_argument("--input-len", type=int, default=128, help="prompt length in words (~tokens)")
    bserve.add_argument("--output-len", type=int, default=128)
    bserve.add_argument("--api-key", default=envs.API_KEY.get())
    bserve.add_argument("--seed", type=int, default=0)
    bserve.set_defaults(func=_bench_serve)

    tiny = sub.add_parser("make-tiny", help="write a tiny random-weight checkpoint (tests, demos)")
    tiny.add_argument("out_dir")
    tiny.add_argument("--arch", default="qwen2", choices=CAUSAL_LM_ARCHS)
    tiny.set_defaults(func=_make_tiny)

    demo = sub.add_parser("demo", help="serve a tiny model and chat with it through the OpenAI client")
    demo.add_argument("--arch", default="qwen2", choices=DEMO_ARCHS,
                      help="qwen2_5_omni: text and speech out (needs the `omni` extra)")
    demo.add_argument("--audio-out", default="omnistage-demo.wav", help="qwen2_5_omni: where the speech goes")
    demo.add_argument("--port", type=int, default=0, help="0: any free port")
    demo.add_argument("--prompt", default="Tell me about the river in the old town.")
    demo.add_argument("--max-tokens", type=int, default=32)
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
