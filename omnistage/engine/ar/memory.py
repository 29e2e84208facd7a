"""How many KV blocks a stage gets: an exact count, a byte budget, or its share of the device.

On CUDA, the share is `gpu_memory_utilization * total` minus what this stage itself needs besides
the cache (its weights and the peak activations of its largest step, measured by a profiling
run), and never more than the device has free: several stages can share one GPU, each with its
own share, and other processes' memory is respected.
"""

from __future__ import annotations

import torch

from omnistage.engine.ar.attention import KVSpec

_CPU_DEFAULT_BUDGET_GB = 1.0
_FREE_MEMORY_MARGIN = 0.98  # leave the allocator a little slack when taking the last free bytes


def plan_num_blocks(
    spec: KVSpec,
    block_size: int,
    device: torch.device,
    max_model_len: int,
    max_num_seqs: int,
    num_kv_blocks: int | None = None,
    kv_cache_memory_gb: float | None = None,
    gpu_memory_utilization: float = 0.9,
    weight_bytes: int = 0,
    activation_bytes: int = 0,
) -> int:
    if num_kv_blocks is not None:
        return num_kv_blocks
    per_block = spec.bytes_per_block(block_size)
    if kv_cache_memory_gb is not None:
        budget = kv_cache_memory_gb * 2**30
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = min(gpu_memory_utilization * total - weight_bytes - activation_bytes, free * _FREE_MEMORY_MARGIN)
    else:
        budget = _CPU_DEFAULT_BUDGET_GB * 2**30
    blocks = int(budget // per_block)
    if kv_cache_memory_gb is None:
        # Beyond twice what a full batch of full-length sequences holds, blocks only feed the prefix
        # cache, and small models would otherwise get millions of them (host bookkeeping per block).
        blocks = min(blocks, 2 * max_num_seqs * -(-max_model_len // block_size))
    return max(blocks, 0)
