"""LoRA adapters of a diffusion stage's DiT, selected per request.

Invariants:
- A path is resolved inside the stage's `lora_root` (symlinks followed, then checked), so a request can only
  load files the operator put there; a missing root refuses every LoRA request.
- Requests with different (adapter, scale) never share a forward: the pair is part of the engine's batch key,
  and `activate` is called when a batch of another pair starts, so one batch runs under one adapter state.
- At most `max_loras` adapters stay loaded; the least recently used is deleted from the DiT first.
The adapter file is read with the family's diffusers pipeline class's `lora_state_dict` (which converts the
community formats diffusers knows) and loaded with the DiT's `load_lora_adapter` (peft).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from omnistage.errors import RequestError

logger = logging.getLogger(__name__)

LoraKey = tuple[str, float] | None  # (adapter path inside the root, scale); None: no adapter


class LoraManager:
    def __init__(self, transformer: torch.nn.Module, root: str | None, pipeline_class: str | None,
                 max_loras: int = 8):
        self.transformer = transformer
        self.root = Path(root).resolve() if root else None
        self.pipeline_class = pipeline_class
        self.max_loras = max_loras
        self.loaded: OrderedDict[str, str] = OrderedDict()  # resolved path -> adapter name in the DiT
        self.active: LoraKey = None

    def key(self, spec: dict[str, Any] | None) -> LoraKey:
        """The batch key part of a request's `lora` ({name, path, scale}); RequestError if it may not load."""
        if spec is None:
            return None
        if self.root is None:
            raise RequestError("this server loads no LoRA adapters (start it with the dit stage's "
                               "options.lora_root set to the adapters' directory)", "lora")
        if self.pipeline_class is None or not hasattr(self.transformer, "load_lora_adapter"):
            raise RequestError("this model's DiT does not take LoRA adapters", "lora")
        path = (self.root / spec["path"]).resolve()
        if not path.is_relative_to(self.root):
            raise RequestError("lora.path must be inside the server's LoRA directory", "lora.path")
        if path.is_dir():
            found = sorted(path.glob("*.safetensors"))
            if len(found) != 1:
                raise RequestError(f"lora.path {spec['path']!r} must hold one .safetensors file "
                                   f"(found {len(found)})", "lora.path")
            path = found[0]
        if path.suffix != ".safetensors" or not path.is_file():
            raise RequestError(f"lora.path {spec['path']!r} is not a .safetensors file or a directory with one "
                               "in the server's LoRA directory", "lora.path")
        return str(path), float(spec.get("scale", 1.0))

    def activate(self, key: LoraKey) -> None:
        """Put the DiT under adapter `key` (None: no adapter) for the batch that starts now."""
        if key == self.active:
            return
        if key is None:
            self.transformer.disable_lora()
        else:
            path, scale = key
            name = self._load(path)
            self.transformer.enable_lora()
            self.transformer.set_adapters([name], [scale])
        self.active = key

    def _load(self, path: str) -> str:
        if path in self.loaded:
            self.loaded.move_to_end(path)
            return self.loaded[path]
        import diffusers

        if len(self.loaded) >= self.max_loras:
            _, evicted = self.loaded.popitem(last=False)
            self.transformer.delete_adapters(evicted)
        name = f"lora{abs(hash(path)) % 10**12}"
        loaded = getattr(diffusers, self.pipeline_class).lora_state_dict(path)
        state, alphas = loaded if isinstance(loaded, tuple) else (loaded, None)
        try:
            self.transformer.load_lora_adapter(state, network_alphas=alphas, adapter_name=name,
                                               prefix="transformer" if any(k.startswith("transformer.")
                                                                           for k in state) else None)
        except Exception as exc:
            logger.warning("LoRA %s failed to load: %s", path, exc)
            raise RequestError("the LoRA adapter at lora.path does not fit this model's DiT (the server log has "
                               "the details)", "lora.path") from None
        self.loaded[path] = name
        logger.info("loaded LoRA adapter %s as %s", path, name)
        return name
