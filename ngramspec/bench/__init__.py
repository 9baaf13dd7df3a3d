"""Benchmarks: engine vs HF, speed, serving, drafting cost, quality, context curve; streams."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any


def emit(result: dict[str, Any], as_json: bool, print_results: Callable[[dict[str, Any]], None]) -> int:
    """Print a benchmark's result as one JSON object or as its tables; the command's exit code."""
    if as_json:
        print(json.dumps(result))
    else:
        print_results(result)
    return 0
