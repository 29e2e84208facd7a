from transformers import AutoTokenizer

from omnistage.engine.ar.detokenizer import IncrementalDetokenizer

TEXT = "Grüße, naïve café — 東京 and emoji 🎉 done."


def test_incremental_text_equals_full_decode(tiny_qwen2: str) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_qwen2)
    prompt = tok.encode("Prompt: ")
    ids = tok.encode(TEXT)
    det = IncrementalDetokenizer(tok, prompt)
    pieces = []
    for t in ids:
        det.add(t)
        pieces.append(det.take(final=False))
    pieces.append(det.take(final=True))
    assert "".join(pieces) == tok.decode(ids) == TEXT
    assert all("\ufffd" not in p for p in pieces)  # multi-byte characters are never split


def test_stop_string_is_held_back_and_cut(tiny_qwen2: str) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_qwen2)
    det = IncrementalDetokenizer(tok, [], stop=["café"])
    streamed = ""
    for t in tok.encode(TEXT):
        if det.add(t):
            break
        streamed += det.take(final=False)
    streamed += det.take(final=True)
    assert streamed == "Grüße, naïve "
