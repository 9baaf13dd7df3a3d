"""make_drafter: the drafter a DrafterConfig asks for (kept out of config.py so the config imports
no drafter and no drafter imports back into a cycle)."""

from __future__ import annotations

from ngramspec.drafting.config import CorpusSnapshot, DrafterConfig
from ngramspec.drafting.protocol import Drafter


def make_drafter(config: DrafterConfig, corpora: CorpusSnapshot | None = None) -> Drafter:
    """Build the drafter a config asks for; the SGLang preset is imported only when used."""
    if config.preset == "sglang":
        from ngramspec.baselines.sglang.drafter import SGLangDrafter

        return SGLangDrafter(config, corpora)
    if resolve_backend(config.backend) == "numba":
        from ngramspec.drafting.drafter import FastNgramDrafter

        return FastNgramDrafter(config, corpora)
    from ngramspec.drafting.oracle.drafter import NgramDrafter

    return NgramDrafter(config, corpora)


def resolve_backend(backend: str) -> str:
    """"python" or "numba" ("auto" = numba when importable); numba missing is an error."""
    from ngramspec.drafting.kernels import numba_available

    if backend == "python":
        return "python"
    if numba_available():
        return "numba"
    if backend == "numba":
        raise ValueError("DrafterConfig.backend 'numba' needs numba installed")
    return "python"
