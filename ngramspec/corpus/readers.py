"""Reading external corpora from files into one token stream, documents joined by SEPARATOR.

Accepted inputs (a path, a directory searched recursively, or a glob pattern):
- `*.jsonl` / `*.json`: one document per non-blank line, either a JSON string or {"text": "..."}.
- anything else: a UTF-8 text file is one document.

Errors name the file and line. The token budget is checked while reading, so an oversized corpus
fails after reading at most `max_tokens` tokens rather than after tokenising everything.
"""

from __future__ import annotations

import glob
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Protocol

# Same value as `sam.SEPARATOR` (INT32_MIN, SGLang's SEPARATOR_TOKEN); kept here so readers do not
# depend on the automaton module. tests/test_corpus.py asserts they agree.
SEPARATOR = -(2**31)
CHUNK_TOKENS = 4096
JSONL_SUFFIXES = (".jsonl", ".json")


class CorpusError(ValueError):
    """A corpus could not be read or does not fit; the message names the file and line."""


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


def _skipped(relative: Path) -> bool:
    # Hidden files and folders (.git, .cache) and bytecode caches are never corpus material.
    return any(part.startswith(".") or part == "__pycache__" for part in relative.parts)


def expand_paths(paths: Iterable[str | Path]) -> list[Path]:
    """Files named by `paths`: files as given, directories recursively, globs sorted."""
    files: list[Path] = []
    for p in paths:
        text = str(p)
        if glob.has_magic(text):
            matches = sorted(Path(m) for m in glob.glob(text, recursive=True))
            found = [m for m in matches if m.is_file()]
            if not found:
                raise CorpusError(f"{text}: the pattern matches no file")
            files += found
        elif Path(text).is_dir():
            files += sorted(f for f in Path(text).rglob("*")
                            if f.is_file() and not _skipped(f.relative_to(text)))
        elif Path(text).is_file():
            files.append(Path(text))
        else:
            raise CorpusError(f"{text}: no such file or directory")
    return files


def _jsonl_documents(path: Path, lines: Iterable[str]) -> Iterator[tuple[str, int]]:
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            raise CorpusError(f"{path}:{number}: malformed JSON ({e.msg})") from e
        if isinstance(value, dict) and isinstance(value.get("text"), str):
            value = value["text"]
        if not isinstance(value, str):
            raise CorpusError(
                f"{path}:{number}: expected a JSON string or an object with a string \"text\" "
                f"field, got {type(value).__name__}")
        yield value, number


def iter_documents(paths: Iterable[str | Path]) -> Iterator[tuple[str, str, int]]:
    """(text, file, line) per document; line is 1 for whole-file documents."""
    for path in expand_paths(paths):
        try:
            with open(path, encoding="utf-8") as f:
                if path.suffix.lower() in JSONL_SUFFIXES:
                    for text, line in _jsonl_documents(path, f):
                        yield text, str(path), line
                else:
                    yield f.read(), str(path), 1
        except UnicodeDecodeError as e:
            raise CorpusError(f"{path}: unreadable file (not UTF-8 text: {e.reason})") from e
        except OSError as e:
            raise CorpusError(f"{path}: unreadable file ({e.strerror or e})") from e


def tokenize_documents(
    documents: Iterable[tuple[str, str, int]], tokenizer: Tokenizer, max_tokens: int
) -> Iterator[list[int]]:
    """Token chunks (≤ CHUNK_TOKENS) of all documents, one SEPARATOR before every document but
    the first. Empty documents are skipped. Raises CorpusError as soon as the budget is exceeded."""
    if max_tokens <= 0:
        raise CorpusError(f"the token budget must be positive, got {max_tokens}")
    total, chunk = 0, []
    for text, file, line in documents:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if not ids:
            continue
        if total:
            ids = [SEPARATOR, *ids]
        if total + len(ids) > max_tokens:
            raise CorpusError(f"the corpus exceeds the token budget {max_tokens} "
                              f"at {file}:{line} after {total} tokens")
        total += len(ids)
        chunk += ids
        while len(chunk) >= CHUNK_TOKENS:
            yield chunk[:CHUNK_TOKENS]
            chunk = chunk[CHUNK_TOKENS:]
    if chunk:
        yield chunk


def join_token_documents(documents: Iterable[Iterable[int]], max_tokens: int) -> list[int]:
    """Token documents joined by SEPARATOR (empty ones skipped), with the same budget rule."""
    stream: list[int] = []
    for number, doc in enumerate(documents, 1):
        ids = [int(t) for t in doc]
        if any(t == SEPARATOR for t in ids):
            raise CorpusError(f"document {number}: contains the separator token {SEPARATOR}")
        if not ids:
            continue
        if stream:
            ids = [SEPARATOR, *ids]
        if len(stream) + len(ids) > max_tokens:
            raise CorpusError(f"the corpus exceeds the token budget {max_tokens} "
                              f"at document {number} after {len(stream)} tokens")
        stream += ids
    return stream
