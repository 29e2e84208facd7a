"""A tiny random LoRA adapter for a diffusers pipeline's DiT, saved as diffusers saves trained ones
(`<Pipeline>.save_lora_weights`: one `pytorch_lora_weights.safetensors` with `transformer.`-prefixed keys)."""

from __future__ import annotations

from pathlib import Path

import torch


def make_tiny_lora(pipeline_path: str | Path, out_dir: str | Path, rank: int = 2, seed: int = 0,
                   target_modules: tuple[str, ...] = ("to_q", "to_k", "to_v")) -> Path:
    """Write a LoRA of the attention projections of the DiT at `pipeline_path`/transformer to `out_dir`, with
    both factors random (a freshly initialised LoRA is a no-op: its B factor is zero)."""
    import diffusers
    from diffusers import AutoModel
    from peft import LoraConfig, get_peft_model_state_dict

    pipeline_path, out = Path(pipeline_path), Path(out_dir)
    index = diffusers.DiffusionPipeline.load_config(pipeline_path)
    transformer = AutoModel.from_pretrained(str(pipeline_path / "transformer"))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer.add_adapter(LoraConfig(r=rank, lora_alpha=rank, target_modules=list(target_modules),
                                           init_lora_weights=False))
    getattr(diffusers, index["_class_name"]).save_lora_weights(
        out, transformer_lora_layers=get_peft_model_state_dict(transformer), safe_serialization=True)
    return out
