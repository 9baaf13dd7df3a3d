"""ngramspec: an LLM inference engine with lossless model-free n-gram speculative decoding."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ngramspec.config import EngineConfig
    from ngramspec.drafting.config import DrafterConfig
    from ngramspec.llm import LLM
    from ngramspec.outputs import RequestOutput
    from ngramspec.sampling_params import SamplingParams
    from ngramspec.structured.params import StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "EngineConfig", "DrafterConfig", "RequestOutput",
           "StructuredOutputsParams"]

_HOMES = {
    "LLM": "ngramspec.llm",
    "SamplingParams": "ngramspec.sampling_params",
    "EngineConfig": "ngramspec.config",
    "DrafterConfig": "ngramspec.drafting.config",
    "RequestOutput": "ngramspec.outputs",
    "StructuredOutputsParams": "ngramspec.structured.params",
}


def __getattr__(name: str) -> Any:
    # Lazy, so `import ngramspec.spec...` (the drafter, the simulator) never pulls in torch.
    if name not in _HOMES:
        raise AttributeError(f"module 'ngramspec' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_HOMES[name]), name)
