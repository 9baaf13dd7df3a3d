"""Named external corpora (suffix automata) under one global token budget.

A corpus is built outside the lock and published atomically: a failed load (duplicate name, empty
corpus, malformed file, budget exceeded) raises and leaves every existing corpus as it was; SGLang
once wiped them (#22294). Drafters read `snapshot()`, an immutable mapping that is replaced, never
mutated, so a drafter holding one never sees a half-built automaton or needs the lock.
"""

from __future__ import annotations

import threading
import types
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tqdm import tqdm

from ngramspec.corpus import ngc as persist
from ngramspec.corpus.readers import (
    SEPARATOR,
    CorpusError,
    Tokenizer,
    expand_paths,
    iter_documents,
    join_token_documents,
    tokenize_documents,
)

SAM_KIND = "sam"
CORPUS_FORMAT = 1

TokensOrDocuments = Sequence[int] | Sequence[Sequence[int]] | Sequence[str]


def _default_sam_class() -> type:
    from ngramspec.drafting.index.sam import SuffixAutomaton

    return SuffixAutomaton


def build_sam(chunks: Iterable[Sequence[int]], sam_class: type | None = None,
              progress: bool = False, desc: str = "corpus") -> Any:
    """Stream token chunks into a new automaton and finalize it."""
    sam = (sam_class or _default_sam_class())()
    with tqdm(desc=desc, unit="tok", disable=not progress, unit_scale=True) as bar:
        for chunk in chunks:
            sam.extend(list(chunk))
            bar.update(len(chunk))
    if sam.num_tokens == 0:
        raise CorpusError(f"{desc}: the corpus is empty")
    sam.finalize()
    return sam


def file_chunks(paths: Iterable[str | Path], tokenizer: Tokenizer,
                max_tokens: int) -> Iterator[list[int]]:
    if tokenizer is None:
        raise CorpusError("reading corpus files needs a tokenizer")
    return tokenize_documents(iter_documents(paths), tokenizer, max_tokens)


def build_corpus_file(paths: Iterable[str | Path], tokenizer: Tokenizer, out_path: str | Path,
                      max_tokens: int = 10_000_000, sam_class: type | None = None,
                      progress: bool = True) -> dict[str, Any]:
    """Tokenise `paths`, build the finalized automaton and save it as a .ngc file.

    Returns the stored corpus metadata ({"num_tokens", "sources", ...}).
    """
    files = [str(f) for f in expand_paths(paths)]
    sam = build_sam(file_chunks(files, tokenizer, max_tokens), sam_class, progress,
                    desc=Path(out_path).name)
    sam_meta, arrays = sam.to_arrays()
    meta = {"corpus_format": CORPUS_FORMAT, "num_tokens": int(sam.num_tokens),
            "sources": files, "separator": SEPARATOR, "sam": sam_meta}
    persist.save(out_path, SAM_KIND, meta, arrays)
    return meta


def load_corpus_file(path: str | Path, sam_class: type | None = None) -> Any:
    """The automaton stored in a .ngc file, restored from its arrays (never rebuilt)."""
    meta, arrays = persist.load(path, SAM_KIND)
    if meta.get("corpus_format", 0) > CORPUS_FORMAT or "sam" not in meta:
        raise persist.CorruptFileError(path, "not a corpus file of a supported format")
    return (sam_class or _default_sam_class()).from_arrays(meta["sam"], arrays)


def corpus_file_info(path: str | Path) -> dict[str, Any]:
    meta, arrays = persist.load(path, SAM_KIND)
    info = {k: v for k, v in meta.items() if k != "sam"}
    info["arrays"] = {name: {"dtype": a.dtype.str, "shape": list(a.shape), "nbytes": a.nbytes}
                      for name, a in arrays.items()}
    info["array_bytes"] = sum(a.nbytes for a in arrays.values())
    info["file_bytes"] = Path(path).stat().st_size
    return info


class ExternalCorpora:
    """Thread-safe named corpora sharing `max_tokens` (separators included, as in SGLang)."""

    def __init__(self, max_tokens: int = 10_000_000, progress: bool = True,
                 sam_class: type | None = None) -> None:
        if max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        self.max_tokens = max_tokens
        self.progress = progress
        self._sam_class = sam_class
        self._lock = threading.Lock()
        self._published: Mapping[str, Any] = types.MappingProxyType({})
        self._sizes: dict[str, int] = {}
        self._loading: set[str] = set()  # names reserved by loads in flight
        self._executor: ThreadPoolExecutor | None = None

    # ---- reading -------------------------------------------------------------------------
    def snapshot(self) -> Mapping[str, Any]:
        """An immutable name -> automaton view; later adds/removes do not change it."""
        return self._published

    def list(self) -> dict[str, int]:
        with self._lock:
            return dict(self._sizes)

    @property
    def remaining_tokens(self) -> int:
        with self._lock:
            return self.max_tokens - sum(self._sizes.values())

    def __len__(self) -> int:
        return len(self._published)

    def __contains__(self, name: object) -> bool:
        return name in self._published

    # ---- adding --------------------------------------------------------------------------
    def add(self, name: str, data: TokensOrDocuments, tokenizer: Tokenizer | None = None) -> int:
        """Add a token stream (list[int]), token documents (list[list[int]]) or text documents
        (list[str], needs `tokenizer`). Returns the corpus size in tokens."""
        return self._load(name, self._data_builder(name, data, tokenizer))

    def add_files(self, name: str, paths: Iterable[str | Path], tokenizer: Tokenizer) -> int:
        return self._load(name, self._files_builder(name, paths, tokenizer))

    def add_built(self, name: str, path: str | Path) -> int:
        """Add a corpus saved by `build_corpus_file` (a .ngc file); nothing is re-tokenised."""
        return self._load(name, lambda budget: load_corpus_file(path, self._sam_class))

    # The async variants reserve the name before returning, so a second add of the same name
    # fails at once even if the loader thread has not started yet. Every error, including a
    # duplicate name, is reported through the future.
    def add_async(self, name: str, data: TokensOrDocuments,
                  tokenizer: Tokenizer | None = None) -> Future[int]:
        return self._submit(name, self._data_builder(name, data, tokenizer))

    def add_files_async(self, name: str, paths: Iterable[str | Path],
                        tokenizer: Tokenizer) -> Future[int]:
        return self._submit(name, self._files_builder(name, paths, tokenizer))

    def add_built_async(self, name: str, path: str | Path) -> Future[int]:
        return self._submit(name, lambda budget: load_corpus_file(path, self._sam_class))

    # ---- removing ------------------------------------------------------------------------
    def remove(self, name: str) -> bool:
        """Drop a corpus and free its budget; an unknown name is a no-op (returns False)."""
        with self._lock:
            if name not in self._sizes:
                return False
            del self._sizes[name]
            self._publish({k: v for k, v in self._published.items() if k != name})
            return True

    def clear(self) -> None:
        with self._lock:
            self._sizes.clear()
            self._publish({})

    def close(self) -> None:
        """Wait for background loads and stop the loader thread."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    # ---- internals -----------------------------------------------------------------------
    def _publish(self, corpora: dict[str, Any]) -> None:
        # Replace, never mutate: snapshots already handed out stay valid and consistent.
        self._published = types.MappingProxyType(corpora)

    def _submit(self, name: str, build: Callable[[int], Any]) -> Future[int]:
        try:
            budget = self._reserve(name)
        except CorpusError as e:
            failed: Future[int] = Future()
            failed.set_exception(e)
            return failed
        with self._lock:
            if self._executor is None:
                # One loader thread: loads queue up instead of competing for CPU and memory.
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="corpus-loader")
            return self._executor.submit(self._finish, name, budget, build)

    def _load(self, name: str, build: Callable[[int], Any]) -> int:
        return self._finish(name, self._reserve(name), build)

    def _finish(self, name: str, budget: int, build: Callable[[int], Any]) -> int:
        """Build (slow, outside the lock) and publish; always releases the reserved name."""
        try:
            sam = build(budget)
            size = int(sam.num_tokens)
            if size == 0:
                raise CorpusError(f"corpus {name!r} is empty")
            with self._lock:
                left = self.max_tokens - sum(self._sizes.values())
                if size > left:
                    raise CorpusError(f"corpus {name!r} has {size} tokens, which exceeds the "
                                      f"remaining token budget {left} of {self.max_tokens}")
                self._sizes[name] = size
                self._publish({**self._published, name: sam})
            return size
        finally:
            with self._lock:
                self._loading.discard(name)

    def _reserve(self, name: str) -> int:
        """Claim `name` for a load in flight; returns the token budget left right now."""
        if not isinstance(name, str) or not name:
            raise CorpusError(f"a corpus name must be a non-empty string, got {name!r}")
        with self._lock:
            if name in self._sizes or name in self._loading:
                raise CorpusError(f"corpus {name!r} already exists; remove it before re-adding")
            left = self.max_tokens - sum(self._sizes.values())
            if left <= 0:
                raise CorpusError(f"no token budget left ({self.max_tokens} in use)")
            self._loading.add(name)
            return left

    def _files_builder(self, name: str, paths: Iterable[str | Path],
                       tokenizer: Tokenizer) -> Callable[[int], Any]:
        paths = list(paths)
        return lambda budget: build_sam(file_chunks(paths, tokenizer, budget), self._sam_class,
                                        self.progress, desc=name)

    def _data_builder(self, name: str, data: TokensOrDocuments,
                      tokenizer: Tokenizer | None) -> Callable[[int], Any]:
        items = list(data)  # copied now: the caller may reuse its list while we load
        return lambda budget: self._build_from_data(name, items, tokenizer, budget)

    def _build_from_data(self, name: str, items: list[Any], tokenizer: Tokenizer | None,
                         budget: int) -> Any:
        if items and all(isinstance(x, str) for x in items):
            if tokenizer is None:
                raise CorpusError(f"corpus {name!r}: text documents need a tokenizer")
            docs = ((text, f"documents[{i}]", 1) for i, text in enumerate(items))
            chunks: Iterable[Sequence[int]] = tokenize_documents(docs, tokenizer, budget)
        elif items and all(isinstance(x, Iterable) and not isinstance(x, str) for x in items):
            chunks = [join_token_documents(items, budget)]
        elif all(isinstance(x, int) or hasattr(x, "__index__") for x in items):
            chunks = [self._check_stream(name, items, budget)]
        else:
            raise CorpusError(f"corpus {name!r}: expected a token list, a list of token lists "
                              "or a list of strings")
        return build_sam(chunks, self._sam_class, self.progress, desc=name)

    @staticmethod
    def _check_stream(name: str, tokens: list[Any], budget: int) -> list[int]:
        ids = [int(t) for t in tokens]
        if len(ids) > budget:
            raise CorpusError(f"corpus {name!r}: the corpus exceeds the token budget {budget} "
                              f"({len(ids)} tokens)")
        return ids
