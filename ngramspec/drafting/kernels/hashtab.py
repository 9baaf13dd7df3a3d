"""Open-addressing hash tables that store only node ids (the key lives in the node's columns).

A slot holds a node id or -1. The key of a stored node is recomputed from its columns by the
caller-supplied `key_of`, so a table costs 4 bytes per slot; entries must be removed BEFORE
the columns that form their key change. Linear probing with backward-shift deletion keeps
lookups tombstone-free.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

EMPTY = -1


@intrinsic
def prefetch(typingctx, arr, row):
    """Ask the cache for arr[row] (a row of a 2-d array), without waiting for it: a hint, so
    an index out of range is harmless. Independent probes issued together overlap their misses
    instead of paying them one after another."""
    if not isinstance(arr, types.Array) or not isinstance(row, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        array_type = signature.args[0]
        array = context.make_array(array_type)(context, builder, args[0])
        row_index = context.cast(builder, args[1], signature.args[1], types.intp)
        index = [row_index] + [context.get_constant(types.intp, 0)] * (array_type.ndim - 1)
        pointer = cgutils.get_item_pointer(context, builder, array_type, array, index,
                                           wraparound=False)
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
            "llvm.prefetch")  # unsuffixed: LLVM names it for its own pointer types
        # read, high temporal locality, data cache
        builder.call(fn, [builder.bitcast(pointer, i8p), i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return types.void(arr, row), codegen


@njit(cache=True, inline="always")
def mix(key: np.int64) -> np.uint64:
    """splitmix64 finaliser: spreads (parent, token)-style keys over all bits."""
    z = np.uint64(key) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@njit(cache=True, inline="always")
def pair_key(a: np.int64, b: np.int64) -> np.int64:
    return np.int64(a) * np.int64(2**31) + np.int64(b)


@njit(cache=True, inline="always")
def home(table: np.ndarray, key: np.int64) -> np.int64:
    return np.int64(mix(key) & np.uint64(table.shape[0] - 1))


@njit(cache=True, inline="always")
def find(table: np.ndarray, cols: np.ndarray, ca: int, cb: int, a: int, b: int) -> int:
    """Node n with (cols[n, ca], cols[n, cb]) == (a, b), or -1."""
    mask = table.shape[0] - 1
    i = home(table, pair_key(a, b))
    while True:
        n = table[i]
        if n == EMPTY:
            return -1
        if cols[n, ca] == a and cols[n, cb] == b:
            return n
        i = (i + 1) & mask


@njit(cache=True, inline="always")
def slot_of(table: np.ndarray, node: int, key: np.int64) -> int:
    mask = table.shape[0] - 1
    i = home(table, key)
    while table[i] != node:
        i = (i + 1) & mask
    return i


@njit(cache=True, inline="always")
def insert(table: np.ndarray, node: int, key: np.int64) -> None:
    mask = table.shape[0] - 1
    i = home(table, key)
    while table[i] != EMPTY:
        i = (i + 1) & mask
    table[i] = node


@njit(cache=True)
def remove(table: np.ndarray, cols: np.ndarray, ca: int, cb: int, node: int) -> None:
    """Delete `node` (its key columns must still hold the key it was inserted with)."""
    mask = table.shape[0] - 1
    i = slot_of(table, node, pair_key(cols[node, ca], cols[node, cb]))
    j = i
    while True:
        j = (j + 1) & mask
        n = table[j]
        if n == EMPTY:
            break
        k = home(table, pair_key(cols[n, ca], cols[n, cb]))
        # Entry j may move back to i only if its home is not cyclically in (i, j].
        stays = (i < k <= j) if i <= j else (i < k or k <= j)
        if not stays:
            table[i] = n
            i = j
    table[i] = EMPTY


@njit(cache=True, inline="always")
def replace(table: np.ndarray, cols: np.ndarray, ca: int, cb: int, old: int, new: int) -> None:
    """Swap the node stored for a key for another node with the same key."""
    table[slot_of(table, old, pair_key(cols[old, ca], cols[old, cb]))] = new


def table_size(entries: int) -> int:
    """A power of two keeping the load factor at or below 3/4."""
    size = 1024
    while size * 3 < entries * 4:
        size *= 2
    return size
