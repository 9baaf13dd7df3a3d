"""Stop strings: the tail-decoding check (engine/stops.py) against decoding the whole output."""

from __future__ import annotations

import functools
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st
from oracles.stops import reference_stop_text_len

from ngramspec import SamplingParams
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


def _check_every_prefix(data, min_tokens: int = 0, include: bool = False,
                        skip: bool = True) -> None:
    """For every prefix of a random output: the same stop decision and the same cut."""
    tok = _tokenizer()
    pool = _text_tokens()
    output = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=90))
    text = tok.decode(output, skip_special_tokens=skip)
    # Stop strings cut from the output's own text (so they occur), and one that may not.
    picks = st.tuples(st.integers(0, max(0, len(text) - 1)), st.integers(1, 12))
    stops = [text[a:a + n] or "x" for a, n in data.draw(st.lists(picks, min_size=1, max_size=3))]
    stops.append(data.draw(st.sampled_from(["\n\n", "STOP", "🙂", "return", "zzz"])))
    params = SamplingParams(ignore_eos=True, stop=stops, max_tokens=10**6, min_tokens=min_tokens,
                            include_stop_str_in_output=include, skip_special_tokens=skip)
    for n in range(1, len(output) + 1):
        seq = SimpleNamespace(params=params, token_ids=[7, *output[:n]], num_prompt_tokens=1,
                              eos_token_ids={2},
                              output_ids=output[:n], num_output_tokens=n, num_tokens=n + 1,
                              stop_text_len=None)
        expected = reference_stop_text_len(output[:n], tok, stops, min_tokens, include, skip)
        reason = check_stop(seq, tok, 10**6)
        assert (reason == "stop") == (expected is not None), (n, stops)
        assert seq.stop_text_len == expected


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_stop_check_equals_decoding_the_whole_output(data) -> None:
    _check_every_prefix(data)


@settings(max_examples=60, deadline=None)
@given(st.data(), st.integers(0, 30), st.booleans(), st.booleans())
def test_stop_check_with_min_tokens_include_and_special_tokens(data, min_tokens, include,
                                                               skip) -> None:
    """vLLM's options: min_tokens, include_stop_str_in_output, skip_special_tokens=False."""
    _check_every_prefix(data, min_tokens, include, skip)


def test_min_tokens_holds_back_eos_and_stop_token_ids() -> None:
    tok = _tokenizer()
    params = SamplingParams(max_tokens=10, min_tokens=3, stop_token_ids=[5])
    for n, last, expected in ((1, 2, None), (3, 2, None), (3, 5, None), (4, 2, "stop"),
                              (4, 5, "stop"), (4, 6, None), (10, 6, "length")):
        output = [9] * (n - 1) + [last]
        seq = SimpleNamespace(params=params, token_ids=[7, *output], num_prompt_tokens=1,
                              eos_token_ids={2}, output_ids=output, num_output_tokens=n,
                              num_tokens=n + 1, stop_text_len=None)
        assert check_stop(seq, tok, 10**6) == expected, (n, last)
