"""`omnistage` command line: serve a model, benchmark a server, build a tiny checkpoint, run a demo.

Start-up failures a user can fix (bad path, unsupported model, bad deploy config) print one line,
`error: ...`, and exit 2; tracebacks are kept for real bugs.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from omnistage import envs
from omnistage.errors import ConfigError, OmniError
from omnistage.testing.layouts import DIFFUSERS_LAYOUTS

EXIT_USAGE = 2
# omnistage.testing.factory's (a test keeps them equal); not imported from there, as that pulls in torch and
# `--help` must stay fast: nothing heavy is imported before the arguments are parsed
CAUSAL_LM_ARCHS = ("qwen2", "qwen3", "llama")

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
    if args.allowed_media_domains is not None:
        overrides["media.allowed_domains"] = args.allowed_media_domains
    if args.no_remote_media:
        overrides["media.remote_fetch"] = False
    if args.allowed_local_media_path is not None:
        overrides["media.allowed_local_path"] = args.allowed_local_media_path
    for item in args.set or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set expects KEY=VALUE (e.g. stages.*.max_num_seqs=8), got {item!r}")
        overrides[key.strip()] = _scalar(value)
    return overrides


def api_keys(args: argparse.Namespace) -> list[str]:
    """--api-key (repeatable) and --api-key-file (one key a line, # comments), else $OMNISTAGE_API_KEY."""
    keys = list(args.api_key or [])
    for path in args.api_key_file or []:
        try:
            lines = open(path, encoding="utf-8").read().splitlines()
        except OSError as exc:
            raise ConfigError(f"--api-key-file {path}: cannot read it ({exc.strerror})") from None
        found = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        if not found:
            raise ConfigError(f"--api-key-file {path} holds no key (one a line)")
        keys += found
    env_key = envs.API_KEY.get()
    return keys or ([env_key] if env_key else [])


def _listen(host: str, port: int) -> Any:
    import socket

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}"
                          + ("; is another server running there? pick another --port" if port else "")) from None
    sock.listen(2048)  # connections queue from now on, answered once the server runs
    return sock


def override_chat_template(pipeline: Any, template: str) -> None:
    """`--chat-template`: a file's contents, or the text itself, as the chat template of the entry stage's
    tokenizer (and of a multimodal model's processor, which renders its own)."""
    path = Path(template)
    text = path.read_text(encoding="utf-8") if len(template) < 4096 and path.is_file() else template
    if "{" not in text:
        raise ConfigError(f"--chat-template {template!r} is neither a file nor a Jinja template")
    for owner in (pipeline.tokenizer, getattr(pipeline, "processor", None)):
        if owner is not None:
            owner.chat_template = text


def quiet_libraries(log_level: str) -> None:
    """transformers' and the hub's warnings and progress bars stay out of the server's log unless it is at debug
    level (loading prints dozens of them; none is about the server)."""
    if log_level.lower() == "debug":
        return
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("CACHE_DIT_LOG_LEVEL", "warning")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("transformers").setLevel(logging.ERROR)


def _serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        overrides = serve_overrides(args)
        keys = api_keys(args)
        sock = _listen(args.host, args.port)  # first: a busy port fails before anything loads
    except OmniError as exc:
        return _fail(exc)
    quiet_libraries(args.log_level)
    if args.voices_dir:  # read by the voices store when first used (envs.VOICES_DIR)
        os.environ[envs.VOICES_DIR.name] = str(Path(args.voices_dir).expanduser().resolve())
    from omnistage.entrypoints.async_omni import AsyncOmni
    from omnistage.entrypoints.openai.server import ServerOptions, serve
    from omnistage.families.registry import load_pipeline
    from omnistage.runtime.launch import check_devices

    try:  # the checkpoint and the deploy config are checked before serving, so their errors are one line
        pipeline = load_pipeline(args.model, args.deploy_config, overrides or None)
        check_devices(pipeline)
        if args.chat_template:
            override_chat_template(pipeline, args.chat_template)
    except (OmniError, OSError) as exc:
        sock.close()
        return _fail(exc)

    def load(progress: Any) -> AsyncOmni:
        name = args.served_model_name[0] if args.served_model_name else None
        return AsyncOmni.from_model(pipeline, served_model_name=name, on_progress=progress)

    options = ServerOptions(
        api_keys=keys, served_model_names=args.served_model_name, allowed_origins=args.allowed_origins or (),
        enable_docs=args.enable_docs, metrics_without_auth=args.metrics_without_auth,
        max_queued_requests=args.max_queued_requests, max_connections=args.max_connections,
        body_timeout_s=args.body_timeout_s, shutdown_timeout_s=args.shutdown_timeout_s,
        video_jobs_dir=args.video_jobs_dir, max_video_jobs=args.max_video_jobs,
        video_jobs_max_bytes=int(args.video_jobs_max_gib * 2**30), video_jobs_max_age_s=args.video_jobs_max_age_s,
    )
    try:
        serve(load, sock, options, log_level=args.log_level)
    except (OmniError, OSError) as exc:
        return _fail(exc)
    return 0


def _make_tiny(args: argparse.Namespace) -> int:
    if args.arch in TTS_ARCHS:
        from omnistage.testing.qwen3_tts import make_tiny_qwen3_tts

        print(make_tiny_qwen3_tts(args.out_dir, args.variant or "custom_voice"))
    elif args.arch == "qwen2_5_omni":
        from omnistage.testing.qwen2_5_omni import make_tiny_qwen2_5_omni

        print(make_tiny_qwen2_5_omni(args.out_dir))
    elif args.arch == "qwen3_omni_moe":
        from omnistage.testing.qwen3_omni_moe import make_tiny_qwen3_omni_moe

        print(make_tiny_qwen3_omni_moe(args.out_dir))
    elif args.arch in DIFFUSERS_LAYOUTS:
        from omnistage.testing.factory import make_tiny_diffusers

        print(make_tiny_diffusers(args.arch, args.out_dir))
    else:
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


TEXT_DEMO_ARCHS = (*CAUSAL_LM_ARCHS, "qwen2_5_omni", "qwen3_omni_moe")
TTS_ARCHS = ("qwen3_tts",)
AUDIO_GENERATION_ARCHS = ("stable_audio",)  # diffusers layouts whose demo is POST /v1/audio/generate
VIDEO_ARCHS = tuple(a for a, (module, _) in DIFFUSERS_LAYOUTS.items() if module == "wan")  # POST /v1/videos/sync
TTS_VARIANTS = ("custom_voice", "voice_design", "base")
DEMO_ARCHS = (*TEXT_DEMO_ARCHS, *DIFFUSERS_LAYOUTS, *TTS_ARCHS)
TINY_ARCHS = DEMO_ARCHS  # every layout the tiny-checkpoint factory knows


def _image_demo(url: str, engine: Any, prompt: str, image_out: str) -> None:
    """One image through the official client: `images.generate`, or for an edit model `images.edit` of a local
    input image the demo draws (written next to the output); the PNG goes to `image_out`."""
    import base64
    import io

    from openai import OpenAI
    from PIL import Image

    client = OpenAI(base_url=f"{url}/v1", api_key="demo")
    pipeline = engine.pipeline
    side = pipeline.size_multiple * 4  # small: random weights draw noise at any size
    extra = {"num_inference_steps": 4, "seed": 0}
    start = time.perf_counter()
    if pipeline.max_input_images:
        source = Image.new("RGB", (side, side))
        source.putdata([(x * 255 // side, y * 255 // side, 128) for y in range(side) for x in range(side)])
        input_path = str(Path(image_out).with_name(Path(image_out).stem + "-input.png"))
        source.save(input_path)
        buffer = io.BytesIO()
        source.save(buffer, format="PNG")
        print(f"input image: {input_path}")
        out = client.images.edit(model=engine.served_model_name, image=("input.png", buffer.getvalue(), "image/png"),
                                 prompt=prompt, size=f"{side}x{side}", extra_body=extra)
    else:
        out = client.images.generate(model=engine.served_model_name, prompt=prompt, size=f"{side}x{side}",
                                     extra_body=extra)
    Path(image_out).write_bytes(base64.b64decode(out.data[0].b64_json))
    print(f"[{side}x{side} image in {(time.perf_counter() - start) * 1000:.0f} ms; wrote {image_out}]")


def _audio_generation_demo(url: str, engine: Any, prompt: str, audio_out: str) -> None:
    """One clip through `POST /v1/audio/generate` (a short one: random weights make noise at any length); the
    wav goes to `audio_out`."""
    import httpx

    start = time.perf_counter()
    resp = httpx.post(f"{url}/v1/audio/generate", timeout=300, json={
        "model": engine.served_model_name, "input": prompt, "audio_length": min(1.0, engine.pipeline.max_audio_seconds),
        "num_inference_steps": 4, "seed": 0, "response_format": "wav"})
    if resp.status_code != 200:
        raise ConfigError(f"/v1/audio/generate answered {resp.status_code}: {resp.text}")
    Path(audio_out).write_bytes(resp.content)
    seconds = resp.headers.get("x-usage-audio-seconds", "?")
    print(f"[{seconds} s of audio at {engine.pipeline.audio_sample_rate} Hz in "
          f"{(time.perf_counter() - start) * 1000:.0f} ms; wrote {audio_out}]")


def _video_demo(url: str, engine: Any, prompt: str, video_out: str) -> None:
    """One short clip through `POST /v1/videos/sync` (an image-to-video model animates a gradient the demo draws);
    the mp4 goes to `video_out`."""
    import io

    import httpx
    from PIL import Image

    pipeline = engine.pipeline
    side = pipeline.size_multiple * 2  # small: random weights draw noise at any size
    form = {"model": engine.served_model_name, "prompt": prompt, "size": f"{side}x{side}", "num_frames": "9",
            "fps": "8", "num_inference_steps": "4", "seed": "0"}
    files = None
    if pipeline.max_input_images:
        source = Image.new("RGB", (side, side))
        source.putdata([(x * 255 // side, y * 255 // side, 128) for y in range(side) for x in range(side)])
        buffer = io.BytesIO()
        source.save(buffer, format="PNG")
        files = {"input_reference": ("input.png", buffer.getvalue(), "image/png")}
    start = time.perf_counter()
    resp = httpx.post(f"{url}/v1/videos/sync", data=form, files=files, timeout=600)
    if resp.status_code != 200:
        raise ConfigError(f"/v1/videos/sync answered {resp.status_code}: {resp.text}")
    Path(video_out).write_bytes(resp.content)
    print(f"[9 frames of {side}x{side} at 8 fps in {(time.perf_counter() - start) * 1000:.0f} ms; wrote {video_out}]")


def _tts_demo(args: argparse.Namespace) -> int:
    """A tiny CustomVoice checkpoint (built in a temporary directory), served; one `/v1/audio/speech` request;
    the wav written to --audio-out and a one-line summary printed."""
    import tempfile

    import httpx

    from omnistage.entrypoints.async_omni import AsyncOmni
    from omnistage.entrypoints.openai.server import BackgroundServer
    from omnistage.testing.qwen3_tts import make_tiny_qwen3_tts

    t_load = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="omnistage-tts-") as tmp:
        try:
            engine = AsyncOmni.from_model(str(make_tiny_qwen3_tts(Path(tmp) / "qwen3_tts", "custom_voice")))
        except (OmniError, OSError) as exc:
            return _fail(exc)
        load_s = time.perf_counter() - t_load
        print(f"loaded tiny qwen3_tts (CustomVoice) in {load_s:.1f}s (random weights, so the speech is noise)")
        try:
            with BackgroundServer(engine, port=args.port) as server:
                _wait_healthy(server.url)
                voice = engine.pipeline.talker_config["spk_id"] and next(iter(engine.pipeline.talker_config["spk_id"]))
                t0 = time.perf_counter()
                resp = httpx.post(f"{server.url}/v1/audio/speech", timeout=300, json={
                    "model": engine.served_model_name, "input": args.prompt, "voice": voice or None,
                    "response_format": "wav", "max_new_tokens": args.max_tokens})
                took = time.perf_counter() - t0
                if resp.status_code != 200:
                    return _fail(ConfigError(f"/v1/audio/speech answered {resp.status_code}: {resp.text}"))
                Path(args.audio_out).write_bytes(resp.content)
                seconds = resp.headers.get("x-usage-audio-seconds", "?")
                frames = resp.headers.get("x-usage-output-frames", "?")
                print(f"[qwen3_tts speech: voice {voice}, {frames} frames, {seconds} s of audio in "
                      f"{took * 1000:.0f} ms; wrote {args.audio_out}]")
        finally:
            engine.shutdown()
    return 0


def _demo(args: argparse.Namespace) -> int:
    """End to end on a random-weight tiny model: real server, real OpenAI client, streamed answer (for a
    model that speaks: streamed text and speech, the speech written to a WAV file)."""
    from omnistage.entrypoints.async_omni import AsyncOmni
    from omnistage.entrypoints.openai.server import BackgroundServer
    from omnistage.testing import tiny_checkpoint

    if args.arch in TTS_ARCHS:
        if args.ui:
            return _fail(ConfigError("--ui serves chat models; qwen3_tts runs the speech API demo (leave out --ui)"))
        return _tts_demo(args)
    clip = args.arch in AUDIO_GENERATION_ARCHS
    video = args.arch in VIDEO_ARCHS
    image = args.arch in DIFFUSERS_LAYOUTS and not clip and not video
    if video and args.ui:
        return _fail(ConfigError("--ui serves chat models; video archs run the videos API demo (leave out --ui)"))
    if clip and args.ui:
        return _fail(ConfigError("--ui serves chat models; stable_audio runs the audio generation demo (leave out "
                                 "--ui)"))
    if image and args.ui:
        return _fail(ConfigError("--ui serves chat models; image archs run the images API demo (leave out --ui)"))
    t_load = time.perf_counter()
    # a random-weight talker rarely says its end code: the page sends no sampling_params_list to stop it sooner
    deploy = {"stages": {"talker": {"default_sampling_params": {"max_tokens": 150}}}} if args.ui else None
    try:
        engine = AsyncOmni.from_model(tiny_checkpoint(args.arch), deploy)
    except (OmniError, OSError) as exc:
        return _fail(exc)
    load_s = time.perf_counter() - t_load
    noise = "image is noise" if image else "audio is noise" if clip else "video is noise" if video else None
    print(f"loaded tiny {args.arch} checkpoint from {engine.pipeline.model_path} in {load_s:.1f}s (random weights, "
          f"so the {noise or 'answer is gibberish'})")
    if args.ui:
        from omnistage.entrypoints.openai.ui import serve_ui_demo

        try:
            serve_ui_demo(engine, port=args.port)
        finally:
            engine.shutdown()
        return 0
    try:
        with BackgroundServer(engine, port=args.port) as server:
            _wait_healthy(server.url)
            print(f"server up at {server.url}\n> {args.prompt}")
            if clip:
                _audio_generation_demo(server.url, engine, args.prompt, args.audio_out)
            elif video:
                _video_demo(server.url, engine, args.prompt, args.video_out)
            elif image:
                _image_demo(server.url, engine, args.prompt, args.image_out)
            elif "audio" in engine.output_modalities:
                _stream_speech(server.url, engine.served_model_name, args.prompt, args.max_tokens, args.audio_out,
                               engine.pipeline.audio_sample_rate)
            else:
                _stream_chat(server.url, engine.served_model_name, args.prompt, args.max_tokens)
    finally:
        engine.shutdown()
    return 0


class _DefaultsFormatter(argparse.HelpFormatter):
    """Help with each flag's default, where it has one and its help does not already say it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default not in (None, False, argparse.SUPPRESS) and "default" not in text and action.option_strings:
            text += " (default: %(default)s)"
        return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omnistage", description="Serve any-to-any models behind an OpenAI API.")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                           formatter_class=_DefaultsFormatter, description="Operating it: docs/serving.md.")
    serve.add_argument("model", help="model directory (HF checkpoint)")
    serve.add_argument("--deploy-config", help="deploy config YAML (placement, sizing, sampling defaults)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on, bound before the model loads")
    # the key's default is resolved after parsing, so --help never shows it
    serve.add_argument("--api-key", action="append", metavar="KEY",
                       help="require `Authorization: Bearer KEY` on every route but /health and /ping "
                            "(repeatable: any of the keys; default: $OMNISTAGE_API_KEY, else no key)")
    serve.add_argument("--api-key-file", action="append", metavar="FILE",
                       help="more keys, one a line (# comments); repeatable")
    serve.add_argument("--metrics-without-auth", action="store_true",
                       help="serve /metrics without a key (for a Prometheus scraper)")
    serve.add_argument("--allowed-origins", nargs="+", metavar="ORIGIN",
                       help="CORS: browser origins allowed to call the API, or '*' (default: none)")
    serve.add_argument("--enable-docs", action="store_true",
                       help="serve /docs, /redoc and /openapi.json (behind the key; the pages load scripts from "
                            "a CDN)")
    serve.add_argument("--max-queued-requests", type=int, metavar="N",
                       help="generations (prompts x n) admitted at once; beyond it 429 (default: the deploy "
                            "config's limits.max_queued_requests, 256)")
    serve.add_argument("--max-connections", type=int, default=2048, metavar="N",
                       help="open connections; beyond it new requests get 503")
    serve.add_argument("--body-timeout-s", type=float, default=30.0, metavar="S",
                       help="a request's head and body must arrive within this; else 408 (or the connection "
                            "closes)")
    serve.add_argument("--shutdown-timeout-s", type=float, default=30.0, metavar="S",
                       help="on SIGTERM, how long requests in flight may take to finish before they are aborted")
    serve.add_argument("--served-model-name", nargs="+", metavar="NAME",
                       help="model name(s) clients may send; /v1/models lists them all and responses report the "
                            "first when a request names none (default: from the model path)")
    serve.add_argument("--chat-template", help="a Jinja chat template (a file, or the template itself) replacing the "
                       "checkpoint's")
    serve.add_argument("--max-model-len", type=int)
    serve.add_argument("--max-num-seqs", type=int)
    serve.add_argument("--max-num-batched-tokens", type=int)
    serve.add_argument("--dtype", help="e.g. bfloat16, float16, float32")
    serve.add_argument("--enforce-eager", action="store_true", help="disable CUDA graphs")
    serve.add_argument("--allowed-media-domains", nargs="+", metavar="HOST",
                       help="fetch media URLs only from these hosts and their subdomains (media.allowed_domains; "
                            "default: any public host)")
    serve.add_argument("--no-remote-media", action="store_true",
                       help="never fetch media URLs; media must be inline (media.remote_fetch=false)")
    serve.add_argument("--voices-dir", metavar="DIR",
                       help="where uploaded TTS voices are kept (POST /v1/audio/voices; env OMNISTAGE_VOICES_DIR; "
                            "default ~/.cache/omnistage/voices)")
    serve.add_argument("--video-jobs-dir", metavar="DIR",
                       help="where /v1/videos jobs keep their records and mp4s, one server per directory "
                            "(default: <temp dir>/omnistage-videos-<uid>)")
    serve.add_argument("--max-video-jobs", type=int, default=16, metavar="N",
                       help="unfinished /v1/videos jobs at once; beyond it 429")
    serve.add_argument("--video-jobs-max-gib", type=float, default=10.0, metavar="GIB",
                       help="finished videos kept on disk; beyond it the oldest are removed")
    serve.add_argument("--video-jobs-max-age-s", type=float, default=86400.0, metavar="S",
                       help="finished video jobs are removed this long after they finished")
    serve.add_argument("--allowed-local-media-path", metavar="DIR",
                       help="file:// media URLs may name files under this directory (media.allowed_local_path; "
                            "default: none)")
    serve.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="deploy-config override, dotted key, YAML value (repeatable): stages.*.max_num_seqs=8",
    )
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                       help="server log level")
    serve.set_defaults(func=_serve)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    from omnistage.bench.serve import add_bench_serve_args  # argparse only: keeps --help fast

    add_bench_serve_args(bench.add_parser("serve", help="load-test a running server; prints JSON"))

    tiny = sub.add_parser("make-tiny", help="write a tiny random-weight checkpoint (tests, demos)")
    tiny.add_argument("out_dir")
    tiny.add_argument("--arch", default="qwen2", choices=TINY_ARCHS)
    tiny.add_argument("--variant", choices=TTS_VARIANTS, help="qwen3_tts: the checkpoint kind (default custom_voice)")
    tiny.set_defaults(func=_make_tiny)

    demo = sub.add_parser("demo", help="serve a tiny model and chat with it (or draw with it) through the OpenAI "
                          "client")
    demo.add_argument("--arch", default="qwen2", choices=DEMO_ARCHS,
                      help="qwen2_5_omni, qwen3_omni_moe: text and speech out (needs the `omni` extra); flux-dev, "
                      "qwen-image, qwen-image-edit, z-image-turbo, ...: an image through the images API (needs "
                      "diffusers); stable_audio: a clip through POST /v1/audio/generate")
    demo.add_argument("--image-out", default="omnistage-demo.png", help="image archs: where the image goes")
    demo.add_argument("--video-out", default="omnistage-demo.mp4", help="wan2_2 archs: where the video goes")
    demo.add_argument("--audio-out", default="omnistage-demo.wav",
                      help="qwen2_5_omni, qwen3_omni_moe, qwen3_tts: where the speech goes; stable_audio: the clip")
    demo.add_argument("--port", type=int, default=0, help="0: any free port")
    demo.add_argument("--prompt", default="Tell me about the river in the old town.")
    demo.add_argument("--max-tokens", type=int, default=32)
    demo.add_argument("--ui", action="store_true", help="serve the demo model with the browser page until Ctrl-C")
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
