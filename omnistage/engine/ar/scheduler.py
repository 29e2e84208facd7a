"""Continuous batching: which sequences run this step, and how many tokens each.

Running sequences go first (decodes and unfinished prefill chunks), then waiting ones are
admitted while token budget, sequence slots and KV blocks last. When a running sequence needs
a block and none is free, the newest running sequence is preempted: its blocks are freed and it
will recompute its tokens later (prefix caching often makes that cheap).
"""

from __future__ import annotations

from collections import deque

from omnistage.engine.ar.block_manager import BlockManager
from omnistage.engine.ar.sequence import SeqStatus, Sequence


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
    ):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and release its blocks."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free_blocks(seq)
        seq.status = SeqStatus.FINISHED

    def has_work(self) -> bool:
        return bool(self.waiting) or any(s.num_new_tokens for s in self.running)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free_blocks(seq)
        seq.num_computed = seq.num_cached = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def schedule(self) -> list[tuple[Sequence, int]]:
        budget = self.max_num_batched_tokens
        batch: list[tuple[Sequence, int]] = []
        preempted = False
        for seq in list(self.running):
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(seq.num_new_tokens, budget)
            if n == 0:
                continue
            while not self.block_manager.allocate(seq, n):
                victim = max(self.running, key=lambda s: s.arrival)
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                batch.append((seq, n))
                budget -= n

        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            seq = self.waiting[0]
            if not seq.block_table:
                seq.num_cached = self.block_manager.match_prefix(seq)
                seq.num_computed = seq.num_cached
            n = min(seq.num_new_tokens, budget)
            if n == 0:
                break  # admitted only once its first input tokens arrive
            if n < seq.num_new_tokens and not self.enable_chunked_prefill and batch:
                break
            if not self.block_manager.allocate(seq, n):
                self.block_manager.free_blocks(seq)
                seq.num_computed = seq.num_cached = 0
                break
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            batch.append((seq, n))
            budget -= n
        return batch
