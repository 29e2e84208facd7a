"""One request's state inside the AR engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

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
    num_prompt_tokens: int = 0
    num_computed: int = 0
    num_cached: int = 0  # prompt tokens served from the prefix cache on first schedule
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # prefix hashes of leading full blocks
    status: SeqStatus = SeqStatus.WAITING
    generator: torch.Generator | None = None
    detokenizer: IncrementalDetokenizer | None = None
    hidden_sent: int = 0  # positions whose hidden states were already output

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
        return self.num_tokens - self.num_computed

    @property
    def in_prefill(self) -> bool:
        """True while prompt tokens are still being computed (no token sampled this step)."""
        return self.num_computed < self.num_prompt_tokens
