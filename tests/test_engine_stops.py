"""Stop strings: the tail-decoding check (engine/stops.py) against decoding the whole output."""

from __future__ import annotations

import functools
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st
from oracles.stops import reference_stop_text_len

from ngramspec.engine.stops import check_stop
from ngramspec.models.loader import load_tokenizer


@functools.cache
def _tokenizer():
    return load_tokenizer(None)


def _text_tokens() -> list[int]:
    """Ids that decode to ordinary text, multi-byte characters, and special tokens."""
    tok = _tokenizer()
    words = ("def f(x):\n    return x  # done\n"
             "Ünïcödé ✓ 日本語のテキスト 🙂 <|im_end|> stop STOP\n\n")
    ids = tok.encode(words, add_special_tokens=False)
    return sorted(set(ids) | {0, 1, 2, 200, 1000, 30000})


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_stop_check_equals_decoding_the_whole_output(data) -> None:
    """For every prefix of a random output: the same stop decision and the same cut."""
    tok = _tokenizer()
    pool = _text_tokens()
    output = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=90))
    text = tok.decode(output, skip_special_tokens=True)
    # Stop strings cut from the output's own text (so they occur), and one that may not.
    picks = st.tuples(st.integers(0, max(0, len(text) - 1)), st.integers(1, 12))
    stops = [text[a:a + n] or "x" for a, n in data.draw(st.lists(picks, min_size=1, max_size=3))]
    stops.append(data.draw(st.sampled_from(["\n\n", "STOP", "🙂", "return", "zzz"])))
    params = SimpleNamespace(ignore_eos=True, stop_token_ids=[], stop=stops, max_tokens=10**6)
    for n in range(1, len(output) + 1):
        seq = SimpleNamespace(params=params, token_ids=[7, *output[:n]], num_prompt_tokens=1,
                              eos_token_ids={2},
                              output_ids=output[:n], num_output_tokens=n, num_tokens=n + 1,
                              stop_text_len=None)
        expected = reference_stop_text_len(output[:n], tok, stops)
        reason = check_stop(seq, tok, 10**6)
        assert (reason == "stop") == (expected is not None), (n, stops)
        assert seq.stop_text_len == expected
