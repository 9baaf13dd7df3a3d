"""Native CPU kernels, compiled on first use with the machine's C++ compiler and cached.

`gguf_kernels.cpp` multiplies by weights kept in GGUF's blocks (Q4_0 ... Q8_0, Q4_K/Q5_K/Q6_K);
`attention.cpp` attends over the KV cache in place (prefix + visible query tokens per token). They
are built with torch's extension builder (ninja + the system g++) for the CPU it runs on into
`<ngramspec cache>/kernels/<key>`, the key hashing everything the build reads, so checkouts at other
paths or revisions never rebuild each other's library; later imports load the cached one.

`NGRAMSPEC_CPU_ISA` picks the tier they are compiled for, so a slower tier can be measured on a
faster machine: `native` (default: everything this CPU has, AMX included), `amx`, `avx512` (AMX
left out), `avx2` (x86-64-v3: AVX2, FMA, F16C, no AVX-512, as on AMD Zen 2/3 and most Intel
client CPUs) or `scalar` (no vector path). A tier this CPU cannot run is refused by name.

torch guards a build with a lock file that a killed build leaves behind, after which every later
load waits on it forever. Builds here are serialised by an flock instead, which the kernel drops
with its process: holding it, a torch lock file is stale.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

from ngramspec.progress import build_progress, cache_root

# bindings.cpp first: it alone includes torch/extension.h, the longest compile by far, so ninja
# starts it while the other files share the second core.
_SOURCES = [Path(__file__).with_name(f) for f in (
    "bindings.cpp", "gguf_kernels.cpp", "gguf_int8.cpp", "amx_linear.cpp", "amx_dense.cpp",
    "attention.cpp", "layer_ops.cpp", "decoder_stack.cpp")]


class KernelBuildError(RuntimeError):
    """The native kernels could not be compiled or loaded on this machine."""


_CFLAGS = ["-O3", "-fopenmp"]  # -fopenmp: at::parallel_for is inline OpenMP
_NO_AMX = ["-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"]
# tier -> (its -march flags, the /proc/cpuinfo flags it needs)
ISA_TIERS: dict[str, tuple[list[str], set[str]]] = {
    "native": (["-march=native"], set()),
    "amx": (["-march=native"], {"amx_tile", "amx_bf16", "avx512_bf16"}),
    "avx512": (["-march=native", *_NO_AMX], {"avx512f"}),
    "avx2": (["-march=x86-64-v3", "-mtune=native"], {"avx2", "fma", "f16c"}),
    "scalar": (["-march=x86-64", "-mtune=native"], set()),
}
_LDFLAGS = ["-fopenmp"]  # the soname resolves to torch's libgomp
_BUILD_DEFAULT_S = 60.0  # the progress estimate before this machine has built once
_LOCK_TIMEOUT_S = 1800.0  # far beyond a build (under a minute on 2 cores): only a stuck builder waits this long
# A build directory nobody loaded for this long (other revisions' sources, an old torch) is
# removed by the next load of another: each is ~1 MB of objects, and every edit makes a new one.
_STALE_AFTER_S = 14 * 24 * 3600.0


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:  # not Linux: the tier's own compile is the check
        return set()


def isa_tier() -> str:
    """The tier `NGRAMSPEC_CPU_ISA` selects ("native" when unset), checked against this CPU. A bad
    tier is a ValueError, not a build failure: it must stop the run, not fall back to PyTorch."""
    tier = os.environ.get("NGRAMSPEC_CPU_ISA", "native").strip().lower() or "native"
    if tier not in ISA_TIERS:
        raise ValueError(f"NGRAMSPEC_CPU_ISA={tier!r} is not a tier; use one of {', '.join(ISA_TIERS)}")
    flags = _cpu_flags()
    missing = ISA_TIERS[tier][1] - flags
    if flags and missing:
        raise ValueError(f"NGRAMSPEC_CPU_ISA={tier} needs CPU flags {sorted(missing)} that this CPU lacks")
    return tier


def _cflags() -> list[str]:
    return [*_CFLAGS, *ISA_TIERS[isa_tier()][0]]


def _build_dir() -> Path:
    import torch

    key = hashlib.sha256(f"{torch.__version__} {_cflags()} {_LDFLAGS}".encode())
    for source in sorted(Path(__file__).parent.glob("*.[ch]*")):  # the sources and their headers
        key.update(str(source).encode())
        key.update(source.read_bytes())
    path = cache_root() / "kernels" / key.hexdigest()[:16]
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def _exclusive_build(directory: Path, timeout_s: float = _LOCK_TIMEOUT_S) -> Iterator[None]:
    """Hold the directory's flock, and clear a torch lock file that a killed build left there."""
    with open(directory / "build.flock", "w") as handle:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise KernelBuildError(
                        f"another process has held {directory / 'build.flock'} for over "
                        f"{timeout_s:.0f} s; end it or delete the directory") from None
                time.sleep(0.1)
        try:
            # Every torch build here runs under this flock, so a lock file present now has no owner.
            (directory / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@functools.cache
def cpu_kernels() -> ModuleType:
    """The compiled kernel module (gguf_linear, gguf_rows, paged_attention, vector_isa)."""
    from torch.utils.cpp_extension import load

    isa_tier()  # a bad NGRAMSPEC_CPU_ISA stops here, before the fallback's except
    try:  # the directory and its lock are part of the build: an unwritable cache falls back too
        directory = _build_dir()
        with _exclusive_build(directory), build_progress(
                f"the CPU kernels ({isa_tier()} tier)", f"kernels-{isa_tier()}",
                _BUILD_DEFAULT_S, enabled=not (directory / "ngramspec_cpu.so").exists()):
            module = load(
                name="ngramspec_cpu",
                sources=[str(s) for s in _SOURCES],
                extra_cflags=_cflags(),
                extra_ldflags=_LDFLAGS,
                build_directory=str(directory),
                verbose=False,
            )
            (directory / "last_load").touch()
        _prune_stale_builds(directory)
        return module
    except KernelBuildError:  # the lock's own, already clear
        raise
    except Exception as e:  # compiler missing, ninja missing, a failed build, an unwritable cache
        raise KernelBuildError(
            f"cannot build the CPU kernels ({type(e).__name__}: {e}); they need a C++ "
            "compiler (g++) and the `ninja` package"
        ) from e


def _prune_stale_builds(current: Path, stale_after_s: float = _STALE_AFTER_S) -> list[Path]:
    """Remove the sibling build directories not loaded for `stale_after_s` whose flock is free
    (a build or load in progress holds it); returns those removed. Best effort: a directory in
    use by another user or process is left alone. A loaded library stays mapped after removal."""
    import shutil

    removed = []
    now = time.time()
    for other in current.parent.iterdir():
        if other == current or not other.is_dir():
            continue
        marker = other / "last_load"
        try:
            last = (marker if marker.exists() else other).stat().st_mtime
            if now - last < stale_after_s:
                continue
            with open(other / "build.flock", "a") as handle:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                shutil.rmtree(other)
            removed.append(other)
        except OSError:  # held (BlockingIOError), someone else's, or already gone
            continue
    return removed


@functools.cache
def kernels_available() -> bool:
    """Whether the CPU kernels build here; warns once (with the reason) when they do not."""
    try:
        cpu_kernels()
    except KernelBuildError as e:
        warnings.warn(f"{e}; falling back to PyTorch ops (slower)", RuntimeWarning, stacklevel=2)
        return False
    return True


def kernel_path() -> str:
    """Which CPU kernels run here, for benchmark reports: "amx" (AMX tiles for the matrices,
    AVX-512 for the rest), "avx512", "avx2", "scalar" (compiled without a vector path), or
    "none" (no compiler: PyTorch ops)."""
    if not kernels_available():
        return "none"
    return "amx" if cpu_kernels().amx_available() else cpu_kernels().vector_isa()
