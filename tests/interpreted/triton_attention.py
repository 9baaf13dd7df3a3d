"""The Triton paged attention kernel (the CUDA path) against the SDPA reference, run on the CPU by
Triton's interpreter, and the engine on it end to end on a tiny model.

tests/test_triton_attention.py runs this file in its own pytest process with TRITON_INTERPRET=1:
the flag must be set before the kernels are defined, and Triton's bindings print leak warnings
when their process exits.
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run by tests/test_triton_attention.py (TRITON_INTERPRET=1)",
                allow_module_level=True)
pytest.importorskip("triton")

from attention_cases import CASES, check_against_sdpa

from ngramspec import LLM, SamplingParams

FLAT_COST = [1.0] * 14  # verify cost independent of size: always draft the full tree


@pytest.mark.parametrize("heads,kv_heads,head_dim,dtype", CASES)
def test_kernel_matches_the_sdpa_reference(heads, kv_heads, head_dim, dtype):
    check_against_sdpa(heads, kv_heads, head_dim, dtype, torch.device("cpu"))


def test_engine_on_the_triton_kernel_decodes_like_sdpa(tiny_model_dirs):
    prompts = [[7, 8, 9, 10, 11, 7, 8, 9], [20, 21, 22, 23] * 3]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = {}
    for backend in ("sdpa", "triton"):
        for spec in (None, "ngram"):
            llm = LLM(model=str(tiny_model_dirs["llama"]), num_threads=1, device="cpu",
                      attention_backend=backend, speculative=spec, verify_cost=FLAT_COST)
            assert llm.engine.runner.attention == backend
            outputs[backend, spec] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outputs["triton", "ngram"] == outputs["triton", None] == outputs["sdpa", None] \
        == outputs["sdpa", "ngram"]
    assert llm.engine.stats.num_accepted_tokens > 0  # trees were verified through the kernel


def test_triton_backend_errors_are_clear(monkeypatch):
    from ngramspec.engine.model_runner import _attention_backend

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="runs on CUDA"):
        _attention_backend("triton", torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="attention_backend"):
        LLM(attention_backend="flash")


def test_a_bf16_cache_under_float32_activations_decodes_like_the_cpu_kernel(tiny_model_dirs):
    prompts = [[7, 8, 9, 10, 11, 7, 8, 9], [20, 21, 22, 23] * 3]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = []
    for backend in ("auto", "triton"):  # auto on the CPU: the C++ kernel
        llm = LLM(model=str(tiny_model_dirs["llama"]), num_threads=1, device="cpu",
                  dtype="float32", kv_cache_dtype="bfloat16", attention_backend=backend)
        assert llm.engine.runner.attention == ("cpu" if backend == "auto" else "triton")
        outputs.append([o.token_ids for o in llm.generate(prompts, params)])
    assert outputs[0] == outputs[1]
