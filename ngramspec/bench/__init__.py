"""Benchmarks: engine vs HF, speed, serving, drafting cost, quality, context curve; streams."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

# Named weight modes the benchmarks compare: LLM options for each.
WEIGHT_MODES: dict[str, dict[str, str]] = {
    "float32": dict(dtype="float32", quantization="none"),
    "bfloat16": dict(dtype="bfloat16", quantization="none"),
    "gguf": dict(quantization="gguf", gguf_activations="float32"),  # GGUF block kernels, bf16 K/V
    "gguf-int8": dict(quantization="gguf", gguf_activations="int8"),  # llama.cpp's numerics
    "gguf-kv-fp32": dict(quantization="gguf", gguf_activations="float32", kv_cache_dtype="float32"),
}


def emit(result: dict[str, Any], as_json: bool, print_results: Callable[[dict[str, Any]], None]) -> int:
    """Print a benchmark's result as one JSON object or as its tables; the command's exit code."""
    if as_json:
        print(json.dumps(result))
    else:
        print_results(result)
    return 0
