"""`ngramspec build`: compile the native code for this machine now, with progress, so that the
first request does not wait for it. `make run` and `make test` run it at set-up.

What it builds (each once, cached under `$NGRAMSPEC_CACHE`, then only loaded): the C++ CPU
kernels for the tier `NGRAMSPEC_CPU_ISA` names (default: everything this CPU has), and the
drafter's native kernels (drafting/kernels/drafter.cpp, which also lists a step's tree tokens).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any


def register(sub: Any) -> None:
    p = sub.add_parser("build", help="compile the native kernels and the drafter now, with "
                                     "progress (otherwise the first run does)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--no-cpu-kernels", action="store_true",
                   help="skip the C++ CPU kernels (e.g. a GPU-only setup)")
    p.set_defaults(func=run_build)


def run_build(args: argparse.Namespace) -> int:
    from ngramspec.drafting.kernels import native
    from ngramspec.kernels import KernelBuildError, cpu_kernels, isa_tier

    start = time.monotonic()
    if not args.no_cpu_kernels:
        tier = isa_tier()  # a bad NGRAMSPEC_CPU_ISA is a ValueError: the CLI names it
        try:
            vector = cpu_kernels().vector_isa()
            print(f"CPU kernels: {tier} tier, vector path {vector}", file=sys.stderr)
        except KernelBuildError as e:  # the engine still runs, on PyTorch ops: say so, go on
            print(f"warning: {e}; the engine will run PyTorch ops instead (slower)",
                  file=sys.stderr)
    native()
    print(f"ngramspec build: ready in {time.monotonic() - start:.0f} s", file=sys.stderr)
    return 0
