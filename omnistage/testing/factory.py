"""Tiny random-weight HF checkpoints for tests and demos.

Everything is built locally (no hub access): a byte-level BPE tokenizer trained on a bundled corpus and a
2-layer model of a real architecture, so the server loads them through the same code paths as real models.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from omnistage import envs
from omnistage.testing.layouts import DIFFUSERS_LAYOUTS

# Bump whenever the produced files change, so stale cached checkpoints are not reused.
FACTORY_VERSION = 2

_HERE = Path(__file__).resolve().parent
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
VOCAB_SIZE = 512

# Default init (std 0.02) leaves the residual stream dominated by the (tied) token embedding, so greedy
# decoding repeats one token, and logits are nearly flat (std ~0.16), so argmax near-ties flip between
# attention kernels. Scaling block weights makes every layer move the residual stream (varied greedy output);
# log-normal output-embedding row norms make the top logit stand out (heavier upper tail); scaling the final
# norm spreads logits to std ~3. Measured over 1920 greedy steps (3 archs x 4 seeds x 8 chat prompts x 20
# tokens): top-1 margin median ~1.0, 1st percentile ~0.015, 0.2% of steps below 1e-3 (min ~9e-5); with
# seed 0 the min is >= 3.8e-4. fp32 eager and sdpa greedy outputs match exactly; bf16 ones do not.
_QK_SCALE = 5.0
_LAYER_SCALE = 8.0
_LOGIT_SCALE = 20.0
_ROW_NORM_SIGMA = 0.2


def make_tokenizer(
    out_dir: str | Path,
    extra_special_tokens: tuple[str, ...] = (),
    named_special_tokens: dict[str, str] | None = None,
    chat_template: str = "chat_template.jinja",
    model_max_length: int = 1024,
) -> Path:
    """Train a small byte-level BPE on the bundled corpus and save it as a fast HF tokenizer.

    `extra_special_tokens` get ids right after SPECIAL_TOKENS; `named_special_tokens` (e.g. {"image_token":
    "<|IMAGE|>"}) become tokenizer attributes (`tok.image_token`, `tok.image_token_id`), as multimodal processors
    expect; `chat_template` names a template file bundled beside this module."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    # Same pipeline transformers' Qwen2Tokenizer rebuilds on load (AutoTokenizer forces that class for qwen2
    # configs), so HF and a raw `tokenizers` load of tokenizer.json give identical ids for every arch.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[*SPECIAL_TOKENS, *extra_special_tokens],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = (_HERE / "corpus.txt").read_text(encoding="utf-8")
    tok.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", *extra_special_tokens],
        model_max_length=model_max_length,
        **({"model_specific_special_tokens": named_special_tokens} if named_special_tokens else {}),
    )
    template = (_HERE / chat_template).read_text(encoding="utf-8")
    fast.chat_template = template
    fast.save_pretrained(out)  # transformers 5 writes the template to chat_template.jinja ...
    # ... and older readers (and non-HF code) look in tokenizer_config.json, so put it there too.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    cfg["chat_template"] = template
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return out


CAUSAL_LM_ARCHS = ("qwen2", "qwen3", "llama")  # what make_tiny_causal_lm builds (and the tests sweep)
# Also built, for the tests that need them: a sparse MoE decoder, written by transformers in the released
# per-expert layout (`experts.<i>.gate_proj.weight`, ...).
MOE_ARCHS = {"qwen3_moe": dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2),
             "qwen2_moe": dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                               shared_expert_intermediate_size=64)}


def _config(arch: str, tokenizer: Any, overrides: dict[str, Any]) -> Any:
    from transformers import LlamaConfig, Qwen2Config, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig

    classes = dict(zip(CAUSAL_LM_ARCHS, (Qwen2Config, Qwen3Config, LlamaConfig), strict=True))
    classes["qwen3_moe"], classes["qwen2_moe"] = Qwen3MoeConfig, Qwen2MoeConfig
    if arch not in classes:
        raise ValueError(f"unknown arch {arch!r}; expected one of {list(classes)}")
    overrides = {**MOE_ARCHS.get(arch, {}), **overrides}
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    kwargs: dict[str, Any] = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=len(tokenizer),
        max_position_embeddings=1024,
        bos_token_id=eot,
        eos_token_id=eos,
        pad_token_id=eot,
        tie_word_embeddings=arch != "llama",
    )
    kwargs.update(overrides)
    return classes[arch](**kwargs)


@torch.no_grad()
def _make_peaky(model: torch.nn.Module, special_ids: list[int]) -> None:
    """Rescale random weights so greedy output varies and top-1 logits are well separated (see constants)."""
    for name, p in model.named_parameters():
        if p.ndim < 2 or "embed_tokens" in name or "lm_head" in name:
            continue
        p.mul_(_QK_SCALE if name.endswith(("q_proj.weight", "k_proj.weight")) else _LAYER_SCALE)
    model.model.norm.weight.mul_(_LOGIT_SCALE)
    out_emb = model.get_output_embeddings().weight  # shared with the input embedding when tied
    out_emb.mul_(torch.exp(_ROW_NORM_SIGMA * torch.randn(out_emb.shape[0], 1)))
    # Keep special tokens out of greedy output so generations run to max_tokens deterministically.
    out_emb[special_ids] *= 0.1


def make_tiny_causal_lm(
    out_dir: str | Path, arch: str = "qwen2", seed: int = 0, **config_overrides: Any
) -> Path:
    """Write tokenizer + random `arch` model to `out_dir`; identical bytes for identical arguments."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    out = make_tokenizer(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(out)
    config = _config(arch, tokenizer, config_overrides)
    special_ids = [tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS]
    with torch.random.fork_rng(devices=[]):  # don't disturb the caller's RNG stream
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        _make_peaky(model, special_ids)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        do_sample=False,
    )
    model.save_pretrained(out)
    return out


def make_tiny_diffusers(arch: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Write the tiny checkpoint of a diffusers layout (`DIFFUSERS_LAYOUTS`) to `out_dir`."""
    module, variant = DIFFUSERS_LAYOUTS[arch]
    return importlib.import_module(f"omnistage.testing.{module}").make_tiny(out_dir, variant, seed)


def tiny_checkpoint(arch: str = "qwen2", seed: int = 0) -> Path:
    """Return a cached tiny checkpoint dir, built atomically (tmp dir + rename): safe for concurrent callers.

    `arch`: a causal-LM arch ("qwen2", "qwen3", "llama"), "qwen2_5_omni" or "qwen3_omni_moe" (testing/<arch>.py), a
    diffusers layout of `DIFFUSERS_LAYOUTS` ("flux-dev", "qwen-image", "z-image-turbo", ...).

    Cache root: $OMNISTAGE_CACHE (default ~/.cache/omnistage/tiny); entries are keyed by the factory version of
    their layout (FACTORY_VERSION for causal LMs).
    """
    root = Path(envs.CACHE_DIR.get() or Path.home() / ".cache" / "omnistage" / "tiny")
    marker = "config.json"
    if arch == "qwen2_5_omni":
        from omnistage.testing.qwen2_5_omni import OMNI_FACTORY_VERSION, make_tiny_qwen2_5_omni

        version, make = OMNI_FACTORY_VERSION, lambda out: make_tiny_qwen2_5_omni(out, seed=seed)
    elif arch == "qwen3_omni_moe":
        from omnistage.testing import qwen3_omni_moe

        version, make = qwen3_omni_moe.FACTORY_VERSION, lambda out: qwen3_omni_moe.make_tiny_qwen3_omni_moe(out, seed)
    elif arch in DIFFUSERS_LAYOUTS:
        version = importlib.import_module(f"omnistage.testing.{DIFFUSERS_LAYOUTS[arch][0]}").FACTORY_VERSION
        marker, make = "model_index.json", lambda out: make_tiny_diffusers(arch, out, seed)
    else:
        version, make = FACTORY_VERSION, lambda out: make_tiny_causal_lm(out, arch=arch, seed=seed)
    final = root / f"{arch}-s{seed}-v{version}"
    if (final / marker).is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=root))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
    try:
        make(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / marker).is_file():  # lost the race only if the winner finished
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
