"""A tiny random-weight Stable Audio Open checkpoint in the released diffusers layout of
stabilityai/stable-audio-open-1.0 (`StableAudioPipeline`: model_index.json + one subfolder per component), built
locally: a T5 encoder with a unigram T5 tokenizer trained on the bundled corpus, the projection model (text
projection + seconds_start / seconds_total conditioners), `StableAudioDiTModel`, a stereo `AutoencoderOobleck` and
the released `CosineDPMSolverMultistepScheduler`, weights saved as safetensors by `save_pretrained`.

Scaled down where the released configs are large: 8 kHz audio (44.1 kHz released), a 32x VAE hop (2048), a latent
window of 250 frames (1024), so the model's longest clip is 1 s (47.55 s), and a 32-token text length (128).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

# Bump whenever the produced files change, so stale cached checkpoints are not reused.
FACTORY_VERSION = 1
VARIANTS = ("open-1.0",)

SAMPLE_RATE = 8000
HOP = (4, 8)  # the VAE's downsampling ratios: 32 samples per latent frame
WINDOW = 250  # the DiT's latent frames (`sample_size`): SAMPLE_RATE * 1 s / 32
MAX_SECONDS = 10  # the seconds conditioners' range [0, MAX_SECONDS]
TEXT_LENGTH = 32  # the tokenizer's model_max_length: every prompt is padded to it
_TEXT_DIM = 32  # T5's width
_COND_DIM = 16  # the projection's output: cross-attention input, and half the global input
_LATENT_CHANNELS = 4


def make_tiny_stable_audio(out_dir: str | Path, variant: str = "open-1.0", seed: int = 0) -> Path:
    """Write a tiny StableAudioPipeline directory to `out_dir`."""
    from diffusers import (
        AutoencoderOobleck,
        CosineDPMSolverMultistepScheduler,
        StableAudioDiTModel,
        StableAudioPipeline,
        StableAudioProjectionModel,
    )
    from transformers import T5Config, T5EncoderModel, T5TokenizerFast

    from omnistage.testing.flux import _t5_tokenizer

    if variant not in VARIANTS:
        raise ValueError(f"unknown Stable Audio variant {variant!r}; expected one of {list(VARIANTS)}")
    out = Path(out_dir)
    with tempfile.TemporaryDirectory() as tmp:
        size = _t5_tokenizer(Path(tmp))
        tokenizer = T5TokenizerFast.from_pretrained(tmp, model_max_length=TEXT_LENGTH)
    with torch.random.fork_rng(devices=[]):  # don't disturb the caller's RNG stream
        torch.manual_seed(seed)
        text_encoder = T5EncoderModel(T5Config(
            vocab_size=size, d_model=_TEXT_DIM, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
            relative_attention_num_buckets=8, relative_attention_max_distance=32, feed_forward_proj="relu",
            dropout_rate=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)).eval()
        projection = StableAudioProjectionModel(text_encoder_dim=_TEXT_DIM, conditioning_dim=_COND_DIM, min_value=0,
                                                max_value=MAX_SECONDS)
        transformer = StableAudioDiTModel(
            sample_size=WINDOW, in_channels=_LATENT_CHANNELS, num_layers=2, attention_head_dim=8,
            num_attention_heads=2, num_key_value_attention_heads=1, out_channels=_LATENT_CHANNELS,
            cross_attention_dim=16, time_proj_dim=16, global_states_input_dim=2 * _COND_DIM,
            cross_attention_input_dim=_COND_DIM)
        vae = AutoencoderOobleck(encoder_hidden_size=8, downsampling_ratios=list(HOP), channel_multiples=[1, 2],
                                 decoder_channels=8, decoder_input_channels=_LATENT_CHANNELS, audio_channels=2,
                                 sampling_rate=SAMPLE_RATE)
        # Random init leaves cross-attention nearly uniform over the (mostly zero-padded) text tokens, so the prompt
        # barely moves the clip: scale the text path and its attention so the audio clearly depends on it.
        with torch.no_grad():
            for name, weight in transformer.named_parameters():
                if name.startswith("cross_attention_proj") or ".attn2." in name:
                    weight.mul_(3.0)
    # The released scheduler config: an SDE DPM-Solver on a cosine (arctan) timestep map, v-prediction.
    scheduler = CosineDPMSolverMultistepScheduler(sigma_min=0.3, sigma_max=500.0, sigma_data=1.0,
                                                  sigma_schedule="exponential", solver_order=2,
                                                  prediction_type="v_prediction", final_sigmas_type="zero")
    pipe = StableAudioPipeline(vae=vae, text_encoder=text_encoder, projection_model=projection, tokenizer=tokenizer,
                               transformer=transformer, scheduler=scheduler)
    pipe.save_pretrained(out, safe_serialization=True)
    return out


make_tiny = make_tiny_stable_audio  # the factory's entry point (testing/factory.py DIFFUSERS_LAYOUTS)


def tiny_stable_audio(seed: int = 0) -> Path:
    """A cached tiny Stable Audio checkpoint dir: `tiny_checkpoint("stable_audio")`."""
    from omnistage.testing.factory import tiny_checkpoint

    return tiny_checkpoint("stable_audio", seed)
