"""The drafter's native kernels: drafter.cpp, a CPython extension without torch, built once.

drafting/index/ and drafting/drafter.py own the arrays (layout.py says how they are laid out);
drafter.cpp reads and writes them in place, one call per engine step. The first use on a machine
compiles it with the system C++ compiler (`$CXX`, else g++; seconds, with progress on
stderr) into `<ngramspec cache>/drafter/<key>`, the key hashing the source, the flags, the
compiler and the Python ABI, so checkouts and interpreters never load each other's build. Two
processes building at once each write their own temporary file and rename it into place.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType

from ngramspec.drafting.kernels.layout import check_layout
from ngramspec.progress import build_progress, cache_root

_SOURCE = Path(__file__).with_name("drafter.cpp")
_NAME = "ngramspec_drafter"
# -ffp-contract=off: the trees' floats must be the pure-Python reference's, operation by
# operation (a fused multiply-add rounds once where the reference rounds twice).
_FLAGS = ["-O2", "-std=c++17", "-shared", "-fPIC", "-pthread", "-ffp-contract=off",
          "-fvisibility=hidden"]
_BUILD_DEFAULT_S = 10.0  # the progress estimate before this machine has built it once


class DrafterBuildError(RuntimeError):
    """The drafter's native kernels could not be compiled or loaded on this machine."""


def _compiler() -> str:
    return os.environ.get("CXX", "g++")


def _compiler_version(cxx: str) -> str:
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True,
                              check=True).stdout.splitlines()[0]
    except (OSError, subprocess.CalledProcessError, IndexError) as e:
        raise DrafterBuildError(f"no C++ compiler: {cxx!r} failed ({e}); install g++ or set "
                                "CXX") from e


def library_path() -> Path:
    """Where this source's build for this interpreter lives (built or not)."""
    cxx = _compiler()
    key = hashlib.sha256()
    for part in (_SOURCE.read_bytes(), " ".join(_FLAGS).encode(), _compiler_version(cxx).encode(),
                 sysconfig.get_config_var("EXT_SUFFIX").encode(), sys.version.encode()):
        key.update(part + b"\0")
    folder = cache_root() / "drafter" / key.hexdigest()[:16]
    return folder / f"{_NAME}{sysconfig.get_config_var('EXT_SUFFIX')}"


def _compile(target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    cmd = [_compiler(), *_FLAGS, f"-I{sysconfig.get_paths()['include']}", str(_SOURCE),
           "-o", tmp]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise DrafterBuildError(f"compiling {_SOURCE.name} failed:\n{' '.join(cmd)}\n"
                                    f"{done.stderr[-4000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def native() -> ModuleType:
    """The compiled module (built here first when this machine has no build of this source)."""
    target = library_path()
    if not target.exists():
        with build_progress("the drafter's kernels", "drafter", _BUILD_DEFAULT_S,
                            cached_in=target.parent):
            _compile(target)
    loader = importlib.machinery.ExtensionFileLoader(_NAME, str(target))
    spec = importlib.util.spec_from_file_location(_NAME, target, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    check_layout(module.layout())
    return module
