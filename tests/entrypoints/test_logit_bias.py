"""logit_bias on a real server: +100 makes greedy decoding pick the token, -100 keeps the greedy choice out; ids
outside the vocabulary and out-of-range biases are 400s; a biased request batched with others leaves theirs as is."""

from __future__ import annotations

import concurrent.futures

from openai_helpers import CHAT, Served, assert_openai_error


def _tokens(served: Served, **kw) -> list[int]:
    out = served.client().chat.completions.create(model=served.model, messages=CHAT, max_tokens=4, temperature=0,
                                                  extra_body={"return_token_ids": True}, **kw)
    return out.choices[0].token_ids


def test_bias_steers_greedy_decoding(real_served: Served) -> None:
    plain = _tokens(real_served)
    assert _tokens(real_served, logit_bias={"42": 100}) == [42] * 4
    banned = _tokens(real_served, logit_bias={str(plain[0]): -100})
    assert banned[0] != plain[0]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        mixed = list(pool.map(lambda kw: _tokens(real_served, **kw), [{}, {"logit_bias": {"42": 100}}] * 2))
    assert mixed == [plain, [42] * 4] * 2


def test_bad_bias_is_400(real_served: Served) -> None:
    http = real_served.http()
    base = {"model": real_served.model, "messages": CHAT, "max_tokens": 2}
    assert_openai_error(http.post("/v1/chat/completions", json={**base, "logit_bias": {"99999999": 1}}), 400,
                        "vocabulary")
    assert_openai_error(http.post("/v1/chat/completions", json={**base, "logit_bias": {"5": 101}}), 400,
                        "[-100, 100]")
