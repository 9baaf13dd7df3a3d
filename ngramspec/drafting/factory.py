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
    from ngramspec.drafting.drafter import NgramDrafter

    return NgramDrafter(config, corpora)
