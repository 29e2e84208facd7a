"""One request's state inside the AR engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from omnistage.engine.ar.detokenizer import IncrementalDetokenizer
from omnistage.sampling_params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """Tokens are prompt + outputs; `num_computed` of them have K/V in the cache.

    The scheduler schedules `num_tokens - num_computed` new tokens (a prefill chunk or one
    decode token). A request fed by streamed input chunks sits at zero new tokens, holding its
    blocks, until the next chunk arrives.
    """

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    arrival: int  # engine-local order, for FCFS and preemption choice
    embeds: dict[int, torch.Tensor] = field(default_factory=dict)  # position -> replacement embedding
    input_final: bool = True
    return_hidden: bool = False  # output the engine's configured hidden-state layers for its tokens
    rope_positions: torch.Tensor | None = None  # [axes, n] rotary positions of the first n tokens
    rope_delta: int = 0  # rotary position of later tokens: index + delta
    # added to generated positions' embeddings, in order, as [1, D] rows; a tuple: parts summed at step time
    embed_adds: list[torch.Tensor | tuple[torch.Tensor, ...]] | None = None
    embed_add_default: torch.Tensor | None = None
    adds_final: bool = True  # no more `embed_adds` rows will arrive
    # a model with `after_sample` (ARModel): row i is added to output token i's position; with `tensors`, the
    # request's input tensors that hook reads
    step_adds: list[torch.Tensor] | None = None
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    num_prompt_tokens: int = 0
    num_computed: int = 0
    num_cached: int = 0  # prompt tokens served from the prefix cache on first schedule
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # prefix hashes of leading full blocks
    status: SeqStatus = SeqStatus.WAITING
    generator: torch.Generator | None = None
    detokenizer: IncrementalDetokenizer | None = None
    hidden_sent: int = 0  # positions whose hidden states were already output
    banned: tuple[bool, tuple[int, ...]] | None = None  # (before min_tokens?, ids the sampler may not pick)
    history_slot: int | None = None  # its row in the engine's device-side token history (penalties)
    history_len: int = 0  # output tokens recorded there
    grammar: Any = None  # structured output: its matcher (xgrammar), advanced by every token it keeps
    pooling: str | None = None  # "last" | "mean": output the prompt's pooled hidden state, generate nothing
    pooled: torch.Tensor | None = None  # the running sum ("mean") or the latest row ("last")

    def __post_init__(self) -> None:
        self.num_prompt_tokens = self.num_prompt_tokens or len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_new_tokens(self) -> int:
        """Tokens that can be computed now; a decode whose added embedding has not arrived waits."""
        limit = self.num_tokens
        if self.embed_adds is not None and not self.adds_final:
            limit = min(limit, self.num_prompt_tokens + len(self.embed_adds))
        return max(0, limit - self.num_computed)

    @property
    def cacheable(self) -> bool:
        """Whether its K/V depend on the token ids alone (so blocks may be shared by prefix)."""
        return (not self.embeds and self.rope_positions is None and not self.rope_delta and self.embed_adds is None
                and self.step_adds is None)

    def embed_add(self, pos: int) -> torch.Tensor | tuple[torch.Tensor, ...] | None:
        """What is added to a generated position's input embedding: its `embed_adds` row (or the default) and its
        `step_adds` row, as a tuple of parts when both are there."""
        if pos < self.num_prompt_tokens:
            return None
        i = pos - self.num_prompt_tokens
        add = None
        if self.embed_adds is not None:
            add = self.embed_adds[i] if i < len(self.embed_adds) else self.embed_add_default
        if self.step_adds is not None and i < len(self.step_adds):
            step = self.step_adds[i]
            add = step if add is None else (*(add if isinstance(add, tuple) else (add,)), step)
        return add

    def rope_position(self, pos: int) -> int | torch.Tensor:
        if self.rope_positions is not None and pos < self.rope_positions.shape[1]:
            return self.rope_positions[:, pos]
        return pos + self.rope_delta

    @property
    def in_prefill(self) -> bool:
        """True while prompt tokens are still being computed (no token sampled this step)."""
        return self.num_computed < self.num_prompt_tokens
