"""The AR engine: continuous batching over a paged KV cache, one `step()` at a time."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import torch
from pydantic import Field

from omnistage.config.deploy import Advanced, StageConfig, parse_section
from omnistage.engine.ar.block_manager import BlockManager
from omnistage.engine.ar.detokenizer import IncrementalDetokenizer
from omnistage.engine.ar.grammar import Grammars
from omnistage.engine.ar.memory import plan_num_blocks
from omnistage.engine.ar.model import ARModel
from omnistage.engine.ar.model_runner import DecodeLaunch, ModelRunner, StepResult
from omnistage.engine.ar.parallel import GroupLost
from omnistage.engine.ar.sampler import ROW_FAILED, Sampler, SampleRow, SamplingColumns, StaticDraw, TokenHistory
from omnistage.engine.ar.scheduler import Scheduler
from omnistage.engine.ar.sequence import SeqStatus, Sequence
from omnistage.engine.transfer import host_list, to_device
from omnistage.errors import ConfigError, RequestError, stage_failure
from omnistage.sampling_params import SamplingParams
from omnistage.types import StageInput, StageOutput

logger = logging.getLogger(__name__)


class ARAdvanced(Advanced):
    """An AR stage's `advanced:` block. Every setting leaves the tokens as they are; the defaults suit any model,
    and a family may tune them for one of its stages (`AREngineConfig.from_stage`'s `tuned`)."""

    tensor_parallel: ClassVar[bool] = True  # the stage may set tensor_parallel_size (parallel.py)
    overlap_decode: bool = Field(True, description="keep a greedy decode step in flight while the host reads the "
                                 "last one's tokens")
    overlap_sampled: bool = Field(True, description="... and sampled or penalised steps, their tokens drawn on the "
                                  "device (the same tokens)")
    decode_burst: int = Field(1, ge=1, le=64, description="decode steps per launch (one CUDA graph replay) while "
                              "every running sequence can take them; frees the host of per-token work")
    prompt_graph_tokens: int = Field(512, ge=0, description="on CUDA, a step prefilling one sequence's prompt (or "
                                     "a chunk of it) of up to this many tokens replays a graph captured for its "
                                     "token bucket; 0: prompts always run eagerly (less start-up time and memory)")


@dataclass
class AREngineConfig:
    max_model_len: int
    # KV cache size: an exact block count, else a byte budget, else a share of the device memory.
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float | None = None
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    overlap_decode: bool = True  # keep a greedy decode step in flight while the host handles the last
    overlap_sampled: bool = True  # ... and sampled / penalised ones (tokens drawn on the device: the same tokens)
    decode_burst: int = 1  # decode steps per launch (one graph replay) when every sequence can take them
    prompt_graph_tokens: int = 512  # one sequence's prompt steps up to this many tokens replay CUDA graphs
    # Hidden states a request can ask for: output name -> layer (0 = embeddings, L = final).
    hidden_state_layers: dict[str, int] = field(default_factory=dict)
    default_params: SamplingParams = field(default_factory=SamplingParams)
    seed: int = 0

    @classmethod
    def from_stage(
        cls,
        cfg: StageConfig,
        max_model_len: int,
        hidden_state_layers: dict[str, int] | None = None,
        tuned: dict[str, Any] | None = None,
        where: str = "advanced",
    ) -> AREngineConfig:
        """The engine config of a stage: its deploy fields of the same names (sizing, caching, enforce_eager),
        its sampling defaults, and its `advanced` block over the family's `tuned` defaults over ARAdvanced's.
        `max_model_len` is the context the model allows (the family clips the deploy's to it)."""
        advanced = parse_section(ARAdvanced, {**(tuned or {}), **cfg.advanced}, where)
        names = {f.name for f in fields(cls)}
        return cls(
            max_model_len=max_model_len,
            hidden_state_layers=dict(hidden_state_layers or {}),
            default_params=cfg.sampling_params(),
            **{name: getattr(cfg, name) for name in _FROM_STAGE},
            **{name: value for name, value in advanced.model_dump().items() if name in names},
        )


# StageConfig fields that AREngineConfig takes as they are
_FROM_STAGE = ("num_kv_blocks", "kv_cache_memory_gb", "gpu_memory_utilization", "enforce_eager", "block_size",
               "max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching", "enable_chunked_prefill")


class AREngine:
    latency_bound = True  # a request waits on every decode step: hosts favour its GPU work (stream priority)

    def __init__(
        self,
        name: str,
        model: ARModel,
        config: AREngineConfig,
        tokenizer: Any = None,
        eos_token_ids: tuple[int, ...] = (),
    ):
        self.name = name
        self.config = config
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        max_batched = config.max_num_batched_tokens
        if not config.enable_chunked_prefill:
            max_batched = max(max_batched, config.max_model_len)
        self._hidden_layers = tuple(sorted(set(config.hidden_state_layers.values())))
        self._after_sample = getattr(model, "after_sample", None)  # see ARModel: its steps all take the host path
        self.runner = ModelRunner(
            model, config.block_size, config.max_num_seqs, config.max_model_len, config.enforce_eager,
            graph_layers=self._hidden_layers, burst_steps=config.decode_burst,
            prompt_graph_tokens=min(config.prompt_graph_tokens, max_batched),
        )
        activation_bytes = self.runner.profile(max_batched)
        num_blocks = plan_num_blocks(
            model.kv_spec, config.block_size, model.device, config.max_model_len, config.max_num_seqs,
            config.num_kv_blocks, config.kv_cache_memory_gb, config.gpu_memory_utilization,
            model.weight_bytes, activation_bytes,
        )
        if num_blocks * config.block_size < config.max_model_len:
            raise ConfigError(
                f"stage {name!r}: the KV cache holds {num_blocks * config.block_size} tokens, "
                f"fewer than max_model_len={config.max_model_len}; lower max_model_len or raise the KV budget"
            )
        self.runner.allocate_kv_cache(num_blocks)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, max_batched, config.enable_chunked_prefill)
        self.sampler = Sampler(config.seed)
        self.seqs: dict[str, Sequence] = {}
        self.in_flight: DecodeLaunch | None = None  # a decode step whose tokens are unread
        self.num_overlapped_steps = 0
        self.num_burst_steps = 0  # decode steps run inside bursts
        self.num_output_tokens = 0  # tokens generated, all requests
        self.history: TokenHistory | None = None  # decoding sequences' tokens on the device, for penalties
        self._free_history_slots = list(range(config.max_num_seqs))  # row max_num_seqs: padded burst rows'
        self._columns: tuple[tuple, SamplingColumns, torch.Tensor] | None = None  # the last decode batch's
        self._arrivals = 0
        self._static_draw: StaticDraw | None = None
        self._grammars: Grammars | None = None  # built on the first request with structured output
        graphs = self.runner.graphs
        vocab = graphs[min(graphs)][1].shape[-1] if graphs else model.vocab_size  # the logits' width
        self.vocab_size = vocab  # token ids a request names (stop, bad) must be below it: the sampler indexes by them
        self.sampler.warm_up(vocab, model.device)
        if self.runner.graphs and self.runner.burst_steps > 1 and self._after_sample is None:  # (no bursts: ARModel)
            self.history = TokenHistory(config.max_num_seqs + 1, vocab, model.device)
            self._static_draw = StaticDraw(self.sampler, self.history, config.max_num_seqs, vocab,
                                           pad_slot=config.max_num_seqs)
            self.runner.capture_bursts(self._static_draw, self.sampler.device_generator(model.device))

    # ---- requests -------------------------------------------------------------------------

    def validate(self, inp: StageInput) -> SamplingParams:
        """Check a request fits this stage; returns its effective params. The params are checked again here,
        whoever built them: nothing unchecked reaches a step, where one request's bad value would fail a batch."""
        params = inp.params or self.config.default_params
        if not isinstance(params, SamplingParams):
            raise RequestError(f"stage {self.name!r} takes SamplingParams, not {type(params).__name__}", "params")
        params.validate()
        params.check_token_ids(self.vocab_size)
        prompt_len = len(inp.token_ids)
        limit = self.config.max_model_len
        if prompt_len == 0 and inp.final:
            raise RequestError("the prompt is empty; send at least one token", "prompt")
        if prompt_len >= limit:
            raise RequestError(
                f"the prompt has {prompt_len} tokens but this model's context is {limit}; shorten it", "messages"
            )
        if params.max_tokens is not None and prompt_len + params.max_tokens > limit:
            raise RequestError(
                f"max_tokens={params.max_tokens} plus the prompt's {prompt_len} tokens exceeds the context "
                f"length {limit}; ask for at most {limit - prompt_len} tokens",
                "max_tokens",
            )
        return params

    def add_request(self, inp: StageInput) -> None:
        inp = self._prepare(inp, first=True)
        params = self.validate(inp)
        if inp.pooling is not None and (inp.pooling not in ("last", "mean")
                                        or "last" not in self.config.hidden_state_layers):
            raise RequestError(f"stage {self.name!r} cannot pool {inp.pooling!r} embeddings", "pooling")
        max_tokens = params.max_tokens or self.config.max_model_len - len(inp.token_ids)
        seq = Sequence(
            request_id=inp.request_id,
            token_ids=list(inp.token_ids),
            params=params,
            max_tokens=max_tokens,
            arrival=self._arrivals,
            input_final=inp.final,
            return_hidden=inp.return_hidden_states or inp.pooling is not None,
            pooling=inp.pooling,
        )
        self._arrivals += 1
        if inp.embed_adds is not None or inp.embed_add_default is not None:
            seq.embed_adds = []  # its prompt is whole; `final` speaks of the added rows
            seq.input_final = True
        if self._after_sample is not None:
            seq.step_adds, seq.tensors = [], inp.tensors
        self._take_input(seq, inp, 0)
        if params.seed is not None:
            seq.generator = torch.Generator(device=self.runner.device).manual_seed(params.generator_seed)
        if self.tokenizer is not None:
            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer, seq.token_ids, params.skip_special_tokens, params.stop,
                params.include_stop_str_in_output,
            )
        if params.structured_outputs is not None:
            seq.grammar = self.grammars().matcher(params.structured_outputs)
        self.seqs[seq.request_id] = seq
        self.scheduler.add(seq)

    def grammars(self) -> Grammars:
        if self._grammars is None:
            if self.tokenizer is None:
                raise RequestError(f"stage {self.name!r} has no tokenizer, so its output cannot follow a grammar",
                                   "structured_outputs")
            self._grammars = Grammars(self.tokenizer, self.vocab_size, tuple(sorted(self.eos_token_ids)))
        return self._grammars

    def add_input_chunk(self, request_id: str, chunk: StageInput) -> None:
        """More prompt tokens (a streamed prompt) or more added-embedding rows (a streamed side input)."""
        seq = self.seqs.get(request_id)
        if seq is None:
            return  # aborted meanwhile
        chunk = self._prepare(chunk, first=False)
        start = seq.num_tokens
        if chunk.token_ids:
            seq.token_ids += chunk.token_ids
            seq.num_prompt_tokens = seq.num_tokens
            seq.input_final = chunk.final
        elif seq.embed_adds is None:
            seq.input_final = chunk.final
        self._take_input(seq, chunk, start)

    def _prepare(self, inp: StageInput, first: bool) -> StageInput:
        """Let the model complete its own inputs (run media encoders, compute rotary positions, compose
        embeddings from its own tables) on this stage's worker, never in the orchestrator."""
        prepare = getattr(self.runner.model, "prepare_input", None)
        return prepare(inp, first) if prepare is not None else inp

    @property
    def device(self) -> torch.device:
        return self.runner.device

    def _take_input(self, seq: Sequence, inp: StageInput, start: int) -> None:
        """Per-position extras of an input (or chunk) whose first token sits at `start`."""
        for i, row in enumerate(inp.embeds if inp.embeds is not None else ()):
            seq.embeds[start + i] = row
        if inp.rope_positions is not None:
            old = seq.rope_positions
            seq.rope_positions = inp.rope_positions if old is None else torch.cat([old, inp.rope_positions], dim=1)
        if inp.rope_delta is not None:
            seq.rope_delta = inp.rope_delta
        if seq.embed_adds is not None:  # rows kept as [1, D] views (or tuples of them), concatenated at step time
            adds = inp.embed_adds  # [n, D], or a tuple of parts of the same n rows, summed at step time
            rows = 0 if adds is None else len(adds[0] if isinstance(adds, tuple) else adds)
            if rows == 1:  # a streamed row: kept as it came (per request per step, so no torch call here)
                seq.embed_adds.append(adds)
            elif rows and isinstance(adds, tuple):
                seq.embed_adds.extend(zip(*(part.split(1) for part in adds), strict=True))
            elif rows:
                seq.embed_adds.extend(adds.split(1))
            if inp.embed_add_default is not None:
                seq.embed_add_default = inp.embed_add_default.reshape(1, -1)
            seq.adds_final = inp.final

    def abort(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self.scheduler.remove(seq)
            if seq.history_slot is not None:
                self._free_history_slots.append(seq.history_slot)

    def has_work(self) -> bool:
        return self.in_flight is not None or self.scheduler.has_work()

    def describe(self) -> str:
        spec, blocks, size = self.runner.model.kv_spec, self.block_manager.num_blocks, self.config.block_size
        gib = spec.bytes_per_block(size) * blocks / 2**30
        graphs = len(self.runner.graphs) + len(self.runner.burst_graphs) + len(self.runner.prompt_graphs) \
            + len(self.runner.hook_graphs)
        return (f"{self.device}, {str(spec.dtype).removeprefix('torch.')}, KV cache {blocks} blocks of {size} tokens "
                f"({gib:.2f} GiB), max_model_len {self.config.max_model_len}, max_num_seqs {self.config.max_num_seqs}, "
                + (f"{graphs} CUDA graphs" if graphs else "eager"))

    def stats(self) -> dict[str, int]:
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_blocks_used": self.block_manager.num_used,
            "kv_blocks_total": self.block_manager.num_blocks,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_overlapped_steps": self.num_overlapped_steps,
            "num_burst_steps": self.num_burst_steps,
            "num_output_tokens": self.num_output_tokens,
            "num_prompt_graph_steps": self.runner.num_prompt_replays,
            "num_after_sample_graph_steps": self.runner.num_after_sample_replays,
        }

    def shutdown(self) -> None:
        if self.in_flight is not None:  # let the device finish before its buffers go
            self.runner.read_tokens(self.in_flight)
            self.in_flight = None
        for request_id in list(self.seqs):
            self.abort(request_id)
        self.runner.release()
        if hasattr(self.runner.model, "close"):  # a tensor-parallel group: its follower processes
            self.runner.model.close()

    # ---- one step -------------------------------------------------------------------------

    def step(self) -> list[StageOutput]:
        if self.in_flight is not None:
            return self._advance_decode()
        batch = self.scheduler.schedule()
        if not batch:
            return []
        if self.config.overlap_decode and all(n == 1 and self._overlappable(s) for s, n in batch):
            return self._start_decode([s for s, _ in batch])
        layers = self._hidden_layers
        want_hidden = layers and any(s.return_hidden for s, _ in batch)
        try:
            result = self.runner.execute(batch, layers if want_hidden else ())
        except GroupLost:  # a tensor-parallel rank is gone: the stage restarts
            raise
        except Exception:  # a failed forward fails its batch, not the engine
            logger.exception("stage %s: step failed", self.name)
            return [self._fail(seq, "this step") for seq, _ in batch]
        for seq, n in batch:
            seq.num_computed += n
            self.block_manager.register_full_blocks(seq)
        sampling = [batch[i][0] for i in result.sample_rows]
        sampled = dict(zip(result.sample_rows, self._sample_each(sampling, result.logits, result.argmax),
                           strict=True))
        outputs = []
        extras = self._run_after_sample(batch, result, sampled) if self._after_sample is not None else {}
        for i, (seq, n) in enumerate(batch):
            if sampled.get(i, ()) is None:
                outputs.append(self._fail(seq))
                continue
            try:
                out = StageOutput(request_id=seq.request_id, stage=self.name)
                if seq.pooling is not None:  # its sampled token, if any, is not its output
                    self._pool(seq, out, result.hidden, result.row_spans[i], seq.num_computed - n)
                    self._emit(seq, out, outputs)
                    continue
                if want_hidden and seq.return_hidden:
                    span = result.row_spans[i]
                    self._collect_hidden(seq, out, result.hidden, span, seq.num_computed - (span[1] - span[0]))
                if i in sampled:
                    self._append_token(seq, out, *sampled[i])
                if i in extras:
                    self._take_extras(seq, out, *extras[i])
                self._emit(seq, out, outputs)
            except Exception:  # its own bookkeeping (stop checks, text, output): it alone fails
                logger.exception("stage %s: request %r failed", self.name, seq.request_id)
                outputs.append(self._fail(seq))
        return outputs

    def _run_after_sample(self, batch: list[tuple[Sequence, int]], result: StepResult, sampled: dict[int, Any]
                          ) -> dict[int, tuple[torch.Tensor, dict[str, torch.Tensor]]]:
        """The model's `after_sample` over the step's sampled rows: batch index -> (next add [1, hidden], host
        outputs). If it raises, those rows' requests fail (their `sampled` entries become None)."""
        rows = [i for i in result.sample_rows if sampled.get(i) is not None and batch[i][0].pooling is None]
        if not rows:
            return {}
        where = {i: j for j, i in enumerate(result.sample_rows)}
        try:
            picks = self._tensor([where[i] for i in rows])
            tokens = self._tensor([sampled[i][0] for i in rows])
            seqs = [batch[i][0] for i in rows]
            extra = self.runner.after_sample(result.last_hidden.index_select(0, picks), tokens,
                                             [s.tensors for s in seqs], [s.generator for s in seqs])
            host = {name: value.cpu() for name, value in extra.outputs.items()}
        except Exception:
            logger.exception("stage %s: the model's after_sample failed", self.name)
            for i in rows:
                sampled[i] = None
            return {}
        return {i: (extra.next_adds[j : j + 1], {n: v[j : j + 1] for n, v in host.items()})
                for j, i in enumerate(rows)}

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return to_device(torch.tensor(values, dtype=torch.long), self.device)

    @staticmethod
    def _take_extras(seq: Sequence, out: StageOutput, next_add: torch.Tensor, tensors: dict[str, torch.Tensor]
                     ) -> None:
        """A sampled token's `after_sample` rows: its position's addition, and its outputs unless it stopped
        the request (a stop token's outputs describe nothing emitted: a talker's EOS frame is no audio)."""
        seq.step_adds.append(next_add)
        if out.finish_reason != "stop":
            out.tensors.update(tensors)

    def _sample_each(self, seqs: list[Sequence], logits: torch.Tensor, argmax: torch.Tensor | None
                     ) -> list[tuple[int, Any] | None]:
        """(token, logprob) per row, drawn for the whole batch at once; if that raises, row by row, so the rows
        that raise alone get None (their request fails) and the others their tokens."""
        if not seqs:
            return []
        try:
            return [None if lp is ROW_FAILED else (t, lp) for t, lp in zip(*self._sample(seqs, logits, argmax),
                                                                           strict=True)]
        except Exception:  # in practice while building the rows' columns, before any noise is drawn: draw again
            logger.exception("stage %s: sampling a batch failed; sampling its rows one by one", self.name)
        out: list[tuple[int, Any] | None] = []
        for i, seq in enumerate(seqs):
            try:
                (token,), (logprob,) = self._sample([seq], logits[i : i + 1],
                                                    None if argmax is None else argmax[i : i + 1])
                out.append(None if logprob is ROW_FAILED else (token, logprob))
            except Exception:
                logger.exception("stage %s: sampling for request %r failed", self.name, seq.request_id)
                out.append(None)
        return out

    def _emit(self, seq: Sequence, out: StageOutput, outputs: list[StageOutput]) -> None:
        if out.token_ids or out.hidden_states or out.finished:
            out.num_prompt_tokens = seq.num_prompt_tokens
            out.num_cached_tokens = seq.num_cached
            out.num_output_tokens = seq.num_output_tokens
            outputs.append(out)
        if out.finished:
            self.abort(seq.request_id)

    # ---- overlapped decoding -------------------------------------------------------------------
    # While every scheduled sequence decodes one token that the device can choose alone (greedy; with
    # `overlap_sampled` also sampled, seeded or not, or penalised, without logprobs) and nobody waits to be
    # admitted, the engine keeps one step in flight: it launches step N+1 (its input tokens are step N's
    # outputs, passed on the device) before reading step N's tokens, so the host's bookkeeping overlaps the
    # device's work. Penalties read the tokens from a device-side history that each step's draw is recorded
    # into. A sequence that turns out to have finished at step N wastes one token of N+1.

    def _overlappable(self, seq: Sequence) -> bool:
        params, pos = seq.params, seq.num_computed
        return (
            seq.input_final
            and self._after_sample is None  # its hook reads each step's tokens before the next step is packed
            and params.logprobs is None
            and (params.plain_greedy or self.config.overlap_sampled)
            and seq.num_output_tokens >= params.min_tokens
            and seq.grammar is None  # its next mask depends on the token just drawn
            and seq.pooling is None  # (a one-token prompt to pool looks like a decode step)
            and not params.logit_bias
            and pos not in seq.embeds
            # an added row (a talker's thinker states) for the position must have arrived
            and (seq.embed_adds is None or seq.adds_final or pos - seq.num_prompt_tokens < len(seq.embed_adds))
        )

    def _launch(self, seqs: list[Sequence], previous: DecodeLaunch | None = None, steps: int = 1) -> DecodeLaunch:
        pending = {id(s): previous.steps for s in previous.seqs} if previous is not None else {}
        if steps > 1:
            return self._launch_burst(seqs, previous, steps, pending)
        layers = self._hidden_layers if any(s.return_hidden for s in seqs) else ()
        if all(s.params.plain_greedy for s in seqs):
            return self.runner.launch_decode(seqs, previous, output_layers=layers)  # the argmax, from the graph
        return self.runner.launch_decode(seqs, previous, lambda logits: self._draw(seqs, logits, pending), layers)

    # ---- decode bursts -----------------------------------------------------------------------------
    # With `decode_burst` K > 1, a chain of in-flight steps launches K steps at once when every sequence can take
    # them: each step's tokens are drawn on the device and fed to the next, so the host works once per K tokens
    # (on CUDA one graph replay). A sequence qualifies while nothing it needs can change inside the burst: its
    # added rows (a talker's thinker states) for all K positions have arrived, it has K tokens left, no own seed
    # (its generator cannot be captured), no hidden states to hand on. Tokens after a stop are discarded.

    def _burst_steps(self, seqs: list[Sequence], in_flight: int) -> int:
        """K if every sequence can decode K more tokens in one burst (after `in_flight` unread ones), else 1."""
        k, limit = self.config.decode_burst, self.config.max_model_len
        if k < 2:
            return 1
        for seq in seqs:
            pos = seq.num_computed
            if (
                seq.generator is not None or seq.return_hidden
                or seq.max_tokens - seq.num_output_tokens - in_flight < k or limit - seq.num_tokens - in_flight < k
                or (seq.embed_adds is not None and not seq.adds_final
                    and pos + k - seq.num_prompt_tokens > len(seq.embed_adds))
                or (seq.rope_positions is not None and pos < seq.rope_positions.shape[1])
                or (seq.embeds and any(pos + j in seq.embeds for j in range(k)))
            ):
                return 1
        return k

    def _launch_burst(self, seqs: list[Sequence], previous: DecodeLaunch | None, steps: int,
                      pending: dict[int, int]) -> DecodeLaunch:
        """A captured burst draws with the static columns, loaded here; an eager one with the batch's own
        columns, built on its first logits (their width is the vocabulary)."""
        columns: list[tuple[SamplingColumns, torch.Tensor]] = []  # (columns, history slots)

        def draw(logits: torch.Tensor) -> torch.Tensor:
            if not columns:
                columns.append(self._batch_columns(seqs, logits.shape[-1], logits.device, pending))
            cols, slots = columns[0]
            return self.sampler.draw(logits, cols, self.history, slots)

        static = self._static_draw
        if static is not None and self.runner.burst_graph_fits(seqs, steps):
            columns.append(self._batch_columns(seqs, static.vocab, self.device, pending))
            cols, slots = columns[0]
            static.load(cols, slots if cols.needs_history else None, len(seqs))
        launch = self.runner.launch_burst(seqs, steps, draw, previous)
        self.num_burst_steps += steps
        if columns[0][0].needs_history:
            for seq in seqs:
                seq.history_len += steps
        return launch

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor, argmax: torch.Tensor | None
                ) -> tuple[list[int], list]:
        """A host-path step's tokens: the graph's argmax when every row is plain greedy; the device-side draw
        (cached columns, token history: no per-step lists) unless a row asks for logprobs; else from the rows'
        own token lists. Rows with structured output have their logits masked to what their grammar allows, rows with
        a logit_bias their biases added."""
        constrained = [(i, s.grammar) for i, s in enumerate(seqs) if s.grammar is not None]
        if constrained or any(s.params.logit_bias for s in seqs):
            logits = logits.clone()  # may be a graph's output buffer, and a failed batch is sampled again by row
        if constrained:
            self.grammars().mask(logits, constrained)
        for i, seq in enumerate(seqs):
            if seq.params.logit_bias:
                ids = torch.tensor(list(seq.params.logit_bias), device=logits.device)
                bias = torch.tensor(list(seq.params.logit_bias.values()), device=logits.device, dtype=logits.dtype)
                logits[i].index_add_(0, ids, bias)
        if argmax is not None and all(s.params.plain_greedy and not self._banned(s) for s in seqs):
            return host_list(argmax), [None] * len(seqs)
        if all(s.params.logprobs is None for s in seqs):
            return host_list(self._draw(seqs, logits, {})), [None] * len(seqs)
        return self.sampler(logits, [self._sample_row(s) for s in seqs], argmax)

    def _draw(self, seqs: list[Sequence], logits: torch.Tensor, pending: dict[int, int]) -> torch.Tensor:
        """Tokens drawn on the device, recorded into the token history when penalties need it. `pending`: how many
        tokens of each sequence (by id) are still in flight."""
        cols, slots = self._batch_columns(seqs, logits.shape[-1], logits.device, pending)
        tokens = self.sampler.draw(logits, cols, self.history, slots)
        if cols.needs_history:
            for seq in seqs:
                seq.history_len += 1
        return tokens

    def _batch_columns(self, seqs: list[Sequence], vocab: int, device: torch.device, pending: dict[int, int]
                       ) -> tuple[SamplingColumns, torch.Tensor]:
        """The batch's sampling columns and history slots, rebuilt only when its members change; a member's
        history is (re)loaded from its token lists when it misses tokens (drawn on the host meanwhile)."""
        if any(s.params.penalised for s in seqs):
            if self.history is None:
                self.history = TokenHistory(self.config.max_num_seqs + 1, vocab, device)
            for seq in seqs:
                if seq.history_slot is None:
                    seq.history_slot = self._take_history_slot()
                    seq.history_len = -1
                # tokens still in flight were recorded by the steps that drew them (this batch's sequences all
                # decoded on the device path in those steps); only tokens the host drew can be missing
                if seq.history_len != seq.num_output_tokens + pending.get(id(seq), 0):
                    self.history.load(seq.history_slot, seq.token_ids[: seq.num_prompt_tokens], seq.output_token_ids)
                    seq.history_len = seq.num_output_tokens
        key = tuple((s.arrival, s.history_slot, s.num_output_tokens < s.params.min_tokens) for s in seqs)
        if self._columns is None or self._columns[0] != key:
            cols = self.sampler.columns([self._sample_row(s) for s in seqs], vocab, device)
            slots = to_device(torch.tensor([s.history_slot or 0 for s in seqs]), device)
            self._columns = (key, cols, slots)
        return self._columns[1], self._columns[2]

    def _take_history_slot(self) -> int:
        """A free history slot; running sequences never outnumber the slots, so one held by a sequence that
        is not running (preempted) can be taken back."""
        if not self._free_history_slots:
            for seq in self.seqs.values():
                if seq.history_slot is not None and seq.status is not SeqStatus.RUNNING:
                    self._free_history_slots.append(seq.history_slot)
                    seq.history_slot = None
                    break
        return self._free_history_slots.pop()

    def _start_decode(self, seqs: list[Sequence]) -> list[StageOutput]:
        steps = self._allocate_steps(seqs, self._burst_steps(seqs, 0))  # >= 1: the scheduler allocated one
        try:
            self.in_flight = self._launch(seqs, steps=steps)
        except GroupLost:  # a tensor-parallel rank is gone: the stage restarts
            raise
        except Exception:
            logger.exception("stage %s: step failed", self.name)
            return self._launch_failed(seqs)
        for seq in seqs:
            seq.num_computed += steps
        return self._advance_decode()

    def _launch_failed(self, seqs: list[Sequence]) -> list[StageOutput]:
        """A decode launch raised. Requests whose own sampling rows cannot be built fail alone, and the others
        are scheduled again by the next step (their positions were not advanced); with none to blame (the
        forward itself failed) the step's requests all fail."""
        culprits = [seq for seq in seqs if not self._row_builds(seq)]
        return [self._fail(seq) for seq in culprits] or [self._fail(seq, "this step") for seq in seqs]

    def _row_builds(self, seq: Sequence) -> bool:
        try:
            self.sampler.columns([self._sample_row(seq)], self.vocab_size, self.device)
            return True
        except Exception:
            logger.exception("stage %s: the sampling parameters of request %r failed", self.name, seq.request_id)
            return False

    def _allocate_steps(self, seqs: list[Sequence], steps: int) -> int:
        """Blocks for `steps` more positions of each sequence: `steps` if they fit, else 1 if that does, else 0."""
        for n in dict.fromkeys((steps, 1)):
            if all(self.block_manager.allocate(seq, n) for seq in seqs):
                return n
        return 0

    def _advance_decode(self) -> list[StageOutput]:
        current, self.in_flight = self.in_flight, None
        following, ending, steps, unread = [], set(), 1, current.steps
        if not self.scheduler.waiting:
            for seq in current.seqs:
                # the tokens in flight make num_tokens + unread; a sure finish by length gets no next step
                if seq.num_output_tokens + unread >= seq.max_tokens or (
                        seq.num_tokens + unread >= self.config.max_model_len):
                    ending.add(id(seq))
                elif self.seqs.get(seq.request_id) is seq and self._overlappable(seq):
                    following.append(seq)
            # Only with every running sequence: one left out (its next input row has not arrived) would wait for
            # the whole chain to end; without a step in flight the scheduler batches it as soon as it can run.
            chained = ending | {id(s) for s in following}
            if any(id(s) not in chained for s in self.scheduler.running):
                following = []
            elif following:
                steps = self._allocate_steps(following, self._burst_steps(following, unread))
                following = following if steps else []
        outputs: list[StageOutput] = []
        if following:
            try:
                self.in_flight = self._launch(following, previous=current, steps=steps)
                self.num_overlapped_steps += 1
            except GroupLost:  # a tensor-parallel rank is gone: the stage restarts
                raise
            except Exception:  # the current step's tokens are still read; the next step is scheduled afresh
                logger.exception("stage %s: step failed", self.name)
                self.in_flight = None
                outputs += self._launch_failed(following)
                following = []
        try:
            tokens = self.runner.read_tokens(current)
        except Exception:
            logger.exception("stage %s: step failed", self.name)
            self.in_flight = None
            return outputs + [self._fail(seq, "this step") for seq in current.seqs
                              if self.seqs.get(seq.request_id) is seq]
        for seq in following:
            seq.num_computed += steps
        for row, seq in enumerate(current.seqs):
            if self.seqs.get(seq.request_id) is not seq:
                continue  # finished or aborted while its step was in flight
            try:
                out = StageOutput(request_id=seq.request_id, stage=self.name)
                if seq.return_hidden and current.hidden:
                    self._collect_hidden(seq, out, current.hidden, (row, row + 1), current.positions[row])
                for step_tokens in tokens:  # a burst's tokens after a stop are dropped
                    self._append_token(seq, out, step_tokens[row], None)
                    if out.finished:
                        break
                self.block_manager.register_full_blocks(seq)
                self._emit(seq, out, outputs)
            except Exception:  # its own bookkeeping (stop checks, text, output): it alone fails
                logger.exception("stage %s: request %r failed", self.name, seq.request_id)
                outputs.append(self._fail(seq))
        return outputs

    def _banned(self, seq: Sequence) -> tuple[int, ...]:
        """Ids the sequence may not draw now: its bad ids, and EOS / stop ids before min_tokens."""
        params = seq.params
        before_min = seq.num_output_tokens < params.min_tokens
        if seq.banned is None or seq.banned[0] != before_min:  # changes once, when min_tokens is reached
            banned = set(params.bad_token_ids)
            if before_min:
                banned |= self.eos_token_ids | set(params.stop_token_ids)
            seq.banned = (before_min, tuple(sorted(banned)))
        return seq.banned[1]

    def _sample_row(self, seq: Sequence) -> SampleRow:
        return SampleRow(seq.params, seq.token_ids[: seq.num_prompt_tokens], seq.output_token_ids, seq.generator,
                         self._banned(seq))

    def _collect_hidden(self, seq: Sequence, out: StageOutput, hidden: dict[int, torch.Tensor],
                        span: tuple[int, int], start_pos: int) -> None:
        """Hidden rows (`span` of the step's rows, for positions from `start_pos`) not yet sent: rows
        recomputed after a preemption are skipped."""
        skip = max(0, seq.hidden_sent - start_pos)
        if span[0] + skip >= span[1]:
            return
        for name, layer in self.config.hidden_state_layers.items():
            out.hidden_states[name] = hidden[layer][span[0] + skip : span[1]]
        seq.hidden_sent = start_pos + span[1] - span[0]

    def _pool(self, seq: Sequence, out: StageOutput, hidden: dict[int, torch.Tensor], span: tuple[int, int],
              start_pos: int) -> None:
        """Fold this step's final hidden rows of the prompt into the sequence's embedding (rows recomputed after a
        preemption are skipped); once the whole prompt is in, output it and finish."""
        skip = max(0, seq.hidden_sent - start_pos)
        rows = hidden[self.config.hidden_state_layers["last"]][span[0] + skip : span[1]].float()
        if len(rows):
            seq.hidden_sent = start_pos + span[1] - span[0]
            if seq.pooling == "last":
                seq.pooled = rows[-1]
            else:
                seq.pooled = rows.sum(0) if seq.pooled is None else seq.pooled + rows.sum(0)
        if seq.num_computed >= seq.num_prompt_tokens:
            pooled = seq.pooled if seq.pooling == "last" else seq.pooled / seq.num_prompt_tokens
            out.tensors["embedding"] = pooled.cpu()
            out.finished, out.finish_reason = True, "stop"

    def _append_token(self, seq: Sequence, out: StageOutput, token_id: int, logprob) -> None:
        params = seq.params
        seq.token_ids.append(token_id)
        self.num_output_tokens += 1
        out.token_ids.append(token_id)
        if logprob is not None:
            out.logprobs = [logprob]
        hit_stop_string = seq.detokenizer.add(token_id) if seq.detokenizer else False
        # EOS and stop ids cannot be sampled before min_tokens (the sampler bans them).
        reason = None
        is_eos = token_id in self.eos_token_ids and not params.ignore_eos
        # a grammar that is complete ends the reply (on the stop token it then allows)
        done = seq.grammar is not None and (not seq.grammar.accept_token(token_id) or seq.grammar.is_terminated())
        if is_eos or token_id in params.stop_token_ids or hit_stop_string or done:
            reason = "stop"
        elif seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.config.max_model_len:
            reason = "length"
        out.finished = reason is not None
        out.finish_reason = reason
        if seq.detokenizer:
            out.text += seq.detokenizer.take(final=out.finished)  # a burst appends several tokens to one output

    def _fail(self, seq: Sequence, scope: str = "this request") -> StageOutput:
        """The request's failure (the log has the traceback; the caller hears only which stage failed)."""
        self.abort(seq.request_id)
        return StageOutput.failure(seq.request_id, self.name, stage_failure(self.name, scope))
