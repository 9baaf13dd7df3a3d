"""numba kernels of the n-gram drafter: the indexes' hot loops, the tree build and the commit.

drafting/index/ owns the arrays and drafting/drafter.py composes the kernels; the pure-Python
references in tests/oracles/ give identical results (the lockstep property tests).
"""

from __future__ import annotations

import hashlib
from pathlib import Path


def drop_stale_kernel_cache(package_dir: Path = Path(__file__).parent) -> None:
    """Delete numba's on-disk cache when any module of this package changed.

    numba (`cache=True`) checks only the file that defines a kernel, so a kernel that calls an
    edited kernel of another module would load stale machine code. One stamp of every source
    here guards them all. Runs at package import, before any kernel loads its cache.
    """
    cache = package_dir / "__pycache__"
    digest = hashlib.sha256()
    for source in sorted(package_dir.glob("*.py")):
        digest.update(source.name.encode() + source.read_bytes())
    stamp = cache / "kernels.stamp"
    try:
        if stamp.read_text() == digest.hexdigest():
            return
    except OSError:
        pass
    try:
        cache.mkdir(exist_ok=True)
        for path in list(cache.glob("*.nbi")) + list(cache.glob("*.nbc")):
            path.unlink(missing_ok=True)
        stamp.write_text(digest.hexdigest())
    except OSError:
        pass  # read-only install: numba then cannot cache here either


drop_stale_kernel_cache()
