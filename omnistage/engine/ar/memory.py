"""How many KV blocks a stage gets: from an explicit count, a byte budget, or the device's
free memory after the weights are loaded."""

from __future__ import annotations

import torch

from omnistage.engine.ar.attention import KVSpec

_CPU_DEFAULT_BUDGET_GB = 1.0


def plan_num_blocks(
    spec: KVSpec,
    block_size: int,
    device: torch.device,
    max_model_len: int,
    max_num_seqs: int,
    num_kv_blocks: int | None = None,
    kv_cache_memory_gb: float | None = None,
    gpu_memory_utilization: float = 0.9,
) -> int:
    if num_kv_blocks is not None:
        return num_kv_blocks
    per_block = spec.bytes_per_block(block_size)
    if kv_cache_memory_gb is not None:
        budget = kv_cache_memory_gb * 2**30
    elif device.type == "cuda":
        # Weights and the profiling forward are already resident; keep the rest of the share.
        total = torch.cuda.get_device_properties(device).total_memory
        budget = gpu_memory_utilization * total - torch.cuda.max_memory_allocated(device)
    else:
        budget = _CPU_DEFAULT_BUDGET_GB * 2**30
    blocks = int(budget // per_block)
    if device.type != "cuda" and kv_cache_memory_gb is None:
        # Host memory is shared with everything else: never more than the stage can use.
        blocks = min(blocks, max_num_seqs * -(-max_model_len // block_size))
    return max(blocks, 0)
