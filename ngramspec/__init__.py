"""ngramspec: an LLM inference engine with lossless model-free n-gram speculative decoding."""

from ngramspec.config import EngineConfig
from ngramspec.llm import LLM
from ngramspec.outputs import RequestOutput
from ngramspec.sampling_params import SamplingParams
from ngramspec.spec.config import DrafterConfig

__all__ = ["LLM", "SamplingParams", "EngineConfig", "DrafterConfig", "RequestOutput"]
