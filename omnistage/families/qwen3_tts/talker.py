"""The Qwen3-TTS talker on the AR engine: text (+ speaker) in, one codec frame of Q codes per engine step out.

Architecture notes: docs/families/qwen3_tts.md. The talker decoder is a Qwen3 decoder (transformers' classes, run by
`hf.HFCausalLM` on the paged KV cache) whose token embedding is the codec embedding and whose head is `codec_head`:
the engine samples codebook 0 (c0) from it. Codebooks 1..Q-1 come from the code predictor, which the engine runs
through `after_sample` in the same step, for the whole batch at once: a small Qwen3 over the frame, its K/V in a
static per-frame scratch buffer (positions 0..Q-1, rewritten every frame, so it can live in a CUDA graph), one
batched pass per codebook. `after_sample` also returns the next step's input addition, the sum of the
codebook-1.. embeddings; the engine adds it to the codec embedding of c0 and to the request's trailing-text row
(`embed_adds`: the rest of the text one row per frame in the streaming text mode, then tts_pad; only tts_pad in the
non-streaming mode, the text being in the prompt).

Request tensors (`StageInput.tensors`, built by `talker_input`): `text_ids` (the assistant-formatted text's ids),
`codec_prefix` (think tags, language, speaker ids: `codec_prefix_ids`), `subtalker` ([do_sample, temperature,
top_k, top_p] of the code predictor's sampling), `streaming` (the text mode) and, Base, `x_vector` and for ICL
`ref_codes` [T, Q] + `ref_text_ids`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.activations import ACT2FN
from transformers.initialization import no_init_weights
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3DecoderLayer,
    Qwen3Model,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    apply_rotary_pos_emb,
)

from omnistage.engine.ar.model import SampleExtras
from omnistage.engine.ar.sampler import SampleRow, SamplingColumns, choose
from omnistage.families import hf
from omnistage.sampling_params import SamplingParams
from omnistage.types import StageInput

_SUBTALKER_DEFAULT = torch.tensor([1.0, 0.9, 50.0, 1.0])  # the package's hard defaults (no generation config)
SUPPRESSED_TAIL = 1024  # codec ids in [vocab - 1024, vocab) are control ids: never sampled as c0, except eos


def _qwen3_config(cfg: dict[str, Any], vocab_size: int) -> Qwen3Config:
    """A transformers Qwen3 config with this part's decoder shape. The talker's M-RoPE has three identical
    position rows (text only), which is plain 1D RoPE: the `mrope_section` split does not change the angles."""
    return Qwen3Config(
        vocab_size=vocab_size, hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"], num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"], head_dim=cfg.get("head_dim") or
        cfg["hidden_size"] // cfg["num_attention_heads"], hidden_act=cfg.get("hidden_act", "silu"),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), max_position_embeddings=cfg.get("max_position_embeddings", 32768),
        rope_parameters={"rope_type": "default", "rope_theta": float(cfg.get("rope_theta", 10000.0))},
        attention_bias=cfg.get("attention_bias", False), tie_word_embeddings=False,
    )


class _ResizeMLP(nn.Module):
    def __init__(self, inp: int, inter: int, out: int, act: str) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(inp, inter)
        self.linear_fc2 = nn.Linear(inter, out)
        self.act = ACT2FN[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class CodePredictor(nn.Module):
    """Codebooks 1..Q-1 of a frame from the talker's hidden state and c0, for a batch of frames at once.

    Input position 0 is the talker state h, 1 is C(c0) (the talker's codec embedding), k+1 is E_k(c_k); every
    input goes through `small_to_mtp_projection` first; `lm_head[k]` at position k+1 predicts c_{k+1}. K/V of
    the frame sit in `_scratch` [layers, 2, rows, kv_heads, Q, head_dim]; it only grows (to the largest batch).
    Qwen3-Omni's talker has the same code predictor (parameter names too): that family loads it from here."""

    def __init__(self, cfg: dict[str, Any], talker_hidden: int) -> None:
        super().__init__()
        self.config = _qwen3_config(cfg, 1)
        self.config._attn_implementation = "sdpa"
        c = self.config
        self.num_groups = cfg["num_code_groups"]
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(Qwen3DecoderLayer(c, i) for i in range(c.num_hidden_layers))
        self.model.norm = Qwen3RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.model.rotary_emb = Qwen3RotaryEmbedding(c)
        self.model.codec_embedding = nn.ModuleList(nn.Embedding(cfg["vocab_size"], talker_hidden)
                                                   for _ in range(self.num_groups - 1))
        self.lm_head = nn.ModuleList(nn.Linear(c.hidden_size, cfg["vocab_size"], bias=False)
                                     for _ in range(self.num_groups - 1))
        self.small_to_mtp_projection = nn.Linear(talker_hidden, c.hidden_size) if c.hidden_size != talker_hidden \
            else nn.Identity()
        self._scratch: torch.Tensor | None = None

    def _scratch_for(self, rows: int, like: torch.Tensor) -> torch.Tensor:
        c = self.config
        if self._scratch is None or self._scratch.shape[2] < rows:
            self._scratch = torch.zeros(c.num_hidden_layers, 2, rows, c.num_key_value_heads, self.num_groups,
                                        c.head_dim, dtype=like.dtype, device=like.device)
        return self._scratch[:, :, :rows]

    def _attend(self, layer: Qwen3DecoderLayer, x: torch.Tensor, start: int, rotary: tuple, kv: torch.Tensor
                ) -> torch.Tensor:
        """Self-attention of `x` [n, t, D] at positions start..start+t-1 over the frame's positions so far."""
        a, c = layer.self_attn, self.config
        n, t, _ = x.shape
        q = a.q_norm(a.q_proj(x).view(n, t, -1, c.head_dim)).transpose(1, 2)
        k = a.k_norm(a.k_proj(x).view(n, t, -1, c.head_dim)).transpose(1, 2)
        v = a.v_proj(x).view(n, t, -1, c.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *rotary)
        kv[0, :, :, start : start + t] = k
        kv[1, :, :, start : start + t] = v
        keys, values = kv[0, :, :, : start + t], kv[1, :, :, : start + t]
        rep = c.num_attention_heads // c.num_key_value_heads
        out = F.scaled_dot_product_attention(q, keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1),
                                             is_causal=start == 0 and t > 1, scale=a.scaling)
        return a.o_proj(out.transpose(1, 2).reshape(n, t, -1))

    def _forward(self, x: torch.Tensor, start: int, kv: torch.Tensor) -> torch.Tensor:
        """Predictor hidden states of inputs `x` [n, t, talker_hidden] at positions start..; returns the last's."""
        h = self.small_to_mtp_projection(x)
        pos = torch.arange(start, start + h.shape[1], device=h.device)[None]
        rotary = self.model.rotary_emb(h, pos)
        for i, layer in enumerate(self.model.layers):
            h = h + self._attend(layer, layer.input_layernorm(h), start, rotary, kv[i])
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.model.norm(h[:, -1])

    def predict(self, talker_hidden: torch.Tensor, c0_embed: torch.Tensor, draw: Any) -> tuple[torch.Tensor,
                                                                                                torch.Tensor]:
        """Codes c1..c_{Q-1} [n, Q-1] of n frames, and the sum of their embeddings E_k(c_k) [n, talker_hidden].
        `draw(logits [n, codebook]) -> ids [n]` samples each codebook with the rows' own parameters."""
        kv = self._scratch_for(talker_hidden.shape[0], talker_hidden)
        x = torch.stack([talker_hidden, c0_embed], dim=1)
        codes, total = [], None
        for k in range(self.num_groups - 1):
            hidden = self._forward(x, 0 if k == 0 else k + 1, kv)
            code = draw(self.lm_head[k](hidden).float())
            embed = self.model.codec_embedding[k](code)
            codes.append(code)
            total = embed if total is None else total + embed
            x = embed[:, None]
        return torch.stack(codes, dim=1), total


class _TalkerModule(nn.Module):
    """Parameter names as the checkpoint's `talker.*` (the codec embedding is the decoder's `embed_tokens`)."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        qcfg = _qwen3_config(cfg, cfg["vocab_size"])
        qcfg._attn_implementation = hf.ATTN_IMPL
        self.config = qcfg
        self.model = Qwen3Model(qcfg)
        self.model.text_embedding = nn.Embedding(cfg["text_vocab_size"], cfg["text_hidden_size"])
        self.text_projection = _ResizeMLP(cfg["text_hidden_size"], cfg["text_hidden_size"], cfg["hidden_size"],
                                          cfg.get("hidden_act", "silu"))
        self.codec_head = nn.Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)
        self.code_predictor = CodePredictor(dict(cfg["code_predictor_config"], num_code_groups=cfg["num_code_groups"]),
                                            cfg["hidden_size"])

    def tie_weights(self) -> None:  # nothing is tied (hf.load_weights calls it)
        pass


@dataclass
class TextIds:
    """The checkpoint's text-side special ids."""

    tts_pad: int
    tts_bos: int
    tts_eos: int


def codec_prefix_ids(talker_cfg: dict[str, Any], speaker: str | None, language: str = "auto") -> list[int]:
    """Codec-side ids of the prompt before `[pad, bos]`: think tags with the language (none for auto), then the
    speaker. A dialect speaker with Chinese or auto language speaks its dialect's language id."""
    lang = language.lower()
    langs = talker_cfg.get("codec_language_id") or {}
    spk = speaker.lower() if speaker else None
    if spk is not None and spk not in talker_cfg["spk_id"]:
        raise ValueError(f"unknown speaker {speaker!r}; known: {sorted(talker_cfg['spk_id'])}")
    if lang != "auto" and lang not in langs:
        raise ValueError(f"unknown language {language!r}; known: auto, {', '.join(sorted(langs))}")
    lang_id = None if lang == "auto" else langs[lang]
    dialect = (talker_cfg.get("spk_is_dialect") or {}).get(spk, False) if spk else False
    if lang in ("chinese", "auto") and dialect:
        lang_id = langs[dialect]
    c = talker_cfg
    ids = [c["codec_nothink_id"], c["codec_think_bos_id"], c["codec_think_eos_id"]] if lang_id is None else \
        [c["codec_think_id"], c["codec_think_bos_id"], lang_id, c["codec_think_eos_id"]]
    return ids + ([c["spk_id"][spk]] if spk else [])


def prompt_length(text_ids: list[int], codec_prefix: list[int], instruct_ids: list[int] | None = None, *,
                  x_vector: bool = False, ref_text_ids: list[int] | None = None, ref_frames: int = 0,
                  streaming: bool = False) -> int:
    """Positions of the talker's prompt (`TalkerLM.prepare_input`): the instruction, role 3, codec prefix (+ the
    x-vector) + pad, then the body: non-streaming, the text between the role and the 5 closing ids plus tts_eos and
    a final tts_pad + codec bos; streaming, the first text id + codec bos. ICL (ref codes): the ref text + text +
    tts_eos with codec pad, then codec bos + the ref frames (non-streaming), or the longer of the two (streaming)."""
    head = len(instruct_ids or ()) + 3 + len(codec_prefix) + int(x_vector) + 1
    if ref_frames:
        text = len(ref_text_ids or ()) - 5 + len(text_ids) - 8 + 1
        return head + (max(text, ref_frames + 1) if streaming else text + ref_frames + 1)
    return head + (1 if streaming else len(text_ids) - 8 + 1 + 1)


def talker_params(talker_cfg: dict[str, Any], generation: dict[str, Any], max_tokens: int, **overrides: Any
                  ) -> SamplingParams:
    """c0's sampling: the checkpoint's generation defaults (`generation_config.json`) under `overrides`; control
    ids suppressed (eos excepted), at least 2 frames. `do_sample=False` is greedy (temperature 0)."""
    g = {**generation, **overrides}
    eos, vocab = talker_cfg["codec_eos_token_id"], talker_cfg["vocab_size"]
    return SamplingParams(
        max_tokens=max_tokens, min_tokens=2,
        temperature=float(g.get("temperature", 0.9)) if g.get("do_sample", True) else 0.0,
        top_k=int(g.get("top_k", 50)), top_p=float(g.get("top_p", 1.0)),
        repetition_penalty=float(g.get("repetition_penalty", 1.05)),
        bad_token_ids=[i for i in range(vocab - SUPPRESSED_TAIL, vocab) if i != eos],
    )


def talker_input(request_id: str, text_ids: list[int], codec_prefix: list[int], params: SamplingParams,
                 generation: dict[str, Any], instruct_ids: list[int] | None = None, *,
                 x_vector: torch.Tensor | None = None, ref_codes: torch.Tensor | None = None,
                 ref_text_ids: list[int] | None = None, streaming: bool = False, **overrides: Any) -> StageInput:
    """The talker stage's input for one request: the assistant-formatted text's ids, the codec prefix, and the ids
    of an instruction (`<|im_start|>user\n{instruct}<|im_end|>\n`: VoiceDesign's voice description) if any;
    Base: the speaker's `x_vector` [hidden] and, for ICL, `ref_codes` [T, Q] with the ids of
    `<|im_start|>assistant\n{ref_text}<|im_end|>\n`; `streaming`: the streaming text mode (the text after its first
    id is fed one id per generated frame); `overrides` of the generation defaults name subtalker_* too."""
    g = {**generation, **overrides}
    subtalker = [float(g.get("subtalker_dosample", True)), float(g.get("subtalker_temperature", 0.9)),
                 float(g.get("subtalker_top_k", 50)), float(g.get("subtalker_top_p", 1.0))]
    tensors = {"text_ids": torch.tensor(text_ids), "codec_prefix": torch.tensor(codec_prefix),
               "subtalker": torch.tensor(subtalker), "streaming": torch.tensor(bool(streaming))}
    if instruct_ids:
        tensors["instruct_ids"] = torch.tensor(instruct_ids)
    if x_vector is not None:
        tensors["x_vector"] = x_vector.float().reshape(-1)
    if ref_codes is not None:
        if not ref_text_ids:
            raise ValueError("ICL reference codes need the reference text's ids")
        tensors["ref_codes"] = ref_codes.long()
        tensors["ref_text_ids"] = torch.tensor(ref_text_ids)
    return StageInput(request_id, params=params, tensors=tensors)


class TalkerLM(hf.HFCausalLM):
    """The talker as an ARModel with an `after_sample` hook (the code predictor; see the module doc)."""

    graph_embed_adds = True  # every generated position adds rows (text, last frame's codes): its CUDA graphs take them

    def __init__(self, talker: _TalkerModule, cfg: dict[str, Any], text_ids: TextIds) -> None:
        super().__init__(talker, talker.config, decoder=talker.model, lm_head=talker.codec_head, plain_loop=True)
        self.talker = talker
        self.cfg = cfg
        self.text_ids = text_ids
        self.num_groups = cfg["num_code_groups"]

    def text(self, ids: list[int] | torch.Tensor) -> torch.Tensor:
        """T(ids) [n, hidden]: projected text embeddings."""
        ids = torch.as_tensor(ids, device=self.device)
        return self.talker.text_projection(self.talker.model.text_embedding(ids))

    def codec(self, ids: list[int] | torch.Tensor) -> torch.Tensor:
        return self.embed(torch.as_tensor(ids, device=self.device))

    def frame_embeds(self, codes: torch.Tensor) -> torch.Tensor:
        """[T, hidden]: each frame's summed code embeddings, C(c0) + sum_k E_k(c_k) (a generated frame's input)."""
        codes = codes.to(self.device)
        total = self.codec(codes[:, 0])
        for k, table in enumerate(self.talker.code_predictor.model.codec_embedding):
            total = total + table(codes[:, k + 1])
        return total

    @torch.inference_mode()
    def prepare_input(self, inp: StageInput, first: bool) -> StageInput:
        """The prompt (the doc's "Prompt" steps 1-5): the instruction if any (text only), role, codec prefix (think
        tags, language, speaker id or the Base x-vector, pad; tts_pad.. tts_bos on the text side), then the body.
        Non-streaming: the whole text with codec pad, then tts_pad + codec bos; streaming: the first text id + codec
        bos, the rest of the text + tts_eos fed one row per generated frame (`embed_adds`). ICL: text = ref text +
        text + tts_eos, codec = bos + the ref frames; concatenated (non-streaming) or summed position-wise with the
        text's excess fed per frame (streaming). Every generated position past the fed rows adds tts_pad."""
        if not first:
            return inp
        t, c, s = inp.tensors, self.cfg, self.text_ids
        ids = t["text_ids"].tolist()
        streaming = bool(t["streaming"]) if "streaming" in t else False
        pad, bos, eos = self.text([s.tts_pad, s.tts_bos, s.tts_eos])
        rows = [self.codec(t["codec_prefix"].tolist())]
        if "x_vector" in t:
            rows.append(t["x_vector"].to(self.device, pad.dtype)[None])
        prefix = torch.cat([*rows, self.codec([c["codec_pad_id"], c["codec_bos_id"]])])
        text_side = torch.cat([pad.expand(len(prefix) - 2, -1), bos[None]])
        instruct = [self.text(t["instruct_ids"])] if "instruct_ids" in t else []
        trailing = pad.new_zeros(0, pad.shape[0])
        if "ref_codes" in t:
            text = torch.cat([self.text(t["ref_text_ids"].tolist()[3:-2] + ids[3:-5]), eos[None]])
            codec = torch.cat([prefix[-1:], self.frame_embeds(t["ref_codes"])])
            if not streaming:
                body = torch.cat([text + self.codec([c["codec_pad_id"]]), codec + pad])
            elif len(text) > len(codec):
                body, trailing = text[: len(codec)] + codec, text[len(codec):]
            else:
                body = torch.cat([text, pad.expand(len(codec) - len(text), -1)]) + codec
        elif streaming:
            body = self.text(ids[3:4]) + prefix[-1]
            trailing = torch.cat([self.text(ids[4:-5]), eos[None]])
        else:
            body = torch.cat([torch.cat([self.text(ids[3:-5]), eos[None]]) + self.codec([c["codec_pad_id"]]),
                              (pad + prefix[-1])[None]])
        embeds = torch.cat([*instruct, self.text(ids[:3]), text_side + prefix[:-1], body])
        inp.embeds = embeds
        inp.token_ids = [c["codec_pad_id"]] * len(embeds)  # ids in the suppressed range: the repetition penalty
        # over prompt + output ids then acts on c0's history alone, as the reference's (it has no prompt ids)
        inp.embed_adds = trailing
        inp.embed_add_default = pad
        return inp

    def after_sample(self, hidden: torch.Tensor, tokens: torch.Tensor, inputs: list[dict[str, torch.Tensor]],
                     generators: list[torch.Generator | None]) -> SampleExtras:
        """The code predictor for the step's frames (batched over rows, one pass per codebook). Rows whose c0 is
        eos get codes too (their frame is dropped by the engine with the stop token)."""
        draw = subtalker_draw([x.get("subtalker", _SUBTALKER_DEFAULT) for x in inputs], generators,
                              self.cfg["code_predictor_config"]["vocab_size"], hidden.device)
        codes, embed_sum = self.talker.code_predictor.predict(hidden, self.embed(tokens), draw)
        return SampleExtras(next_adds=embed_sum, outputs={"codes": torch.cat([tokens[:, None], codes], dim=1)})

    def after_sample_rows(self, inputs: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """[n, 4]: each row's code-predictor sampling [do_sample, temperature, top_k, top_p] (`after_sample_graph`'s
        rows; ARModel)."""
        return torch.stack([x.get("subtalker", _SUBTALKER_DEFAULT).float() for x in inputs])

    def after_sample_graph(self, hidden: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor) -> SampleExtras:
        """`after_sample` for rows without generators from static tensors (what the engine captures in CUDA graphs):
        the sampling as device columns (`subtalker_columns`), each codebook's noise drawn from the default generator
        for every row, as `subtalker_draw` draws it when a row samples."""
        draw = subtalker_graph_draw(rows, self.cfg["code_predictor_config"]["vocab_size"])
        codes, embed_sum = self.talker.code_predictor.predict(hidden, self.embed(tokens), draw)
        return SampleExtras(next_adds=embed_sum, outputs={"codes": torch.cat([tokens[:, None], codes], dim=1)})


def subtalker_draw(rows: list[torch.Tensor], generators: list[torch.Generator | None], vocab: int,
                   device: torch.device) -> Any:
    """A draw over the rows' code-predictor logits with their own [do_sample, temperature, top_k, top_p] (the AR
    sampler's column transforms and exponential race); a seeded row's noise from its own generator, the others'
    from the device's default one."""
    params = [SamplingParams(temperature=float(r[1]) if r[0] else 0.0, top_k=int(r[2]), top_p=float(r[3]))
              for r in rows]
    if all(p.greedy for p in params):
        return lambda logits: logits.argmax(dim=-1)
    cols = SamplingColumns.build([SampleRow(p, [], [], g, ()) for p, g in zip(params, generators, strict=True)],
                                 vocab, device)

    def noise(probs: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(probs).exponential_()
        for i, g in enumerate(generators):
            if g is not None:
                out[i].exponential_(generator=g)
        return out

    return lambda logits: choose(logits, cols, noise)


def subtalker_graph_draw(rows: torch.Tensor, vocab: int) -> Any:
    """`subtalker_draw` for rows [n, 4] on the device without generators, graph-safe: the columns from static
    tensors, every row's noise from the default generator (each graph replay draws anew)."""
    cols = subtalker_columns(rows, vocab)
    return lambda logits: choose(logits, cols, lambda probs: torch.empty_like(probs).exponential_())


def subtalker_columns(rows: torch.Tensor, vocab: int) -> SamplingColumns:
    """`subtalker_draw`'s columns from rows [n, 4] on the device, every filter on (a row without one holds its
    neutral value, which keeps every token: the same distribution, the same ids for the same noise): static tensors,
    no host reads, so a CUDA graph can compute them."""
    greedy = (rows[:, 0] == 0) | (rows[:, 1] == 0)
    top_k = rows[:, 2:3].trunc()
    top_p = rows[:, 3:4]
    return SamplingColumns(
        temperature=torch.where(greedy[:, None], 1.0, rows[:, 1:2]), greedy=greedy, all_greedy=False,
        top_k=torch.where(top_k > 0, top_k, float(vocab)), top_p=top_p, min_p=torch.zeros_like(top_p),
        repetition=None, frequency=None, presence=None, ban=None, generators=(),
    )


def load_talker(path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
                ) -> TalkerLM:
    """The talker from a checkpoint directory (config.json's `talker_config`, `talker.*` safetensors)."""
    root = Path(path)
    config = json.loads((root / "config.json").read_text(encoding="utf-8"))
    cfg = config["talker_config"]
    with torch.device(device), no_init_weights():
        module = _TalkerModule(cfg).to(dtype)
    hf.load_weights(module, root, {"talker.model.codec_embedding.": "model.embed_tokens.", "talker.": ""})
    module = module.eval().requires_grad_(False)
    return TalkerLM(module, cfg, TextIds(config["tts_pad_token_id"], config["tts_bos_token_id"],
                                         config["tts_eos_token_id"]))
