"""NgramTrie: the global n-gram trie, on numpy columns and native kernels (drafting/kernels/drafter.cpp `Trie`).

Same semantics as tests/oracles/trie.py `ReferenceTrie` (count-once O(D) insertion, children sorted by count with the same
swap-on-increment tie-breaking, leaf-only LRU eviction that never touches the nodes a request is
extending, never-stale anchors, identical `to_arrays()` format), so both give identical counts,
child orders and evictions on identical inputs. A node costs 9 int32 columns (36 B) plus two
id-only hash-table slots (4 B each at load <= 3/4): see `bytes_per_node`.

Columns grow by doubling up to `capacity`, so a small trie stays small.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ngramspec.drafting.kernels import layout as tk
from ngramspec.drafting.kernels import native

FORMAT_VERSION = 1  # of the persisted trie (to_arrays/from_arrays)

_INITIAL_NODES = 1 << 12


@dataclass(slots=True)
class TrieState:
    """A request's suffix anchors: count, anchors[depth], versions[depth] in one int32 array."""

    arr: np.ndarray = field(default_factory=lambda: np.zeros(1, np.int32))
    epoch: int = -1


def as_context(context: list[int] | np.ndarray) -> np.ndarray:
    if isinstance(context, np.ndarray) and context.dtype == np.int32:
        return context
    return np.asarray(context, dtype=np.int32)


class NgramTrie:
    def __init__(self, capacity: int, max_depth: int) -> None:
        if max_depth < 1 or capacity <= max_depth:
            raise ValueError(f"trie capacity ({capacity}) must exceed max_depth ({max_depth})")
        self.capacity = capacity
        self.max_depth = max_depth
        self.epoch = 0
        self._clear(min(capacity, _INITIAL_NODES))

    def _clear(self, allocated: int) -> None:
        self.cols = np.full((allocated, tk.TRIE_COLS), -1, np.int32)
        self.cols[tk.TRIE_ROOT, tk.TOK], self.cols[tk.TRIE_ROOT, tk.CNT] = tk.SEPARATOR, 0
        self.cols[tk.TRIE_ROOT, tk.VER] = 0
        size = tk.table_size(allocated)
        self.edges = np.full(size, -1, np.int32)
        self.runs = np.full(size, -1, np.int32)
        self.meta = np.array([1, -1, -1, 0, self.capacity, self.max_depth, 0, 0], np.int64)
        self._room = 0  # node allocations known to fit without growing (a Python-side bound)

    def reset(self) -> None:
        """Forget every n-gram; outstanding states become invalid (epoch bump)."""
        self.epoch += 1
        self._clear(min(self.capacity, _INITIAL_NODES))

    def new_state(self) -> TrieState:
        return TrieState(np.zeros(1 + 2 * self.max_depth, np.int32))

    @property
    def num_nodes(self) -> int:
        return int(self.meta[tk.T_NUM])

    @property
    def num_evicted(self) -> int:
        return int(self.meta[tk.EVICTED])

    def nbytes(self) -> int:
        return self.cols.nbytes + self.edges.nbytes + self.runs.nbytes + self.meta.nbytes

    def bytes_per_node(self) -> float:
        """Bytes held per allocated node slot (columns plus both hash tables)."""
        return self.nbytes() / self.cols.shape[0]

    def _arrays(self) -> tuple[np.ndarray, ...]:
        """cols, edges, runs, meta: what the kernels read (drafter.cpp `Trie`)."""
        return self.cols, self.edges, self.runs, self.meta

    # ----------------------------------------------------------------- reads

    def count(self, node: int) -> int:
        return int(self.cols[node, tk.CNT])

    def token(self, node: int) -> int:
        return int(self.cols[node, tk.TOK])

    def child(self, node: int, token: int) -> int:
        return int(native().trie_child(*self._arrays(), node, token))

    def children(self, node: int, limit: int | None = None) -> list[tuple[int, int, int]]:
        """(token, child, count), most frequent first."""
        limit = self.capacity if limit is None else limit
        cols, out = self.cols, []
        child = int(cols[node, tk.FIRST])
        while child != -1 and len(out) < limit:
            out.append((int(cols[child, tk.TOK]), child, int(cols[child, tk.CNT])))
            child = int(cols[child, tk.NEXT])
        return out

    def has_children(self, node: int) -> bool:
        return bool(self.cols[node, tk.FIRST] != -1)

    def lookup(self, tokens: list[int]) -> int:
        ctx = as_context(tokens)
        return int(native().trie_lookup(*self._arrays(), ctx, 0, len(ctx)))

    def anchors(self, state: TrieState, context: list[int] | np.ndarray,
                length: int | None = None) -> list[tuple[int, int]]:
        """(node, length) for suffixes of context[:length] with >= 1 child, longest first."""
        ctx = as_context(context)
        n = len(ctx) if length is None else length
        self.sync(state)
        native().trie_refresh(*self._arrays(), state.arr, ctx, n)
        arr, first = state.arr, self.cols[:, tk.FIRST]
        return [(int(arr[1 + k]), k + 1) for k in range(int(arr[0]) - 1, -1, -1)
                if arr[1 + k] >= 0 and first[arr[1 + k]] != -1]

    def sync(self, state: TrieState) -> None:
        """Start `state` over (no suffixes held) if the trie was reset since it was made."""
        if state.epoch != self.epoch:
            if len(state.arr) != 1 + 2 * self.max_depth:
                state.arr = np.zeros(1 + 2 * self.max_depth, np.int32)
            state.arr[0], state.epoch = 0, self.epoch

    # ----------------------------------------------------------------- writes

    def extend(self, state: TrieState, context: list[int] | np.ndarray, start: int,
               end: int | None = None) -> None:
        """Count the n-grams ending at context[start:end] (see ReferenceTrie.extend)."""
        ctx = as_context(context)
        end = len(ctx) if end is None else end
        if state.epoch != self.epoch:
            self.sync(state)
            if start > 0:
                native().trie_refresh(*self._arrays(), state.arr, ctx, start)
        self.reserve((end - start) * self.max_depth)
        if native().trie_extend(*self._arrays(), state.arr, ctx, start, end):
            raise RuntimeError("trie columns were not grown before extend (bug)")

    def reserve(self, new_nodes: int) -> None:
        """Grow the columns (and re-hash) so `new_nodes` more fit, up to the capacity."""
        if self._room >= new_nodes:  # the common case, without reading numpy scalars
            self._room -= new_nodes
            return
        allocated = self.cols.shape[0]
        need = self.num_nodes + new_nodes
        if allocated >= self.capacity:  # full size: allocation evicts from now on
            self._room = 1 << 62
            return
        if need <= allocated:
            self._room = allocated - need
            return
        grown = min(self.capacity, max(2 * allocated, need))
        cols = np.full((grown, tk.TRIE_COLS), -1, np.int32)
        cols[:allocated] = self.cols
        self.cols = cols
        size = tk.table_size(grown)
        if size > len(self.edges):
            self.edges = np.full(size, -1, np.int32)
            self.runs = np.full(size, -1, np.int32)
            native().trie_rehash(*self._arrays(), self.num_nodes)
        self._room = grown - need

    # ----------------------------------------------------------------- persistence

    def to_arrays(self) -> tuple[dict, dict[str, np.ndarray]]:
        """The same arrays and meta as ReferenceTrie.to_arrays (BFS order, leaf LRU)."""
        num = self.num_nodes
        order, index, lru = (np.empty(num, np.int64) for _ in range(3))
        size, lru_size = native().trie_bfs_order(*self._arrays(), order, index, lru)
        order, lru = order[:size], lru[:lru_size]
        parents = self.cols[order, tk.PAR].astype(np.int64)
        parents[1:] = index[parents[1:]]
        arrays = {
            "token": self.cols[order, tk.TOK].astype(np.int64),
            "parent": parents,
            "count": self.cols[order, tk.CNT].astype(np.int64),
            "lru": lru.copy(),
        }
        return trie_meta(self.capacity, self.max_depth, len(order)), arrays

    @classmethod
    def from_arrays(cls, meta: dict, arrays: dict[str, np.ndarray]) -> NgramTrie:
        check_trie_meta(meta, arrays)
        trie = cls(int(meta["capacity"]), int(meta["max_depth"]))
        num = len(arrays["token"])
        trie._clear(max(num, min(trie.capacity, _INITIAL_NODES)))
        bad = native().trie_restore(*trie._arrays(),
                                    np.ascontiguousarray(arrays["token"], np.int64),
                                    np.ascontiguousarray(arrays["parent"], np.int64),
                                    np.ascontiguousarray(arrays["count"], np.int64),
                                    np.ascontiguousarray(arrays["lru"], np.int64))
        if bad:
            raise ValueError(f"trie arrays are invalid at entry {bad} (parents must come first, "
                             "children in count order, counts >= 1, lru entries live)")
        return trie


def trie_meta(capacity: int, max_depth: int, num_nodes: int) -> dict:
    """The persisted header (tests/oracles/trie.py writes the same, so files are interchangeable)."""
    return {"format": "ngramspec.trie", "version": FORMAT_VERSION,
            "capacity": capacity, "max_depth": max_depth, "num_nodes": num_nodes}


def check_trie_meta(meta: dict, arrays: dict[str, np.ndarray]) -> None:
    """Validation of a persisted trie before from_arrays builds it."""
    if meta.get("version") != FORMAT_VERSION:
        raise ValueError(f"unsupported trie version {meta.get('version')!r}")
    num = len(arrays["token"])
    if num > int(meta["capacity"]) or num != int(meta["num_nodes"]):
        raise ValueError("trie arrays do not match meta (num_nodes/capacity)")
    if not num or int(arrays["parent"][0]) != -1:
        raise ValueError("trie arrays must start with the root")
    if any(len(arrays[name]) != num for name in ("parent", "count")):
        raise ValueError("trie arrays token/parent/count differ in length")
