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

import functools
import importlib.util
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from transformers.initialization import no_init_weights

from omnistage.engine.types import StageInput
from omnistage.errors import RequestError
from omnistage.families import hf
from omnistage.families.causal_lm.fused_decoder import FusedDecoder

logger = logging.getLogger(__name__)

SAMPLE_RATE = 24000


def load_part(cls: Any, path: Path, config: Any, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """One top-level part (thinker / talker) in its dtype; transformers strips the part's prefix and
    applies the checkpoint's key conversions. With accelerate installed it loads straight to the GPU."""
    from transformers.utils import logging as hf_logging

    direct = device.type == "cuda" and importlib.util.find_spec("accelerate") is not None
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the other parts' weights are expected to be left unread
    try:
        model = cls.from_pretrained(path, config=config, dtype=dtype, attn_implementation=hf.ATTN_IMPL,
                                    **({"device_map": device} if direct else {}))
    finally:
        hf_logging.set_verbosity(verbosity)
    return model.to(device).eval()


def checkpoint_rows(path: Path, key: str, rows: list[int]) -> torch.Tensor:
    """A few rows of one checkpoint tensor, read without loading the rest of it."""
    for file in hf.safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            if key in f.keys():
                table = f.get_slice(key)
                return torch.stack([table[r : r + 1][0] for r in rows])
    raise KeyError(f"{key} not in the checkpoint at {path}")


class ThinkerLM(hf.HFCausalLM):
    """The thinker's text decoder, with its media encoders run when a request arrives."""

    def __init__(self, thinker: nn.Module):
        decoder = thinker.model.language_model
        super().__init__(thinker, thinker.config, fused_forward(decoder), decoder=decoder, lm_head=thinker.lm_head,
                         plain_loop=True)
        for encoder in (thinker.model.audio_tower, thinker.model.visual):  # whole media items, not the paged cache
            encoder.config._attn_implementation = "sdpa"
        self.thinker = thinker
        self.num_layers = thinker.config.text_config.num_hidden_layers

    @torch.inference_mode()
    def prepare_input(self, inp: StageInput, first: bool) -> StageInput:
        if not first:
            return inp
        t, device = inp.tensors, self.device
        ids = torch.tensor([inp.token_ids], device=device)
        embeds = self.embed(ids[0])
        audio_lengths = None
        if "input_features" in t:
            mask = t["feature_attention_mask"].to(device)
            audio_lengths = mask.sum(-1)
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
            ids, t.get("image_grid_thw"), t.get("video_grid_thw"), torch.ones_like(ids),
            bool(t.get("use_audio_in_video", torch.tensor(False)).item()), audio_lengths,
            t.get("video_second_per_grid"),
        )
        inp.embeds = embeds
        inp.rope_positions = positions[:, 0]
        inp.rope_delta = int(deltas.view(-1)[0])
        return inp


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

    def _codec(self, name: str) -> torch.Tensor:
        return self.embed(torch.tensor([self.codec[name]], device=self.device))[0]

    def _text(self, token_id: int) -> torch.Tensor:
        return self.text_rows[token_id].to(self.device, self.kv_spec.dtype)

    @torch.inference_mode()
    def prepare_input(self, inp: StageInput, first: bool) -> StageInput:
        """First input: the whole prompt; later chunks: more reply rows (and the end of the reply)."""
        t = inp.tensors
        rows = (t["thinker_last"] + t["thinker_embed"]).to(self.device, self.kv_spec.dtype) if "thinker_last" in t \
            else None
        if first:
            prompt = t["prompt_ids"].tolist()
            n = len(prompt)
            embed = t["thinker_embed"][:n].clone()
            embed[torch.isin(t["prompt_ids"], torch.tensor(self.media_token_ids))] = 0
            prompt_rows = (t["thinker_last"][:n] + embed).to(self.device, self.kv_spec.dtype)
            bos_row = self._text(int(t["voice_bos"])) + self._codec("pad")
            # a one-token reply has no states for its token: the talker hears the reply end at once
            reply0 = rows[n] if len(rows) > n else self._text(int(t["text_eos"]))
            first_reply = reply0 + self._codec("bos")
            inp.embeds = torch.cat([prompt_rows, bos_row[None], first_reply[None]])
            inp.token_ids = [self.codec["mask"]] * n + [self.codec["pad"], self.codec["bos"]]
            text_ids = torch.tensor([prompt + [int(t["voice_bos"]), int(t["first_token"])]], device=self.device)
            positions, deltas = self.talker.get_rope_index(
                text_ids, t.get("image_grid_thw"), t.get("video_grid_thw"), torch.ones_like(text_ids),
                bool(t.get("use_audio_in_video", torch.tensor(False)).item()), t.get("audio_lengths"),
                t.get("video_second_per_grid"),
            )
            inp.rope_positions, inp.rope_delta = positions[:, 0], int(deltas.view(-1)[0])
            rows = rows[n + 1 :]
        adds = [rows] if rows is not None and len(rows) else []
        if inp.final:  # the reply is over: its end marker, then padding for as long as the talker speaks
            adds.append(self._text(int(t["text_eos"]))[None])
            inp.embed_add_default = self._text(int(t["text_pad"]))
        width = self.talker.config.embedding_size
        inp.embed_adds = torch.cat(adds) if adds else torch.zeros(0, width, device=self.device)
        return inp


class Token2Wav:
    """Codes -> 24 kHz waveform, in fp32, seeded per request.

    With `window` codes > 0, audio is decoded while codes still arrive (the first chunk may be smaller:
    `first_window`): each window is decoded with `left` codes of context before it and `right` after it,
    by default the blocks the DiT's block attention reaches; the vocoder gets `vocoder_context` mel frames
    on each side. Every window draws its starting noise from the same per-request noise the whole utterance
    would use; tests bound the streamed audio's distance from a one-shot decode. `window == 0`: one shot.

    On CUDA the whole ODE solve (num_steps x 4 DiT passes) of each input shape is captured once as a
    CUDA graph and replayed: for a few windows, launching its thousands of small kernels one by one costs
    more than running them. Larger batches keep the GPU busy anyway and run eagerly, so capturing (two
    solves' time) never stalls a busy server; `warm_up` captures the single-request window shapes before
    the first request. At most `max_graphs` exist.
    """

    max_graphs = 32
    graph_max_batch = 4
    HOP = 240  # waveform samples per mel frame

    def __init__(self, model: nn.Module, voices: dict[str, dict[str, torch.Tensor]], device: torch.device,
                 window: int = 0, first_window: int | None = None, left: int | None = None,
                 right: int | None = None, vocoder_context: int = 16, num_steps: int = 10,
                 guidance_scale: float = 0.5, sway_coefficient: float = -1.0, use_graphs: bool = True):
        self.model, self.voices, self.device = model, voices, device
        self.dit = model.code2wav_dit_model
        self.dit_dtype = next(self.dit.parameters()).dtype  # the vocoder stays in float32 whatever this is
        # The DiT attends within blocks of `block` codes, one block further back per look-backward layer
        # and one further ahead per look-ahead layer: the default context is those blocks.
        dit = self.dit.config
        self.block = max(1, dit.block_size // dit.repeats)
        self.left = self.block * len(dit.look_backward_layers) if left is None else left
        self.right = self.block * len(dit.look_ahead_layers) if right is None else right
        self.window, self.first_window = window, first_window or window
        self.vocoder_context = vocoder_context
        self.num_steps, self.guidance_scale, self.sway = num_steps, guidance_scale, sway_coefficient
        self.use_graphs = use_graphs and device.type == "cuda"
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, list[torch.Tensor], torch.Tensor] | None] = {}

    def warm_up(self) -> None:
        """Capture the graphs of one request's first and steady-state windows, for each voice's reference
        length (no-op without graphs)."""
        if not (self.use_graphs and self.window):
            return
        zeros = functools.partial(torch.zeros, device=self.device, dtype=self.dit_dtype)
        voice_shapes = {(tuple(v["cond"].shape), tuple(v["ref_mel"].shape)) for v in self.voices.values()}
        for codes in {self.first_window + self.right, self.left + self.window + self.right}:
            for cond, ref_mel in voice_shapes:
                self._solve(zeros(1, codes * self.dit.repeats, self.dit.mel_dim), zeros(*cond), zeros(*ref_mel),
                            torch.zeros(1, codes, dtype=torch.long, device=self.device))

    def _next_window(self, done: int) -> int:
        return self.first_window if done == 0 else self.window

    def ready(self, inp: StageInput) -> bool:
        done = inp.params.get("emitted", 0)
        return inp.final or (self.window > 0 and len(inp.token_ids) - done >= self._next_window(done) + self.right)

    @torch.inference_mode()
    def generate(self, inputs: list[StageInput]) -> list[tuple[dict[str, torch.Tensor], bool]]:
        """One flow-matching run per group of same-length windows (and same voice shape): the DiT is
        where the time goes, and it batches; each request's vocoder pass stays its own."""
        plans = [self._plan(inp) for inp in inputs]
        groups: dict[tuple, list[int]] = {}
        for i, (inp, plan) in enumerate(zip(inputs, plans, strict=True)):
            if plan is not None:
                ref_shape = tuple(self.voices[inp.params["voice"]]["ref_mel"].shape)
                groups.setdefault((plan[2] - plan[0], ref_shape), []).append(i)
        mels: dict[int, torch.Tensor] = {}
        for members in groups.values():
            for i, mel in zip(members, self._mels([inputs[i] for i in members], [plans[i] for i in members]),
                              strict=True):
                mels[i] = mel
        return [self._audio(inp, plan, mels.get(i)) for i, (inp, plan) in enumerate(zip(inputs, plans, strict=True))]

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
        start = max(0, done - self.left) // self.block * self.block
        keep_end = min(len(codes), done + self._next_window(done))
        return (start, keep_end, min(len(codes), keep_end + self.right)) if keep_end > done else None

    def _mels(self, inputs: list[StageInput], plans: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        r = self.dit.repeats
        dtype = self.dit_dtype
        noise = torch.stack([self._noise(inp, end * r)[start * r :] for inp, (start, _, end) in zip(
            inputs, plans, strict=True)]).to(self.device, dtype)
        voices = [self.voices[inp.params["voice"]] for inp in inputs]
        cond = torch.cat([v["cond"] for v in voices]).to(self.device, dtype)
        ref_mel = torch.cat([v["ref_mel"] for v in voices]).to(self.device, dtype)
        codes = torch.tensor([inp.token_ids[start:end] for inp, (start, _, end) in zip(inputs, plans, strict=True)],
                             device=self.device)
        return list(self._solve(noise, cond, ref_mel, codes).float().split(1))

    def _solve(self, *inputs: torch.Tensor) -> torch.Tensor:
        """Flow matching for one batch of same-shape windows: a graph replay when one fits."""
        solve = functools.partial(_flow_matching, self.dit, num_steps=self.num_steps,
                                  guidance_scale=self.guidance_scale, sway=self.sway)
        if not self.use_graphs or inputs[0].shape[0] > self.graph_max_batch:
            return solve(*inputs)
        key = tuple(tuple(x.shape) for x in inputs)
        if key not in self.graphs:
            self.graphs[key] = self._capture(solve, inputs) if len(self.graphs) < self.max_graphs else None
        if self.graphs[key] is None:
            return solve(*inputs)
        graph, static_inputs, static_out = self.graphs[key]
        for static, x in zip(static_inputs, inputs, strict=True):
            static.copy_(x)
        graph.replay()
        return static_out.clone()  # the next replay of this graph overwrites it

    def _capture(self, solve: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...]
                 ) -> tuple[torch.cuda.CUDAGraph, list[torch.Tensor], torch.Tensor] | None:
        static_inputs = [x.clone() for x in inputs]
        try:
            solve(*static_inputs)  # warm-up outside the capture (lazy init, allocator)
            graph = torch.cuda.CUDAGraph()
            # thread_local: stages in other threads keep running (and syncing) while this one captures
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                static_out = solve(*static_inputs)
        except RuntimeError:  # some op syncs with the host: this shape runs eagerly
            logger.warning("token2wav: could not capture the flow-matching solve as a CUDA graph", exc_info=True)
            return None
        return graph, static_inputs, static_out

    def _audio(self, inp: StageInput, plan: tuple[int, int, int] | None, mel: torch.Tensor | None
               ) -> tuple[dict[str, torch.Tensor], bool]:
        if plan is None:
            return {"audio": torch.zeros(0)}, inp.final
        (start, keep_end, end), done, r = plan, inp.params.get("emitted", 0), self.dit.repeats
        lo = max(done * r - self.vocoder_context, start * r)
        hi = min(keep_end * r + self.vocoder_context, end * r)
        wave = self.model.code2wav_bigvgan_model(mel[:, :, lo - start * r : hi - start * r]).reshape(-1).float()
        first = (done * r - lo) * self.HOP
        inp.params["emitted"] = keep_end
        return {"audio": wave[first : first + (keep_end - done) * r * self.HOP].cpu()}, \
            inp.final and keep_end == len(inp.token_ids)


def _flow_matching(dit, noise, cond, ref_mel, codes, num_steps, guidance_scale, sway) -> torch.Tensor:
    """The DiT's ODE from `noise` (what transformers' DiT `sample` does, with the noise passed in so
    each request is seeded on its own). RK4 over the time grid with the same arithmetic as transformers'
    solver, minus its host-side time comparisons, so it can be captured in a CUDA graph."""
    cond = cond.unsqueeze(1).repeat(1, noise.shape[1], 1)

    def velocity(time_step: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        out = dit(hidden_states=state, quantized_code=codes, speaker_embedding=cond, condition_vector=ref_mel,
                  time_step=time_step, apply_cfg=True)
        guided, null = torch.chunk(out, 2, dim=0)
        return guided + (guided - null) * guidance_scale

    times = torch.linspace(0, 1, num_steps, device=noise.device, dtype=cond.dtype)
    if sway is not None:
        times += sway * (torch.cos(torch.pi / 2 * times) - 1 + times)
    state = noise
    for start, end in zip(times[:-1], times[1:], strict=True):
        dt = end - start
        k1 = velocity(start, state)
        k2 = velocity(start + dt * (1 / 3), state + dt * k1 * (1 / 3))
        k3 = velocity(start + dt * (2 / 3), state + dt * (k2 - k1 * (1 / 3)))
        k4 = velocity(end, state + dt * (k1 - k2 + k3))
        state = state + (k1 + 3 * (k2 + k3) + k4) * dt / 8
    return state.permute(0, 2, 1)


def load_token2wav(path: Path, config: Any, device: torch.device, dit_dtype: torch.dtype = torch.float32
                   ) -> nn.Module:
    """token2wav in float32, its DiT optionally in a lower precision (the vocoder stays float32)."""
    from transformers import Qwen2_5OmniToken2WavModel

    with torch.device(device), no_init_weights():
        model = Qwen2_5OmniToken2WavModel._from_config(config, dtype=torch.float32)
    hf.load_weights(model, path, {"token2wav.": ""})
    model.code2wav_dit_model.to(dit_dtype)
    return model.eval()


def load_voices(path: Path) -> dict[str, dict[str, torch.Tensor]]:
    """spk_dict.pt: tensors and ints only (weights_only refuses anything that would run code)."""
    file = path / "spk_dict.pt"
    return torch.load(file, weights_only=True, map_location="cpu") if file.is_file() else {}
