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


def test_ids_ending_mid_character_flush_at_finish(tiny_qwen2: str) -> None:
    """Output ids that stop inside a multi-byte character: nothing of it is streamed while running (it may
    complete), and at the finish the held bytes come out as decode spells them, so the streamed deltas and
    the whole text both equal `tokenizer.decode(output_ids)`."""
    tok = AutoTokenizer.from_pretrained(tiny_qwen2)
    for tail in ("é", "🎉", "東"):
        char_ids = tok.encode(tail)
        assert len(char_ids) > 1  # a byte-level split, else the test proves nothing
        for cut in range(1, len(char_ids)):
            ids = tok.encode("naïve caf") + char_ids[:cut]
            expected = tok.decode(ids, skip_special_tokens=True)
            assert expected.endswith("\ufffd")
            det = IncrementalDetokenizer(tok, tok.encode("Prompt: "))
            pieces = []
            for t in ids:
                det.add(t)
                pieces.append(det.take(final=False))
            assert "\ufffd" not in "".join(pieces)
            pieces.append(det.take(final=True))
            assert "".join(pieces) == det.text == expected, (tail, cut)
            assert det.take(final=True) == ""  # a second finish adds nothing


def test_flush_after_a_special_token_and_after_a_stop(tiny_qwen2: str) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_qwen2)
    ids = tok.encode("ok ") + tok.encode("🎉")[:2] + [tok.all_special_ids[0]]
    det = IncrementalDetokenizer(tok, [])
    for t in ids:
        det.add(t)
    assert det.take(final=True) == tok.decode(ids, skip_special_tokens=True)
    det = IncrementalDetokenizer(tok, [], stop=["ok"])  # a stop string ends the text: nothing held comes after
    ids = tok.encode("say ok") + tok.encode("é")[:1]
    assert any(det.add(t) for t in ids)  # stops at the first hit, as the engine does
    assert det.take(final=True) == "say "
