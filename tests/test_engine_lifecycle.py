"""n > 1 choices (prompt computed once, seeded streams, each choice exact) and weight updates
in place (same weights: same output; new weights: a fresh engine's output; nothing in flight
lost)."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_no_kv_leak
from test_engine_speculation import (
    RandomTreeDrafter,
    _chi_square_p,
    _exact_joint,
    _fields,
    _tiny_llm,
)

from ngramspec import SamplingParams
from ngramspec.models.loader import load_state_dict


def test_n_choices_share_the_prompt_and_are_reproducible(tiny_model_dirs) -> None:
    llm = _tiny_llm(tiny_model_dirs, speculative="ngram")
    prompt = list(range(5, 45))
    params = SamplingParams(n=4, temperature=0.9, seed=11, max_tokens=12, ignore_eos=True)
    before = llm.engine.stats.num_prefill_tokens
    out = llm.generate(prompt, params)[0]
    # the prompt once, then each other choice recomputes only the prompt's last token
    assert llm.engine.stats.num_prefill_tokens - before == len(prompt) + 3
    assert len(out.outputs) == 4 and out.outputs[0] is out
    again = llm.generate(prompt, params)[0]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in out.outputs]
    for i, choice in enumerate(out.outputs):  # choice i is the request with seed + i
        alone = llm.generate(prompt, SamplingParams(**{**_fields(params), "n": 1,
                                                        "seed": 11 + i}))[0]
        assert alone.token_ids == choice.token_ids
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    assert_no_kv_leak(llm.engine)


def test_each_choice_keeps_the_target_distribution(tiny_model_dirs) -> None:
    prompt = [5, 17, 42, 99, 7, 3]
    params = SamplingParams(temperature=0.9, top_k=6, max_tokens=3, ignore_eos=True, n=3)
    exact = _exact_joint(_tiny_llm(tiny_model_dirs).engine, prompt, params)
    support = sorted({t for key in exact for t in key})
    llm = _tiny_llm(tiny_model_dirs, speculative="ngram", draft_sizing="full",
                    custom_drafter=RandomTreeDrafter(support + [0, 1]))
    requests = 900
    outs = llm.generate([prompt] * requests, [SamplingParams(**{**_fields(params),
                                                               "seed": 3 * i + 10_000})
                                              for i in range(requests)])
    assert llm.engine.stats.num_accepted_tokens > 50
    for choice in range(3):
        counts: dict[tuple[int, ...], int] = {}
        for o in outs:
            key = tuple(o.outputs[choice].token_ids[:3])
            counts[key] = counts.get(key, 0) + 1
        p = _chi_square_p(counts, exact, requests)
        assert p > 1e-3, f"choice {choice}: chi-square p = {p:.3g}"


def test_abort_ends_every_choice(tiny_model_dirs) -> None:
    llm = _tiny_llm(tiny_model_dirs)
    seq = llm.engine.add_request("g", [5, 6, 7], SamplingParams(n=3, max_tokens=50))
    llm.engine.step()
    llm.engine.abort_request("g")
    assert all(s.finish_reason == "abort" for s in seq.choices)
    assert not llm.engine.has_unfinished()
    assert_no_kv_leak(llm.engine)


def _perturbed(model_dir, out_dir, scale: float = 0.05) -> dict[str, torch.Tensor]:
    import shutil

    from safetensors.torch import save_file

    state = load_state_dict(model_dir)
    gen = torch.Generator().manual_seed(3)
    new = {k: (v + scale * torch.randn(v.shape, generator=gen) * v.std()).contiguous()
           if v.dim() == 2 else v.clone() for k, v in state.items()}
    for f in model_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out_dir / f.name)
    save_file(new, str(out_dir / "model.safetensors"))
    return new


def test_update_weights_in_place(tiny_model_dirs, tmp_path) -> None:
    model_dir = tiny_model_dirs["llama"]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13]]
    llm = _tiny_llm(tiny_model_dirs, speculative="ngram")
    before = [o.token_ids for o in llm.generate(prompts, params)]
    llm.update_weights(str(model_dir))  # the same weights: the same output
    assert [o.token_ids for o in llm.generate(prompts, params)] == before
    new_state = _perturbed(model_dir, tmp_path)
    fresh = _tiny_llm(tiny_model_dirs, model=tmp_path)
    expected = [o.token_ids for o in fresh.generate(prompts, params)]
    assert expected != before, "the perturbation changed nothing: the test proves nothing"
    llm.update_weights(new_state)  # a state dict
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    llm.update_weights(str(model_dir))
    llm.update_weights(str(tmp_path))  # a path
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    with pytest.raises(ValueError, match="fit|architecture"):
        llm.update_weights({"model.embed_tokens.weight": torch.zeros(3, 3)})
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected  # still serving


def test_requests_in_flight_survive_an_update(tiny_model_dirs, tmp_path) -> None:
    """Policy: in-flight requests keep their tokens and go on under the new weights; from the
    update on they decode exactly as a fresh engine with those weights would."""
    model_dir = tiny_model_dirs["llama"]
    _perturbed(model_dir, tmp_path)
    llm = _tiny_llm(tiny_model_dirs, speculative="ngram")
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    seqs = [engine.add_request(f"r{i}", [5 + i, 6, 7, 8], params) for i in range(6)]
    for _ in range(4):
        engine.step()
    at_update = [seq.num_tokens for seq in seqs]
    assert any(seq.num_output_tokens for seq in seqs), "nothing was in flight"
    llm.update_weights(str(tmp_path))
    while engine.has_unfinished():
        engine.step()
    fresh = _tiny_llm(tiny_model_dirs, model=tmp_path)
    for seq, k in zip(seqs, at_update):
        assert seq.finish_reason == "length"
        rest = fresh.generate(seq.token_ids[:k], SamplingParams(
            temperature=0, max_tokens=seq.num_tokens - k, ignore_eos=True))[0].token_ids
        assert rest == seq.token_ids[k:], "after the update it must decode as the new weights do"
    assert_no_kv_leak(engine)
