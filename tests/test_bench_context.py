"""bench context on a tiny model: every mode and context is measured, q=1 is the unit."""

from __future__ import annotations

import argparse

from ngramspec.bench.context_bench import QUERY_TOKENS, run


def test_context_bench_measures_every_mode_and_context(tiny_model_dirs) -> None:
    args = argparse.Namespace(modes=["float32", "bfloat16"], contexts=[16, 40], tokens=2,
                              repeats=1, model=str(tiny_model_dirs["llama"]), threads=2)
    r = run(args)
    assert r["kernels"] in {"amx", "avx512", "avx2", "scalar", "none"}
    assert set(r["modes"]) == {"float32", "bfloat16"}
    for rows in r["modes"].values():
        assert set(rows) == {16, 40}
        for row in rows.values():
            assert row["prefill_tok_s"] > 0 and row["decode_ms"] > 0
            assert row["verify_rel"][1] == 1.0 and set(row["verify_rel"]) == set(QUERY_TOKENS)
            assert all(v > 0 for v in row["verify_rel"].values())
