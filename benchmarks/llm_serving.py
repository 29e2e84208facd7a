"""HTTP serving under load on one GPU: the real server on a Qwen2.5-7B-architecture checkpoint
(random bf16 weights, saved to disk and loaded through the normal loader), driven by
`omnistage bench serve`'s load generator at several concurrency levels.

    python benchmarks/llm_serving.py --out serving.jsonl [--concurrency 1,64] [--tiny]

Random weights sample ids the bundled tiny tokenizer cannot spell, so token arrivals are counted
from `return_token_ids` rather than from text.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from llm_throughput import random_qwen2

from omnistage.bench.serve import run_bench
from omnistage.entrypoints.async_omni import AsyncOmni
from omnistage.entrypoints.openai.server import BackgroundServer
from omnistage.testing.factory import make_tokenizer


def write_checkpoint(path: Path, tiny: bool) -> None:
    from transformers import GenerationConfig

    model, _ = random_qwen2(tiny)
    model.save_pretrained(path)
    GenerationConfig(eos_token_id=2).save_pretrained(path)
    make_tokenizer(path)
    del model
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--concurrency", default="1,64")
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--input-words", type=int, default=64)
    args = ap.parse_args()

    def record(**row) -> None:
        row["device"] = torch.cuda.get_device_name()
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")

    path = Path(tempfile.mkdtemp()) / "qwen2.5-7b-arch"
    started = time.perf_counter()
    write_checkpoint(path, args.tiny)
    saved = time.perf_counter()
    engine = AsyncOmni.from_model(
        path, overrides={"stages.lm.max_model_len": 2048, "stages.lm.max_num_seqs": 256,
                         "stages.lm.max_num_batched_tokens": 8192}
    )
    record(part="server_startup", write_checkpoint_s=round(saved - started, 1),
           load_and_capture_s=round(time.perf_counter() - saved, 1))
    server = BackgroundServer(engine).start()
    try:
        run_bench(server.url, num_prompts=8, concurrency=8, input_len=args.input_words, output_len=16,
                  return_token_ids=True)  # warm-up
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            num_prompts = max(8, 4 * concurrency)
            result = run_bench(server.url, num_prompts=num_prompts, concurrency=concurrency,
                               input_len=args.input_words, output_len=args.output_len, return_token_ids=True)
            record(part="http_serving", **result)
    finally:
        server.stop()
        engine.shutdown()


if __name__ == "__main__":
    main()
