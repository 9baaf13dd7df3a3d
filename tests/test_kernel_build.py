"""The kernel build's lock: a killed builder never blocks later loads, a live one makes them wait."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from ngramspec.kernels import KernelBuildError, _build_dir, _exclusive_build, _prune_stale_builds

# Takes the flock, says so, then sleeps until killed.
_HOLDER = """
import fcntl, sys, time
handle = open(sys.argv[1], "w")
fcntl.flock(handle, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(600)
"""


def _hold(directory: Path) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(directory / "build.flock")],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    return holder


def test_torch_lock_file_left_by_a_killed_build_is_cleared(tmp_path):
    (tmp_path / "lock").touch()  # what torch's FileBaton leaves when its build is killed
    with _exclusive_build(tmp_path):
        assert not (tmp_path / "lock").exists()


def test_killed_holder_releases_the_build(tmp_path):
    holder = _hold(tmp_path)
    holder.kill()
    holder.wait()
    start = time.monotonic()
    with _exclusive_build(tmp_path, timeout_s=30):
        pass
    assert time.monotonic() - start < 5


def test_live_holder_makes_a_build_wait_then_fail_clearly(tmp_path):
    holder = _hold(tmp_path)
    try:
        with pytest.raises(KernelBuildError, match="build.flock"), _exclusive_build(tmp_path, timeout_s=0.3):
            pass
    finally:
        holder.kill()
        holder.wait()


def test_build_directory_is_keyed_by_the_cache_root(tmp_path, monkeypatch):
    monkeypatch.setenv("NGRAMSPEC_CACHE", str(tmp_path))
    first = _build_dir()
    assert first.parent == tmp_path / "kernels" and first.is_dir()
    assert _build_dir() == first  # same sources, same key


def test_stale_build_directories_are_pruned_unless_in_use(tmp_path):
    import os

    root = tmp_path / "kernels"
    current, fresh, stale, busy = (root / name for name in ("cur", "fresh", "stale", "busy"))
    for d in (current, fresh, stale, busy):
        d.mkdir(parents=True)
        (d / "last_load").touch()
    month_ago = time.time() - 30 * 24 * 3600
    for d in (stale, busy):
        os.utime(d / "last_load", (month_ago, month_ago))
    holder = _hold(busy)  # a build or load in progress there
    try:
        assert _prune_stale_builds(current) == [stale]
    finally:
        holder.kill()
        holder.wait()
    assert sorted(p.name for p in root.iterdir()) == ["busy", "cur", "fresh"]
