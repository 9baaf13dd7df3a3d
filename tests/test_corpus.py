"""External corpora: file readers and their errors, the budget, the named manager, .ngc files."""

from __future__ import annotations

import importlib.util
import json
import threading
from typing import Any

import numpy as np
import pytest

from ngramspec.corpus import readers as corpus_files
from ngramspec.corpus.ngc import CorruptFileError
from ngramspec.corpus.readers import SEPARATOR, CorpusError, iter_documents, tokenize_documents
from ngramspec.corpus.registry import (
    ExternalCorpora,
    build_corpus_file,
    corpus_file_info,
    load_corpus_file,
)


class CharTokenizer:
    """One token per character (its code point): easy to predict, like an HF tokenizer's encode."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert add_special_tokens is False  # corpora must never contain BOS/EOS
        return [ord(c) for c in text]


class StubSAM:
    """Records what it was fed; `from_arrays` restores without calling `extend`."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.finalized = False
        self.extend_calls = 0

    def extend(self, tokens: list[int]) -> None:
        assert not self.finalized
        self.extend_calls += 1
        self.tokens += tokens

    def finalize(self) -> None:
        self.finalized = True

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def to_arrays(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        return {"stub": True}, {"tokens": np.array(self.tokens, dtype=np.int32)}

    @classmethod
    def from_arrays(cls, meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> StubSAM:
        assert meta == {"stub": True}
        sam = cls()
        sam.tokens, sam.finalized = arrays["tokens"].tolist(), True
        return sam


def sam_classes() -> list[Any]:
    classes: list[Any] = [StubSAM]
    if importlib.util.find_spec("ngramspec.drafting.index.sam") is not None:
        from ngramspec.drafting.index.sam import SuffixAutomaton

        classes.append(SuffixAutomaton)
    return classes


@pytest.fixture(params=sam_classes(), ids=lambda c: c.__name__)
def sam_class(request):
    return request.param


TOK = CharTokenizer()


def write(path, text: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def all_tokens(paths, max_tokens=10**6) -> list[int]:
    return [t for c in tokenize_documents(iter_documents(paths), TOK, max_tokens) for t in c]


# ---- readers ------------------------------------------------------------------------------------

def test_jsonl_strings_objects_and_blank_lines(tmp_path):
    f = write(tmp_path / "a.jsonl", '"ab"\n\n  \n{"text": "cd", "meta": 1}\n""\n"e"\n')
    # Empty documents are skipped and cost no separator.
    assert all_tokens([f]) == [97, 98, SEPARATOR, 99, 100, SEPARATOR, 101]


def test_text_files_directories_and_globs(tmp_path):
    write(tmp_path / "d" / "b.txt", "xy")
    write(tmp_path / "d" / "sub" / "a.md", "z")
    write(tmp_path / "d" / ".hidden" / "c.txt", "never")
    write(tmp_path / "d" / "e.jsonl", '"q"\n')
    by_dir = all_tokens([tmp_path / "d"])
    # Directory order is sorted by path: b.txt, e.jsonl, sub/a.md; hidden folders are skipped.
    assert by_dir == [ord("x"), ord("y"), SEPARATOR, ord("q"), SEPARATOR, ord("z")]
    assert all_tokens([str(tmp_path / "d" / "**" / "*.md")]) == [ord("z")]
    assert all_tokens([tmp_path / "d" / "b.txt", tmp_path / "d" / "b.txt"]) == [
        ord("x"), ord("y"), SEPARATOR, ord("x"), ord("y")]


@pytest.mark.parametrize(("text", "match"), [
    ('"ok"\n{bad json\n', r"a\.jsonl:2: malformed JSON"),
    ('"ok"\n\n[1, 2]\n', r"a\.jsonl:3: expected a JSON string or an object .* got list"),
    ('{"text": 5}\n', r"a\.jsonl:1: expected a JSON string .* got dict"),
    ('3\n', r"a\.jsonl:1: .* got int"),
])
def test_jsonl_errors_name_file_and_line(tmp_path, text, match):
    f = write(tmp_path / "a.jsonl", text)
    with pytest.raises(CorpusError, match=match):
        all_tokens([f])


def test_missing_unreadable_and_unmatched_paths(tmp_path):
    with pytest.raises(CorpusError, match=r"nope\.jsonl: no such file"):
        all_tokens([tmp_path / "nope.jsonl"])
    with pytest.raises(CorpusError, match="matches no file"):
        all_tokens([str(tmp_path / "*.zzz")])
    bad = tmp_path / "bin.txt"
    bad.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(CorpusError, match=r"bin\.txt: unreadable file"):
        all_tokens([bad])


def test_budget_is_exact_and_fails_fast(tmp_path):
    f = write(tmp_path / "a.jsonl", '"abc"\n"de"\n"f"\n')
    # 3 + (1 + 2) + (1 + 1) = 8 tokens, separators included.
    assert len(all_tokens([f], max_tokens=8)) == 8
    with pytest.raises(CorpusError,
                       match=r"exceeds the token budget 7 at .*a\.jsonl:3 after 6 tokens"):
        all_tokens([f], max_tokens=7)

    class CountingTokenizer(CharTokenizer):
        calls = 0

        def encode(self, text, add_special_tokens=True):
            self.calls += 1
            return super().encode(text, add_special_tokens)

    big = write(tmp_path / "big.jsonl", '"xxxx"\n' * 1000)
    tok = CountingTokenizer()
    with pytest.raises(CorpusError):
        list(tokenize_documents(iter_documents([big]), tok, 20))
    assert tok.calls == 5  # stopped at the first document over budget, not at the end of the file


def test_chunks_are_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus_files, "CHUNK_TOKENS", 3)
    f = write(tmp_path / "a.jsonl", '"abcdefg"\n"hi"\n')
    chunks = list(tokenize_documents(iter_documents([f]), TOK, 100))
    assert all(1 <= len(c) <= 3 for c in chunks)
    assert [t for c in chunks for t in c] == [*map(ord, "abcdefg"), SEPARATOR, *map(ord, "hi")]


def test_separator_matches_the_automaton():
    if importlib.util.find_spec("ngramspec.drafting.index.sam") is None:
        pytest.skip("ngramspec.drafting.index.sam not written yet")
    from ngramspec.drafting.index import sam

    assert sam.SEPARATOR == SEPARATOR == -(2**31)


# ---- manager ------------------------------------------------------------------------------------

def test_add_list_snapshot_remove_budget(sam_class):
    corpora = ExternalCorpora(max_tokens=20, progress=False, sam_class=sam_class)
    assert corpora.add("a", [[1, 2, 3], [], [4, 5]]) == 6  # 1 2 3 SEP 4 5
    assert corpora.add("b", [7, 8, 9]) == 3
    assert corpora.add("c", ["hi", "", "yo"], tokenizer=TOK) == 5
    assert corpora.list() == {"a": 6, "b": 3, "c": 5}
    assert corpora.remaining_tokens == 6
    before = corpora.snapshot()
    assert set(before) == {"a", "b", "c"}
    assert corpora.remove("b") is True
    assert corpora.remove("b") is False  # unknown name: a no-op
    assert corpora.remaining_tokens == 9
    assert set(corpora.snapshot()) == {"a", "c"}
    assert set(before) == {"a", "b", "c"}  # a snapshot never changes afterwards
    with pytest.raises(TypeError):
        before["x"] = None  # type: ignore[index]
    corpora.clear()
    assert corpora.list() == {} and corpora.remaining_tokens == 20


def test_stub_sam_receives_the_joined_stream():
    corpora = ExternalCorpora(max_tokens=100, progress=False, sam_class=StubSAM)
    corpora.add("a", [[1, 2], [3]])
    sam = corpora.snapshot()["a"]
    assert sam.tokens == [1, 2, SEPARATOR, 3] and sam.finalized


def test_failed_adds_leave_existing_corpora_intact(tmp_path, sam_class):
    corpora = ExternalCorpora(max_tokens=10, progress=False, sam_class=sam_class)
    corpora.add("keep", [1, 2, 3])
    kept = corpora.snapshot()["keep"]
    bad_json = write(tmp_path / "bad.jsonl", '"ok"\n{oops\n')
    big = write(tmp_path / "big.jsonl", '"abcdefgh"\n')
    cases = [
        (lambda: corpora.add("keep", [4]), "already exists"),
        (lambda: corpora.add("e", []), "empty"),
        (lambda: corpora.add("e", [[], []]), "empty"),
        (lambda: corpora.add("e", ["a"]), "need a tokenizer"),
        (lambda: corpora.add("e", [[1], "x"]), "expected a token list"),
        (lambda: corpora.add("e", [[1, SEPARATOR]]), "separator"),
        (lambda: corpora.add_files("e", [bad_json], TOK), r"bad\.jsonl:2: malformed JSON"),
        (lambda: corpora.add_files("e", [big], TOK), "exceeds the token budget 7"),
        (lambda: corpora.add_files("e", [tmp_path / "missing"], TOK), "no such file"),
        (lambda: corpora.add_built("e", bad_json), "not an ngramspec file"),
        (lambda: corpora.add("", [1]), "non-empty string"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()
        assert corpora.list() == {"keep": 3}
        assert corpora.snapshot()["keep"] is kept
    # A failed load releases its name.
    assert corpora.add("e", [5]) == 1


def test_budget_across_corpora_and_freed_on_remove(sam_class):
    corpora = ExternalCorpora(max_tokens=5, progress=False, sam_class=sam_class)
    corpora.add("a", [1, 2, 3])
    with pytest.raises(CorpusError, match="exceeds the token budget 2"):
        corpora.add("b", [1, 2, 3])
    corpora.remove("a")
    assert corpora.add("b", [1, 2, 3, 4, 5]) == 5
    with pytest.raises(CorpusError, match="no token budget left"):
        corpora.add("c", [1])


def test_async_add_runs_in_background_and_reports_errors(tmp_path, sam_class):
    corpora = ExternalCorpora(max_tokens=1000, progress=False, sam_class=sam_class)
    gate = threading.Event()

    class SlowTokenizer(CharTokenizer):
        def encode(self, text, add_special_tokens=True):
            assert gate.wait(10)
            return super().encode(text, add_special_tokens)

    f = write(tmp_path / "a.jsonl", '"abc"\n"de"\n')
    future = corpora.add_files_async("slow", [f], SlowTokenizer())
    # While it loads, the caller keeps working: other adds and snapshots go through.
    corpora.add("other", [1, 2])
    assert not future.done() and set(corpora.snapshot()) == {"other"}
    with pytest.raises(CorpusError, match="already exists"):
        corpora.add("slow", [1])  # the name is reserved by the load in flight
    gate.set()
    assert future.result(timeout=10) == 6
    assert corpora.list() == {"other": 2, "slow": 6}
    failing = corpora.add_async("slow", [1])
    with pytest.raises(CorpusError, match="already exists"):
        failing.result(timeout=10)
    corpora.close()


def test_concurrent_adds_never_exceed_the_budget(sam_class):
    corpora = ExternalCorpora(max_tokens=50, progress=False, sam_class=sam_class)
    errors: list[Exception] = []

    def add(i: int) -> None:
        try:
            corpora.add(f"c{i}", list(range(1, 11)))
        except CorpusError as e:
            errors.append(e)

    threads = [threading.Thread(target=add, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(corpora.list().values()) <= 50
    assert len(corpora.list()) + len(errors) == 8 and len(corpora.list()) == 5


# ---- .ngc files ---------------------------------------------------------------------------------

def test_ngc_round_trip_does_not_rebuild(tmp_path, sam_class, monkeypatch):
    f = write(tmp_path / "docs.jsonl", "\n".join(json.dumps(s) for s in ["abcab", "cab", "b"]))
    out = tmp_path / "c.ngc"
    meta = build_corpus_file([f], TOK, out, max_tokens=100, sam_class=sam_class, progress=False)
    assert meta["num_tokens"] == 5 + 1 + 3 + 1 + 1
    info = corpus_file_info(out)
    assert info["num_tokens"] == 11 and info["sources"] == [str(f)]
    assert info["array_bytes"] > 0 and info["file_bytes"] >= info["array_bytes"]

    def no_extend(self, tokens):
        raise AssertionError("loading a .ngc must not rebuild the automaton")

    built = ExternalCorpora(progress=False, sam_class=sam_class)
    built.add_files("direct", [f], TOK)
    monkeypatch.setattr(sam_class, "extend", no_extend)
    loaded = load_corpus_file(out, sam_class)
    assert loaded.num_tokens == 11
    # Same arrays as building from the files directly.
    meta_a, arrays_a = loaded.to_arrays()
    meta_b, arrays_b = built.snapshot()["direct"].to_arrays()
    assert meta_a == meta_b and arrays_a.keys() == arrays_b.keys()
    for name in arrays_a:
        np.testing.assert_array_equal(arrays_a[name], arrays_b[name])
    assert built.add_built("file", out) == 11


def test_ngc_corrupt_and_wrong_kind(tmp_path):
    f = write(tmp_path / "docs.txt", "hello")
    out = tmp_path / "c.ngc"
    build_corpus_file([f], TOK, out, sam_class=StubSAM, progress=False)
    data = out.read_bytes()
    out.write_bytes(data[:-3])
    corpora = ExternalCorpora(progress=False, sam_class=StubSAM)
    with pytest.raises(CorruptFileError, match=r"c\.ngc: truncated"):
        corpora.add_built("x", out)
    from ngramspec.corpus import ngc as persist

    persist.save(out, "trie", {}, {})
    with pytest.raises(CorruptFileError, match="expected a 'sam'"):
        corpora.add_built("x", out)
    assert corpora.list() == {}


def test_corpus_cli_build_and_info(tmp_path, monkeypatch, capsys):
    pytest.importorskip("ngramspec.drafting.index.sam")
    from ngramspec.cli import main
    from ngramspec.models import loader

    asked = []
    monkeypatch.setattr(loader, "load_tokenizer", lambda model=None: asked.append(model) or TOK)
    write(tmp_path / "docs" / "a.jsonl", '"abc"\n{"text": "de"}\n')
    write(tmp_path / "docs" / "b.txt", "fgh")
    out = tmp_path / "c.ngc"
    assert main(["corpus", "build", str(tmp_path / "docs"), "-o", str(out), "--model", "m",
                 "--no-progress"]) == 0
    assert asked == ["m"]
    assert "10 tokens from 2 files" in capsys.readouterr().out  # 3 + 1 + 2 + 1 + 3
    assert main(["corpus", "info", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["num_tokens"] == 10 and len(info["sources"]) == 2
    with pytest.raises(SystemExit):  # a budget error becomes a one-line CLI error
        main(["corpus", "build", str(tmp_path / "docs"), "-o", str(out), "--max-tokens", "5",
              "--no-progress"])
    assert "exceeds the token budget 5" in capsys.readouterr().err
    assert corpus_file_info(out)["num_tokens"] == 10  # the failed build left the old file
