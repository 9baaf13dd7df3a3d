"""EngineConfig: everything the engine needs, validated at construction and passed explicitly."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal

import torch

from ngramspec.drafting.config import DrafterConfig

# "half" and "float" are vLLM's spellings of float16 and float32.
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
           "fp16": torch.float16, "half": torch.float16}


@dataclass(slots=True)
class EngineConfig:
    # GGUF file, HF directory or an HF model id in the local HF cache (replaced by its local
    # path at construction); None = bundled SmolLM2-135M-Instruct
    model: str | None = None
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (fp32 on CPU, bf16 on CUDA) | float32 | bfloat16 | float16
    # "gguf": keep a GGUF model's block-quantised matrices (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/
    # Q6_K) as they are and run them with the native CPU kernels (float32 activations); "none":
    # dequantise every weight to `dtype`;
    # "auto": "gguf" for a GGUF model on the CPU when dtype is "auto", else "none".
    quantization: Literal["auto", "none", "gguf"] = "auto"
    # What the GGUF kernels multiply the blocks by: "float32" activations, or "int8": each row
    # quantised per 32 values and multiplied in integers, as llama.cpp does (kernels/gguf_int8.cpp:
    # faster one-row decode, slightly different numbers). "auto": int8, the fastest mode whose
    # greedy agreement with float32 is at least llama.cpp's own (`bench quality`,
    # docs/benchmarks.md). Speculation is lossless within either mode.
    gguf_activations: Literal["auto", "float32", "int8"] = "auto"
    # K/V storage: "auto" = the activations' dtype, except bfloat16 for quantization="gguf" (half
    # the bytes that long-context attention streams; its quality is in `bench quality`).
    # bfloat16 under float32 activations needs the CPU attention kernel.
    kv_cache_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # Attention over the paged K/V cache: "auto" = the C++ kernel on the CPU (SDPA where it
    # cannot build), the Triton kernel on CUDA where triton is installed (else SDPA); "sdpa" =
    # PyTorch SDPA with explicit masks (the reference); "triton" = layers/triton_attention.py.
    attention_backend: Literal["auto", "sdpa", "triton"] = "auto"
    # On CUDA, decode and tree-verify steps replay as CUDA graphs (engine/cuda_graphs.py) unless
    # this is set; prefill chunks longer than 64 tokens, and the SDPA backend, always run eagerly.
    enforce_eager: bool = False
    max_model_len: int = 4096
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    # Memory budget for K/V; sets the number of slots. None: 1 GiB on the CPU; on CUDA, room for
    # max_num_seqs sequences of max_model_len tokens (no request ever waits for slots), at most
    # 30% of the GPU's memory.
    kv_cache_bytes: int | None = None
    num_threads: int | None = None  # CPU threads for torch; None leaves torch's default
    # Processes the model is split over (engine/parallel.py): NCCL on CUDA, gloo on the CPU.
    # Dense weights only (quantization "auto" then resolves to "none").
    tensor_parallel_size: int = 1
    # Keep finished requests' K/V indexed by token prefix; a prompt that starts with a cached
    # prefix skips its prefill (engine/prefix_cache.py).
    enable_prefix_caching: bool = True
    speculative: Literal["ngram"] | None = None
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    # Speculation pays only when expected accepted tokens beat the extra verify cost; this
    # per-token cost curve (relative to one token) lets the budget follow it. None = measure.
    verify_cost: list[float] | None = None
    # How much of each drafted tree is verified: "cost" keeps the prefix that pays for its verify
    # cost, "full" the whole tree (as SGLang does); "auto" = "full" for the sglang preset.
    draft_sizing: Literal["auto", "cost", "full"] = "auto"

    def __post_init__(self) -> None:
        self._resolve_model_id()
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "kv_cache_bytes",
                     "tensor_parallel_size"):
            value = getattr(self, name)
            if name == "kv_cache_bytes" and value is None:
                continue
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"EngineConfig.{name}={value!r} must be a positive integer")
        if self.dtype not in _DTYPES and self.dtype != "auto":
            raise ValueError(f"EngineConfig.dtype={self.dtype!r}: choose auto, {', '.join(_DTYPES)}")
        if self.quantization not in ("auto", "none", "gguf"):
            raise ValueError(f"EngineConfig.quantization={self.quantization!r}: "
                             "use auto, none or gguf")
        if self.quantization == "gguf" and self.dtype not in ("auto", "float32", "fp32"):
            raise ValueError(f"quantization='gguf' computes in float32; dtype={self.dtype!r} "
                             "does not apply (use dtype='auto' or 'float32')")
        if self.quantization == "gguf" and self.device.startswith("cuda"):
            raise ValueError("quantization='gguf' runs CPU kernels; use device='cpu'")
        if self.quantization == "gguf" and self.tensor_parallel_size > 1:
            raise ValueError("quantization='gguf' keeps whole GGUF blocks, which tensor "
                             "parallelism does not split; use quantization='none' or 'auto'")
        if self.gguf_activations not in ("auto", "float32", "int8"):
            raise ValueError(f"EngineConfig.gguf_activations={self.gguf_activations!r}: "
                             "use auto, float32 or int8")
        if self.kv_cache_dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"EngineConfig.kv_cache_dtype={self.kv_cache_dtype!r}: "
                             "use auto, float32 or bfloat16")
        if self.attention_backend not in ("auto", "sdpa", "triton"):
            raise ValueError(f"EngineConfig.attention_backend={self.attention_backend!r}: "
                             "use auto, sdpa or triton")
        if self.speculative not in (None, "ngram"):
            raise ValueError(f"EngineConfig.speculative={self.speculative!r}: use None or 'ngram'")
        if not (self.device in ("auto", "cpu") or self.device.startswith("cuda")):
            raise ValueError(f"EngineConfig.device={self.device!r}: use auto, cpu or cuda[:N]")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"EngineConfig.device={self.device!r} but CUDA is not available")
        if self.draft_sizing not in ("auto", "cost", "full"):
            raise ValueError(f"EngineConfig.draft_sizing={self.draft_sizing!r}: use auto, cost or full")
        if self.max_num_batched_tokens < self.drafter.draft_token_num:
            raise ValueError("max_num_batched_tokens must hold at least one draft tree")

    def _resolve_model_id(self) -> None:
        """An HF id becomes its cached local path now: a missing model fails at construction,
        and everything after (the GGUF checks, tensor-parallel workers) sees a path."""
        if self.model is None:
            return
        from ngramspec.models.loader import is_hf_model_id, resolve_hf_model

        if is_hf_model_id(self.model):
            self.model = str(resolve_hf_model(str(self.model)))

    @property
    def sizes_drafts(self) -> bool:
        """Whether speculation trims each tree to the prefix that pays for its verify cost."""
        if self.draft_sizing == "auto":
            return self.drafter.preset != "sglang"
        return self.draft_sizing == "cost"

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def uses_gguf_kernels(self) -> bool:
        """Whether the model's GGUF blocks run on the CPU kernels (quantization resolved)."""
        if self.quantization != "auto":
            return self.quantization == "gguf"
        if self.tensor_parallel_size > 1:
            return False
        model_is_gguf = self.model is None or str(self.model).endswith(".gguf")
        return model_is_gguf and self.dtype == "auto" and self.torch_device.type == "cpu"

    @property
    def gguf_int8(self) -> bool:
        """Whether the GGUF kernels quantise activations to int8 (gguf_activations resolved)."""
        return self.uses_gguf_kernels and self.gguf_activations in ("auto", "int8")

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            cuda = self.torch_device.type == "cuda" and not self.uses_gguf_kernels
            return torch.bfloat16 if cuda else torch.float32
        return _DTYPES[self.dtype]

    @property
    def torch_kv_dtype(self) -> torch.dtype:
        if self.kv_cache_dtype == "auto":
            return torch.bfloat16 if self.uses_gguf_kernels else self.torch_dtype
        return _DTYPES[self.kv_cache_dtype]

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Split engine options from drafter options (any DrafterConfig field) like vLLM's LLM()."""
        names = {f.name for f in fields(cls)}
        drafter_names = {f.name for f in fields(DrafterConfig)}
        unknown = set(kwargs) - names - drafter_names
        if unknown:
            raise TypeError(f"unknown option(s): {', '.join(sorted(unknown))}")
        drafter_kwargs = {k: v for k, v in kwargs.items() if k in drafter_names and k not in names}
        engine_kwargs = {k: v for k, v in kwargs.items() if k in names}
        if drafter_kwargs and "drafter" not in engine_kwargs:
            preset = drafter_kwargs.pop("preset", "ngramspec")
            base = DrafterConfig.sglang if preset == "sglang" else DrafterConfig
            engine_kwargs["drafter"] = base(**drafter_kwargs)
        return cls(**engine_kwargs)
