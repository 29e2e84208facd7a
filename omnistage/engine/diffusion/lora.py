"""LoRA adapters of a diffusion stage's DiT or DiTs, selected per request.

A request's `lora` names an adapter per DiT: `path` / `scale` for the first (the only DiT of most models; the
high-noise expert `transformer` of Wan2.2 A14B), `path_2` / `scale_2` for the second (the low-noise expert
`transformer_2`), either or both; a DiT the request names no adapter for runs without one.

Invariants:
- A path is resolved inside the stage's `lora_root` (symlinks followed, then checked), so a request can only
  load files the operator put there; a missing root refuses every LoRA request.
- Requests with different adapter states (per DiT: adapter and scale) never share a forward: the state is part
  of the engine's batch key, and `activate` is called when a batch of another state starts, so one batch runs
  under one adapter state.
- Each DiT keeps at most `max_loras` adapters loaded; its least recently used is deleted first. A request puts at
  most one adapter in each DiT, so activating it never evicts an adapter it needs.
The adapter file is read with the family's diffusers pipeline class's `lora_state_dict` (which converts the
community formats diffusers knows) and loaded with the DiT's `load_lora_adapter` (peft), with the file's network
alphas and adapter metadata, as the pipeline's `load_lora_weights` loads it (into `transformer_2` as
`load_into_transformer_2=True` does).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from omnistage.errors import RequestError

logger = logging.getLogger(__name__)

Adapter = tuple[str, float] | None  # (adapter file inside the root, scale); None: the DiT runs without one
LoraKey = tuple[Adapter, ...] | None  # one entry per DiT; None: no adapter anywhere
FIELDS = (("path", "scale"), ("path_2", "scale_2"))  # a request's fields for the first and the second DiT


class LoraManager:
    def __init__(self, transformers: torch.nn.Module | list[torch.nn.Module] | None, root: str | None,
                 pipeline_class: str | None, max_loras: int = 8):
        """`transformers`: the model's DiT, or its DiTs in the order of `FIELDS`."""
        if isinstance(transformers, torch.nn.Module):
            transformers = [transformers]
        self.transformers: list[torch.nn.Module] = list(transformers or [])
        self.root = Path(root).resolve() if root else None
        self.pipeline_class = pipeline_class
        self.max_loras = max_loras
        # per DiT: resolved path -> adapter name in that DiT, least recently used first
        self.loaded: list[OrderedDict[str, str]] = [OrderedDict() for _ in self.transformers]
        self.active: list[Adapter] = [None] * len(self.transformers)

    def key(self, spec: dict[str, Any] | None) -> LoraKey:
        """The batch key part of a request's `lora` ({name, path, scale, path_2, scale_2}); RequestError if it may
        not load."""
        if spec is None:
            return None
        if self.root is None:
            raise RequestError("this server loads no LoRA adapters (start it with the dit stage's "
                               "options.lora_root set to the adapters' directory)", "lora")
        if self.pipeline_class is None or not self.transformers or \
                not all(hasattr(t, "load_lora_adapter") for t in self.transformers):
            raise RequestError("this model's DiT does not take LoRA adapters", "lora")
        entries: list[Adapter] = [None] * len(self.transformers)
        for i, (path_field, scale_field) in enumerate(FIELDS):
            if spec.get(path_field) is None:
                continue
            if i >= len(self.transformers):
                raise RequestError(f"lora.{path_field} names an adapter for a second DiT (the low-noise expert of a "
                                   "two-expert model); this model has one DiT: use lora.path", f"lora.{path_field}")
            entries[i] = self._resolve(spec[path_field], f"lora.{path_field}"), float(spec.get(scale_field, 1.0))
        return tuple(entries)

    def _resolve(self, name: str, field: str) -> str:
        path = (self.root / name).resolve()
        if not path.is_relative_to(self.root):
            raise RequestError(f"{field} must be inside the server's LoRA directory", field)
        if path.is_dir():
            found = sorted(path.glob("*.safetensors"))
            if len(found) != 1:
                raise RequestError(f"{field} {name!r} must hold one .safetensors file (found {len(found)})", field)
            path = found[0]
        if path.suffix != ".safetensors" or not path.is_file():
            raise RequestError(f"{field} {name!r} is not a .safetensors file or a directory with one in the "
                               "server's LoRA directory", field)
        return str(path)

    def activate(self, key: LoraKey) -> None:
        """Put each DiT under its adapter of `key` (None: no adapter) for the batch that starts now."""
        entries = key or (None,) * len(self.transformers)
        for i, (transformer, entry) in enumerate(zip(self.transformers, entries, strict=True)):
            if entry == self.active[i]:
                continue
            if entry is None:
                transformer.disable_lora()  # it had an adapter active, so peft is set up on it
            else:
                path, scale = entry
                name = self._load(i, path)
                transformer.enable_lora()
                transformer.set_adapters([name], [scale])
            self.active[i] = entry  # per DiT: a later DiT's failed load leaves the earlier ones' state known

    def _load(self, i: int, path: str) -> str:
        loaded, transformer = self.loaded[i], self.transformers[i]
        if path in loaded:
            loaded.move_to_end(path)
            return loaded[path]
        import diffusers

        if len(loaded) >= self.max_loras:
            _, evicted = loaded.popitem(last=False)
            transformer.delete_adapters(evicted)
        name = f"lora{abs(hash(path)) % 10**12}"
        # (state, metadata), or (state, network alphas, metadata) for the loaders of UNet-era formats
        *parts, metadata = getattr(diffusers, self.pipeline_class).lora_state_dict(path, return_lora_metadata=True)
        state, alphas = parts[0], parts[1] if len(parts) > 1 else None
        try:
            transformer.load_lora_adapter(state, network_alphas=alphas, metadata=metadata, adapter_name=name,
                                          prefix="transformer" if any(k.startswith("transformer.")
                                                                      for k in state) else None)
        except Exception as exc:
            logger.warning("LoRA %s failed to load into DiT %d: %s", path, i, exc)
            field = f"lora.{FIELDS[i][0]}" if i < len(FIELDS) else "lora"
            raise RequestError(f"the LoRA adapter at {field} does not fit this model's DiT (the server log has the "
                               "details)", field) from None
        loaded[path] = name
        logger.info("loaded LoRA adapter %s into DiT %d as %s", path, i, name)
        return name
