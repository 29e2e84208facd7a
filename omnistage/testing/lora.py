"""A tiny random LoRA adapter for a diffusers pipeline's DiT, saved as diffusers saves trained ones
(`<Pipeline>.save_lora_weights`: one `pytorch_lora_weights.safetensors` with `transformer.`-prefixed keys, also for
the second expert of two-expert models, which diffusers loads with `load_into_transformer_2=True`)."""

from __future__ import annotations

from pathlib import Path

import torch


def make_tiny_lora(pipeline_path: str | Path, out_dir: str | Path, rank: int = 2, seed: int = 0,
                   target_modules: tuple[str, ...] = ("to_q", "to_k", "to_v"), component: str = "transformer",
                   lora_alpha: int | None = None) -> Path:
    """Write a LoRA of the attention projections of the DiT at `pipeline_path`/`component` to `out_dir`, with
    both factors random (a freshly initialised LoRA is a no-op: its B factor is zero). `lora_alpha` (default: the
    rank, scaling 1) other than the rank is saved with the adapter's config as metadata, as diffusers' training
    scripts save it, so a loader must read the metadata to scale it right."""
    import diffusers
    from diffusers import AutoModel
    from peft import LoraConfig, get_peft_model_state_dict

    pipeline_path, out = Path(pipeline_path), Path(out_dir)
    index = diffusers.DiffusionPipeline.load_config(pipeline_path)
    transformer = AutoModel.from_pretrained(str(pipeline_path / component))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer.add_adapter(LoraConfig(r=rank, lora_alpha=rank if lora_alpha is None else lora_alpha,
                                           target_modules=list(target_modules), init_lora_weights=False))
    metadata = {} if lora_alpha is None else {
        "transformer_lora_adapter_metadata": transformer.peft_config["default"].to_dict()}
    getattr(diffusers, index["_class_name"]).save_lora_weights(
        out, transformer_lora_layers=get_peft_model_state_dict(transformer), safe_serialization=True, **metadata)
    return out
