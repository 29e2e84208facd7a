"""What omnistage.media decodes is what Qwen2.5-Omni's HF processor takes: image, audio and a video with its
audio track (use_audio_in_video) become model inputs the tiny checkpoint runs on."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

for _module in ("torchvision", "soundfile", "soxr", "av", "PIL"):
    pytest.importorskip(_module, reason="needs the omni extra (pip install 'omnistage[omni]')")

from omnistage.media import load_part  # noqa: E402
from omnistage.testing.media_files import Image, make_video, png_bytes, sound_file, tone  # noqa: E402


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_decoded_media_feed_the_processor_and_model(tiny_qwen2_5_omni: str) -> None:
    from transformers import Qwen2_5OmniForConditionalGeneration, Qwen2_5OmniProcessor

    processor = Qwen2_5OmniProcessor.from_pretrained(tiny_qwen2_5_omni)
    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(tiny_qwen2_5_omni).eval()
    picture = Image.fromarray((np.random.RandomState(1).rand(40, 60, 3) * 255).astype(np.uint8))
    parts = [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{_b64(png_bytes(picture))}"}},
        {"type": "input_audio", "input_audio": {"data": _b64(sound_file(tone(300, 1.0, 22050), 22050, "WAV")),
                                                "format": "wav"}},
        {"type": "video_url", "video_url": {"url": _b64(make_video(frames=20, fps=10))}},
        {"type": "text", "text": "What do you see and hear?"},
    ]
    items = [load_part(p, f"messages[0].content[{i}]", use_audio_in_video=True) for i, p in enumerate(parts[:3])]
    image, audio, video = (item.value for item in items)
    text = processor.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True,
                                         tokenize=False)
    inputs = processor(
        text=[text], images=[image], videos=[video.frames], audio=[audio, video.audio], fps=video.fps,
        load_audio_from_video=True, audio_from_video_indices=[None, 0], return_tensors="pt",
    )
    ids = inputs["input_ids"][0]
    cfg = model.config.thinker_config
    assert (ids == cfg.image_token_id).sum() > 0 and (ids == cfg.video_token_id).sum() > 0
    # 1 s of standalone audio (25 tokens) + the video's 2 s track (50 tokens, a few more for AAC's padding),
    # the latter interleaved with the video's frames
    assert 25 + 50 <= (ids == cfg.audio_token_id).sum() <= 25 + 53
    assert inputs["video_second_per_grid"].tolist() == [1.0]  # 2 frames per temporal patch at 2 fps
    with torch.no_grad():
        logits = model.thinker(**inputs, use_audio_in_video=True).logits
    assert logits.shape[:2] == (1, ids.numel()) and torch.isfinite(logits).all()
