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


def test_the_backend_decode_equals_transformers_decode(tiny_qwen2: str, tiny_qwen2_5_omni: str) -> None:
    """The detokenizer calls the Rust tokenizer directly (transformers' wrapper costs more than the decoding);
    on windows of ids with special tokens, multi-byte pieces and both settings it gives transformers' text."""
    import random

    from omnistage.engine.ar.detokenizer import backend_decode

    for path in (tiny_qwen2, tiny_qwen2_5_omni):
        tok = AutoTokenizer.from_pretrained(path)
        ids = tok.encode(TEXT) + tok.all_special_ids + tok.encode(" more text 🎉")
        rng = random.Random(0)
        for skip in (True, False):
            fast = backend_decode(tok, skip)
            assert fast is not None
            for _ in range(200):
                window = rng.sample(ids, rng.randint(1, 8))
                assert fast(window) == tok.decode(window, skip_special_tokens=skip)
