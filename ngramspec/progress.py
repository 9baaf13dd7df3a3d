"""Progress for the one-time native builds (the C++ CPU kernels, the drafter's kernels).

A first run compiles for minutes; without a word it looks hung. `build_progress` says what is
being built, for how long it should take (the last build's time on this machine, else a default)
and where it is cached; on a terminal it ticks a bar. No torch here: drafting uses it.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path


def cache_root() -> Path:
    """Where every native build is cached (`$NGRAMSPEC_CACHE`, default ~/.cache/ngramspec)."""
    return Path(os.environ.get("NGRAMSPEC_CACHE", Path.home() / ".cache" / "ngramspec"))


def _times_file() -> Path:
    return cache_root() / "build_times.json"


def _read_times() -> dict[str, float]:
    try:
        times = json.loads(_times_file().read_text())
        return {k: float(v) for k, v in times.items()} if isinstance(times, dict) else {}
    except (OSError, ValueError, TypeError):
        return {}


def expected_seconds(key: str, default_s: float) -> float:
    """The last recorded build time of `key` on this machine, else `default_s`."""
    return _read_times().get(key, default_s)


def _record(key: str, seconds: float) -> None:
    times = _read_times() | {key: round(seconds, 1)}
    try:  # best effort: an unwritable cache only loses the estimate
        _times_file().parent.mkdir(parents=True, exist_ok=True)
        tmp = _times_file().with_suffix(".tmp")
        tmp.write_text(json.dumps(times, indent=1, sort_keys=True))
        tmp.replace(_times_file())
    except OSError:
        pass


def _fmt(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


@contextlib.contextmanager
def build_progress(what: str, key: str, default_s: float, enabled: bool = True,
                   cached_in: str | Path | None = None) -> Iterator[None]:
    """Announce a build of `what` on stderr, tick while it runs, record its time under `key`.

    The estimate is wall time on this machine, so it includes whatever else the machine was
    doing during the last build; it is a guide, not a promise. `cached_in` names where the
    result is kept (default: `cache_root()`).
    """
    if not enabled:
        yield
        return
    estimate = expected_seconds(key, default_s)
    print(f"ngramspec: building {what} for this machine, once (about {_fmt(estimate)}; "
          f"cached in {cached_in or cache_root()})", file=sys.stderr, flush=True)
    start = time.monotonic()
    stop = threading.Event()
    ticker = None
    if sys.stderr.isatty():
        ticker = threading.Thread(target=_tick, args=(what, estimate, start, stop), daemon=True)
        ticker.start()
    ok = False
    try:
        yield
        ok = True
    finally:
        stop.set()
        if ticker is not None:
            ticker.join()
        took = time.monotonic() - start
        if ok:
            _record(key, took)
        print(f"\rngramspec: {what} {'built' if ok else 'failed'} in {_fmt(took)}\033[K"
              if ticker is not None else
              f"ngramspec: {what} {'built' if ok else 'failed'} in {_fmt(took)}",
              file=sys.stderr, flush=True)


def _tick(what: str, estimate: float, start: float, stop: threading.Event) -> None:
    width = 24
    while not stop.wait(1.0):
        elapsed = time.monotonic() - start
        done = min(elapsed / estimate, 0.99) if estimate > 0 else 0.0
        bar = "#" * int(done * width)
        print(f"\r  {what}: [{bar:<{width}}] {_fmt(elapsed)} of about {_fmt(estimate)}\033[K",
              end="", file=sys.stderr, flush=True)
