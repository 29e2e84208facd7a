"""The HF reference (reference.py) is deterministic, and its dataflow notes are right: a re-implementation
written from them, on HF's sub-modules, gives the same talker codes and waveform as HF's generate."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchvision", reason="Qwen2.5-Omni's processor needs torchvision (pip install 'omnistage[omni]')")

from omnistage.testing.qwen2_5_omni import NUM_CODES  # noqa: E402

from .reference import (  # noqa: E402
    TALKER_CODES,
    THINKER_TOKENS,
    VOICE,
    image_audio_inputs,
    load_hf,
    reference_image_audio,
    reference_text,
    run_hf,
    text_inputs,
)


@torch.no_grad()
def talker_from_notes(model, inputs: dict, thinker_tokens: list[int], as_intended: bool = True) -> list[int]:
    """Greedy talker codes built the way reference.py's notes say HF builds them."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    thinker, talker = model.thinker, model.talker
    cfg = model.config.thinker_config
    ids = inputs["input_ids"]
    n = ids.shape[1]
    fed = torch.cat([ids, torch.tensor([thinker_tokens[:-1]])], dim=1)  # the last token is never fed back
    # Layer 0 after the multimodal merge is the thinker's own input: recompute the merge by running it.
    out = thinker(**{**inputs, "input_ids": fed, "attention_mask": torch.ones_like(fed)}, output_hidden_states=True)
    embeds, last = out.hidden_states[0][0].clone(), out.hidden_states[-1][0]
    media = (ids[0] == cfg.audio_token_id) | (ids[0] == cfg.image_token_id) | (ids[0] == cfg.video_token_id)
    embeds[:n][media] = 0.0
    rows = embeds + last
    text_table, codec_table = thinker.get_input_embeddings(), talker.get_input_embeddings()

    def emb(table, i: int) -> torch.Tensor:
        return table(torch.tensor([i]))[0]

    bos = int(model.speaker_map[VOICE]["bos_token"])
    add = 1.0 if as_intended else 0.0
    prefill = torch.cat([
        rows[:n],
        (emb(text_table, bos) + add * emb(codec_table, talker.codec_pad_token))[None],
        (rows[n] + add * emb(codec_table, talker.codec_bos_token))[None],
    ])
    reply = [*rows[n + 1 :], emb(text_table, talker.text_eos_token)]
    pad = emb(text_table, talker.text_pad_token)
    if as_intended:
        text_ids = torch.cat([ids, torch.tensor([[bos, thinker_tokens[0]]])], dim=1)
        lengths = inputs["feature_attention_mask"].sum(-1) if "feature_attention_mask" in inputs else None
        positions, delta = talker.get_rope_index(
            text_ids, inputs.get("image_grid_thw"), inputs.get("video_grid_thw"), torch.ones_like(text_ids), False,
            lengths, inputs.get("video_second_per_grid"),
        )
        delta = int(delta[0, 0])
    else:
        positions, delta = torch.arange(n + 2).view(1, 1, -1).expand(3, 1, -1), 0
    history = [talker.codec_mask_token] * n + [talker.codec_pad_token, talker.codec_bos_token]
    penalty = RepetitionPenaltyLogitsProcessor(1.05)
    sequence, codes = prefill, []
    for step in range(TALKER_CODES):
        steps = (torch.arange(n + 2, n + 2 + step) + delta).view(1, 1, -1).expand(3, 1, -1)
        hidden = talker.model(inputs_embeds=talker.thinker_to_talker_proj(sequence)[None],
                              position_ids=torch.cat([positions, steps], dim=2)).last_hidden_state
        logits = penalty(torch.tensor([history + codes]), talker.codec_head(hidden[:, -1]).float())
        logits[0, [talker.codec_pad_token, talker.codec_eos_token, talker.codec_bos_token]] = float("-inf")
        codes.append(int(logits.argmax()))
        step_input = emb(codec_table, codes[-1]) + (reply[step] if step < len(reply) else pad)
        sequence = torch.cat([sequence, step_input[None]])
    return codes


def test_reference_is_deterministic_and_sized(tiny_qwen2_5_omni: str) -> None:
    a, b = reference_text(tiny_qwen2_5_omni), reference_text(tiny_qwen2_5_omni)
    assert (a.thinker_tokens, a.talker_codes) == (b.thinker_tokens, b.talker_codes)
    assert torch.equal(a.waveform, b.waveform)
    assert len(a.thinker_tokens) == THINKER_TOKENS and len(set(a.thinker_tokens)) >= 5
    assert len(a.talker_codes) == TALKER_CODES and max(a.talker_codes) < NUM_CODES and len(set(a.talker_codes)) >= 5
    assert a.waveform.shape == (TALKER_CODES * 480,) and a.waveform.abs().max() > 0.05
    other_seed = reference_text(tiny_qwen2_5_omni, seed=1)
    assert other_seed.talker_codes == a.talker_codes and not torch.equal(other_seed.waveform, a.waveform)


@pytest.mark.parametrize("prompt", ["text", "image_audio"])
def test_notes_reproduce_hf(tiny_qwen2_5_omni: str, prompt: str) -> None:
    model, processor = load_hf(tiny_qwen2_5_omni)
    inputs = text_inputs(processor) if prompt == "text" else image_audio_inputs(processor)
    ref = reference_text(tiny_qwen2_5_omni) if prompt == "text" else reference_image_audio(tiny_qwen2_5_omni)
    assert ref.prompt_ids == inputs["input_ids"][0].tolist()
    assert talker_from_notes(model, inputs, ref.thinker_tokens) == ref.talker_codes
    speaker = model.speaker_map[VOICE]
    torch.manual_seed(0)  # token2wav: its starting noise is the first draw after seeding
    with torch.no_grad():
        wav = model.token2wav(torch.tensor([ref.talker_codes]), conditioning=speaker["cond"],
                              reference_mel=speaker["ref_mel"]).reshape(-1)
    assert torch.equal(wav, ref.waveform)
    # generate as released skips the codec pad/bos additions and M-RoPE for the talker (see the notes)
    released = run_hf(model, inputs, talker_as_intended=False)
    assert released.thinker_tokens == ref.thinker_tokens
    assert talker_from_notes(model, inputs, ref.thinker_tokens, as_intended=False) == released.talker_codes
