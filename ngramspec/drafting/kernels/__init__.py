"""numba kernels of the n-gram drafter: the indexes' hot loops, the tree build and the commit.

drafting/index/ owns the arrays and drafting/drafter.py composes the kernels; the pure-Python
references in tests/oracles/ give identical results (the lockstep property tests).

Inlining: a call between numba functions passes every array argument as its ~10-word struct,
and the build and commit helpers take up to 20 arrays, so the calls cost more than the work (the
build of a 12-node tree made 12 `_push_children` calls, each ~20 arrays). The hot path is
therefore `inline="always"` down to its leaves, into two compiled roots only: `step.build_block`
(the trees) and `step.apply_queue` (the commits). At 64 requests in flight this took a
request-step from 13.5 to 8.5 µs (`ngramspec bench corpus`); the first compile of the drafter
takes about twice as long (~40 s -> ~75 s on 2 cores, cached on disk afterwards). Rarely run
code (eviction, rehashing) stays a call.
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
