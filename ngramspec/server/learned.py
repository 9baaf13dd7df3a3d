"""The learned global corpus (the drafter's trie): save, restore, flush.

Functions taking the engine run on the engine thread (AsyncEngine.call); the file I/O and the
rebuild from arrays run elsewhere, so generation stalls only for the snapshot and the swap.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ngramspec.corpus import ngc as persist
from ngramspec.engine.engine import LLMEngine

STATE_KIND = "trie"

TrieArrays = tuple[dict[str, Any], dict[str, np.ndarray]]


class NoLearnedCorpus(ValueError):
    pass


def _drafter(engine: LLMEngine) -> Any:
    if engine.speculator is None:
        raise NoLearnedCorpus("speculation is off (start the server with --speculative ngram)")
    return engine.speculator.drafter


def _is_trie(trie: Any) -> bool:
    # The persistence API of drafting/index/trie.py (the SGLang preset's trie has none).
    return all(hasattr(trie, name) for name in ("to_arrays", "from_arrays", "reset", "epoch"))


def _trie(engine: LLMEngine) -> Any:
    trie = getattr(_drafter(engine), "trie", None)
    if not _is_trie(trie):
        raise NoLearnedCorpus("this drafter preset has no persistable learned corpus")
    return trie


def trie_class(engine: LLMEngine) -> type:
    """Engine thread: the class `read` should rebuild."""
    return type(_trie(engine))


def info(engine: LLMEngine) -> dict[str, Any]:
    """Engine thread."""
    trie = _trie(engine)
    return {"num_nodes": trie.num_nodes, "capacity": trie.capacity,
            "max_depth": trie.max_depth, "num_evicted": trie.num_evicted}


def snapshot(engine: LLMEngine) -> TrieArrays:
    """Engine thread: the trie as arrays (copies, so the trie may change afterwards)."""
    return _trie(engine).to_arrays()


def write(path: Path, state: TrieArrays) -> int:
    """Any thread: write atomically (temp file + rename). Returns the bytes written."""
    meta, arrays = state
    path.parent.mkdir(parents=True, exist_ok=True)
    persist.save(path, STATE_KIND, {"trie": meta}, arrays)
    return path.stat().st_size


def read(path: Path, trie_class: type, max_depth: int) -> Any:
    """Any thread: the trie stored at `path`; ValueError (CorruptFileError) when unusable."""
    meta, arrays = persist.load(path, STATE_KIND)
    trie_meta = meta.get("trie")
    if not isinstance(trie_meta, dict):
        raise persist.CorruptFileError(path, "no trie metadata")
    if trie_meta.get("max_depth") != max_depth:
        raise persist.CorruptFileError(
            path, f"trie depth {trie_meta.get('max_depth')} differs from the drafter's "
            f"max_trie_depth {max_depth}")
    try:
        return trie_class.from_arrays(trie_meta, arrays)
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise persist.CorruptFileError(path, f"inconsistent trie arrays ({e})") from e


def max_depth(engine: LLMEngine) -> int:
    return engine.config.drafter.max_trie_depth


def install(engine: LLMEngine, trie: Any) -> int:
    """Engine thread: replace the learned trie. Running requests keep going: the epoch bump
    makes their suffix anchors re-probe the new trie instead of reading recycled node ids."""
    drafter = _drafter(engine)
    old = _trie(engine)
    trie.epoch = old.epoch + 1
    drafter.trie = trie
    return trie.num_nodes


def flush(engine: LLMEngine) -> None:
    """Engine thread: forget everything learned; external corpora and requests are kept."""
    drafter = _drafter(engine)
    trie = getattr(drafter, "trie", None)
    if _is_trie(trie):
        trie.reset()  # epoch bump: running requests re-anchor, calibration stays
    else:
        drafter.reset()  # the SGLang preset: its flush_cache
