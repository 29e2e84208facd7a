"""Qwen3-Omni's three models as omnistage stage models: thinker and talker for the AR engine, code2wav for the
generation engine. Each stage loads only its own part of the checkpoint.

What transformers' `Qwen3OmniMoeForConditionalGeneration.generate` does, reproduced stage by stage:

- Thinker: an MoE text decoder reading text with audio / image / video features scattered into the placeholder
  rows, with 3-axis rotary positions (interleaved M-RoPE). Vision features come with DeepStack features, added to
  the visual rows' hidden states after the first decoder layers (one set per layer). For speech it hands on, per
  token it computed, its input embedding (layer 0) and its hidden state after `accept_hidden_layer` layers.
- Talker prompt: the thinker prompt's *user* turns (every token whose latest `<|im_start|>` opens a user turn;
  system turns and earlier assistant turns are left out), media rows through `hidden_projection` of the thinker
  hidden state, other rows through `text_projection` of the thinker embedding; then the last assistant turn: its
  3 role rows (text only), 4 tts_pad rows + codec nothink / think_bos / think_eos / speaker, tts_bos + codec pad,
  and the first reply token + codec bos. Its rotary positions come from the talker's own `get_rope_index` over the
  user ids + tts_pad ids when the prompt has media, else 0, 1, 2, ...
- Talker step: the codec embedding of the frame's first code c0 plus the code predictor's embeddings of codes
  1..Q-1 (`after_sample`, the shared `CodePredictor` of qwen3_tts) plus the next reply row (reply tokens 1.., then
  tts_eos, then tts_pad for as long as it speaks). The repetition penalty sees c0's history only.
- Code2wav: codes [Q, T] -> 24 kHz audio through transformers' `Qwen3OmniMoeCode2Wav` (a causal codec decoder).

On CUDA both MoE decoders' sparse blocks run as `FusedSparseMoe` (`omnistage.kernels.moe`: the same routing and
parameters, the experts as two grouped GEMMs, no host sync); on the CPU transformers' blocks stay.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from omnistage.engine.ar.attention import AttentionMetadata
from omnistage.engine.ar.model import SampleExtras
from omnistage.engine.generation.engine import Results
from omnistage.engine.transfer import to_device
from omnistage.errors import ConfigError
from omnistage.families import hf
from omnistage.families.moe import fuse_moe
from omnistage.families.qwen2_5_omni.models import _media_layout, _scatter
from omnistage.families.qwen3_tts.talker import CodePredictor, subtalker_draw, subtalker_graph_draw
from omnistage.kernels import moe
from omnistage.types import StageInput

SAMPLE_RATE = 24000
SUBTALKER_GREEDY = torch.tensor([0.0, 1.0, 50.0, 0.8])  # [do_sample, temperature, top_k, top_p] of the code predictor
SUBTALKER_SAMPLED = torch.tensor([1.0, 1.0, 50.0, 0.8])  # transformers' draw when the talker samples


class ThinkerLM(hf.HFCausalLM):
    """The thinker's MoE text decoder, its media encoders run when a request arrives.

    DeepStack: a request's visual rows carry their per-layer DeepStack features in extra columns of the input
    embedding ([T, hidden * (1 + layers)]; zeros on other rows), so the additions travel with their rows through
    the engine's packing and chunked prefill. `embed` returns that width too (zeros), so a step mixing such rows
    with others is one tensor; steps without replaced rows give no embeddings and take the plain path."""

    def __init__(self, thinker: nn.Module):
        decoder = thinker.model.language_model
        super().__init__(thinker, thinker.config, decoder=decoder, lm_head=thinker.lm_head, plain_loop=True)
        for encoder in (thinker.model.audio_tower, thinker.model.visual):  # whole media items, not the paged cache
            encoder.config._attn_implementation = "sdpa"
        self.thinker = thinker
        # CUDA graphs with the fused MoE blocks (no host sync, shapes fixed by the token count); transformers'
        # expert loops read the routing back to the host, so without the kernels every step runs eagerly
        self.graph_safe = moe.available(self.device) and fuse_moe(decoder, thinker.config.text_config) > 0
        self.hidden = thinker.config.text_config.hidden_size
        self.deepstack = len(thinker.config.vision_config.deepstack_visual_indexes)
        self.num_layers = thinker.config.text_config.num_hidden_layers

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        rows = self.decoder.embed_tokens(token_ids)
        return torch.cat([rows, rows.new_zeros(len(rows), self.hidden * self.deepstack)], dim=-1) \
            if self.deepstack else rows

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                embeds: torch.Tensor | None = None, output_layers: tuple[int, ...] = ()
                ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The decoder's forward (hidden-state indices as transformers records them: 0 = embeddings, i = layer i's
        output before its DeepStack addition, the last after the final norm)."""
        d, width = self.decoder, self.hidden
        hidden = (embeds[:, :width] if embeds is not None else self.decoder.embed_tokens(token_ids))[None]
        extra = embeds[:, width:] if embeds is not None and self.deepstack else None
        position_ids = hf.hf_position_ids(positions)
        rotary = d.rotary_emb(hidden, position_ids)
        layers: dict[int, torch.Tensor] = {0: hidden[0]} if 0 in output_layers else {}
        for i, layer in enumerate(d.layers):
            hidden = layer(hidden, attention_mask=None, position_embeddings=rotary, position_ids=position_ids,
                           **{hf._METADATA_KWARG: attn})
            if i + 1 in output_layers and i + 1 < self.num_layers:
                layers[i + 1] = hidden[0]
            if extra is not None and i < self.deepstack:
                hidden = hidden + extra[None, :, i * width : (i + 1) * width]
        hidden = d.norm(hidden)
        if self.num_layers in output_layers:
            layers[self.num_layers] = hidden[0]
        return hidden[0], layers

    @torch.inference_mode()
    def prepare_input(self, inp: StageInput, first: bool,
                      embed: Callable[[torch.Tensor], torch.Tensor] | None = None) -> StageInput:
        """`embed`: the model's `embed` to use (tensor parallel: the group's, as this rank holds a vocab slice)."""
        if not first:
            return inp
        t, device, cfg = inp.tensors, self.device, self.thinker.config
        host_ids = torch.tensor([inp.token_ids])
        ids = to_device(host_ids, device)
        embeds = embed(ids[0])[:, : self.hidden] if embed is not None else self.decoder.embed_tokens(ids[0])
        audio_lengths = None
        if "input_features" in t:
            audio_lengths = t["feature_attention_mask"].sum(-1)
            feats = self.thinker.model.get_audio_features(
                t["input_features"].to(device, embeds.dtype), to_device(t["feature_attention_mask"], device),
                return_dict=True).last_hidden_state
            embeds = _scatter(embeds, ids[0] == cfg.audio_token_id, feats, "audio")
        deepstack = embeds.new_zeros(len(embeds), self.hidden * self.deepstack) if self.deepstack else None
        for kind, pixels, grid, token in (("image", "pixel_values", "image_grid_thw", cfg.image_token_id),
                                          ("video", "pixel_values_videos", "video_grid_thw", cfg.video_token_id)):
            if pixels in t:
                out = getattr(self.thinker.model, f"get_{kind}_features")(
                    t[pixels].to(device, embeds.dtype), t[grid].to(device), return_dict=True)
                mask = ids[0] == token
                embeds = _scatter(embeds, mask, torch.cat(list(out.pooler_output)), kind)
                if deepstack is not None:
                    deepstack[mask] = torch.cat([torch.cat(list(f)) for f in out.deepstack_features], dim=-1)
        positions, deltas = self.thinker.model.get_rope_index(
            host_ids, *_media_layout(t, ("image_grid_thw", "video_grid_thw")), torch.ones_like(host_ids),
            bool(t.get("use_audio_in_video", torch.tensor(False)).item()), audio_lengths,
            *_media_layout(t, ("video_second_per_grid",)),
        )
        inp.embeds = torch.cat([embeds, deepstack], dim=-1) if deepstack is not None else embeds
        inp.rope_positions = positions[:, 0]
        inp.rope_delta = int(deltas.view(-1)[0])
        return inp


def user_rows(prompt_ids: list[int], im_start: int, user: int) -> list[int]:
    """Positions of the prompt's user-turn tokens: those whose latest `<|im_start|>` (itself included) is followed
    by the user role token."""
    rows, role = [], None
    for i, tok in enumerate(prompt_ids):
        if tok == im_start:
            role = prompt_ids[i + 1] if i + 1 < len(prompt_ids) else None
        if role == user:
            rows.append(i)
    return rows


def assistant_start(prompt_ids: list[int], im_start: int, assistant: int) -> int:
    """Position of the last `<|im_start|>assistant` (the reply's turn)."""
    for i in range(len(prompt_ids) - 2, -1, -1):
        if prompt_ids[i] == im_start and prompt_ids[i + 1] == assistant:
            return i
    raise ValueError("the prompt does not open an assistant turn")


class TalkerLM(hf.HFCausalLM):
    """The talker's MoE decoder (first codebook) with the code predictor (the others) in `after_sample`, and its
    graph form `after_sample_graph` (captured per decode bucket even when the decoder is not graph-safe)."""

    graph_embed_adds = True  # every generated position adds a row (reply text, or tts_pad): its graphs take them

    def __init__(self, talker: nn.Module, predictor: CodePredictor, text_rows: dict[str, torch.Tensor],
                 config: Any, top: Any):
        super().__init__(talker, talker.config, decoder=talker.model, lm_head=talker.codec_head, plain_loop=True)
        self.talker, self.predictor, self.cfg, self.top = talker, predictor, config, top
        self.graph_safe = moe.available(self.device) and fuse_moe(talker.model, talker.config.text_config) > 0
        self._text_rows = text_rows  # thinker embeddings of tts_pad / tts_bos / tts_eos (host, thinker width)
        self._rows: dict[str, torch.Tensor] = {}
        self.media_ids = [config.audio_token_id, config.image_token_id, config.video_token_id]

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.decoder.codec_embedding(token_ids)

    def text(self, name: str) -> torch.Tensor:
        """The projected thinker embedding of tts_pad / tts_bos / tts_eos: fixed rows, computed once."""
        if name not in self._rows:
            row = to_device(self._text_rows[name], self.device).to(self.kv_spec.dtype)
            self._rows[name] = self.talker.text_projection(row[None])[0]
        return self._rows[name]

    def codec(self, ids: list[int]) -> torch.Tensor:
        return self.embed(torch.tensor(ids, device=self.device))

    def _project(self, embed: torch.Tensor) -> torch.Tensor:
        return self.talker.text_projection(embed.to(self.device, self.kv_spec.dtype))

    @torch.inference_mode()
    def prepare_input(self, inp: StageInput, first: bool) -> StageInput:
        """First input: the prompt (see the module doc) from the thinker's prompt ids, layout and rows; later
        chunks: more reply rows; the last one ends the reply (tts_eos, then tts_pad)."""
        t = inp.tensors
        # the thinker's rows are read here only: not kept with the request (`after_sample` reads `subtalker`)
        reply, hidden = t.pop("thinker_embed", None), t.pop("thinker_hidden", None)  # thinker width
        adds = []
        if first:
            c, top = self.cfg, self.top
            prompt = t["prompt_ids"].tolist()
            n = len(prompt)
            users = user_rows(prompt, top.im_start_token_id, top.user_token_id)
            start = assistant_start(prompt, top.im_start_token_id, top.assistant_token_id)
            rows = torch.tensor(users, dtype=torch.long)
            user_ids = t["prompt_ids"][rows]
            media = torch.isin(user_ids, torch.tensor(self.media_ids))
            user = self._project(reply[rows])
            if media.any():
                user[media.to(user.device)] = self.talker.hidden_projection(
                    hidden[rows[media]].to(self.device, self.kv_spec.dtype))
            role = self._project(reply[start : start + 3])
            first_reply = self._project(reply[n : n + 1]) if len(reply) > n else self.text("eos")[None]
            pad = self.text("pad")
            assistant = torch.cat([role, pad.expand(4, -1), self.text("bos")[None], first_reply]) + torch.cat([
                role.new_zeros(3, role.shape[1]),
                self.codec([c.codec_nothink_id, c.codec_think_bos_id, c.codec_think_eos_id, int(t["speaker"]),
                            c.codec_pad_id, c.codec_bos_id])])
            inp.embeds = torch.cat([user, assistant])
            # prompt ids in the suppressed control range: the repetition penalty then acts on c0's history alone
            inp.token_ids = [c.codec_pad_id] * len(inp.embeds)
            talker_ids = torch.cat([user_ids, torch.full((9,), top.tts_pad_token_id)])[None]
            if "audio_lengths" in t or "image_grid_thw" in t or "video_grid_thw" in t:
                positions, deltas = self.talker.get_rope_index(
                    talker_ids, *_media_layout(t, ("image_grid_thw", "video_grid_thw")), torch.ones_like(talker_ids),
                    False, *_media_layout(t, ("audio_lengths", "video_second_per_grid")))
                inp.rope_positions, inp.rope_delta = positions[:, 0], int(deltas.view(-1)[0])
            reply = reply[n + 1 :]
        if reply is not None and len(reply):
            adds.append(self._project(reply))
        if inp.final:
            adds.append(self.text("eos")[None])
            inp.embed_add_default = self.text("pad")
        if adds:
            inp.embed_adds = adds[0] if len(adds) == 1 else torch.cat(adds)
        elif first:  # none yet, but this request takes added rows
            inp.embed_adds = torch.zeros(0, self.talker.config.text_config.hidden_size, device=self.device)
        else:
            inp.embed_adds = None
        return inp

    def after_sample(self, hidden: torch.Tensor, tokens: torch.Tensor, inputs: list[dict[str, torch.Tensor]],
                     generators: list[torch.Generator | None]) -> SampleExtras:
        """Codebooks 1..Q-1 of the step's frames (one batched pass per codebook)."""
        draw = subtalker_draw([x.get("subtalker", SUBTALKER_GREEDY) for x in inputs], generators,
                              self.cfg.code_predictor_config.vocab_size, hidden.device)
        codes, embed_sum = self.predictor.predict(hidden, self.embed(tokens), draw)
        return SampleExtras(next_adds=embed_sum, outputs={"codes": torch.cat([tokens[:, None], codes], dim=1)})

    def after_sample_rows(self, inputs: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """[n, 4]: each row's code-predictor sampling (`after_sample_graph`'s rows; ARModel)."""
        return torch.stack([x.get("subtalker", SUBTALKER_GREEDY).float() for x in inputs])

    def after_sample_graph(self, hidden: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor) -> SampleExtras:
        """`after_sample` for rows without generators, from static tensors (captured in CUDA graphs)."""
        draw = subtalker_graph_draw(rows, self.cfg.code_predictor_config.vocab_size)
        codes, embed_sum = self.predictor.predict(hidden, self.embed(tokens), draw)
        return SampleExtras(next_adds=embed_sum, outputs={"codes": torch.cat([tokens[:, None], codes], dim=1)})


def load_talker(path: Path, config: Any, top: Any, dtype: torch.dtype, device: torch.device) -> TalkerLM:
    """The talker (MoE decoder, projections, codec head) and its code predictor, moved into the shared
    `CodePredictor` (same parameter names), with the three tts text rows of the thinker's embedding."""
    from transformers import Qwen3OmniMoeTalkerForConditionalGeneration
    from transformers.initialization import no_init_weights

    from omnistage.families.qwen2_5_omni.models import checkpoint_rows

    with torch.device(device), no_init_weights():
        talker = Qwen3OmniMoeTalkerForConditionalGeneration._from_config(config, dtype=dtype,
                                                                          attn_implementation=hf.ATTN_IMPL)
    _load_talker_weights(talker, path, config.text_config.moe_intermediate_size)
    talker = talker.eval().requires_grad_(False)
    # The talker's `get_rope_index` (shared with the thinker's) reads `config.audio_config.n_window` to count an
    # audio's tokens, which only the thinker's config has (transformers 5.25): the thinker's audio encoder's.
    talker.config.audio_config = top.thinker_config.audio_config
    p = config.code_predictor_config
    cfg = dict(hidden_size=p.hidden_size, intermediate_size=p.intermediate_size, num_hidden_layers=p.num_hidden_layers,
               num_attention_heads=p.num_attention_heads, num_key_value_heads=p.num_key_value_heads,
               head_dim=p.head_dim, hidden_act=p.hidden_act, rms_norm_eps=p.rms_norm_eps,
               max_position_embeddings=p.max_position_embeddings, attention_bias=p.attention_bias,
               rope_theta=p.rope_parameters["rope_theta"], num_code_groups=config.num_code_groups,
               vocab_size=p.vocab_size)
    with torch.device(device):
        predictor = CodePredictor(cfg, config.text_config.hidden_size).to(dtype)
    predictor.load_state_dict(talker.code_predictor.state_dict(), strict=True)
    del talker.code_predictor
    predictor = predictor.eval().requires_grad_(False)
    ids = [top.tts_pad_token_id, top.tts_bos_token_id, top.tts_eos_token_id]
    rows = checkpoint_rows(path, "thinker.model.embed_tokens.weight", ids)
    return TalkerLM(talker, predictor, dict(zip(("pad", "bos", "eos"), rows, strict=True)), config, top)


def _load_talker_weights(talker: nn.Module, path: Path, inter: int) -> None:
    """Copy the checkpoint's `talker.*` tensors straight into the module's tensors (read on its device, converted to
    its dtype, one at a time: no host or second copy of the experts). The released layout keeps one gate / up / down
    projection per expert, the module one fused tensor per kind ([experts, 2 * inter, hidden]: gate rows, then up
    rows; [experts, hidden, inter]): each expert's go to their slice. (transformers converts them when it loads the
    whole model, not the talker on its own.) Strict: every tensor of the module filled, no checkpoint tensor left."""
    from safetensors import safe_open

    targets = talker.state_dict()  # shares storage with the parameters and persistent buffers
    device = next(talker.parameters()).device
    filled: dict[str, int] = {}  # name -> elements copied into it
    unexpected = []
    for file in hf.safetensors_files(path):
        with safe_open(str(file), framework="pt", device=str(device)) as f:
            for key in f.keys():
                if not key.startswith("talker."):
                    continue
                name = key[len("talker.") :]
                head, sep, tail = name.partition(".mlp.experts.")
                parts = tail.split(".")
                if sep and parts[0].isdigit() and parts[1] in ("gate_proj", "up_proj", "down_proj"):
                    expert, kind = int(parts[0]), parts[1]
                    name = f"{head}.mlp.experts.{'down_proj' if kind == 'down_proj' else 'gate_up_proj'}"
                    if name not in targets:
                        unexpected.append(key)
                        continue
                    target = targets[name][expert]
                    if kind != "down_proj":
                        target = target[:inter] if kind == "gate_proj" else target[inter:]
                elif name in targets:
                    target = targets[name]
                else:
                    unexpected.append(key)
                    continue
                tensor = f.get_tensor(key)
                if tensor.shape != target.shape:
                    raise ConfigError(f"{key}: checkpoint shape {tuple(tensor.shape)} != model {tuple(target.shape)}")
                with torch.no_grad():
                    target.copy_(tensor)
                filled[name] = filled.get(name, 0) + tensor.numel()
    missing = [n for n, t in targets.items() if filled.get(n, 0) != t.numel()]
    if missing or unexpected:
        raise ConfigError(f"checkpoint {str(path)!r}: talker tensors missing or partial: {', '.join(missing[:5])}; "
                          f"unexpected: {', '.join(unexpected[:5])}")


class Code2Wav:
    """The generation engine's model for code2wav: a request's frames ([T, Q] in `tensors["codes"]`, grown by
    chunks) decode to audio in windows, all of a step's windows in one batched forward (rows right-padded: the
    decoder is causal, and a row's kept samples never depend on frames after its own).

    A decode of frames [s, e) gives the samples of [s * up, e * up - lost): the upsampling convolutions' trims drop
    `lost` (< up) samples at the end, which need the next frames. So each window emits from where the last one
    stopped to e * up - lost (all the rest at the request's end) and decodes `left_context` frames before its own
    (at least one, to cover the held-back samples): the stream has the one-shot decode's length, and its samples
    if `left_context` covers the decoder's receptive field. Streamed (`params["stream"]`): a first window of
    `first_window` frames, then `window`; otherwise the whole utterance at its end, in `chunk`-frame windows (one
    decode for up to `chunk` frames, as transformers' `chunked_decode`)."""

    def __init__(self, model: nn.Module, device: torch.device, first_window: int = 10, window: int = 25,
                 left_context: int = 25, chunk: int = 300):
        self.model, self.device = model, device
        self.first_window, self.window, self.chunk = first_window, window, chunk
        self.left_context = max(1, left_context)  # the held-back samples of the last window need a frame
        self.up = int(model.total_upsample)
        with torch.inference_mode():
            probe = model(torch.zeros(1, model.config.num_quantizers, 2, dtype=torch.long, device=device))
        self.lost = 2 * self.up - probe.shape[-1]

    @staticmethod
    def _frames(inp: StageInput) -> int:
        codes = inp.tensors.get("codes")
        return 0 if codes is None else codes.shape[0]

    def _end(self, inp: StageInput) -> int:
        """Frames (exclusive) to decode up to now: whole windows only, the rest at the final chunk."""
        n, done, p = self._frames(inp), inp.params.setdefault("done", 0), inp.params
        if not p.get("stream", False):
            return min(n, done + self.chunk) if inp.final else done
        if inp.final:
            return n
        size = self.window if p.get("started") else self.first_window
        return done + size if n - done >= size else done

    def ready(self, inp: StageInput) -> bool:
        return inp.final or self._end(inp) > inp.params.setdefault("done", 0)

    @torch.inference_mode()
    def generate(self, inputs: list[StageInput]) -> Results:
        rows = []
        for inp in inputs:
            done, end = inp.params.setdefault("done", 0), self._end(inp)
            rows.append((max(0, done - self.left_context) if done else 0, end))
        longest = max((end - start for start, end in rows), default=0)
        wav = None
        if longest > 0:
            batch = torch.zeros(len(inputs), self.model.config.num_quantizers, longest, dtype=torch.long)
            for i, (inp, (start, end)) in enumerate(zip(inputs, rows, strict=True)):
                batch[i, :, : end - start] = inp.tensors["codes"][start:end].T
            wav = self.model(batch.to(self.device))[:, 0].float().cpu()
        results: Results = []
        for i, (inp, (start, end)) in enumerate(zip(inputs, rows, strict=True)):
            p = inp.params
            emitted = p.setdefault("emitted", 0)
            last = end == self._frames(inp) and inp.final
            stop = end * self.up - self.lost  # samples known once frames up to `end` are decoded
            audio = wav[i, emitted - start * self.up : stop - start * self.up].clone() \
                if wav is not None and end > p["done"] else torch.zeros(0)
            if end > p["done"]:
                p["started"], p["done"], p["emitted"] = True, end, stop
            results.append(({"audio": audio}, last))
        return results


def load_code2wav(path: Path, config: Any, device: torch.device) -> nn.Module:
    """code2wav in float32 (its convolutions run at audio rate)."""
    from transformers import Qwen3OmniMoeCode2Wav
    from transformers.initialization import no_init_weights

    with torch.device(device), no_init_weights():
        model = Qwen3OmniMoeCode2Wav._from_config(config, dtype=torch.float32)
    model.config._attn_implementation = "sdpa"
    hf.load_weights(model, path, {"code2wav.": ""})
    return model.eval().requires_grad_(False)


def frames_per_second(config: Any) -> float:
    return SAMPLE_RATE / math.prod([*config.upsample_rates, *config.upsampling_ratios])
