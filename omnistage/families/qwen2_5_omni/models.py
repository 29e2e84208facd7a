"""Qwen2.5-Omni's three models as omnistage stage models: thinker and talker for the AR engine,
token2wav for the generation engine. Each stage loads only its own part of the checkpoint.

How the parts connect (what transformers' `Qwen2_5OmniForConditionalGeneration.generate` does, which
this reproduces stage by stage):

- The thinker reads text with audio / image / video features scattered into the placeholder tokens'
  embeddings, with 3-axis rotary positions (M-RoPE), and writes text. For speech it also hands on,
  per token it computed, its input embedding (media rows zeroed) and its last hidden state.
- The talker's prompt is, per thinker prompt token, hidden + embedding; then the voice's text-bos
  embedding (+ codec pad); then the first reply token's hidden + embedding (+ codec bos); its token ids
  are codec mask/pad/bos. Each decode step's input is the codec embedding of the last code plus the next
  reply token's hidden + embedding, then the text-eos embedding, then text-pad forever. Everything is
  projected from the thinker's width to the talker's before its layers.
- token2wav turns the codes into a mel spectrogram by flow matching (a DiT integrated with RK4 from
  seeded noise, conditioned on the voice) and the mel into 24 kHz audio with BigVGAN, in fp32.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn
from transformers.initialization import no_init_weights

from omnistage.engine.ar.parallel import TPGroup
from omnistage.engine.generation.engine import InFlight
from omnistage.engine.generation.graphs import BatchGraphs
from omnistage.engine.transfer import HostCopy, to_device
from omnistage.errors import RequestError
from omnistage.families import hf, tensor_parallel
from omnistage.families.base import TRANSFORMERS_LOAD
from omnistage.families.causal_lm.fused_decoder import FusedDecoder
from omnistage.families.qwen2_5_omni.dit import DiTSolver
from omnistage.families.qwen2_5_omni.vocoder import DTYPES as VOCODER_DTYPES
from omnistage.families.qwen2_5_omni.vocoder import cast_convolutions, fuse_activations
from omnistage.kernels import exact_gemm
from omnistage.types import StageInput

logger = logging.getLogger(__name__)

SAMPLE_RATE = 24000


# The thinker-vocabulary token ids Qwen2.5-Omni's talker config carries beside its 8,448 codec codes.
_THINKER_IDS_IN_TALKER_CONFIG = frozenset(f"{name}_token_id" for name in (
    "tts_text_start", "tts_text_end", "tts_text_pad", "vision_start", "vision_end", "audio_start", "audio_end"))


def _keep_unless_a_thinker_id(record: logging.LogRecord) -> bool:
    """A logging filter: False (drop) for transformers' "Model config: NAME must be `None` or an integer within
    the vocabulary" warning about one of those ids, True for every other record."""
    message = record.getMessage()
    name = message.removeprefix("Model config: ").split(" ", 1)[0]
    return not (message.startswith("Model config: ") and "within the vocabulary" in message
                and name in _THINKER_IDS_IN_TALKER_CONFIG)


@contextlib.contextmanager
def thinker_ids_unflagged() -> Iterator[None]:
    """While Qwen2.5-Omni configs are built. transformers 5 checks every `*_token_id` of a config against its own
    text vocabulary, and this family's talker config carries the thinker's ids (tts_text_*, vision_*, audio_*)
    beside a vocabulary of 8,448 codec codes: every checkpoint, the released one too, sets off a warning for each,
    all false alarms. Only those are dropped (any other id out of its vocabulary is still reported), only inside
    the block."""
    config_logger = logging.getLogger("transformers.configuration_utils")
    outermost = _keep_unless_a_thinker_id not in config_logger.filters  # nested blocks: the outer one removes it
    config_logger.addFilter(_keep_unless_a_thinker_id)
    try:
        yield
    finally:
        if outermost:
            config_logger.removeFilter(_keep_unless_a_thinker_id)


def load_part(cls: Any, path: Path, config: Any, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """One top-level part (thinker / talker) in its dtype; transformers strips the part's prefix and
    applies the checkpoint's key conversions. With accelerate installed it loads straight to the GPU."""
    from transformers.utils import logging as hf_logging

    direct = device.type == "cuda" and importlib.util.find_spec("accelerate") is not None
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the other parts' weights are expected to be left unread
    try:
        model = cls.from_pretrained(path, config=config, dtype=dtype, attn_implementation=hf.ATTN_IMPL,
                                    **TRANSFORMERS_LOAD,
                                    **({"device_map": device} if direct else {}))
    finally:
        hf_logging.set_verbosity(verbosity)
    return model.to(device).eval().requires_grad_(False)


def checkpoint_rows(path: Path, key: str, rows: list[int]) -> torch.Tensor:
    """A few rows of one checkpoint tensor, read without loading the rest of it."""
    for file in hf.safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            if key in f.keys():
                table = f.get_slice(key)
                return torch.stack([table[r : r + 1][0] for r in rows])
    raise KeyError(f"{key} not in the checkpoint at {path}")


class ThinkerLM(hf.HFCausalLM):
    """The thinker's text decoder, with its media encoders run when a request arrives. `fused`: the fused layer
    loop where the layers allow (not for a tensor-parallel shard, whose layers communicate)."""

    def __init__(self, thinker: nn.Module, fused: bool = True):
        decoder = thinker.model.language_model
        super().__init__(thinker, thinker.config, fused_forward(decoder) if fused else None, decoder=decoder,
                         lm_head=thinker.lm_head, plain_loop=True)
        for encoder in (thinker.model.audio_tower, thinker.model.visual):  # whole media items, not the paged cache
            encoder.config._attn_implementation = "sdpa"
        self.thinker = thinker
        self.num_layers = thinker.config.text_config.num_hidden_layers

    @torch.inference_mode()
    def prepare_input(self, inp: StageInput, first: bool,
                      embed: Callable[[torch.Tensor], torch.Tensor] | None = None) -> StageInput:
        """`embed`: the token embedding to use (tensor parallel: the group's, as this rank holds a vocab slice)."""
        if not first:
            return inp
        # Applied on the stage's thread while its previous step may still run: host tensors go over through
        # pinned memory and rotary positions are computed on the host, so nothing here waits for the device.
        t, device = inp.tensors, self.device
        host_ids = torch.tensor([inp.token_ids])
        ids = to_device(host_ids, device)
        embeds = (embed or self.embed)(ids[0])
        audio_lengths = None
        if "input_features" in t:
            audio_lengths = t["feature_attention_mask"].sum(-1)
            mask = to_device(t["feature_attention_mask"], device)
            feats = self.thinker.model.get_audio_features(t["input_features"].to(device, embeds.dtype), mask,
                                                          return_dict=True).last_hidden_state
            embeds = _scatter(embeds, ids[0] == self.thinker.config.audio_token_id, feats, "audio")
        for kind, pixels, grid, token in (("image", "pixel_values", "image_grid_thw", "image_token_id"),
                                          ("video", "pixel_values_videos", "video_grid_thw", "video_token_id")):
            if pixels in t:
                getter = getattr(self.thinker.model, f"get_{kind}_features")
                out = getter(t[pixels].to(device, embeds.dtype), t[grid].to(device), return_dict=True)
                feats = torch.cat(list(out.pooler_output), dim=0)
                embeds = _scatter(embeds, ids[0] == getattr(self.thinker.config, token), feats, kind)
        positions, deltas = self.thinker.get_rope_index(
            host_ids, *_media_layout(t, ("image_grid_thw", "video_grid_thw")), torch.ones_like(host_ids),
            bool(t.get("use_audio_in_video", torch.tensor(False)).item()), audio_lengths,
            *_media_layout(t, ("video_second_per_grid",)),
        )
        inp.embeds = embeds
        inp.rope_positions = positions[:, 0]
        inp.rope_delta = int(deltas.view(-1)[0])
        return inp


# The checkpoint's thinker keys -> the thinker module's (transformers nests the text decoder under `language_model`).
THINKER_KEYS = {"thinker.model.": "model.language_model.", "thinker.audio_tower.": "model.audio_tower.",
                "thinker.visual.": "model.visual.", "thinker.": ""}


def load_thinker_shard(path: Path, dtype_name: str, group: TPGroup) -> hf.HFCausalLM:
    """This tensor-parallel rank's thinker (tensor_parallel.py shards it): rank 0 the whole thinker with its text
    decoder, embedding and LM head sharded, its media encoders whole (only rank 0 runs them); the other ranks only
    their shard of the text decoder and head."""
    from transformers import Qwen2_5OmniConfig, Qwen2_5OmniThinkerForConditionalGeneration

    with thinker_ids_unflagged():
        config = Qwen2_5OmniConfig.from_pretrained(path).thinker_config
    text, device = config.text_config, group.device
    dtype = hf.resolve_dtype(dtype_name, text, device)
    if group.rank == 0:
        thinker = thinker_skeleton(Qwen2_5OmniThinkerForConditionalGeneration, config, dtype, device)
        tensor_parallel.load_sharded(thinker, thinker.model.language_model, "lm_head", text, group, dtype, path,
                                     THINKER_KEYS)
        return tensor_parallel.sharded_kv(ThinkerLM(thinker, fused=False), text, group.world)
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniThinkerTextModel

    with torch.device("meta"), no_init_weights():
        root = ThinkerText(config, Qwen2_5OmniThinkerTextModel, dtype)
    decoder = root.model.language_model
    tensor_parallel.load_sharded(root, decoder, "lm_head", text, group, dtype, path, THINKER_KEYS)
    lm = hf.HFCausalLM(root, text, decoder=decoder, lm_head=root.lm_head, plain_loop=True)
    return tensor_parallel.sharded_kv(lm, text, group.world)


def thinker_skeleton(cls: type, config: Any, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """A tensor-parallel rank 0's thinker (transformers' `cls`) on the meta device, for its text decoder to be
    sharded, with its audio and vision encoders real on `device` from the start (their tables are buffers the
    checkpoint does not hold)."""
    with torch.device("meta"), no_init_weights():
        thinker = cls._from_config(config, dtype=dtype, attn_implementation=hf.ATTN_IMPL)
    with torch.device(device), no_init_weights():
        for name, sub in (("audio_tower", config.audio_config), ("visual", config.vision_config)):
            setattr(thinker.model, name, type(getattr(thinker.model, name))._from_config(sub, dtype=dtype))
    return thinker


class ThinkerText(nn.Module):
    """An omni thinker's text decoder (`text_model`, transformers' class) and LM head under the thinker's module
    names (so the same checkpoint keys load), for the tensor-parallel ranks that run no media encoders."""

    def __init__(self, config: Any, text_model: type, dtype: torch.dtype):
        super().__init__()
        text = config.text_config
        self.config = config  # the thinker's, as on rank 0 (whether the head is tied)
        self.model = nn.Module()
        self.model.language_model = text_model._from_config(text, dtype=dtype, attn_implementation=hf.ATTN_IMPL)
        self.lm_head = nn.Linear(text.hidden_size, text.vocab_size, bias=False, dtype=dtype)

    def tie_weights(self) -> None:
        """Nothing to do (hf.load_weights asks): tensor_parallel.load_sharded ties a tied head itself."""


def _media_layout(tensors: dict[str, torch.Tensor], names: tuple[str, ...]) -> list[torch.Tensor | None]:
    """The named media-layout tensors (the processor's) on the host, where rotary positions are computed; None
    where absent."""
    return [tensors[name].cpu() if name in tensors else None for name in names]


def fused_forward(decoder: nn.Module):
    """The fused layer loop for these Qwen2-style decoders (M-RoPE is folded into cos/sin by their
    rotary embedding), when their layers have the expected shape."""
    return FusedDecoder(decoder).forward if FusedDecoder.supports(decoder) else None


def _scatter(embeds: torch.Tensor, mask: torch.Tensor, features: torch.Tensor, kind: str) -> torch.Tensor:
    if int(mask.sum()) != features.shape[0]:
        raise RequestError(f"the prompt has {int(mask.sum())} {kind} placeholder tokens but the {kind} encoder "
                           f"produced {features.shape[0]} features", "messages")
    embeds = embeds.clone()
    embeds[mask] = features.to(embeds.dtype)
    return embeds


class TalkerLM(hf.HFCausalLM):
    """The talker: codec-token decoder fed by the thinker's per-token states (see the module doc)."""

    graph_embed_adds = True  # every decode step adds a thinker row: its CUDA graphs take the additions

    def __init__(self, talker: nn.Module, thinker_rows: dict[int, torch.Tensor], media_token_ids: list[int]):
        super().__init__(talker, talker.config, fused_forward(talker.model), decoder=talker.model,
                         lm_head=talker.codec_head, input_proj=talker.thinker_to_talker_proj, plain_loop=True)
        self.talker = talker
        self.text_rows = thinker_rows  # the thinker's embeddings of the voice bos / text eos / text pad ids
        self.media_token_ids = media_token_ids
        cfg = talker.config
        self.codec = {"bos": cfg.tts_codec_start_token_id, "pad": cfg.tts_codec_pad_token_id,
                      "mask": cfg.tts_codec_mask_token_id}
        self._codec_rows: dict[str, torch.Tensor] = {}
        self._text_rows: dict[int, torch.Tensor] = {}

    def _codec(self, name: str) -> torch.Tensor:
        if name not in self._codec_rows:  # a fixed embedding row: looked up once, not per request
            self._codec_rows[name] = self.embed(to_device(torch.tensor([self.codec[name]]), self.device))[0]
        return self._codec_rows[name]

    def _text(self, token_id: int) -> torch.Tensor:
        if token_id not in self._text_rows:  # on the device once, not per request
            self._text_rows[token_id] = to_device(self.text_rows[token_id], self.device).to(self.kv_spec.dtype)
        return self._text_rows[token_id]

    def prepare_input(self, inp: StageInput, first: bool) -> StageInput:
        """First input: the whole prompt; later chunks: more reply rows (and the end of the reply)."""
        t = inp.tensors
        if not first and not inp.final:  # more reply rows: (last, embed) parts the engine sums a step at a time
            # (a row per request per thinker step, so no inference-mode context unless there is work for one)
            last, embed = t.get("thinker_last"), t.get("thinker_embed")
            if last is not None and (last.device != self.device or last.dtype != self.kv_spec.dtype):
                with torch.inference_mode():
                    inp.embed_adds = (last + embed).to(self.device, self.kv_spec.dtype)  # another GPU's rows
            else:
                inp.embed_adds = None if last is None else (last, embed)
            return inp
        return self._prepare_whole(inp, first)

    @torch.inference_mode()
    def _prepare_whole(self, inp: StageInput, first: bool) -> StageInput:
        """The first input (the talker's prompt from the thinker's) or the last (the reply's end)."""
        t = inp.tensors
        rows = (t["thinker_last"] + t["thinker_embed"]).to(self.device, self.kv_spec.dtype) if "thinker_last" in t \
            else None
        if first:
            prompt = t["prompt_ids"].tolist()
            n = len(prompt)
            media = torch.isin(t["prompt_ids"], torch.tensor(self.media_token_ids))
            embed = t["thinker_embed"][:n].masked_fill(to_device(media, t["thinker_embed"].device)[:, None], 0)
            prompt_rows = (t["thinker_last"][:n] + embed).to(self.device, self.kv_spec.dtype)
            bos_row = self._text(int(t["voice_bos"])) + self._codec("pad")
            # a one-token reply has no states for its token: the talker hears the reply end at once
            reply0 = rows[n] if len(rows) > n else self._text(int(t["text_eos"]))
            first_reply = reply0 + self._codec("bos")
            inp.embeds = torch.cat([prompt_rows, bos_row[None], first_reply[None]])
            inp.token_ids = [self.codec["mask"]] * n + [self.codec["pad"], self.codec["bos"]]
            text_ids = torch.tensor([prompt + [int(t["voice_bos"]), int(t["first_token"])]])  # on the host
            positions, deltas = self.talker.get_rope_index(
                text_ids, *_media_layout(t, ("image_grid_thw", "video_grid_thw")),
                torch.ones_like(text_ids), bool(t.get("use_audio_in_video", torch.tensor(False)).item()),
                *_media_layout(t, ("audio_lengths", "video_second_per_grid")),
            )
            inp.rope_positions, inp.rope_delta = positions[:, 0], int(deltas.view(-1)[0])
            rows = rows[n + 1 :]
        adds = [rows] if rows is not None and len(rows) else []
        if inp.final:  # the reply is over: its end marker, then padding for as long as the talker speaks
            adds.append(self._text(int(t["text_eos"]))[None])
            inp.embed_add_default = self._text(int(t["text_pad"]))
        if len(adds) == 1:
            inp.embed_adds = adds[0]
        elif adds:
            inp.embed_adds = torch.cat(adds)
        elif first:  # none yet, but this request takes added rows
            inp.embed_adds = torch.zeros(0, self.talker.config.embedding_size, device=self.device)
        return inp


class Token2Wav:
    """Codes -> 24 kHz waveform, seeded per request; the DiT in float32 unless asked otherwise.

    With `window` codes > 0, audio is decoded while codes still arrive (the first chunk may be smaller:
    `first_window`, by default FIRST_WINDOW or `window` if smaller; later windows may double from `window` up to
    `max_window`: fewer, longer windows cost less context per code). Each window is solved with `right` codes
    of look-ahead after it (by default the blocks the DiT's look-ahead layers reach). Before it, by default
    (`kept_context`), the DiT's look-back layers read the keys and values the previous window's own solve
    computed for its last block (DiTSolver: nothing solved twice on the left, and the same as one solve of the
    whole in a DiT without look-ahead); otherwise (`kept_context=False`, `left` set, or windows that are not
    whole DiT blocks) each window solves `left` codes of context again, by default the blocks the look-back
    layers reach. The vocoder gets `vocoder_context` mel frames on each side (the left ones kept from the
    previous window). Every window draws its starting noise from the same per-request noise the whole
    utterance would use; tests bound the streamed audio's distance from a one-shot decode. `window == 0`: one
    shot.

    Same-length windows of different requests share one flow-matching solve and one vocoder pass. On CUDA
    both are captured as graphs at start-up for the first- and middle-window shapes (batches of 1, 2, 4, ...
    up to `max_batch`, see BatchGraphs); a shorter window (a request's last) is solved padded to the next
    captured length (the solve never lets real frames see padding), and its vocoder pass takes more of the
    request's earlier mel on its left, up to a captured length (`_widened`; eager only where there is too little,
    in an utterance shorter than its first window; `widen_vocoder_spans=False`: eager at the span's own length).
    `tf32`: the DiT's float32 matmuls on TensorFloat-32 tensor cores (faster, a little less exact).
    `cublas_sm_carveout`: SMs the solve's cuBLAS matmuls leave to the other stages (`matmul_sm_carveout`) in
    batches of up to `carveout_max_batch` windows (None: every batch): latency where few requests speak, with
    the larger batches of a busy server left at full speed. `overlap_vocoder_max_batch` > 0 (CUDA): the vocoder
    runs on a stream of its own, and after a batch of up to that many windows the next solve starts beside it
    (see `launch`; None: `default_vocoder_overlap`). `vocoder_dtype` "bfloat16" (CUDA): the vocoder's
    convolutions in bfloat16 on tensor cores; its activations still compute in float32.
    """

    HOP = 240  # waveform samples per mel frame
    FIRST_WINDOW = 24  # codes (~0.5 s of audio) in the first chunk unless set: audio starts early

    def __init__(self, model: nn.Module, voices: dict[str, dict[str, torch.Tensor]], device: torch.device,
                 window: int = 0, first_window: int | None = None, left: int | None = None,
                 right: int | None = None, max_window: int | None = None, vocoder_context: int = 16,
                 num_steps: int = 10, guidance_scale: float = 0.5, sway_coefficient: float = -1.0,
                 use_graphs: bool = True, max_batch: int = 16, tf32: bool = False, kept_context: bool = True,
                 cublas_sm_carveout: int = 0, carveout_max_batch: int | None = None,
                 overlap_vocoder_max_batch: int | None = None, vocoder_dtype: str = "float32",
                 widen_vocoder_spans: bool = True):
        self.model, self.voices, self.device = model, voices, device
        self.dit = model.code2wav_dit_model
        self.dit_dtype = next(self.dit.parameters()).dtype  # the vocoder runs in vocoder_dtype whatever this is
        if device.type == "cuda" and self.dit_dtype == torch.float32 and not tf32:
            how = "exact 3xTF32 products" if exact_gemm.ENABLED else "strict float32 on CUDA cores"
            logger.info("token2wav: the DiT runs in float32 (the default, as transformers runs it), its matmuls as "
                        "%s: several times slower than bfloat16 under load, with playback stalls. For serving set "
                        "stages.token2wav.dtype: bfloat16 (or advanced.tf32: true); see the README", how)
        # The DiT attends within blocks of `block` codes, one block further back per look-backward layer
        # and one further ahead per look-ahead layer: the default context is those blocks.
        dit = self.dit.config
        self.block = max(1, dit.block_size // dit.repeats)
        self.left = self.block * len(dit.look_backward_layers) if left is None else left
        self.right = self.block * len(dit.look_ahead_layers) if right is None else right
        self.window, self.first_window = window, first_window or min(window, self.FIRST_WINDOW)
        self.max_window = max(window, max_window or window)
        self.vocoder_context = vocoder_context
        self.solver = DiTSolver(self.dit, num_steps, guidance_scale, sway_coefficient)
        whole_blocks = all(size % self.block == 0 for size in (self.first_window, self.window, self.max_window))
        self.kept_context = (kept_context and window > 0 and left is None and whole_blocks
                             and bool(self.solver.back_layers) and self.solver.kept_frames % dit.repeats == 0)
        if self.kept_context:
            self.left = 0
            self._nothing_kept = torch.zeros(1, *self.solver.kept_shape(), device=device, dtype=self.dit_dtype)
        with torch.inference_mode():  # per voice: its `cond` and its speaker-encoder features
            self.speakers = {name: (v["cond"].to(device, self.dit_dtype),
                                    self.solver.speaker_features(v["ref_mel"].to(device, self.dit_dtype)))
                             for name, v in voices.items()}
        if device.type == "cuda":
            fuse_activations(model.code2wav_bigvgan_model)  # two Triton kernels per anti-aliased activation
        if vocoder_dtype not in VOCODER_DTYPES:
            raise ValueError(f"vocoder_dtype must be {' or '.join(VOCODER_DTYPES)}, got {vocoder_dtype!r}")
        if vocoder_dtype != "float32" and device.type != "cuda":
            raise ValueError(f"vocoder_dtype {vocoder_dtype} needs CUDA (its activations are fused kernels there)")
        self.vocoder_dtype = getattr(torch, vocoder_dtype)
        cast_convolutions(model.code2wav_bigvgan_model, self.vocoder_dtype)  # float32 too: this setting holds
        self.use_graphs = use_graphs and device.type == "cuda" and window > 0
        # Graphs replayed one at a time share a memory pool; the vocoder's overlap the next solve: a pool apart.
        if overlap_vocoder_max_batch is None:
            overlap_vocoder_max_batch = default_vocoder_overlap(self.dit_dtype, tf32)
        self.overlap_vocoder_max_batch = overlap_vocoder_max_batch if device.type == "cuda" else 0
        self._side: tuple[torch.cuda.Stream, torch.cuda.Stream] | None = None  # (the stage's stream, the vocoder's)
        pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        vocoder_pool = torch.cuda.graph_pool_handle() if self.use_graphs and self.overlap_vocoder_max_batch else pool
        self.cublas_sm_carveout = cublas_sm_carveout if device.type == "cuda" else 0
        self.carveout_max_batch = carveout_max_batch

        @contextlib.contextmanager
        def solve_context(batch: int):
            with matmul_sm_carveout(self.carveout_for(batch)), (tf32_matmuls() if tf32 else contextlib.nullcontext()):
                yield

        self.solve = BatchGraphs(self.solver.solve, max_batch, key_input=1, pool=pool, context=solve_context)
        # no carveout for the vocoder: its convolutions are cuDNN's, which the carveout does not reach
        self.vocode = BatchGraphs(self._vocode, max_batch, pool=vocoder_pool)
        self.solve_lengths: list[int] = []  # codes per window the solve has graphs for (warm_up)
        self.vocoder_lengths: list[int] = []  # mel frames the vocoder has graphs for (warm_up)
        self.widen_vocoder_spans = widen_vocoder_spans
        self._window_at: dict[int, int] = {}  # _next_window's answers

    def carveout_for(self, batch: int) -> int:
        """SMs a solve of `batch` windows leaves free of its cuBLAS matmuls."""
        if self.carveout_max_batch is not None and batch > self.carveout_max_batch:
            return 0
        return self.cublas_sm_carveout

    def warm_up(self) -> None:
        """Capture the solve and vocoder graphs (no-op without graphs): seconds at start-up, none while serving."""
        if not (self.use_graphs and self.speakers):  # no voices (no spk_dict.pt): nothing will be spoken
            return
        started = time.perf_counter()
        speaker, features = next(iter(self.speakers.values()))
        shapes = self.window_shapes()
        with torch.inference_mode():
            for codes in {codes for codes, _ in shapes}:
                frames = codes * self.dit.repeats
                noise = torch.zeros(1, frames, self.dit.mel_dim, device=self.device, dtype=self.dit_dtype)
                kept = (self._nothing_kept, torch.zeros(1, device=self.device, dtype=torch.long),
                        torch.full((1,), frames, device=self.device)) if self.kept_context else ()
                if self.solve.capture(noise, torch.zeros(1, codes, dtype=torch.long, device=self.device), speaker,
                                      features, torch.full((1,), frames, device=self.device), *kept):
                    self.solve_lengths = sorted([*self.solve_lengths, codes])
            for frames in {frames for _, frames in shapes}:
                if self.vocode.capture(torch.zeros(1, self.dit.mel_dim, frames, device=self.device)):
                    self.vocoder_lengths = sorted([*self.vocoder_lengths, frames])
        logger.info("token2wav: captured %d solve and %d vocoder graphs in %.1fs", len(self.solve.graphs),
                    len(self.vocode.graphs), time.perf_counter() - started)

    def window_shapes(self) -> set[tuple[int, int]]:
        """(codes solved, mel frames vocoded) of a request's first window and of its later full ones. Windows
        start on DiT blocks: with a left context that is not a whole number of blocks their lengths cycle
        (at most `block` windows long); with the defaults every later window has one shape."""
        starts, sizes = [0], self._window_sizes()
        for _ in range(self.block + (self.max_window // self.window).bit_length()):  # growth, then a cycle
            starts.append(starts[-1] + next(sizes))
        probe = StageInput("shapes", [0] * (starts[-1] + self.max_window + self.right), params={}, final=False)
        shapes = set()
        for done in starts:
            probe.params["emitted"] = done
            plan = self._plan(probe)
            lo, hi = self._vocoder_span(done, plan)
            shapes.add((plan[2] - plan[0], hi - lo))
        return shapes

    def _window_sizes(self) -> Iterator[int]:
        """Codes per window, in order: the first, then `window` doubling up to `max_window`."""
        yield self.first_window
        size = self.window
        while True:
            yield size
            size = min(2 * size, self.max_window)

    def _next_window(self, done: int) -> int:
        """The size of the window that starts after `done` codes (always a window boundary). Asked for every
        waiting request whenever codes arrive, so remembered."""
        if done not in self._window_at:
            start = 0
            for size in self._window_sizes():
                if start >= done:
                    self._window_at[done] = size
                    break
                start += size
        return self._window_at[done]

    def ready(self, inp: StageInput) -> bool:
        done = inp.params.get("emitted", 0)
        return inp.final or (self.window > 0 and len(inp.token_ids) - done >= self._next_window(done) + self.right)

    def generate(self, inputs: list[StageInput]) -> list[tuple[dict[str, torch.Tensor], bool]]:
        """`launch`, waited for: each input's (output tensors, finished)."""
        flight = self.launch(inputs)
        return list(zip(flight.collect(), flight.finished, strict=True))

    @torch.inference_mode()
    def launch(self, inputs: list[StageInput]) -> InFlight:
        """One flow-matching solve per group of same-length windows and one vocoder pass per group of
        same-length mel spans: both batch, and at small batches cost about as much as one. Returns once the
        work is queued on the device (the GenerationEngine collects the audio when it has landed). With
        `overlap_vocoder_max_batch` > 0 (CUDA) the vocoder passes and the audio's copy to the host run on a
        stream of their own, and a batch of up to that many windows is `busy` only until its solves are done:
        the engine can launch a request's next window, whose solve needs only this solve's kept context, while
        the vocoder still works on this one, so a request ends sooner. Larger batches stay busy until their
        audio is out, so the next batch gathers the windows that arrive meanwhile (overlapping every batch
        costs a busy server throughput)."""
        plans = {i: plan for i, inp in enumerate(inputs) if (plan := self._plan(inp)) is not None}
        lengths = {i: self._solve_length(end - start) for i, (start, _, end) in plans.items()}
        mels = self._grouped(plans, lambda i: lengths[i], lambda members: self._mels(
            [inputs[i] for i in members], [plans[i] for i in members], lengths[members[0]]))
        r = self.dit.repeats
        spans = {i: self._widened(inputs[i], plan, self._vocoder_span(inputs[i].params.get("emitted", 0), plan))
                 for i, plan in plans.items()}
        vocoder_mels = {i: self._vocoder_mel(inputs[i], plans[i], spans[i], mels[i]) for i in plans}
        samples = {}  # per window: (first sample kept, how many)
        for i, (_, keep_end, _) in plans.items():
            inp, lo = inputs[i], spans[i][0]
            done = inp.params.get("emitted", 0)
            samples[i] = ((done * r - lo) * self.HOP, (keep_end - done) * r * self.HOP)
            inp.params["emitted"] = keep_end
            if self.kept_context and self.vocoder_context:  # the next windows' vocoder context on the left
                kept_mel = vocoder_mels[i][:, :, : keep_end * r - lo]
                inp.params["mel_tail"] = self._mel_history(inp, done * r - lo, kept_mel)
        finished = [inp.final and (i not in plans or inp.params["emitted"] == len(inp.token_ids))
                    for i, inp in enumerate(inputs)]
        # the vocoder's batches (windows with as many mel frames), joined on the solve's stream before the event
        # the vocoder's stream waits for
        batches = [(members, torch.cat([vocoder_mels[i] for i in members]))
                   for members in self._groups(plans, lambda i: spans[i][1] - spans[i][0])]
        solved, side = self._vocoder_stream()
        waves = {}
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            for members, mel in batches:
                if side is not None:
                    mel.record_stream(side)  # made on the solve's stream, read on this one
                waves.update(zip(members, self.vocode(mel), strict=True))
            audio = {i: waves[i][first : first + count] for i, (first, count) in samples.items()}
            copy = HostCopy(list(audio.values()))  # through pinned memory: waiting on it holds up no other stage

        def collect() -> list[dict[str, torch.Tensor]]:
            landed = dict(zip(audio, copy.wait(), strict=True))
            return [{"audio": landed.get(i, torch.zeros(0))} for i in range(len(inputs))]

        beside = solved is not None and len(plans) <= self.overlap_vocoder_max_batch
        return InFlight(finished, solved if beside else copy.done, copy.done, collect)

    def _vocoder_stream(self) -> tuple[torch.cuda.Event | None, torch.cuda.Stream | None]:
        """With `overlap_vocoder_max_batch` on CUDA: an event after the solves on the current stream, and the
        vocoder's stream (the current one's priority), made to wait for it; every batch's vocoder pass runs
        there, never on the solve's stream, as the vocoder graphs of one length share their input buffers and
        memory pool. Otherwise (None, None): the vocoder follows on the current stream."""
        if not self.overlap_vocoder_max_batch:
            return None, None
        current = torch.cuda.current_stream(self.device)
        if self._side is None or self._side[0] != current:
            self._side = current, torch.cuda.Stream(self.device, priority=current.priority)
        solved = torch.cuda.Event()
        solved.record(current)
        self._side[1].wait_event(solved)
        return solved, self._side[1]

    @staticmethod
    def _grouped(items: dict[int, Any], key: Callable[[int], int], run: Callable[[list[int]], Any]
                 ) -> dict[int, torch.Tensor]:
        """run(members) once per group of items with the same key; its rows go back to the members."""
        return {i: row for members in Token2Wav._groups(items, key)
                for i, row in zip(members, run(members), strict=True)}

    @staticmethod
    def _groups(items: dict[int, Any], key: Callable[[int], int]) -> list[list[int]]:
        """The items with the same key, in groups, in first-seen order."""
        groups: dict[int, list[int]] = {}
        for i in items:
            groups.setdefault(key(i), []).append(i)
        return list(groups.values())

    def _noise(self, inp: StageInput, frames: int) -> torch.Tensor:
        """The request's starting noise for its first `frames` mel frames, drawn once, extended as needed."""
        p = inp.params
        if "generator" not in p:
            p["generator"] = torch.Generator().manual_seed(p.get("seed") or 0)
            p["noise"] = torch.zeros(0, self.dit.mel_dim)
        if frames > len(p["noise"]):
            more = torch.randn((frames - len(p["noise"]), self.dit.mel_dim), generator=p["generator"])
            p["noise"] = torch.cat([p["noise"], more])
        return p["noise"][:frames]

    def _plan(self, inp: StageInput) -> tuple[int, int, int] | None:
        """Codes to decode (start, end) and to keep audio for (up to keep_end); None: nothing new."""
        codes, done = inp.token_ids, inp.params.get("emitted", 0)
        if not self.window:
            return (0, len(codes), len(codes)) if codes else None  # the whole utterance at once
        # Windows fall where they would if codes came one by one, however many have arrived: the audio
        # does not depend on timing (a request left with several windows at its end gets them one per step).
        start = done if self.kept_context else max(0, done - self.left) // self.block * self.block
        keep_end = min(len(codes), done + self._next_window(done))
        return (start, keep_end, min(len(codes), keep_end + self.right)) if keep_end > done else None

    def _vocoder_span(self, done: int, plan: tuple[int, int, int]) -> tuple[int, int]:
        """Mel frames the vocoder gets for a window: the new ones and up to `vocoder_context` either side (on
        the left from the previous window's kept mel when the solve starts at the window)."""
        (start, keep_end, end), r = plan, self.dit.repeats
        first = 0 if self.kept_context else start * r
        return max(done * r - self.vocoder_context, first), min(keep_end * r + self.vocoder_context, end * r)

    def _widened(self, inp: StageInput, plan: tuple[int, int, int], span: tuple[int, int]) -> tuple[int, int]:
        """A vocoder span of a length with no graph (a request's last window, mostly) moved left, onto mel of the
        request's earlier windows, to the shortest length that has one: its new samples then come with more left
        context than `vocoder_context`, where an eager pass at a length never seen before costs cuDNN a
        long host-side plan, once per length, which stalls a busy server where every request has a new length.
        As is where too little earlier mel is kept
        (an utterance shorter than the first window) or no graph is longer."""
        lo, hi = span
        if not self.widen_vocoder_spans or hi - lo in self.vocoder_lengths:
            return span
        kept = inp.params["mel_tail"].shape[-1] if "mel_tail" in inp.params else 0
        earliest = plan[0] * self.dit.repeats - kept  # the first frame with mel at hand
        longer = next((n for n in self.vocoder_lengths if n > hi - lo), None)
        return (hi - longer, hi) if longer is not None and hi - longer >= earliest else span

    def _mel_history(self, inp: StageInput, before: int, mel: torch.Tensor) -> torch.Tensor:
        """The request's last mel frames, up to the longest vocoder graph's length (what `_widened` may reach
        back into), ending where `mel` (this window's vocoder input up to its last kept frame, whose first
        `before` frames came from the history itself) ends."""
        longest = max(self.vocoder_lengths, default=0) if self.widen_vocoder_spans else 0
        keep = max(longest, self.vocoder_context)
        if "mel_tail" in inp.params and mel.shape[-1] < keep:
            earlier = inp.params["mel_tail"]
            mel = torch.cat([earlier[:, :, : earlier.shape[-1] - before], mel], dim=-1)
        return mel[:, :, max(0, mel.shape[-1] - keep) :]

    def _vocoder_mel(self, inp: StageInput, plan: tuple[int, int, int], span: tuple[int, int], mel: torch.Tensor
                     ) -> torch.Tensor:
        """The window's mel frames `span` (absolute), those before its solve from the previous window's."""
        (lo, hi), solved_from = span, plan[0] * self.dit.repeats
        part = mel[:, :, max(lo, solved_from) - solved_from : hi - solved_from]
        if lo >= solved_from:
            return part
        return torch.cat([inp.params["mel_tail"][:, :, lo - solved_from :], part], dim=-1)

    def _solve_length(self, codes: int) -> int:
        """The window length a solve of `codes` codes runs at: the shortest with a graph that fits, else its own."""
        return next((n for n in self.solve_lengths if n >= codes), codes)

    def _mels(self, inputs: list[StageInput], plans: list[tuple[int, int, int]], length: int) -> list[torch.Tensor]:
        """Mel frames of each window, solved together at `length` codes (shorter windows padded)."""
        r, dtype = self.dit.repeats, self.dit_dtype
        noise, codes, frames = [], [], []
        for inp, (start, _, end) in zip(inputs, plans, strict=True):
            pad = length - (end - start)
            noise.append(F.pad(self._noise(inp, end * r)[start * r :], (0, 0, 0, pad * r)))
            codes.append(inp.token_ids[start:end] + [0] * pad)
            frames.append((end - start) * r)
        speakers = [self.speakers[inp.params["voice"]] for inp in inputs]
        speaker = torch.cat([s for s, _ in speakers])
        features = torch.cat([f for _, f in speakers])
        frame_counts = torch.tensor(frames, device=self.device)
        if not self.kept_context:
            mels = self.solve(torch.stack(noise).to(self.device, dtype), torch.tensor(codes, device=self.device),
                              speaker, features, frame_counts)
            return [mel[None, :, :n] for mel, n in zip(mels.float(), frames, strict=True)]
        kept = torch.cat([inp.params.get("kept", self._nothing_kept) for inp in inputs])
        has_kept = torch.tensor([int("kept" in inp.params) for inp in inputs], device=self.device)
        keep = torch.tensor([(keep_end - start) * r for start, keep_end, _ in plans], device=self.device)
        mels, kept_on = self.solve(torch.stack(noise).to(self.device, dtype), torch.tensor(codes, device=self.device),
                                   speaker, features, frame_counts, kept, has_kept, keep)
        for n, (inp, (_, keep_end, _)) in enumerate(zip(inputs, plans, strict=True)):
            if keep_end < len(inp.token_ids) or not inp.final:  # another window follows: it continues this one
                inp.params["kept"] = kept_on[n : n + 1].clone()  # its own (a view would hold the whole batch's)
            else:
                inp.params.pop("kept", None)
        return [mel[None, :, :n] for mel, n in zip(mels.float(), frames, strict=True)]

    def _vocode(self, mel: torch.Tensor) -> torch.Tensor:
        """BigVGAN over [B, mel, frames] -> [B, samples]: transformers' forward without its final squeeze and
        copy to the host (so batches and graph capture work), the dB scaling with Python constants."""
        v = self.model.code2wav_bigvgan_model
        db = 20 * torch.log10(torch.clamp(torch.exp(mel), min=_MIN_AMPLITUDE)) - 20
        x = v.conv_pre(torch.clamp(2 * ((db + 115) / 115) - 1, -1, 1).to(self.vocoder_dtype))
        for i in range(v.num_upsample_layers):
            x = v.ups[i][0](x)
            blocks = v.resblocks[i * v.num_residual_blocks : (i + 1) * v.num_residual_blocks]
            x = sum(block(x) for block in blocks) / v.num_residual_blocks
        return torch.clamp(v.conv_post(v.activation_post(x)).float(), min=-1.0, max=1.0)[:, 0]


_MIN_AMPLITUDE = math.exp(-115 / 20.0 * math.log(10))  # -115 dB, the vocoder's floor


def default_vocoder_overlap(dit_dtype: torch.dtype, tf32: bool) -> int:
    """`overlap_vocoder_max_batch` when not set: 2, but 0 with the DiT in strict float32. Beside a short
    solve (bfloat16 or TF32) a window's vocoder finishes early and a request ends sooner; beside a strict
    float32 solve, several times longer, the overlapped vocoder starves and a request's first audio comes
    later than with the vocoder after the solve."""
    return 0 if dit_dtype == torch.float32 and not tf32 else 2


@contextlib.contextmanager
def tf32_matmuls():
    """float32 matmuls on TensorFloat-32 tensor cores inside the block (a process-wide switch, restored after)."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


@contextlib.contextmanager
def matmul_sm_carveout(sms: int):
    """cuBLAS matmuls launched (or captured) inside the block use all SMs but `sms` (torch's experimental
    carveout, a process-wide setting restored after), so the latency-bound kernels of stages sharing the GPU
    find SMs free while a long solve runs. 0: no change."""
    if not sms or not hasattr(torch._C, "_set_sm_carveout_experimental"):
        yield
        return
    before = torch._C._get_sm_carveout_experimental()
    torch._C._set_sm_carveout_experimental(sms)
    try:
        yield
    finally:
        torch._C._set_sm_carveout_experimental(before)


def load_token2wav(path: Path, config: Any, device: torch.device, dit_dtype: torch.dtype = torch.float32
                   ) -> nn.Module:
    """token2wav in float32, its DiT optionally in a lower precision (the vocoder loads in float32; Token2Wav's
    `vocoder_dtype` may cast its convolutions)."""
    from transformers import Qwen2_5OmniToken2WavModel

    with torch.device(device), no_init_weights():
        model = Qwen2_5OmniToken2WavModel._from_config(config, dtype=torch.float32)
    hf.load_weights(model, path, {"token2wav.": ""})
    model.code2wav_dit_model.to(dit_dtype)
    return model.eval().requires_grad_(False)


def load_voices(path: Path) -> dict[str, dict[str, torch.Tensor]]:
    """spk_dict.pt: tensors and ints only (weights_only refuses anything that would run code)."""
    file = path / "spk_dict.pt"
    return torch.load(file, weights_only=True, map_location="cpu") if file.is_file() else {}
