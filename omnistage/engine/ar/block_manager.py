"""Paged KV cache bookkeeping: a free list of fixed-size blocks plus a prefix cache.

A full block is identified by a hash chained over every token before it, so equal hashes mean
equal prefixes. Freed blocks keep their hash and stay reusable until the free list (kept in LRU
order) hands them out again.
"""

from __future__ import annotations

from collections import OrderedDict

from omnistage.engine.ar.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # prefix hash -> block id
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # LRU first

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = -(-(seq.num_computed + num_new_tokens) // self.block_size)
        return max(0, total - len(seq.block_table))

    def _extend_hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """Hashes of blocks len(seq.block_hashes)..num_blocks-1, chained on the known ones."""
        hashes, parent = [], seq.block_hashes[-1] if seq.block_hashes else 0
        for i in range(len(seq.block_hashes), num_blocks):
            chunk = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            parent = hash((parent, chunk))
            hashes.append(parent)
        return hashes

    def match_prefix(self, seq: Sequence) -> int:
        """Attach cached blocks for the longest cached prefix of a new sequence; returns the
        number of tokens they cover. The last token is always recomputed (its logits are needed)."""
        if not self.enable_prefix_caching or not seq.cacheable or seq.block_table or seq.pooling == "mean":
            return 0  # (mean pooling reads every prompt position's hidden state: none may come from the cache)
        max_blocks = (seq.num_tokens - 1) // self.block_size
        for block_hash in self._extend_hashes(seq, max_blocks):
            block = self.cached.get(block_hash)
            if block is None:
                break
            if self.ref_counts[block] == 0:
                del self.free[block]
            self.ref_counts[block] += 1
            seq.block_table.append(block)
            seq.block_hashes.append(block_hash)
        return len(seq.block_table) * self.block_size

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Give `seq` enough blocks to hold `num_new_tokens` more tokens; False if out of blocks."""
        needed = self.blocks_needed(seq, num_new_tokens)
        if needed > len(self.free):
            return False
        for _ in range(needed):
            block, _ = self.free.popitem(last=False)
            if self.block_hash[block] is not None:
                self.cached.pop(self.block_hash[block], None)
                self.block_hash[block] = None
            self.ref_counts[block] = 1
            seq.block_table.append(block)
        return True

    def register_full_blocks(self, seq: Sequence) -> None:
        """Publish newly completed blocks of computed, token-only content to the prefix cache."""
        if not self.enable_prefix_caching or not seq.cacheable:
            return
        full = min(seq.num_computed, seq.num_tokens) // self.block_size  # a token may still be in flight
        for block_hash in self._extend_hashes(seq, full):
            block = seq.block_table[len(seq.block_hashes)]
            if block_hash not in self.cached:  # a duplicate keeps the first copy as the cached one
                self.cached[block_hash] = block
                self.block_hash[block] = block_hash
            seq.block_hashes.append(block_hash)

    def free_blocks(self, seq: Sequence) -> None:
        # Release tail-first so a sequence's later blocks are evicted before its earlier ones.
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free[block] = None
        seq.block_table = []
        seq.block_hashes = []
