"""Golden correctness against HF transformers (fp32, same weights), and model loading errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import (
    NUM_THREADS,
    PROMPTS,
    TOKENIZER_FILES,
    describe_mismatch,
    first_difference,
    prefill_logits,
    top2_gap,
)
from transformers import GenerationConfig

from ngramspec import LLM, SamplingParams
from ngramspec.models.config import ModelConfig
from ngramspec.models.loader import ModelLoadError, load_model_config, resolve_model_dir

ATOL = 1e-3
NUM_NEW = 64


def _hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def _hf_greedy(model, ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """HF generate(do_sample=False) without EOS stopping: tokens and the raw logits of each step."""
    config = GenerationConfig(do_sample=False, max_new_tokens=n, eos_token_id=[],
                              pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    with torch.inference_mode():
        mask = torch.ones(1, len(ids), dtype=torch.long)
        out = model.generate(torch.tensor([ids]), attention_mask=mask, generation_config=config)
    return out.sequences[0, len(ids):].tolist(), torch.cat(out.logits).float()


def _assert_close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert ours.shape == ref.shape, f"{what}: shape {tuple(ours.shape)} != {tuple(ref.shape)}"
    assert (ours - ref).abs().max() <= ATOL, describe_mismatch(ours, ref, what)


def test_prompts_are_varied(prompt_ids: list[list[int]]) -> None:
    kinds = {kind for kind, _ in PROMPTS}
    assert len(prompt_ids) >= 8 and kinds == {"chat", "raw"}
    assert max(map(len, prompt_ids)) >= 280 and min(map(len, prompt_ids)) <= 10


def test_prefill_logits_match_hf(llm, hf_model, prompt_ids: list[list[int]]) -> None:
    for i, ids in enumerate(prompt_ids):
        _assert_close(prefill_logits(llm.engine, ids), _hf_logits(hf_model, ids),
                      f"prompt {i} prefill")


def test_chunked_prefill_logits_match_hf(llm, hf_model, prompt_ids: list[list[int]]) -> None:
    # Chunks of 16 attend to the cached K/V of earlier chunks; every position must still agree.
    for i in (2, 6):
        ids = prompt_ids[i]
        _assert_close(prefill_logits(llm.engine, ids, chunk=16), _hf_logits(hf_model, ids),
                      f"prompt {i} prefill in chunks of 16")


def _assert_same_tokens(ours: torch.Tensor, ours_tokens: list[int], ref: torch.Tensor,
                        ref_tokens: list[int], what: str) -> None:
    """Logits agree up to (and at) the first differing token, and no token differs."""
    k = first_difference(ours_tokens, ref_tokens)
    upto = len(ref_tokens) if k is None else k + 1
    _assert_close(ours[:upto], ref[:upto], what)
    assert k is None, (f"{what}: first differing token at step {k}: ours {ours_tokens[k]} vs "
                       f"HF {ref_tokens[k]} (HF top-2 gap {top2_gap(ref[k]):.3g})")


@pytest.fixture(scope="module")
def greedy_64(llm, prompt_ids: list[list[int]]) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Our greedy 64-token continuations of all prompts, batched together, with the logits rows
    each token was picked from."""
    from conftest import LogitsProbe

    rec = LogitsProbe(llm.engine)
    try:
        outs = llm.generate(prompt_ids, SamplingParams(temperature=0, max_tokens=NUM_NEW,
                                                       ignore_eos=True))
    finally:
        rec.close()
    return [o.token_ids for o in outs], [torch.stack(rec.rows[o.request_id]) for o in outs]


def test_greedy_64_tokens_match_hf_teacher_forced(hf_model, prompt_ids, greedy_64) -> None:
    # One HF forward over prompt + our continuation gives HF's logits at every decode step; its
    # argmax must reproduce our tokens exactly and its logits must match ours.
    for i, (ids, tokens, rows) in enumerate(zip(prompt_ids, *greedy_64)):
        assert len(tokens) == NUM_NEW
        ref = _hf_logits(hf_model, ids + tokens)[len(ids) - 1 : -1]
        _assert_same_tokens(rows, tokens, ref, ref.argmax(-1).tolist(), f"prompt {i} decode")


@pytest.mark.slow
@pytest.mark.parametrize("i", [0, 2, 4])  # chat, code, non-English: HF generate is slow on CPU
def test_greedy_64_tokens_match_hf_generate(i: int, hf_model, prompt_ids, greedy_64) -> None:
    ref_tokens, ref_logits = _hf_greedy(hf_model, prompt_ids[i], NUM_NEW)
    assert len(ref_tokens) == NUM_NEW
    _assert_same_tokens(greedy_64[1][i], greedy_64[0][i], ref_logits, ref_tokens,
                        f"prompt {i} vs HF generate")


@pytest.mark.parametrize("kernels", [True, False], ids=["cpu-kernels", "torch-ops"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_random_models_match_hf(arch: str, kernels: bool, tiny_model_dirs, tiny_hf_models,
                                     probe, monkeypatch) -> None:
    """Both execution paths: the C++ CPU kernels, and the PyTorch ops (SDPA with masks, unfused
    norms and rotary) that CUDA and machines without a compiler run."""
    if not kernels:
        monkeypatch.setattr("ngramspec.engine.model_runner.kernels_available", lambda: False)
    llm = LLM(str(tiny_model_dirs[arch]), num_threads=NUM_THREADS)
    assert llm.engine.runner.paged == kernels
    hf = tiny_hf_models[arch]
    cfg = llm.engine.model_cfg
    assert cfg.attention_bias == (arch == "qwen2") and cfg.qk_norm == (arch == "qwen3")
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(3, cfg.vocab_size, (37,), generator=gen).tolist()
    ref = _hf_logits(hf, ids)
    _assert_close(prefill_logits(llm.engine, ids), ref, f"{arch} prefill")
    _assert_close(prefill_logits(llm.engine, ids, chunk=5), ref, f"{arch} prefill in chunks of 5")
    rec = probe(llm.engine)
    out = llm.generate(ids, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    full_ref = _hf_logits(hf, ids + out.token_ids)[len(ids) - 1 : -1]  # teacher-forced
    _assert_close(torch.stack(rec.rows[out.request_id]), full_ref, f"{arch} decode steps")
    assert out.token_ids == full_ref.argmax(-1).tolist()


# ----------------------------------------------------------------------------- loading errors


def test_unknown_model_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(str(tmp_path / "no-such-model"))
    with pytest.raises(ModelLoadError, match="needs config.json"):
        resolve_model_dir(tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="expected a .gguf"):
        resolve_model_dir(tmp_path / "weights.bin")


def test_gguf_tensor_table_equals_gguf_pys_reader(tiny_gguf: Path) -> None:
    """loader.read_gguf_tensors walks past the metadata that gguf-py decodes: the same tensors,
    shapes, types and bytes, on the bundled file and on a mixed-block one."""
    import gguf
    import numpy as np

    from ngramspec.models.loader import default_model_path, read_gguf_tensors

    for path in (default_model_path(), tiny_gguf):
        arch, ours = read_gguf_tensors(path)
        reader = gguf.GGUFReader(str(path))
        assert arch == bytes(reader.fields["general.architecture"].parts[-1]).decode()
        assert len(ours) == len(reader.tensors)
        for a, b in zip(ours, reader.tensors):
            assert (a.name, a.shape, a.tensor_type) == \
                (b.name, tuple(int(x) for x in b.shape), int(b.tensor_type))
            assert a.data.shape == b.data.shape and a.data.dtype == b.data.dtype, a.name
            assert np.array_equal(a.data, b.data), a.name


def test_corrupt_gguf_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(256)) * 8)
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        LLM(str(bad))
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        resolve_model_dir(bad, cache_dir=tmp_path / "cache")
    from ngramspec.models.loader import read_gguf_tensors

    with pytest.raises(ModelLoadError, match="do not fit the file"):  # counts past its size
        read_gguf_tensors(bad)
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


def test_unsupported_architecture_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 10}))
    with pytest.raises(ValueError, match="unsupported architecture.*GPT2LMHeadModel"):
        LLM(str(tmp_path))


def test_unreadable_config_and_missing_weights(tmp_path: Path, tiny_model_dirs) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="cannot read model config"):
        load_model_config(tmp_path)
    for name in ("config.json", *TOKENIZER_FILES):
        shutil.copy(tiny_model_dirs["llama"] / name, tmp_path / name)
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        LLM(str(tmp_path))


def test_model_config_from_hf_reads_each_family(tiny_model_dirs) -> None:
    cfgs = {a: load_model_config(d) for a, d in tiny_model_dirs.items()}
    assert cfgs["qwen3"].head_dim == 24 and cfgs["llama"].head_dim == 16
    assert cfgs["llama"].num_kv_heads == 2 and cfgs["llama"].rope_theta == 50000.0
    assert cfgs["qwen2"].tie_word_embeddings and not cfgs["llama"].tie_word_embeddings
    raw = json.loads((tiny_model_dirs["llama"] / "config.json").read_text())
    with pytest.raises(ValueError, match="num_heads=4 is not a multiple of num_kv_heads=3"):
        ModelConfig.from_hf({**raw, "num_key_value_heads": 3})
    with pytest.raises(ValueError, match="rope scaling 'yarn'"):
        ModelConfig.from_hf({**raw, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
