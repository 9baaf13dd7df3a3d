"""Source ids stored in `DraftTree.sources`: which index proposed a node (-1 = the root)."""

from __future__ import annotations

ROOT_SOURCE = -1
CONTEXT = 0  # the request's own prompt, output and reference documents
TRIE = 1  # the global trie learned online across requests
CORPUS = 2  # an external corpus (suffix automaton)

SOURCE_NAMES = {CONTEXT: "context", TRIE: "trie", CORPUS: "corpus"}
NUM_SOURCES = len(SOURCE_NAMES)
# Tokens a request's grammar forces, added by the engine (no drafter index proposes them).
GRAMMAR = 3
