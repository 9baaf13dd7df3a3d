"""Compiled (numba) fast path of the n-gram drafter.

Every module here imports numba at import time, so nothing outside this package imports them
unless the numba backend was asked for (`DrafterConfig.backend`). The pure-Python classes in
spec/ stay the reference: the fast classes keep their APIs and produce identical results.
"""

from __future__ import annotations

import importlib.util


def numba_available() -> bool:
    """True if numba can be imported (checked without importing it)."""
    return importlib.util.find_spec("numba") is not None
