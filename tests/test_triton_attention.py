"""The Triton attention kernel (the CUDA path), checked on the CPU under Triton's interpreter.

The checks live in tests/interpreted/triton_attention.py and run in a pytest process of their own:
TRITON_INTERPRET must be set before the kernels are defined, and a process that imports Triton
next to transformers prints binding-leak warnings as it exits. So `make` installs Triton beside
the venv (.venv/triton-site) and only that process sees it; an installed Triton works too.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

CHECKS = Path(__file__).parent / "interpreted" / "triton_attention.py"
SIDE_SITE = Path(sys.prefix) / "triton-site"


@pytest.mark.slow
def test_triton_kernel_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    if (SIDE_SITE / "triton").is_dir():
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SIDE_SITE),
                                                          env.get("PYTHONPATH")]))
    elif importlib.util.find_spec("triton") is None:
        pytest.skip("no triton (make installs it into .venv/triton-site)")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-x", "-p", "no:cacheprovider", str(CHECKS)],
        cwd=Path(__file__).parent.parent, env=env, capture_output=True, text=True, timeout=1200,
        check=False)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-2000:]
