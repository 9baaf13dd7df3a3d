"""numba kernels of the n-gram drafter: the indexes' hot loops, the tree build and the commit.

drafting/index/ owns the arrays and drafting/drafter.py composes the kernels; the pure-Python
references in tests/oracles/ give identical results (the lockstep property tests).

Inlining: a call between numba functions passes every array argument as its ~10-word struct,
and the build and commit helpers take up to 20 arrays, so the calls cost more than the work. The
hot path is therefore `inline="always"` down to its leaves, into few compiled roots:
`step.build_block` (the trees) and `step.propose` with its threaded twin (the commits, then
`build_block` per block of the batch). The price is a long first compile (minutes; cached on
disk afterwards). Rarely run code (eviction, rehashing) stays a call.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def drop_stale_kernel_cache(package_dir: Path = Path(__file__).parent,
                            numba_cache_dir: str | None = None) -> None:
    """Delete numba's on-disk cache of these kernels when any module of this package changed.

    numba (`cache=True`) checks only the file that defines a kernel, so a kernel that calls an
    edited kernel of another module would load stale machine code. One stamp of every source
    here guards them all, in each place numba may keep the cache: `__pycache__` beside the
    sources, and the folder for this package under NUMBA_CACHE_DIR when that is set (numba's
    default `numba_cache_dir`). Runs at package import, before any kernel loads its cache.
    """
    digest = hashlib.sha256()
    for source in sorted(package_dir.glob("*.py")):
        digest.update(source.name.encode() + source.read_bytes())
    if numba_cache_dir is None:
        from numba.core import config

        numba_cache_dir = config.CACHE_DIR
    for cache in _cache_dirs(package_dir, numba_cache_dir):
        _drop_if_stale(cache, digest.hexdigest())


def _cache_dirs(package_dir: Path, numba_cache_dir: str) -> list[Path]:
    """`__pycache__`, and under NUMBA_CACHE_DIR the folder numba's user-provided cache locator
    names "<folder name>_<sha1 of the folder's absolute path>" (numba.core.caching
    `_CacheLocator.get_suitable_cache_subpath`)."""
    dirs = [package_dir / "__pycache__"]
    if numba_cache_dir:
        folder = os.path.abspath(package_dir)
        name = f"{os.path.basename(folder)}_{hashlib.sha1(folder.encode()).hexdigest()}"
        dirs.append(Path(numba_cache_dir) / name)
    return dirs


def _drop_if_stale(cache: Path, stamp_text: str) -> None:
    stamp = cache / "kernels.stamp"
    try:
        if stamp.read_text() == stamp_text:
            return
    except OSError:
        pass
    try:
        cache.mkdir(parents=True, exist_ok=True)
        for path in list(cache.glob("*.nbi")) + list(cache.glob("*.nbc")):
            path.unlink(missing_ok=True)
        stamp.write_text(stamp_text)
    except OSError:
        pass  # read-only: numba then cannot cache here either


def cache_location(package_dir: Path = Path(__file__).parent) -> Path:
    """Where numba keeps these kernels' machine code (the last place it looks first)."""
    from numba.core import config

    return _cache_dirs(package_dir, config.CACHE_DIR)[-1]


def compiled_on_disk(kernel: str = "step.propose", package_dir: Path = Path(__file__).parent) -> bool:
    """Whether numba's disk cache holds `kernel` (module.function), i.e. loading it will not
    compile; the build progress is shown only when it will."""
    from numba.core import config

    return any(any(cache.glob(f"{kernel}-*.nbc"))
               for cache in _cache_dirs(package_dir, config.CACHE_DIR))


drop_stale_kernel_cache()
