"""One Qwen2.5-Omni request at a time (the omni_qwen2_5.py workload): the thinker's milliseconds per token alone
(text-only requests: the talker and token2wav never run) and beside the talker (speech requests: the talker
follows the reply token by token), plus each speech request's end and audio chunk times.

Where c=1's time goes before the reply ends: on an H200 (run 20b) the thinker alone took 3.90 ms a token and 4.61
beside the talker, so the talker's codes in that phase cost 0.71 ms each against ~1.2 alone.

    python benchmarks/thinker_phase.py --checkpoint /tmp/omni --out phase.jsonl     # GPU; omni_qwen2_5.py writes it
    OMNISTAGE_PDL=0 python benchmarks/thinker_phase.py --checkpoint /tmp/omni        # the same without PDL
    python benchmarks/thinker_phase.py --tiny                                        # CPU smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import yaml
from omni_qwen2_5 import DEPLOY, PROMPT, apply_settings, checkpoint_path, parse_settings, request_params
from recording import recorder

from omnistage import AsyncOmni
from omnistage.runtime.messages import OmniRequest

THINKER_TOKENS, CODES = 128, 600


async def one_request(engine: AsyncOmni, params: dict, modalities: tuple[str, ...]) -> dict:
    request = OmniRequest(request_id=f"r{time.monotonic_ns()}", messages=[{"role": "user", "content": PROMPT}],
                          stage_params=params, output_modalities=modalities, options={"voice": "Chelsie"})
    start = time.perf_counter()
    text_times, chunks = [], []
    async for out in engine.generate(request):
        if out.error:
            raise RuntimeError(out.error)
        now = time.perf_counter() - start
        if out.text or out.token_ids:
            text_times.append(now)
        if out.audio is not None and out.audio.size:
            chunks.append(round(now, 4))
    return {"first_text_s": round(text_times[0], 4), "last_text_s": round(text_times[-1], 4),
            "ms_per_token": round(1000 * (text_times[-1] - text_times[0]) / (THINKER_TOKENS - 1), 3),
            "e2e_s": round(time.perf_counter() - start, 4), "audio_chunks_s": chunks}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--checkpoint", type=Path, help="a full-size checkpoint (omni_qwen2_5.py writes one)")
    ap.add_argument("--requests", type=int, default=3, help="of each kind, alternating")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a deploy-config field")
    ap.add_argument("--out")
    args = ap.parse_args()
    record = recorder(args.out)
    path = checkpoint_path(args.tiny, args.checkpoint)
    params = request_params(path, THINKER_TOKENS, CODES)
    deploy = yaml.safe_load(DEPLOY.read_text())
    for name in ("thinker", "talker"):
        deploy["stages"][name].update(max_model_len=2048, max_num_seqs=1)
    deploy["stages"]["token2wav"].update(max_num_seqs=1, dtype="bfloat16")
    settings = parse_settings(args.set)
    apply_settings(deploy, settings)
    engine = AsyncOmni(path, deploy)
    try:
        kinds = {"text": ("text",), "speech": ("text", "audio")}
        for modalities in kinds.values():  # warm-up
            asyncio.run(one_request(engine, params, modalities))
        for _ in range(args.requests):
            for kind, modalities in kinds.items():
                row = asyncio.run(one_request(engine, params, modalities))
                record(part="thinker_phase", request=kind, settings=settings, **row)
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
