"""Qwen3-Omni-30B-A3B speech serving vs transformers' sequential `generate`, one GPU, one run.

Checkpoint: the released Qwen3-Omni-30B-A3B-Instruct architecture (FULL_SIZE below) with random bf16 weights,
built on the GPU from the tiny factory's layout (`omnistage.testing.qwen3_omni_moe`: its tokenizer, processor files
and token ids) and saved by transformers in the released per-expert layout, so both sides load the same files
through their own loaders. The thinker's head rows outside the tokenizer's plain tokens and the talker's codec-head
eos row are zero: greedy replies are decodable text, and speech never draws eos (both sides also suppress the
control codes), so every request speaks exactly `--frames` frames on valid codec ids.
The full checkpoint (~35 B parameters, ~70 GB) is written to /dev/shm when it has room, else to the temp dir's disk;
`--thinker-layers auto` keeps the released 48 thinker layers when they fit there and otherwise the most that fit
(the talker then reads the thinker's middle layer, as the released one reads layer 24 of 48). Every row records
`thinker_layers` and `variant`.

Parts, each in a process of its own (GPU memory and compile state its own), `--parts` picks:

- `hf`: `Qwen3OmniMoeForConditionalGeneration.generate`, text + audio, one request after another (its only audio
  packet is the whole reply: first packet = end-to-end), and one text-only `generate` (tokens/s).
- `ours`: `AsyncOmni` on the one-GPU deploy config (stages inline, talker -> code2wav streamed in windows): time to
  first audio packet, end-to-end latency, RTF and worst playback stall (a listener who starts at the first packet:
  the longest wait for the next) at concurrency 1 (three requests in turn), then request throughput and RTF at each
  `--concurrency` level; then text-only requests (thinker alone) at `--text-concurrency`: tokens/s.
- `lm`: the thinker's MoE text decoder as a plain `Qwen3MoeForCausalLM` checkpoint (the omni checkpoint's tensors
  re-keyed, written beside it when there is room, else skipped with a row saying so), served by omnistage's
  causal-LM family: the same text-only waves, the issue's "text as fast as the plain LLM" comparison.

At the end a `summary` row sets the issue's goals against the rows (first audio and RTF at c=1, RTF, stall and
request throughput vs HF at the largest level, text tokens/s vs the plain LM).

    python benchmarks/omni_qwen3.py --out benchmarks/results/omni_qwen3-h200.jsonl --stop-after 500
    python benchmarks/omni_qwen3.py --checkpoint /dev/shm/q3o --parts build           # write it once (one call)
    python benchmarks/omni_qwen3.py --checkpoint /dev/shm/q3o --parts hf,ours --stop-after 480   # later calls
    python benchmarks/omni_qwen3.py --thinker-layers 24 --parts ours      # a labelled reduced variant
    python benchmarks/omni_qwen3.py --profile /tmp/q3o-prof              # one c=1 request under torch.profiler
    python benchmarks/omni_qwen3.py --tiny                               # the tiny checkpoint, CPU, end to end
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import torch
import yaml
from omni_qwen2_5 import apply_settings, one_request, parse_settings, peak_allocated_gib, stage_steps
from recording import recorder
from tts_qwen3 import stall_of

from omnistage.families.qwen2_5_omni import SPEECH_SYSTEM_PROMPT

SAMPLE_RATE = 24000
FRAMES_PER_S = 12.5
RELEASED_THINKER_LAYERS = 48
DEPLOY = Path(__file__).resolve().parents[1] / "omnistage" / "families" / "qwen3_omni_moe" / "configs" / "1gpu.yaml"
PROMPT = "Please tell me, in a long and friendly story, everything you know about rivers, mountains and the sea."
VOICE = "Ethan"
# The released Qwen/Qwen3-Omni-30B-A3B-Instruct config.json (transformers 5.25's config fields only), as printed
# from the loaded checkpoint in a public model report (the code index's copy of it; its text_config / audio_config /
# vision_config / talker / code_predictor / code2wav sections). The defaults of transformers' config classes are
# other sizes (thinker 28 layers, talker top-8 of 128 over 32 codebooks, ...). Token ids stay the tiny tokenizer's.
_MROPE = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [24, 20, 20], "interleaved": True}
FULL_SIZE: dict[str, Any] = {
    "thinker_config": {
        "text_config": dict(vocab_size=152064, hidden_size=2048, intermediate_size=768, moe_intermediate_size=768,
                            num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                            num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                            mlp_only_layers=[], rms_norm_eps=1e-6, max_position_embeddings=65536,
                            rope_parameters=_MROPE),
        "audio_config": dict(num_mel_bins=128, encoder_layers=32, encoder_attention_heads=20, encoder_ffn_dim=5120,
                             d_model=1280, max_source_positions=1500, n_window=50, n_window_infer=800,
                             conv_chunksize=500, downsample_hidden_size=480, output_dim=2048),
        "vision_config": dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16,
                              spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=2048,
                              num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24],
                              hidden_act="gelu_pytorch_tanh"),
    },
    "talker_config": {
        "text_config": dict(vocab_size=3072, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=384,
                            shared_expert_intermediate_size=768, num_hidden_layers=20, num_attention_heads=16,
                            num_key_value_heads=2, head_dim=128, num_local_experts=128, num_experts_per_tok=6,
                            norm_topk_prob=True, rms_norm_eps=1e-6, max_position_embeddings=65536,
                            rope_parameters=_MROPE),
        "code_predictor_config": dict(vocab_size=2048, hidden_size=1024, intermediate_size=3072, num_hidden_layers=5,
                                      num_attention_heads=16, num_key_value_heads=8, head_dim=128, num_code_groups=16,
                                      max_position_embeddings=32768,
                                      rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        "num_code_groups": 16, "thinker_hidden_size": 2048, "accept_hidden_layer": 24,
        "codec_pad_id": 2148, "codec_bos_id": 2149, "codec_eos_token_id": 2150, "codec_nothink_id": 2155,
        "codec_think_bos_id": 2156, "codec_think_eos_id": 2157,
        "speaker_id": {"chelsie": 2301, "ethan": 2302, "aiden": 2303},
    },
    "code2wav_config": dict(codebook_size=2048, hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
                            num_key_value_heads=16, num_hidden_layers=8, sliding_window=72, num_quantizers=16,
                            decoder_dim=1536, upsample_rates=[8, 5, 4, 3], upsampling_ratios=[2, 2],
                            max_position_embeddings=8000, rms_norm_eps=1e-5,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}
GOALS = {"ttfp_c1_s": 0.3, "rtf_c1": 0.15, "rtf_top": 0.5, "stall_top_s": 0.0, "hf_throughput_ratio": 100.0}
DONE = ".omni_qwen3_done"  # a complete checkpoint's marker (a write cut short by a call's limit leaves none)


# ---------------------------------------------------------------- checkpoint


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return out


def released_config(tokenizer: Any, thinker_layers: int) -> Any:
    """The tiny factory's config for `tokenizer` (its token ids) with FULL_SIZE's sizes and `thinker_layers`
    thinker layers; a reduced thinker has the talker read its middle layer (the released: 24 of 48)."""
    from transformers import Qwen3OmniMoeConfig

    from omnistage.testing.qwen3_omni_moe import tiny_config

    config = _merge(tiny_config(tokenizer).to_dict(), FULL_SIZE)
    config["talker_config"]["code_predictor_config"].pop("layer_types", None)  # one per layer: re-derived
    config["thinker_config"]["text_config"]["num_hidden_layers"] = thinker_layers
    if thinker_layers != RELEASED_THINKER_LAYERS:
        config["talker_config"]["accept_hidden_layer"] = max(1, thinker_layers // 2)
    return Qwen3OmniMoeConfig.from_dict(config)


def _tokenizer(where: Path) -> Any:
    from transformers import AutoTokenizer

    from omnistage.testing.qwen3_omni_moe import make_omni_tokenizer

    return AutoTokenizer.from_pretrained(make_omni_tokenizer(where))


def checkpoint_bytes(thinker_layers: int) -> int:
    """Bytes of the bf16 weights with `thinker_layers` thinker layers (the model built on the meta device)."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    with tempfile.TemporaryDirectory() as tmp, torch.device("meta"):
        model = Qwen3OmniMoeForConditionalGeneration._from_config(released_config(_tokenizer(Path(tmp)),
                                                                                  thinker_layers))
    return sum(p.numel() for p in model.parameters()) * 2


def _room(path: Path) -> int:
    """Bytes a checkpoint may take under `path`: its free space less 6 GiB, and under /dev/shm (RAM) no more than
    leaves 32 GiB of memory available to the processes that load it."""
    path.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(path).free - 6 * 2**30
    if str(path).startswith("/dev/shm"):
        meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        free = min(free, int(meminfo["MemAvailable"].split()[0]) * 1024 - 32 * 2**30)
    return free


def plan_checkpoint(args: argparse.Namespace) -> tuple[Path, int]:
    """Where the checkpoint is (or goes) and its thinker layers: an existing complete one is reused; else /dev/shm
    when the requested size fits there, else the temp dir; `auto` is the released 48 where they fit, else the most
    layers that fit the roomier place."""
    if args.tiny:
        from omnistage.testing import tiny_checkpoint

        path = Path(tiny_checkpoint("qwen3_omni_moe"))
        return path, json.loads((path / "config.json").read_text())["thinker_config"]["text_config"][
            "num_hidden_layers"]
    roots = [Path("/dev/shm"), Path(tempfile.gettempdir())]
    candidates = [Path(args.checkpoint)] if args.checkpoint else [r / "omni_qwen3" for r in roots]
    for path in candidates:
        if (path / DONE).is_file():
            layers = json.loads((path / "config.json").read_text())["thinker_config"]["text_config"][
                "num_hidden_layers"]
            if args.thinker_layers in ("auto", str(layers)):
                return path, layers
            print(f"{path} has {layers} thinker layers, not {args.thinker_layers}: rewritten", file=sys.stderr)
        shutil.rmtree(path.with_name(path.name + ".tmp"), ignore_errors=True)  # a write cut short: its space back
    subprocess.run(["df", "-h", *[str(r) for r in roots if r.exists()]], check=False)
    places = candidates
    room = {p: _room(p.parent) for p in places}
    full = checkpoint_bytes(RELEASED_THINKER_LAYERS)
    per_layer = full - checkpoint_bytes(RELEASED_THINKER_LAYERS - 1)
    if args.thinker_layers != "auto":
        layers = int(args.thinker_layers)
        need = full - (RELEASED_THINKER_LAYERS - layers) * per_layer
    else:
        layers, need = RELEASED_THINKER_LAYERS, full
        if not any(room[p] >= need for p in places):
            best = max(places, key=room.get)
            layers = min(RELEASED_THINKER_LAYERS, (room[best] - (full - RELEASED_THINKER_LAYERS * per_layer))
                         // per_layer)
            need = full - (RELEASED_THINKER_LAYERS - layers) * per_layer
            print(f"REDUCED VARIANT: the released checkpoint ({full / 2**30:.1f} GiB) fits none of "
                  f"{[str(p.parent) for p in places]}; writing {layers} of {RELEASED_THINKER_LAYERS} thinker "
                  f"layers ({need / 2**30:.1f} GiB)", file=sys.stderr, flush=True)
    fitting = [p for p in places if room[p] >= need]
    if layers < 2 or not fitting:
        raise SystemExit(f"no room for a {layers}-layer checkpoint ({need / 2**30:.1f} GiB): "
                         f"{ {str(p.parent): round(r / 2**30, 1) for p, r in room.items()} } GiB free")
    print(f"checkpoint: {fitting[0]} ({layers} thinker layers, {need / 2**30:.1f} GiB)", file=sys.stderr, flush=True)
    return fitting[0], layers


@torch.no_grad()
def write_checkpoint(path: Path, thinker_layers: int) -> None:
    """Random bf16 weights (the modules' own init, on the GPU when there is one) saved in the released layout,
    with the tiny factory's tokenizer and processor files beside them."""
    from transformers import GenerationConfig, Qwen3OmniMoeForConditionalGeneration

    from omnistage.testing.qwen3_omni_moe import _token_ids, save_processor

    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(path, ignore_errors=True)
    tokenizer = _tokenizer(tmp)
    config = released_config(tokenizer, thinker_layers)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen3OmniMoeForConditionalGeneration._from_config(config, dtype=torch.bfloat16).eval()
    for name, p in model.named_parameters():  # the fused expert tensors are created empty
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            p.normal_(0.0, config.initializer_range)
    bad = [name for name, p in model.named_parameters() if not torch.isfinite(p).all()]
    if bad:
        raise RuntimeError(f"parameters left uninitialized: {bad[:5]}")
    ids = _token_ids(tokenizer)
    head = model.thinker.lm_head.weight  # replies: plain tokens only (special and unused rows never win)
    head[len(tokenizer):] = 0.0
    head[sorted(i for i in ids.values() if i < head.shape[0])] = 0.0
    model.talker.codec_head.weight[config.talker_config.codec_eos_token_id] = 0.0  # never in the top-k: no eos
    model.generation_config = GenerationConfig(bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                                               pad_token_id=ids["<|endoftext|>"])
    model.save_pretrained(tmp, max_shard_size="4GB")
    del model
    save_processor(tmp)
    (tmp / DONE).write_text(f"thinker_layers={thinker_layers}\n")
    tmp.rename(path)


_EXPERT = re.compile(r"thinker\.model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
_PLAIN = (("thinker.model.layers.", "model.layers."), ("thinker.model.embed_tokens.", "model.embed_tokens."),
          ("thinker.model.norm.", "model.norm."), ("thinker.lm_head.", "lm_head."))


def plain_lm_tensors(omni: Path) -> tuple[int, Iterator[tuple[str, torch.Tensor]]]:
    """The omni checkpoint's thinker text decoder under `Qwen3MoeForCausalLM`'s names, its per-expert tensors fused
    per layer into `experts.gate_up_proj` [E, 2I, H] (gate rows first) and `experts.down_proj` [E, H, I], the layout
    omnistage's causal-LM loader copies in (transformers loads it too): (bytes, the tensors one by one)."""
    from safetensors import safe_open

    handles = [safe_open(str(f), "pt") for f in sorted(omni.glob("model*.safetensors"))]
    where = {k: h for h in handles for k in h.keys()}
    plain, experts, size = {}, {}, 0
    for k, h in where.items():
        meta = h.get_slice(k)
        nbytes = math.prod(meta.get_shape()) * (4 if meta.get_dtype() == "F32" else 2)
        if m := _EXPERT.fullmatch(k):
            experts.setdefault(int(m[1]), {})[(int(m[2]), m[3])] = k
            size += nbytes
        elif new := next((new + k[len(old):] for old, new in _PLAIN if k.startswith(old)), None):
            plain[new] = k
            size += nbytes

    def get(k: str) -> torch.Tensor:
        return where[k].get_tensor(k)

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for new, k in plain.items():
            yield new, get(k)
        for layer, keys in sorted(experts.items()):
            ids = range(1 + max(e for e, _ in keys))
            prefix = f"model.layers.{layer}.mlp.experts."
            yield prefix + "gate_up_proj", torch.stack([torch.cat([get(keys[e, "gate"]), get(keys[e, "up"])])
                                                        for e in ids])
            yield prefix + "down_proj", torch.stack([get(keys[e, "down"]) for e in ids])

    return size, tensors()


def write_plain_lm(omni: Path, out: Path) -> None:
    """The thinker's text decoder as a `Qwen3MoeForCausalLM` checkpoint (`plain_lm_tensors`, the tokenizer and chat
    template copied): the same weights served as a plain LLM. Raises OSError when `out`'s disk lacks room."""
    from safetensors.torch import save_file
    from transformers import Qwen3MoeConfig, Qwen3OmniMoeConfig

    if (out / DONE).is_file():
        return
    shutil.rmtree(out.with_name(out.name + ".tmp"), ignore_errors=True)
    need, tensors = plain_lm_tensors(omni)
    out.parent.mkdir(parents=True, exist_ok=True)
    if _room(out.parent) < need:
        raise OSError(f"{need / 2**30:.1f} GiB needed for the plain LM, {_room(out.parent) / 2**30:.1f} free at "
                      f"{out.parent}")
    text = Qwen3OmniMoeConfig.from_pretrained(omni).thinker_config.text_config
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    fields = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "num_experts", "num_experts_per_tok",
              "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "rms_norm_eps", "max_position_embeddings",
              "bos_token_id", "eos_token_id", "pad_token_id", "attention_bias")
    config = Qwen3MoeConfig(**{k: getattr(text, k) for k in fields}, tie_word_embeddings=False,
                            rope_parameters={"rope_type": "default", "rope_theta": text.rope_parameters["rope_theta"]})
    config.architectures = ["Qwen3MoeForCausalLM"]
    config.save_pretrained(tmp)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (omni / name).is_file():
            shutil.copy(omni / name, tmp / name)
    shard: dict[str, torch.Tensor] = {}
    index: dict[str, str] = {}

    def flush() -> None:
        if shard:
            file = f"model-{len(set(index.values())) + 1:05d}.safetensors"
            save_file(shard, str(tmp / file), metadata={"format": "pt"})
            index.update(dict.fromkeys(shard, file))
            shard.clear()

    for name, tensor in tensors:
        shard[name] = tensor.contiguous()
        if sum(t.numel() * t.element_size() for t in shard.values()) >= 4 * 2**30:
            flush()
    flush()
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}, indent=1))
    (tmp / DONE).write_text("plain lm\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


# ---------------------------------------------------------------- HF transformers (a process of its own)


def hf_worker(req_path: str, rep_path: str) -> None:
    """Times `generate` with speech, one request after another, and one text-only `generate`."""
    import transformers
    from transformers import Qwen3OmniMoeForConditionalGeneration, Qwen3OmniMoeProcessor

    req = json.loads(Path(req_path).read_text())
    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda else torch.float32
    t0 = time.perf_counter()
    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(req["path"], dtype=dtype,
                                                                 device_map="cuda" if cuda else "cpu").eval()
    load_s = time.perf_counter() - t0
    processor = Qwen3OmniMoeProcessor.from_pretrained(req["path"])
    eos = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")

    def batch(messages: list[dict]) -> dict:
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return {k: v.to(model.device) for k, v in processor(text=[text], return_tensors="pt", padding=False).items()}

    speech = batch([{"role": "system", "content": [{"type": "text", "text": SPEECH_SYSTEM_PROMPT}]},
                    {"role": "user", "content": PROMPT}])  # what omnistage builds for a speech request
    plain = batch([{"role": "user", "content": PROMPT}])

    def timed(inputs: dict, tokens: int, frames: int | None) -> tuple[float, Any]:
        # transformers' talker emits one frame fewer than its max_new_tokens; min_new_tokens keeps eos off too
        kw: dict[str, Any] = dict(thinker_max_new_tokens=tokens, thinker_min_new_tokens=tokens,
                                  thinker_do_sample=False, thinker_eos_token_id=eos, speaker=req["voice"])
        if frames is None:
            kw["return_audio"] = False
        else:
            kw.update(talker_max_new_tokens=frames + 1, talker_min_new_tokens=frames + 1)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(**inputs, **kw)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start, out

    timed(speech, 4, 8)  # warm-up
    rows = []
    for _ in range(req["requests"]):
        wall, (sequences, wav) = timed(speech, req["thinker_tokens"], req["frames"])
        rows.append({"wall": wall, "audio": wav.numel() / SAMPLE_RATE,
                     "tokens": sequences.shape[1] - speech["input_ids"].shape[1]})
    wall, sequences = timed(plain, req["text_tokens"], None)
    text = {"wall": wall, "tokens": sequences.shape[1] - plain["input_ids"].shape[1],
            "prompt_tokens": plain["input_ids"].shape[1]}
    Path(rep_path).write_text(json.dumps({
        "speech": rows, "text": text, "prompt_tokens": speech["input_ids"].shape[1], "load_s": load_s,
        "transformers": transformers.__version__, "torch": torch.__version__}))


def hf_part(ctx: dict, record: Any) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        req, rep = Path(tmp, "req.json"), Path(tmp, "rep.json")
        req.write_text(json.dumps({k: ctx[k] for k in ("path", "thinker_tokens", "frames", "text_tokens", "voice")}
                                  | {"requests": ctx["hf_requests"]}))
        proc = subprocess.run([sys.executable, __file__, "--hf-worker", str(req), str(rep)], text=True,
                              stderr=subprocess.PIPE)
        if proc.returncode != 0:
            record(part="hf_generate", error=proc.stderr[-2000:])
            return
        got = json.loads(rep.read_text())
    rows, tag = got["speech"], {"transformers": got["transformers"], "torch": got["torch"]}
    walls = [r["wall"] for r in rows]
    record(part="hf_generate", mode="speech", level=1, requests=len(rows), prompt_tokens=got["prompt_tokens"],
           thinker_tokens=rows[0]["tokens"], frames=ctx["frames"], load_s=_r(got["load_s"]),
           ttfp_s_median=_r(statistics.median(walls)), e2e_s_median=_r(statistics.median(walls)),
           e2e_s_max=_r(max(walls)), rtf_median=_r(statistics.median(r["wall"] / r["audio"] for r in rows)),
           audio_s_mean=_r(statistics.mean(r["audio"] for r in rows)), stall_max_s=0.0,
           requests_per_s=_r(len(rows) / sum(walls)), note="sequential; no streaming: first packet = whole reply",
           **tag)
    text = got["text"]
    record(part="hf_generate", mode="text", level=1, requests=1, prompt_tokens=text["prompt_tokens"],
           output_tokens=text["tokens"], e2e_s_median=_r(text["wall"]),
           tokens_per_s=_r(text["tokens"] / text["wall"]), note="prefill included", **tag)


# ---------------------------------------------------------------- omnistage


def deploy_for(ctx: dict, levels: list[int]) -> dict:
    deploy = yaml.safe_load(DEPLOY.read_text())
    for name in ("thinker", "talker"):
        deploy["stages"][name].update(max_model_len=4096, max_num_seqs=max(levels))
    deploy["stages"]["code2wav"]["max_num_seqs"] = max(levels)
    apply_settings(deploy, ctx["settings"])  # without a GPU: inline, no device placement
    return deploy


def speech_params(ctx: dict) -> dict:
    from omnistage import SamplingParams

    # transformers' generate defaults for the talker (and the deploy config's); exactly `frames` frames
    return {"thinker": SamplingParams(max_tokens=ctx["thinker_tokens"], temperature=0, ignore_eos=True),
            "talker": SamplingParams(max_tokens=ctx["frames"], temperature=0.9, top_k=50, top_p=1.0,
                                     repetition_penalty=1.05, ignore_eos=True)}


async def speech_events(engine: Any, rid: str, params: dict) -> AsyncIterator[tuple[bool, int, int]]:
    from omnistage.types import OmniRequest

    request = OmniRequest(request_id=rid, messages=[{"role": "user", "content": PROMPT}], stage_params=params,
                          output_modalities=("text", "audio"), options={"voice": VOICE})
    async for out in engine.generate(request):
        if out.error:
            raise RuntimeError(out.error)
        yield bool(out.text or out.token_ids), 0 if out.audio is None else out.audio.size, out.num_prompt_tokens or 0


async def text_request(engine: Any, rid: str, stage: str, tokens: int) -> dict:
    """One text-only request: time to first token, end, output tokens, prompt tokens."""
    from omnistage import SamplingParams
    from omnistage.types import OmniRequest

    request = OmniRequest(request_id=rid, messages=[{"role": "user", "content": PROMPT}],
                          stage_params={stage: SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)})
    start, first, ids, prompt = time.perf_counter(), None, [], 0
    async for out in engine.generate(request):
        if out.error:
            raise RuntimeError(out.error)
        if out.token_ids:
            first = first or time.perf_counter() - start
            ids += out.token_ids
        prompt = out.num_prompt_tokens or prompt
    return {"ttft": first, "e2e": time.perf_counter() - start, "tokens": len(ids), "ids": ids, "prompt": prompt}


async def text_levels(engine: Any, ctx: dict, stage: str, part: str, record: Any, late: Any) -> None:
    await text_request(engine, "text-warm", stage, 8)
    for n in ctx["text_levels"]:
        if late(part, mode="text", level=n):
            return
        start = time.perf_counter()
        got = await asyncio.gather(*(text_request(engine, f"text-c{n}-{i}", stage, ctx["text_tokens"])
                                     for i in range(n)))
        wall = time.perf_counter() - start
        record(part=part, mode="text", level=n, requests=n, prompt_tokens=got[0]["prompt"],
               output_tokens=ctx["text_tokens"], ttft_s_median=_r(statistics.median(g["ttft"] for g in got)),
               e2e_s_median=_r(statistics.median(g["e2e"] for g in got)),
               tokens_per_s=_r(sum(g["tokens"] for g in got) / wall),
               decode_tokens_per_s_per_request=_r(statistics.median((g["tokens"] - 1) / (g["e2e"] - g["ttft"])
                                                                    for g in got)),
               first_ids=got[0]["ids"][:16], **ctx["tag"])  # the thinker and the plain LM: the same decoder


def ours_part(ctx: dict, record: Any, late: Any) -> None:
    from omnistage import AsyncOmni

    levels = ctx["levels"]
    deploy = deploy_for(ctx, levels + ctx["text_levels"])
    t0 = time.perf_counter()
    engine = AsyncOmni(ctx["path"], deploy)
    up_s = time.perf_counter() - t0
    print(f"omnistage up in {up_s:.1f}s", file=sys.stderr, flush=True)
    params = speech_params(ctx)

    async def wave(n: int) -> tuple[list[dict], float]:
        start = time.perf_counter()
        got = await asyncio.gather(*(one_request(speech_events(engine, f"c{n}-{i}-{time.monotonic_ns()}", params))
                                     for i in range(n)))
        return list(got), time.perf_counter() - start

    async def run() -> None:
        for n in sorted({1, max(levels)}):  # warm-up: every batch shape the waves meet compiled and tuned
            await wave(n)
        for n in levels:
            if late("omnistage", mode="speech", level=n):
                return
            before = engine.stats()
            runs = [await wave(n) for _ in range(3 if n == 1 else 1)]
            after = engine.stats()
            got = [r for rs, _ in runs for r in rs]
            wall = statistics.median(w for _, w in runs)
            ttfp = [g["ttfp"] for g in got]
            record(part="omnistage", mode="speech", level=n, requests=len(got), prompt_tokens=got[0]["prompt"],
                   thinker_tokens=ctx["thinker_tokens"], frames=ctx["frames"], startup_s=_r(up_s),
                   ttfp_s_median=_r(statistics.median(ttfp)), ttfp_s_p90=_r(_pct(ttfp, 0.9)), ttfp_s_max=_r(max(ttfp)),
                   e2e_s_median=_r(statistics.median(g["e2e"] for g in got)), e2e_s_max=_r(max(g["e2e"] for g in got)),
                   rtf_median=_r(statistics.median(g["e2e"] / g["audio"] for g in got)),
                   rtf_max=_r(max(g["e2e"] / g["audio"] for g in got)),
                   audio_s_mean=_r(statistics.mean(g["audio"] for g in got)),
                   stall_max_s=_r(max(stall_of(g["chunks"]) for g in got)),
                   chunks_mean=_r(statistics.mean(len(g["chunks"]) for g in got)),
                   requests_per_s=_r(len(runs[0][0]) / wall),
                   audio_s_per_s=_r(sum(g["audio"] for g in runs[0][0]) / wall), stages=stage_steps(before, after),
                   deploy={k: deploy["stages"][k].get("options", {}) for k in ("code2wav",)},
                   gpu_peak_allocated_gib=peak_allocated_gib("inline"), **ctx["tag"])
        await text_levels(engine, ctx, "thinker", "omnistage-thinker", record, late)

    try:
        asyncio.run(run())
    finally:
        engine.shutdown()


def lm_part(ctx: dict, record: Any, late: Any) -> None:
    from omnistage import AsyncOmni

    omni = Path(ctx["path"])
    places = [Path(ctx["lm_checkpoint"])] if ctx["lm_checkpoint"] else [
        omni.with_name(omni.name + "-lm"), Path(tempfile.gettempdir()) / "omni_qwen3-lm"]
    out, refusals = None, []
    for place in dict.fromkeys(places):  # beside the omni checkpoint, else on the temp dir's disk
        try:
            write_plain_lm(omni, place)
            out = place
            break
        except OSError as exc:
            refusals.append(str(exc))
    if out is None:
        record(part="omnistage-plain-lm", mode="text", skipped="; ".join(refusals), **ctx["tag"])
        return
    settings = {"stages.lm.max_model_len": 4096, "stages.lm.max_num_seqs": max(ctx["text_levels"])}
    if torch.cuda.is_available():
        settings["stages.lm.gpu_memory_utilization"] = 0.75
    engine = AsyncOmni.from_model(out, overrides=settings)
    try:
        asyncio.run(text_levels(engine, ctx, "lm", "omnistage-plain-lm", record, late))
    finally:
        engine.shutdown()


def profile_part(ctx: dict, record: Any) -> None:
    """One c=1 speech request under torch.profiler (stages inline: CUPTI sees every kernel): wall and GPU kernel
    time per frame, kernel launches per frame; op tables to `--profile`."""
    from torch.profiler import ProfilerActivity, profile

    from omnistage import AsyncOmni

    engine = AsyncOmni(ctx["path"], deploy_for(ctx, [1]))
    out = Path(ctx["profile"])
    out.mkdir(parents=True, exist_ok=True)
    params, frames = speech_params(ctx), ctx["frames"]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])

    async def run() -> tuple[Any, dict]:
        await one_request(speech_events(engine, "warm", params))
        with profile(activities=activities) as prof:
            got = await one_request(speech_events(engine, "profiled", params))
        return prof, got

    try:
        prof, got = asyncio.run(run())
    finally:
        engine.shutdown()
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    for key in ("self_cpu_time_total", "self_device_time_total"):
        (out / f"omni_qwen3_profile_{key}.txt").write_text(events.table(sort_by=key, row_limit=40))
    prof.export_chrome_trace(str(out / "omni_qwen3_c1.json"))
    record(part="omnistage profile", mode="speech", level=1, frames=frames, e2e_s=_r(got["e2e"]),
           ttfp_s=_r(got["ttfp"]), wall_ms_per_frame=_r(1000 * got["e2e"] / frames),
           gpu_kernel_ms_per_frame=_r(sum(e.self_device_time_total for e in kernels) / 1000 / frames),
           kernel_launches_per_frame=_r(sum(e.count for e in kernels) / frames), **ctx["tag"])


# ---------------------------------------------------------------- output


def _r(x: float | None) -> float | None:
    return None if x is None else round(float(x), 4)


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def summary(rows: list[dict], top: int) -> dict:
    """The issue's goals against this run's rows (None where a row is missing)."""
    def row(part: str, mode: str, level: int) -> dict:
        return next((r for r in rows if r.get("part") == part and r.get("mode") == mode and r.get("level") == level
                     and "error" not in r and "skipped" not in r), {})

    c1, ctop, hf = row("omnistage", "speech", 1), row("omnistage", "speech", top), row("hf_generate", "speech", 1)
    ratio = ctop.get("requests_per_s") / hf["requests_per_s"] if ctop and hf else None
    got = {"ttfp_c1_s": c1.get("ttfp_s_median"), "rtf_c1": c1.get("rtf_median"), "rtf_top": ctop.get("rtf_median"),
           "stall_top_s": ctop.get("stall_max_s"), "hf_throughput_ratio": _r(ratio)}
    met = {k: None if v is None else (v >= GOALS[k] if k == "hf_throughput_ratio" else v <= GOALS[k])
           for k, v in got.items()}
    text = {}
    for level in sorted({r["level"] for r in rows if r.get("mode") == "text" and "level" in r}):
        thinker, lm = row("omnistage-thinker", "text", level), row("omnistage-plain-lm", "text", level)
        if thinker and lm:
            text[f"c{level}_thinker_vs_plain_lm"] = _r(thinker["tokens_per_s"] / lm["tokens_per_s"])
            text[f"c{level}_same_first_tokens"] = thinker["first_ids"] == lm["first_ids"]
    return {"part": "summary", "top_level": top, "goals": GOALS, "got": got, "met": met,
            "text_tokens_per_s_ratio": text}


COLUMNS = ("part", "mode", "level", "requests", "ttfp_s_median", "ttfp_s_max", "e2e_s_median", "rtf_median",
           "rtf_max", "stall_max_s", "requests_per_s", "audio_s_per_s", "tokens_per_s", "ttft_s_median")


def table(rows: list[dict]) -> str:
    shown = [r for r in rows if "error" not in r and "skipped" not in r and r.get("part") != "summary"]
    lines = [" | ".join(COLUMNS), " | ".join("---" for _ in COLUMNS)]
    lines += [" | ".join(str(r.get(c, "")) for c in COLUMNS) for r in shown]
    lines += [f"{r['part']}: ERROR {str(r['error'])[-300:]}" for r in rows if "error" in r]
    lines += [f"{r['part']} {r.get('mode', '')} {r.get('level', '')}: skipped ({r['skipped']})"
              for r in rows if "skipped" in r]
    return "\n".join(lines)


# ---------------------------------------------------------------- main


PARTS = ("build", "hf", "ours", "lm", "profile")


def run_part(part: str, ctx: dict, rows_file: Path, deadline: float) -> None:
    """In the part's own process: its rows appended to `rows_file` (the parent prints and keeps them)."""
    base = recorder(str(rows_file))

    def record(**row: Any) -> None:
        base(**{"thinker_layers": ctx["thinker_layers"], "variant": ctx["variant"], **row})

    def late(part_name: str, **where: Any) -> bool:
        if deadline and time.time() > deadline:
            record(part=part_name, **where, skipped="past --stop-after")
            return True
        return False

    try:
        if part == "build" and (Path(ctx["path"]) / DONE).is_file():
            record(part="build", checkpoint=ctx["path"], reused=True)
        elif part == "build":
            t0 = time.perf_counter()
            write_checkpoint(Path(ctx["path"]), ctx["thinker_layers"])
            record(part="build", checkpoint=ctx["path"], write_s=_r(time.perf_counter() - t0))
        elif part == "hf":
            hf_part(ctx, record)
        elif part == "ours":
            ours_part(ctx, record, late)
        elif part == "lm":
            lm_part(ctx, record, late)
        elif part == "profile":
            profile_part(ctx, record)
    except Exception as exc:  # a part's failure is a row; the other parts still run
        import traceback

        traceback.print_exc()
        record(part=part, error=f"{type(exc).__name__}: {exc}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="the tiny checkpoint on CPU, short requests, levels 1,2")
    ap.add_argument("--checkpoint", help="the full-size checkpoint's directory (written there if not complete; "
                                         "default: /dev/shm/omni_qwen3 when it fits, else $TMPDIR/omni_qwen3)")
    ap.add_argument("--thinker-layers", default="auto", help="thinker decoder layers of a new checkpoint: auto (the "
                    "released 48 if they fit, else the most that fit) or a number (a reduced variant)")
    ap.add_argument("--lm-checkpoint", help="where the plain-LM checkpoint goes (default: beside the omni one)")
    ap.add_argument("--parts", default="hf,ours,lm", help=f"comma-separated, of {PARTS} (build is implied when the "
                    "checkpoint is missing)")
    ap.add_argument("--concurrency", default="1,8,32,64", help="speech levels")
    ap.add_argument("--text-concurrency", default="1,32", help="text-only levels (thinker alone, plain LM)")
    ap.add_argument("--thinker-tokens", type=int, default=64, help="reply tokens per speech request")
    ap.add_argument("--frames", type=int, default=150, help="speech frames per request (12.5 a second)")
    ap.add_argument("--text-tokens", type=int, default=256, help="output tokens per text-only request")
    ap.add_argument("--hf-requests", type=int, default=2, help="sequential timed HF speech requests")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a deploy-config setting (YAML value), e.g. stages.code2wav.options.window=12; repeatable")
    ap.add_argument("--stop-after", type=float, default=0.0, help="start no further part or level once this many "
                    "seconds have passed since the start; 0: no limit")
    ap.add_argument("--profile", help="only profile one c=1 speech request and write op tables / a trace here")
    ap.add_argument("--out", help="append JSON rows to this .jsonl")
    ap.add_argument("--hf-worker", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--part-worker", nargs=3, help=argparse.SUPPRESS)  # part, context json, rows file
    args = ap.parse_args()
    if args.hf_worker:
        hf_worker(*args.hf_worker)
        return
    if args.part_worker:
        part, ctx_file, rows_file = args.part_worker
        ctx = json.loads(Path(ctx_file).read_text())
        run_part(part, ctx, Path(rows_file), ctx["deadline"])
        return
    started = time.time()
    levels = [int(x) for x in args.concurrency.split(",")]
    text_levels = [int(x) for x in args.text_concurrency.split(",")]
    if args.tiny:
        levels, text_levels = [1, 2], [1, 2]
        args.thinker_tokens, args.frames, args.text_tokens, args.hf_requests = 8, 12, 8, 1
    parts = ["profile"] if args.profile else [p for p in args.parts.split(",") if p]
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise SystemExit(f"unknown parts {sorted(unknown)}; choose from {PARTS}")
    path, layers = plan_checkpoint(args)
    if not args.tiny and not (path / DONE).is_file() and "build" not in parts:
        parts.insert(0, "build")
    import transformers

    ctx = {"path": str(path), "thinker_layers": layers, "levels": levels, "text_levels": text_levels,
           "variant": "released" if layers == RELEASED_THINKER_LAYERS or args.tiny
           else f"reduced: {layers} of {RELEASED_THINKER_LAYERS} thinker layers",
           "thinker_tokens": args.thinker_tokens, "frames": args.frames, "text_tokens": args.text_tokens,
           "hf_requests": args.hf_requests, "voice": VOICE, "settings": parse_settings(args.set),
           "lm_checkpoint": args.lm_checkpoint, "profile": args.profile,
           "deadline": started + args.stop_after if args.stop_after else 0.0,
           "tag": {"transformers": transformers.__version__, "torch": torch.__version__}}
    if args.tiny:
        ctx["variant"] = "tiny"
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        ctx_file, rows_file = Path(tmp, "ctx.json"), Path(tmp, "rows.jsonl")
        if args.tiny and not args.lm_checkpoint:  # not beside the shared tiny cache
            ctx["lm_checkpoint"] = str(Path(tmp, "plain_lm"))
        ctx_file.write_text(json.dumps(ctx))
        rows_file.touch()
        for part in parts:
            if part != "build" and ctx["deadline"] and time.time() > ctx["deadline"]:
                print(f"skipped {part}: past --stop-after {args.stop_after:g}s", file=sys.stderr, flush=True)
                with rows_file.open("a") as f:
                    f.write(json.dumps({"part": part, "skipped": f"past --stop-after {args.stop_after:g}s"}) + "\n")
                continue
            print(f"part {part}", file=sys.stderr, flush=True)
            subprocess.run([sys.executable, __file__, "--part-worker", part, str(ctx_file), str(rows_file)],
                           check=False)
            if part == "build" and not (path / DONE).is_file():
                break  # nothing to measure
        rows = [json.loads(line) for line in rows_file.read_text().splitlines() if line.strip()]
    if any(r.get("part") in ("omnistage", "hf_generate") for r in rows):
        rows.append({"thinker_layers": layers, "variant": ctx["variant"], **summary(rows, max(levels))})
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    print(table(rows))
    if rows and rows[-1].get("part") == "summary":
        print(json.dumps(rows[-1]))


if __name__ == "__main__":
    main()
