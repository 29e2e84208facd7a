"""HF transformers' Qwen2.5-Omni run on the tiny checkpoint: the reference omnistage's stages are compared with.

`reference_text(path)` and `reference_image_audio(path)` run `Qwen2_5OmniForConditionalGeneration.generate`
greedily with fixed lengths and return an `HFReference`: prompt ids, thinker token ids, talker codec ids and
the waveform. `run_hf` does the same for any processor inputs. Below, how transformers 5.24
(models/qwen2_5_omni/modeling_qwen2_5_omni.py) goes from a prompt to audio, checked against the code and, in
test_reference.py, by re-implementing it from these notes and matching the results exactly.

1. Thinker (`Qwen2_5OmniThinkerForConditionalGeneration.generate`)
   - Inputs come from `Qwen2_5OmniProcessor`: each media placeholder is expanded to one token per feature
     (<|IMAGE|>/<|VIDEO|>: grid_t*grid_h*grid_w / merge_size**2; <|AUDIO|>: ((L-1)//2+1-2)//2+1 for L mel
     frames; with use_audio_in_video the video's and its track's tokens interleave in 2 s chunks between
     <|audio_bos|>/<|audio_eos|>).
   - `Qwen2_5OmniThinkerModel.forward` embeds the ids, then `masked_scatter`s the audio tower's output over the
     <|AUDIO|> rows, the vision tower's over <|IMAGE|> and <|VIDEO|> rows.
   - Positions are 3-D M-RoPE ids from `get_rope_index` (text: the same index on all three axes; vision: t/h/w
     grid offsets from the block's start, t scaled by position_id_per_seconds; the text after a block starts at
     its max + 1). Decoding continues at `len(sequence) + rope_deltas` on all three axes, where
     rope_deltas = max position + 1 - prompt length.
   - With audio requested, generate asks for `output_hidden_states`: `hidden_states[0]` is the prefill (a tuple over
     layers of [1, n, D]), `hidden_states[k]` (k >= 1) the decode step that fed generated token k-1 ([1, 1, D]).
     Layer 0 is the input embedding after the multimodal merge; layer -1 is the last layer *after* the final norm.
     The last generated token is never fed back, so it has no hidden state.

2. Thinker -> talker (the body of `Qwen2_5OmniForConditionalGeneration.generate`)
   - Per fed token: row = embedding (layer 0) + last hidden state (layer -1). In the prompt's rows, the
     embedding is zeroed at <|AUDIO|>, <|IMAGE|>, <|VIDEO|> positions (only for the media kinds present in the
     call); the hidden state is kept.
   - Talker prefill, n + 2 rows (n = prompt length): the n prompt rows; then the thinker's *text* embedding of
     the voice's `bos_token` (spk_dict.pt; a reserved text id) + the codec embedding of codec_pad; then the row of
     generated token 0 + the codec embedding of codec_bos. Its codec "ids" are [codec_mask] * n + [codec_pad,
     codec_bos]: never embedded, but the repetition penalty sees them.
   - Reply stream: rows of generated tokens 1 .. N-2, then the thinker embedding of tts_text_end (text eos),
     then of tts_text_pad, which repeats for as long as the talker runs. (In a batch, a row that finished early
     gets text eos right after its last real token and pads after: `first_eos_positions`.)
   - Talker step j (j >= 0, feeding the code c_j it produced last): input = codec embedding(c_j) + reply[j].
   - Everything the talker reads is projected by `thinker_to_talker_proj` (thinker hidden -> talker hidden) before
     its decoder; `codec_head` gives logits over the codec vocabulary.
   - Talker positions: M-RoPE from the talker's own `get_rope_index` over ids = prompt ids + [voice bos, token 0]
     (so the prompt's media get the same grid positions as in the thinker), then +1 per step from
     n + 2 + rope_deltas.
   - Caution, transformers 5.24: `GenerationMixin.generate` drops an all-ones attention mask before the talker's
     forward, and `Qwen2_5OmniTalkerForConditionalGeneration.forward` only adds the codec pad/bos embeddings and
     computes M-RoPE positions when it gets a mask. So for an unpadded request, HF's generate runs the talker
     *without* the two codec additions and with plain positions 0, 1, 2, ... (padded batches take the intended
     path). `run_hf(..., talker_as_intended=True)` (the default here) hands the talker an all-ones mask so it runs
     the intended path; False reproduces generate as released. The two agree on the first codes and then drift.
   - Sampling: `talker_*` kwargs of generate go to `talker.generate` (`thinker_*` to the thinker's,
     `token2wav_*` to token2wav's forward; unprefixed ones go to all three). Defaults: do_sample=True, top_k=40,
     top_p=0.8, temperature=0.9, repetition_penalty=1.05 (also applied under greedy: over the codec ids above
     plus the generated codes), eos_token_id=[8292, 8294] *hard-coded* (the released checkpoint's codec pad and
     end ids, not read from the config; the tiny checkpoint's are 300 and 302, so pass `talker_eos_token_id`),
     pad_token_id=codec_pad, suppress_tokens=[codec_bos]. The codes handed on are those before the first eos.
   - Also in 5.24: `pixel_values` / `pixel_values_videos` reach `talker.generate` as unknown kwargs and fail
     validation; pass them as `thinker_pixel_values` / `thinker_pixel_values_videos` (run_hf does).

3. Token2wav (`Qwen2_5OmniToken2WavModel`, always float32: generate calls `.float()` on it)
   - `Qwen2_5OmniToken2WavDiTModel.sample`: mel length T = 2 * codes (`repeats`). Start from x = torch.randn([1, T,
     mel_dim]) from the global RNG (generate decodes each batch row separately, so seed right before; greedy
     thinker/talker draw nothing). Time points: linspace(0, 1, 10) bent by sway -1 into t = 1 - cos(pi/2 t).
     Each of the 9 intervals takes one RK4 step (3/8-rule weights: k1 + 3 k2 + 3 k3 + k4, over 8): 36 DiT calls.
   - One DiT call runs a doubled batch for classifier-free guidance: conditioned (voice `cond` vector repeated
     over T, ECAPA-TDNN embedding of the voice's `ref_mel`, codec embeddings of the codes repeated 2x) and
     unconditioned (zeros for both voice inputs, codec id 0 everywhere); velocity = c + 0.5 * (c - u). Inputs are
     concatenated [x, ecapa(ref_mel), code_embed, cond] and projected; timestep embedding drives adaLN-zero
     blocks; attention is bidirectional within blocks of 24 frames, plus one block back in `look_backward_layers`
     and one ahead in `look_ahead_layers`; RoPE only on the first head.
   - `Qwen2_5OmniToken2WavBigVGANModel`: mel -> exp -> dB (-20 dB offset, floor -115 dB) -> scaled to [-1, 1] ->
     conv_pre, upsampling ConvTranspose1d stages (x240 overall: 24 kHz at 100 mel frames/s, i.e. 480 samples per
     code) each followed by anti-aliased SnakeBeta AMP residual blocks, averaged -> activation -> conv_post ->
     clamp to [-1, 1].
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

THINKER_TOKENS = 10
TALKER_CODES = 30
VOICE = "Ethan"
SEED = 0
TEXT_MESSAGES = [{"role": "user", "content": [{"type": "text", "text": "Tell me about rivers."}]}]
IMAGE_AUDIO_MESSAGES = [{"role": "user", "content": [
    {"type": "image"}, {"type": "audio"}, {"type": "text", "text": "What do you see and hear?"},
]}]


@dataclass
class HFReference:
    prompt_ids: list[int]
    thinker_tokens: list[int]
    talker_codes: list[int]
    waveform: torch.Tensor  # float32 [samples] at 24 kHz
    inputs: dict[str, Any] = field(repr=False)  # the processor's output the run used


@functools.lru_cache(maxsize=4)
def load_hf(path: str) -> tuple[Any, Any]:
    """(Qwen2_5OmniForConditionalGeneration in float32, Qwen2_5OmniProcessor), loaded once per path."""
    from transformers import Qwen2_5OmniForConditionalGeneration, Qwen2_5OmniProcessor

    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return model, Qwen2_5OmniProcessor.from_pretrained(path)


def image_and_audio() -> tuple[Any, np.ndarray]:
    """The image+audio prompt's media: a 64x80 noise picture and 2 s of a 440 Hz tone at 16 kHz."""
    from PIL import Image

    picture = Image.fromarray((np.random.RandomState(0).rand(64, 80, 3) * 255).astype(np.uint8))
    t = np.arange(32000) / 16000
    return picture, (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)


def _give_talker_a_mask(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    if kwargs.get("attention_mask") is None:
        rows = kwargs["inputs_embeds"] if kwargs.get("inputs_embeds") is not None else kwargs["input_ids"]
        cache = kwargs.get("cache")
        past = cache.get_seq_length() if cache is not None else 0
        kwargs["attention_mask"] = torch.ones(rows.shape[0], past + rows.shape[1], dtype=torch.long)
    return args, kwargs


@torch.no_grad()
def run_hf(
    model: Any,
    inputs: dict[str, Any],
    *,
    thinker_tokens: int = THINKER_TOKENS,
    talker_codes: int = TALKER_CODES,
    voice: str = VOICE,
    seed: int = SEED,
    talker_as_intended: bool = True,
    **generate_kwargs: Any,
) -> HFReference:
    """Greedy thinker and talker, each run to exactly its length, then token2wav seeded with `seed`."""
    inputs = dict(inputs)
    kwargs = dict(inputs)
    for key in ("pixel_values", "pixel_values_videos"):  # see the notes: the talker must not get these
        if key in kwargs:
            kwargs[f"thinker_{key}"] = kwargs.pop(key)
    talker = model.config.talker_config
    codes: list[torch.Tensor] = []
    hooks = [model.token2wav.register_forward_pre_hook(
        lambda module, args, kw: codes.append((kw["code"] if "code" in kw else args[0]).clone()), with_kwargs=True,
    )]
    if talker_as_intended:
        hooks.append(model.talker.register_forward_pre_hook(_give_talker_a_mask, with_kwargs=True))
    model.talker.rope_deltas = None
    try:
        torch.manual_seed(seed)
        sequences, waveform = model.generate(
            **kwargs, speaker=voice,
            thinker_max_new_tokens=thinker_tokens, thinker_min_new_tokens=thinker_tokens, thinker_do_sample=False,
            talker_max_new_tokens=talker_codes, talker_min_new_tokens=talker_codes, talker_do_sample=False,
            talker_eos_token_id=[talker.tts_codec_pad_token_id, talker.tts_codec_end_token_id],
            **generate_kwargs,
        )
    finally:
        for hook in hooks:
            hook.remove()
    n = inputs["input_ids"].shape[1]
    return HFReference(
        prompt_ids=inputs["input_ids"][0].tolist(),
        thinker_tokens=sequences[0, n:].tolist(),
        talker_codes=codes[0][0].tolist(),
        waveform=waveform.reshape(-1).float(),
        inputs=inputs,
    )


def text_inputs(processor: Any, messages: list[dict] = TEXT_MESSAGES) -> dict[str, Any]:
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return dict(processor(text=[text], return_tensors="pt"))


def image_audio_inputs(processor: Any, messages: list[dict] = IMAGE_AUDIO_MESSAGES) -> dict[str, Any]:
    picture, audio = image_and_audio()
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return dict(processor(text=[text], images=[picture], audio=[audio], return_tensors="pt"))


def reference_text(path: str, **kwargs: Any) -> HFReference:
    """(a) TEXT_MESSAGES: thinker tokens, talker codes, waveform from HF generate (see run_hf for kwargs)."""
    model, processor = load_hf(path)
    return run_hf(model, text_inputs(processor), **kwargs)


def reference_image_audio(path: str, **kwargs: Any) -> HFReference:
    """(b) IMAGE_AUDIO_MESSAGES with `image_and_audio()`: the same, with the image and audio encoders in play."""
    model, processor = load_hf(path)
    return run_hf(model, image_audio_inputs(processor), **kwargs)
