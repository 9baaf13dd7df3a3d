"""Optional dependencies: what `pip install ngramspec` leaves out and which extra brings it.

`LLM` needs only the core requirements; the server, benchmarks and reports import their extras
inside the commands that use them, through `require`, so a missing one is one clear line.
"""

from __future__ import annotations

import importlib.util


class MissingExtraError(ImportError):
    """A command needs packages of an extra that is not installed."""


def require(extra: str, *modules: str) -> None:
    """Raise MissingExtraError naming `pip install 'ngramspec[extra]'` when a module is missing."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingExtraError(f"this needs {', '.join(missing)}: pip install 'ngramspec[{extra}]'")
