"""Native CPU kernels, compiled on first use with the machine's C++ compiler and cached.

`gguf_kernels.cpp` multiplies by weights kept in GGUF's Q4_0/Q4_1/Q8_0 blocks; `attention.cpp`
attends over the KV cache in place (prefix + visible query tokens per token). They are built with
torch's extension builder (ninja + the system g++) for the CPU it runs on (-march=native) into
`<ngramspec cache>/kernels`, once per source version; later imports load the cached library.
"""

from __future__ import annotations

import functools
import os
import warnings
from pathlib import Path
from types import ModuleType

_SOURCES = [Path(__file__).with_name(f) for f in (
    "gguf_kernels.cpp", "amx_linear.cpp", "amx_dense.cpp", "attention.cpp", "layer_ops.cpp", "bindings.cpp")]


class KernelBuildError(RuntimeError):
    """The native kernels could not be compiled or loaded on this machine."""


def _build_dir() -> Path:
    root = Path(os.environ.get("NGRAMSPEC_CACHE", Path.home() / ".cache" / "ngramspec"))
    path = root / "kernels"
    path.mkdir(parents=True, exist_ok=True)
    return path


@functools.cache
def cpu_kernels() -> ModuleType:
    """The compiled kernel module (gguf_linear, gguf_rows, paged_attention, has_avx512)."""
    from torch.utils.cpp_extension import load

    try:
        return load(
            name="ngramspec_cpu",
            sources=[str(s) for s in _SOURCES],
            # -fopenmp: at::parallel_for is inline OpenMP; the soname resolves to torch's libgomp.
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(_build_dir()),
            verbose=False,
        )
    except Exception as e:  # compiler missing, ninja missing, a failed build
        raise KernelBuildError(
            f"cannot build the CPU kernels ({type(e).__name__}: {e}); they need a C++ "
            "compiler (g++) and the `ninja` package"
        ) from e


@functools.cache
def kernels_available() -> bool:
    """Whether the CPU kernels build here; warns once (with the reason) when they do not."""
    try:
        cpu_kernels()
    except KernelBuildError as e:
        warnings.warn(f"{e}; falling back to PyTorch ops (slower)", RuntimeWarning, stacklevel=2)
        return False
    return True
