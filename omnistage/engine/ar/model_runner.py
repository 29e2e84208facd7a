"""Turns a scheduled batch into packed tensors, runs the model, and returns logits.

Host-side bookkeeping (positions, slots, block tables) is built once per step from plain lists.
On CUDA, steps where every sequence decodes one token replay a CUDA graph of the whole forward (plus
the LM head) for the smallest batch-size bucket that fits, and a step that prefills one sequence's prompt
of up to `prompt_graph_tokens` tokens replays one for the smallest token bucket that fits (cuda_graphs.py);
other steps run eagerly. The graphs also keep the hidden layers the engine may hand on (`graph_layers`) and the
final hidden states (an `after_sample` hook's input) and, for models that declare `graph_embed_adds`, take per-row
additions to the input embeddings (a talker's side input). Replaying a prompt step matters because eagerly it is
hundreds of kernel launches from Python while the whole request waits for its first token. A model whose
`after_sample` hook has a graph-safe form (`after_sample_graph`) gets that captured per batch-size bucket too, even
if its decoder is not graph-safe (cuda_graphs.HookGraphs): a talker's code predictor is hundreds of small kernels
per step.

A decode burst (`burst_steps` > 1) runs several decode steps per launch, each step's tokens drawn on the
device and fed to the next: one graph replay (and one host round trip) per burst instead of per token, for
small models whose step is shorter than the host's work for it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from omnistage.engine.ar.attention import AttentionMetadata, PagedKVCache
from omnistage.engine.ar.cuda_graphs import CUDACapture, HookGraphs, StepGraphs, bucket_sizes, eager_capture
from omnistage.engine.ar.model import ARModel, SampleExtras
from omnistage.engine.ar.sequence import Sequence
from omnistage.engine.transfer import to_device

logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    sample_rows: list[int]  # batch indices of the sequences that sample this step
    logits: torch.Tensor | None  # [len(sample_rows), vocab] float32
    hidden: dict[int, torch.Tensor]  # layer -> [T, hidden] for the whole packed step
    row_spans: list[tuple[int, int]]  # each sequence's rows in the packed step
    argmax: torch.Tensor | None = None  # argmax of `logits`, when the step computed it on the way
    # [len(sample_rows), hidden]: the states `logits` came from (after a replay, in the graph's buffer until the next)
    last_hidden: torch.Tensor | None = None


@dataclass
class DecodeLaunch:
    """A decode step handed to the device whose tokens the host has not read yet."""

    seqs: list[Sequence]
    tokens: torch.Tensor  # [n] chosen ids, on the device
    positions: list[int]  # the position each sequence computed
    hidden: dict[int, torch.Tensor]  # layer -> [n, hidden] for the computed positions (when asked for)
    all_tokens: torch.Tensor | None = None  # [steps, n]: every step's ids (a burst); `tokens` is the last row
    host_tokens: torch.Tensor | None = None  # pinned copy of `all_tokens`, filled asynchronously (CUDA)
    done: torch.cuda.Event | None = None

    @property
    def steps(self) -> int:
        return 1 if self.all_tokens is None else self.all_tokens.shape[0]


@dataclass
class _Packed:
    """One step's inputs as host lists."""

    ids: list[int]
    positions: list[int]  # token index in its sequence (cache slots, causal order)
    rope: list[int]  # rotary position (index + delta); rows in `rope_explicit` are multi-axis instead
    slots: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    tables: list[list[int]]
    embed_rows: list[int]
    embed_values: list[torch.Tensor]
    add_rows: list[int]
    add_values: list[torch.Tensor]
    rope_explicit: list[tuple[int, torch.Tensor]]
    sample_rows: list[int]
    last_rows: list[int]
    row_spans: list[tuple[int, int]]


class ModelRunner:
    def __init__(
        self, model: ARModel, block_size: int, max_num_seqs: int, max_model_len: int, enforce_eager: bool = False,
        graph_layers: tuple[int, ...] = (), burst_steps: int = 1, prompt_graph_tokens: int = 0,
    ):
        self.model = model
        self.device = model.device
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.use_triton = self.device.type == "cuda"
        # Graph-safe models on CUDA step through StepGraphs, captured or (enforce_eager) run eagerly on the same
        # static buffers and padded shapes: the two give the same tokens (and the same `after_sample` outputs).
        self.use_graphs = self.use_triton and getattr(model, "graph_safe", False)
        self.kv_cache: PagedKVCache | None = None
        self.pad_slot = 0
        self.graph_layers = graph_layers
        self._token_slot = 0
        self.burst_steps = max(1, burst_steps)
        self.prompt_graph_tokens = prompt_graph_tokens
        self.step_graphs = StepGraphs(self, eager=enforce_eager) if self.use_graphs else None
        self.enforce_eager = enforce_eager
        self.hooks: HookGraphs | None = None  # the model's `after_sample` per batch bucket, if it has a graph form

    # the step graphs' state, for the engine and its stats
    @property
    def graphs(self) -> dict:
        return self.step_graphs.graphs if self.step_graphs else {}

    @property
    def burst_graphs(self) -> dict:
        return self.step_graphs.burst_graphs if self.step_graphs else {}

    @property
    def prompt_graphs(self) -> dict:
        return self.step_graphs.prompt_graphs if self.step_graphs else {}

    @property
    def num_prompt_replays(self) -> int:
        return self.step_graphs.num_prompt_replays if self.step_graphs else 0

    @property
    def hook_graphs(self) -> dict:
        return self.hooks.graphs if self.hooks else {}

    @property
    def num_after_sample_replays(self) -> int:
        return self.hooks.num_replays if self.hooks else 0

    @property
    def _dev_adds(self) -> torch.Tensor | None:
        return self.step_graphs._dev_adds if self.step_graphs else None

    def burst_graph_fits(self, seqs: list[Sequence], steps: int) -> bool:
        return self.step_graphs is not None and self.step_graphs.burst_graph_fits(seqs, steps)

    def capture_bursts(self, draw: Callable[[torch.Tensor], torch.Tensor], generator: torch.Generator | None
                       ) -> None:
        if self.step_graphs is not None:
            self.step_graphs.capture_bursts(draw, generator)

    # ---- memory ---------------------------------------------------------------------------

    @torch.inference_mode()
    def profile(self, num_tokens: int) -> int:
        """Run the largest step once; returns its peak activation bytes, so the KV cache can take
        the rest of the stage's memory share."""
        if self.device.type != "cuda":
            return 0
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        blocks = -(-num_tokens // self.block_size)
        self.kv_cache = PagedKVCache(self.model.kv_spec, blocks, self.block_size, self.device)
        seqs = [Sequence("profile", [0] * num_tokens, None, max_tokens=1, arrival=0)]  # type: ignore[arg-type]
        seqs[0].block_table = list(range(blocks))
        self.execute([(seqs[0], num_tokens)], ())
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        self.kv_cache = None
        torch.cuda.empty_cache()
        return peak - before

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Allocate `num_blocks` usable blocks plus one that padded graph rows write into."""
        self.kv_cache = PagedKVCache(self.model.kv_spec, num_blocks + 1, self.block_size, self.device)
        self.pad_slot = num_blocks * self.block_size
        if self.device.type == "cuda":  # two of each host buffer: one step may be in flight
            self._host_tokens = [torch.zeros(self.burst_steps * self.max_num_seqs, dtype=torch.long).pin_memory()
                                 for _ in range(2)]
        if self.step_graphs is not None:
            self.step_graphs.capture_decode(num_blocks)
        self._capture_hooks()
        if self.step_graphs is not None:
            self.step_graphs.capture_prompts()

    def _capture_hooks(self) -> None:
        """On CUDA, the hook's graph form per decode bucket: in the decode graphs' pool, or (a decoder that is not
        graph-safe, a MoE's expert loop) in a pool of its own, its width and dtype the token embeddings'."""
        if not self.use_triton or not hasattr(self.model, "after_sample_graph"):
            return
        started = time.perf_counter()
        if self.step_graphs is not None:
            self.hooks = self.step_graphs.capture_after_sample()
        else:
            like = self.model.embed(torch.zeros(1, dtype=torch.long, device=self.device))
            self.hooks = HookGraphs(self.model, bucket_sizes(self.max_num_seqs), like,
                                    eager_capture if self.enforce_eager else CUDACapture(self.device))
        torch.cuda.synchronize(self.device)
        logger.info("%s %d after_sample graphs in %.1fs", "prepared eager stand-ins for" if self.enforce_eager
                    else "captured", len(self.hooks.graphs), time.perf_counter() - started)

    def release(self) -> None:
        """Drop the KV cache and captured graphs (their memory pool) so the device memory returns."""
        self.hooks = None
        if self.step_graphs is not None:
            self.step_graphs.release()
        self.kv_cache = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ---- one step -------------------------------------------------------------------------

    def _pack(self, batch: list[tuple[Sequence, int]], ahead: int = 0) -> _Packed:
        """`ahead`: the rows of a burst's later step (positions that many past `num_computed`)."""
        bs = self.block_size
        p = _Packed([], [], [], [], [], [], [], [], [], [], [], [], [], [], [])
        for i, (seq, n) in enumerate(batch):
            start = seq.num_computed + ahead
            end = start + n
            row = len(p.ids)
            plain = seq.cacheable  # no per-position extras: the common case stays a list extend
            for pos in range(start, end) if not plain else ():
                if pos in seq.embeds:
                    p.embed_rows.append(row + pos - start)
                    p.embed_values.append(seq.embeds[pos])
                elif (add := seq.embed_add(pos)) is not None:
                    p.add_rows.append(row + pos - start)
                    p.add_values.append(add)
            p.rope += range(start + seq.rope_delta, end + seq.rope_delta)
            if seq.rope_positions is not None and start < seq.rope_positions.shape[1]:
                self._explicit_rope(p, seq.rope_positions[:, start:end], row)
            table = seq.block_table
            known = seq.token_ids[start:end]
            p.ids += known + [0] * (n - len(known))  # a token still on the device: filled in there
            p.positions += range(start, end)
            p.slots += [table[pos // bs] * bs + pos % bs for pos in range(start, end)]
            p.query_lens.append(n)
            p.seq_lens.append(end)
            p.tables.append(table)
            p.row_spans.append((row, row + n))
            if end == seq.num_tokens and seq.input_final:
                p.sample_rows.append(i)
                p.last_rows.append(row + n - 1)
        return p

    @staticmethod
    def _explicit_rope(p: _Packed, block: torch.Tensor, row: int) -> None:
        """A sequence's multi-axis rotary positions [axes, n] for its rows from `row` on: where every axis
        agrees (text: a multi-axis rotary then equals the plain one) they are plain positions, the rest stay
        explicit (`_rope` writes them over the plain ones). One look at the block rather than one per position."""
        p.rope[row : row + block.shape[1]] = block[0].tolist()
        differ = (block != block[:1]).any(dim=0).nonzero()[:, 0].tolist()
        p.rope_explicit += [(row + j, block[:, j]) for j in differ]

    def _tensor(self, values: list[int], dtype: torch.dtype = torch.long) -> torch.Tensor:
        return to_device(torch.tensor(values, dtype=dtype), self.device)

    def _block_table_array(self, tables: list[list[int]], rows: int, width: int) -> np.ndarray:
        array = np.zeros((rows, width), dtype=np.int32)
        for i, table in enumerate(tables):
            array[i, : len(table)] = table
        return array

    def _metadata(self, p: _Packed) -> AttentionMetadata:
        meta = AttentionMetadata(kv_cache=self.kv_cache, slot_mapping=self._tensor(p.slots))
        if self.use_triton:
            width = max(len(t) for t in p.tables)
            meta.block_tables = to_device(torch.from_numpy(self._block_table_array(p.tables, len(p.tables), width)),
                                          self.device)
            meta.seq_lens = self._tensor(p.seq_lens, torch.int32)
            meta.cu_seqlens_q = self._tensor([0, *np.cumsum(p.query_lens).tolist()], torch.int32)
            meta.max_query_len = max(p.query_lens)
            return meta
        bs = self.block_size
        ctx_slots, ctx_pos, ctx_seq, query_seq = [], [], [], []
        for i, (table, end, n) in enumerate(zip(p.tables, p.seq_lens, p.query_lens, strict=True)):
            ctx_slots += [table[pos // bs] * bs + pos % bs for pos in range(end)]
            ctx_pos += range(end)
            ctx_seq += [i] * end
            query_seq += [i] * n
        meta.query_pos = self._tensor(p.positions)
        meta.query_seq = self._tensor(query_seq)
        meta.context_slots = self._tensor(ctx_slots)
        meta.context_pos = self._tensor(ctx_pos)
        meta.context_seq = self._tensor(ctx_seq)
        return meta

    @torch.inference_mode()
    def execute(self, batch: list[tuple[Sequence, int]], output_layers: tuple[int, ...] = ()) -> StepResult:
        p = self._pack(batch)
        if self._graph_fits(p, len(batch)) and set(output_layers) <= set(self.graph_layers):
            logits, argmax, layers, last = self.step_graphs.replay(p)
            hidden = {i: layers[i][: len(batch)].clone() for i in output_layers}  # the next replay overwrites
            if len(p.sample_rows) != len(batch):
                rows = self._tensor(p.sample_rows)
                logits, argmax, last = logits[rows], argmax[rows], last[rows]
            return StepResult(p.sample_rows, logits if p.sample_rows else None, hidden, p.row_spans, argmax,
                              last if p.sample_rows else None)
        if self._prompt_graph_fits(p, len(batch)) and set(output_layers) <= set(self.graph_layers):
            logits, argmax, layers, last = self.step_graphs.replay_prompt(p)
            hidden = {i: layers[i][: len(p.ids)].clone() for i in output_layers}  # the next replay overwrites
            return StepResult(p.sample_rows, logits, hidden, p.row_spans, argmax, last)
        token_ids = self._tensor(p.ids)
        embeds = self._input_embeds(p, token_ids)
        hidden, layers = self.model.forward(token_ids, self._rope(p), self._metadata(p), embeds, output_layers)
        last = hidden[self._tensor(p.last_rows)] if p.last_rows else None
        logits = self.model.compute_logits(last) if last is not None else None
        return StepResult(p.sample_rows, logits, layers, p.row_spans, last_hidden=last)

    def after_sample(self, hidden: torch.Tensor, tokens: torch.Tensor, inputs: list[dict[str, torch.Tensor]],
                     generators: list[torch.Generator | None]) -> SampleExtras:
        """The model's `after_sample` over a step's sampled rows: a replay of its captured form where one fits."""
        if self.hooks is None:
            return self.model.after_sample(hidden, tokens, inputs, generators)
        return self.hooks.run(hidden, tokens, inputs, generators)

    def _graph_fits(self, p: _Packed, num_seqs: int) -> bool:
        """A step a captured graph can run: one token per sequence, no replaced embeddings or explicit
        multi-axis positions, additions only where the graphs take them."""
        return (
            bool(self.graphs) and len(p.ids) == num_seqs <= self.max_num_seqs
            and not p.embed_rows and not p.rope_explicit and (not p.add_rows or self._dev_adds is not None)
        )

    def _prompt_graph_fits(self, p: _Packed, num_seqs: int) -> bool:
        """A step a prompt graph can run: one sequence's tokens (more than one: a single token is a decode
        step's), no more than the largest bucket, plain rotary positions."""
        return bool(self.prompt_graphs) and num_seqs == 1 and 1 < len(p.ids) <= max(self.prompt_graphs) \
            and not p.rope_explicit

    def _input_embeds(self, p: _Packed, token_ids: torch.Tensor) -> torch.Tensor | None:
        """Token embeddings with per-position replacements and additions, or None if there are none."""
        if not (p.embed_rows or p.add_rows):
            return None
        embeds = self.model.embed(token_ids)
        if p.embed_rows:
            embeds.index_copy_(0, self._tensor(p.embed_rows),
                               torch.stack(p.embed_values).to(device=self.device, dtype=embeds.dtype))
        if p.add_rows:
            embeds.index_add_(0, self._tensor(p.add_rows),
                              self._stacked_adds(p.add_values).to(device=self.device, dtype=embeds.dtype))
        return embeds

    @staticmethod
    def _stacked_adds(values: list[torch.Tensor | tuple[torch.Tensor, ...]]) -> torch.Tensor:
        """A step's added rows ([1, D] each, Sequence.embed_adds) as one tensor; rows given as parts (a tuple)
        are summed here, a few kernels for the whole step rather than one per request."""
        parts = [v if isinstance(v, tuple) else (v,) for v in values]
        out = torch.cat([p[0] for p in parts])
        for k in range(1, max(len(p) for p in parts)):
            rows = [i for i, p in enumerate(parts) if len(p) > k]
            more = torch.cat([parts[i][k] for i in rows])
            if len(rows) == len(parts):
                out += more
            else:
                out.index_add_(0, torch.tensor(rows, device=out.device), more)
        return out

    def _rope(self, p: _Packed) -> torch.Tensor:
        """Rotary positions: [T], or [axes, T] when some token has explicit multi-axis positions."""
        rope = self._tensor(p.rope)
        if not p.rope_explicit:
            return rope
        rows, values = zip(*p.rope_explicit, strict=True)
        multi = rope.expand(values[0].shape[0], -1).clone()
        explicit = to_device(torch.stack(values, dim=1), self.device)  # host-computed positions: asynchronously
        multi[:, self._tensor(list(rows))] = explicit.to(multi.dtype)
        return multi

    @torch.inference_mode()
    def launch_decode(self, seqs: list[Sequence], previous: DecodeLaunch | None = None,
                      sample: Callable[[torch.Tensor], torch.Tensor] | None = None,
                      output_layers: tuple[int, ...] = ()) -> DecodeLaunch:
        """Decode one token for each sequence (at position `num_computed`) without waiting for the device:
        the argmax, or `sample(logits)` (ids left on the device); with `output_layers`, those layers' rows
        too. A sequence whose input token is still `previous`'s output takes it on the device."""
        p = self._pack([(s, 1) for s in seqs])
        where = {id(s): i for i, s in enumerate(previous.seqs)} if previous else {}
        pending = [(i, where[id(s)]) for i, s in enumerate(seqs) if s.num_computed >= s.num_tokens]
        if self._graph_fits(p, len(seqs)) and set(output_layers) <= set(self.graph_layers):
            logits, argmax, layers, _ = self.step_graphs.replay(p, previous, pending)
            hidden = {i: layers[i][: len(seqs)].clone() for i in output_layers}  # the next replay overwrites
        else:
            ids = self._tensor(p.ids)
            self._take_previous(ids, previous, pending)
            last, hidden = self.model.forward(ids, self._rope(p), self._metadata(p), self._input_embeds(p, ids),
                                              output_layers)
            logits = self.model.compute_logits(last)
            argmax = logits.argmax(dim=-1) if sample is None else None
        tokens = argmax if sample is None else sample(logits)
        return self._launched(DecodeLaunch(seqs, tokens, p.positions, hidden))

    def _launched(self, launch: DecodeLaunch) -> DecodeLaunch:
        """Start the launch's tokens on their way to the host (CUDA: a pinned buffer and an event)."""
        if self.device.type == "cuda":
            self._token_slot ^= 1
            rows = launch.tokens[None] if launch.all_tokens is None else launch.all_tokens
            launch.host_tokens = self._host_tokens[self._token_slot][: rows.numel()].view(rows.shape)  # contiguous
            launch.host_tokens.copy_(rows, non_blocking=True)
            launch.done = torch.cuda.Event()
            launch.done.record()
        return launch

    @staticmethod
    def read_tokens(launch: DecodeLaunch) -> list[list[int]]:
        """Wait for that one launch (not for any launched after it) and return its tokens, one list per step."""
        if launch.done is None:
            rows = launch.tokens[None] if launch.all_tokens is None else launch.all_tokens
            return rows.tolist()
        launch.done.synchronize()
        return launch.host_tokens.tolist()

    # ---- decode bursts ---------------------------------------------------------------------

    @torch.inference_mode()
    def launch_burst(self, seqs: list[Sequence], steps: int, draw: Callable[[torch.Tensor], torch.Tensor],
                     previous: DecodeLaunch | None = None) -> DecodeLaunch:
        """`steps` decode steps for each sequence (positions `num_computed` on, blocks already allocated), each
        step's tokens drawn by `draw(logits)` on the device and fed to the next, without waiting for the device.
        With a captured burst graph (`steps == burst_steps`) the whole burst is one replay and `draw` is the one
        captured in it (its inputs loaded beforehand); otherwise the steps run eagerly."""
        batch = [(s, 1) for s in seqs]
        p = self._pack(batch)
        where = {id(s): i for i, s in enumerate(previous.seqs)} if previous else {}
        pending = [(i, where[id(s)]) for i, s in enumerate(seqs) if s.num_computed >= s.num_tokens]
        if self.burst_graph_fits(seqs, steps):
            all_tokens = self.step_graphs.replay_burst(batch, p, previous, pending)
        else:
            ids = self._tensor(p.ids)
            self._take_previous(ids, previous, pending)
            drawn = []
            for j in range(steps):
                pj = p if j == 0 else self._pack(batch, ahead=j)
                last, _ = self.model.forward(ids, self._rope(pj), self._metadata(pj), self._input_embeds(pj, ids))
                ids = draw(self.model.compute_logits(last))
                drawn.append(ids)
            all_tokens = torch.stack(drawn)
        return self._launched(DecodeLaunch(seqs, all_tokens[-1], p.positions, {}, all_tokens))

    def _take_previous(self, ids: torch.Tensor, previous: DecodeLaunch | None, pending: list[tuple[int, int]]) -> None:
        """Copy the still-unread tokens of `previous` into this step's input ids, on the device."""
        if not pending:
            return
        rows, sources = (list(x) for x in zip(*pending, strict=True))
        if rows == sources == list(range(len(rows))):
            ids[: len(rows)].copy_(previous.tokens[: len(rows)])
        else:
            ids.index_copy_(0, self._tensor(rows), previous.tokens.index_select(0, self._tensor(sources)))
