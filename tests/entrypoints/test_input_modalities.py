"""A part the model cannot take is a 400 naming the part and what the model accepts, never dropped silently."""

from __future__ import annotations

from openai_helpers import Served, assert_openai_error, assert_still_serving

PNG_1PX = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGNgYGD4DwABBAEAwS2O"
           "UAAAAABJRU5ErkJggg==")


def test_image_part_to_a_text_model_is_refused(real_served: Served) -> None:
    content = [{"type": "text", "text": "What is in it?"}, {"type": "image_url", "image_url": {"url": PNG_1PX}}]
    resp = real_served.http().post("/v1/chat/completions", json={
        "model": real_served.model, "messages": [{"role": "user", "content": content}], "max_tokens": 2})
    err = assert_openai_error(resp, 400, "messages[0].content[1]", "'image_url'", "accepts only text")
    assert err["param"] == "messages[0].content[1]"
    assert_still_serving(real_served)


def test_audio_part_in_a_later_message_is_refused(real_served: Served) -> None:
    audio = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": [audio]}]
    resp = real_served.http().post("/v1/chat/completions", json={
        "model": real_served.model, "messages": messages, "max_tokens": 2})
    assert_openai_error(resp, 400, "messages[2].content[0]", "'input_audio'")
