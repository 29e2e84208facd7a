"""Qwen3-TTS-12Hz (issue 53): talker -> codec decoder. Not registered yet; see docs/families/qwen3_tts.md."""
