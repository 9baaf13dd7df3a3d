"""Structured outputs: grammar compilation, tree pruning and masks against brute-force oracles,
and constrained decoding with speculation equal to plain constrained decoding (greedy) and
keeping the masked target distribution (sampling, chi-square)."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch
from conftest import prefill_logits
from hypothesis import given, settings
from hypothesis import strategies as st
from test_engine_speculation import RandomTreeDrafter, _chi_square_p, _fields

from ngramspec import LLM, SamplingParams
from ngramspec.drafting.sources import GRAMMAR
from ngramspec.drafting.tree import DraftTree
from ngramspec.layers.sampler import apply_penalties, target_probs
from ngramspec.structured.grammar import GrammarCompiler, GrammarError
from ngramspec.structured.matcher import RequestGrammar, apply_bitmask, graft_forced
from ngramspec.structured.params import StructuredOutputsParams as S

PERSON = {"type": "object", "additionalProperties": False,
          "properties": {"name": {"type": "string", "maxLength": 30},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "city": {"enum": ["Paris", "London", "Berlin"]}},
          "required": ["name", "age", "city"]}
SPECS = [S(json=PERSON), S(json_object=True), S(regex=r"[0-9]{3}-[0-9]{4}"),
         S(choice=("yes", "no", "maybe")), S(grammar='root ::= "A" ("B" | "C")+ "."'),
         S(grammar='start: "x" NUMBER\nNUMBER: /[0-9]{1,4}/'), S(json=PERSON, disable_any_whitespace=True)]


@pytest.fixture(scope="module")
def compiler(llm) -> GrammarCompiler:
    e = llm.engine
    return GrammarCompiler(e.tokenizer, e.model_cfg.vocab_size, e.eos_token_ids)


def _grammar(compiler: GrammarCompiler, spec: S) -> RequestGrammar:
    return RequestGrammar(compiler.matcher(spec), compiler.vocab_size, compiler.eos_token_ids)


def _allowed(compiler: GrammarCompiler, spec: S, path: list[int]) -> bool:
    """Oracle: a fresh matcher accepts the whole path; EOS only last, where the grammar is
    complete but not finished (a finished grammar ends the request at its last token)."""
    m = compiler.matcher(spec)
    eos = [i for i, t in enumerate(path) if t in compiler.eos_token_ids]
    if eos:
        if eos[0] != len(path) - 1 or not m.consume_tokens(path[:-1]):
            return False
        return m.is_accepting() and not m.is_stopped()
    return m.validate_tokens(path) == len(path)


def _mask_bits(masks: torch.Tensor, vocab: int) -> torch.Tensor:
    bits = torch.arange(32, dtype=torch.int32)
    return ((masks.unsqueeze(-1) >> bits) & 1).view(masks.shape[0], -1)[:, :vocab].bool()


# ---- params and compiler ----------------------------------------------------------------------

@pytest.mark.parametrize("kwargs", [{}, {"json": PERSON, "regex": "a"}, {"choice": []},
                                    {"choice": "yes"}, {"regex": ""}, {"json": 3}])
def test_params_need_exactly_one_valid_constraint(kwargs) -> None:
    with pytest.raises(ValueError, match="StructuredOutputsParams"):
        S(**kwargs)


@pytest.mark.parametrize("spec, fragment", [
    (S(regex="[a-z"), "regex"), (S(json='{"type": '), "not valid JSON"),
    (S(json={"type": "objectx"}), "objectx"), (S(grammar="start: missing_rule"), "missing_rule"),
    (S(grammar="root ::= (("), "grammar"),
])
def test_bad_grammars_name_the_problem(compiler, spec, fragment) -> None:
    with pytest.raises(GrammarError, match=fragment):
        compiler.compile(spec)


def test_compiled_grammars_are_cached(compiler) -> None:
    spec = S(json={"type": "object", "properties": {"cached": {"type": "boolean"}}})
    before = compiler.num_compiled
    a, b = compiler.matcher(spec), compiler.matcher(S(json=json.dumps(spec.json)))
    assert compiler.num_compiled == before + 1  # dict and text forms share one entry
    a.consume_tokens(compiler.tokenizer.tokenize_str('{"cached"'))
    assert b.validate_tokens(compiler.tokenizer.tokenize_str('{"cached"')) > 0, "copies share state"


# ---- trees: pruning, forced tokens and masks vs oracles -----------------------------------------

def _random_tree(rng: random.Random, root: int, candidates: list[int], n: int) -> DraftTree:
    ids, parents, probs = [root], [-1], [1.0]
    for _ in range(n):
        parent = rng.randrange(len(ids))
        taken = {ids[i] for i in range(1, len(ids)) if parents[i] == parent}
        free = [c for c in candidates if c not in taken]
        if free:
            ids.append(rng.choice(free))
            parents.append(parent)
            probs.append(probs[parent] * rng.uniform(0.3, 1.0))
    return DraftTree(ids, parents, probs, [-1] + [0] * (len(ids) - 1))


def _candidates(compiler, text: str) -> list[int]:
    return sorted(set(compiler.tokenizer.tokenize_str(text)))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), spec_index=st.sampled_from([0, 2, 3, 4]),
       prefix_len=st.integers(0, 4))
def test_constrain_keeps_exactly_the_allowed_paths(compiler, seed, spec_index, prefix_len) -> None:
    spec = SPECS[spec_index]
    doc = ['{"name": "Ann", "age": 42, "city": "Paris"}', "123-4567", "maybe", "ABCB."][
        [0, 2, 3, 4].index(spec_index)]
    tokens = compiler.tokenizer.tokenize_str(doc)
    prefix = tokens[: min(prefix_len, len(tokens) - 1)]
    rng = random.Random(seed)
    grammar = _grammar(compiler, spec)
    for t in prefix:
        assert grammar.advance(t) is None
    tree = _random_tree(rng, 7, _candidates(compiler, doc + ' x9,"') + [2], rng.randint(0, 14))
    out = grammar.constrain(tree)
    forced = grammar.forced_tokens()
    # the forced chain leads, with probability 1
    assert out.token_ids[1 : 1 + len(forced)] == forced
    assert out.probs[: 1 + len(forced)] == [1.0] * (1 + len(forced))
    assert all(s == GRAMMAR for s in out.sources[1 : 1 + len(forced)])
    for i in range(1, len(out)):  # every kept path is allowed and best-first order holds
        path = [out.token_ids[j] for j in out.path_to(i)]
        assert _allowed(compiler, spec, prefix + path)
        assert out.parents[i] < i
    # nothing allowed was dropped: each original path the grammar allows (and that agrees with
    # the forced chain) is still in the tree
    kept = {tuple(out.token_ids[j] for j in out.path_to(i)) for i in range(1, len(out))}
    for i in range(1, len(tree)):
        path = [tree.token_ids[j] for j in tree.path_to(i)]
        if path[: len(forced)] == forced[: len(path)] and _allowed(compiler, spec, prefix + path):
            assert tuple(path) in kept or len(path) <= len(forced)
    # and the matcher is back where it was
    assert grammar.forced_tokens() == forced


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6), spec_index=st.sampled_from([0, 3]))
def test_bitmasks_equal_a_fresh_matcher_at_every_node(compiler, seed, spec_index) -> None:
    spec = SPECS[spec_index]
    doc = '{"name": "Ann", "age": 42, "city": "Paris"}' if spec_index == 0 else "maybe"
    rng = random.Random(seed)
    grammar = _grammar(compiler, spec)
    tree = grammar.constrain(_random_tree(rng, 7, _candidates(compiler, doc), rng.randint(0, 12)))
    masks = grammar.bitmasks(tree)
    for i in range(len(tree)):
        m = compiler.matcher(spec)
        assert m.consume_tokens([tree.token_ids[j] for j in tree.path_to(i)])
        ref = torch.zeros(1, grammar.num_words, dtype=torch.int32)
        m.unsafe_compute_mask_ptr(ref.data_ptr(), grammar.num_words * 4)
        assert torch.equal(masks[i], ref[0]), f"node {i}"


def test_graft_keeps_the_drafters_subtree_below_the_forced_chain() -> None:
    # root 0 -> 5 -> 6 -> {7, 8}; 0 -> 9 (contradicts the forced 5)
    tree = DraftTree([0, 5, 6, 7, 9, 8], [-1, 0, 1, 2, 0, 2], [1, .8, .4, .2, .1, .1],
                     [-1, 0, 0, 0, 1, 0])
    out = graft_forced(tree, [5, 6])
    assert out.token_ids == [0, 5, 6, 7, 8] and out.parents == [-1, 0, 1, 2, 2]
    assert out.probs == [1.0, 1.0, 1.0, 0.5, 0.25]
    assert out.sources == [-1, GRAMMAR, GRAMMAR, 0, 0]
    assert graft_forced(tree, [5, 4]).token_ids == [0, 5, 4]  # drafter disagreed: chain only


def test_a_fully_masked_row_allows_eos_and_never_nan() -> None:
    logits = torch.randn(3, 70)
    masks = torch.zeros(3, 3, dtype=torch.int32)
    masks[0, 0] = 0b1010  # tokens 1 and 3
    apply_bitmask(logits, masks, (2, 65))
    assert torch.isfinite(logits[0, [1, 3]]).all() and torch.isinf(logits[0, [0, 2, 4]]).all()
    for row in (1, 2):  # nothing allowed: EOS instead
        assert torch.isfinite(logits[row, [2, 65]]).all()
        assert torch.isfinite(torch.softmax(logits[row], -1)).all()
        assert int(logits[row].argmax()) in (2, 65)


# ---- the engine: spec == plain, outputs valid, distribution kept --------------------------------

EXTRACT = ("Record: Marie Curie, aged 66, lived in Paris. Ada Lovelace, aged 36, lived in London."
           " Give the first person as JSON with name, age and city.")


@pytest.fixture(scope="module")
def spec_llm(llm):
    return LLM(num_threads=2, dtype="float32", speculative="ngram", verify_cost=[1.0] * 14)


def test_greedy_constrained_spec_equals_plain(llm, spec_llm) -> None:
    prompts = [llm.apply_chat_template([{"role": "user", "content": EXTRACT}]),
               llm.apply_chat_template([{"role": "user", "content": "Give a phone number."}])]
    params = [SamplingParams(temperature=0, max_tokens=60, structured_outputs=s) for s in SPECS]
    cases = [(prompts[0 if s.kind != "regex" else 1], p) for s, p in zip(SPECS, params)]
    plain = llm.generate([c[0] for c in cases], [c[1] for c in cases])
    accepted = spec_llm.engine.stats.num_accepted_tokens
    spec = spec_llm.generate([c[0] for c in cases], [c[1] for c in cases])
    assert spec_llm.engine.stats.num_accepted_tokens > accepted
    for s, a, b in zip(SPECS, spec, plain):
        assert a.token_ids == b.token_ids, s
        assert a.finish_reason == b.finish_reason == "stop", (s, b.text)
    person = json.loads(plain[0].text)
    jsonschema.validate(person, PERSON)
    compact = plain[-1].text
    jsonschema.validate(json.loads(compact), PERSON)
    assert compact == json.dumps(json.loads(compact), separators=(",", ":"), ensure_ascii=False)
    assert isinstance(json.loads(plain[1].text), dict)
    assert plain[3].text in ("yes", "no", "maybe")


def test_bad_grammar_rejects_the_request_and_the_engine_keeps_serving(spec_llm) -> None:
    with pytest.raises(ValueError, match="regex"):
        spec_llm.generate("x", SamplingParams(max_tokens=4, structured_outputs=S(regex="(")))
    assert not spec_llm.engine.has_unfinished()
    out = spec_llm.generate("x", SamplingParams(temperature=0, max_tokens=4,
                                                structured_outputs=S(choice=("ok",))))[0]
    assert out.text == "ok"


def _exact_masked_joint(engine, prompt, params, compiler, length=3):
    """Exact distribution of the first `length` tokens of plain constrained sampling."""
    probs = {(): 1.0}
    spec = params.structured_outputs
    for _ in range(length):
        nxt = {}
        for prefix, p in probs.items():
            g = RequestGrammar(compiler.matcher(spec), compiler.vocab_size, engine.eos_token_ids)
            ended = [g.advance(t) for t in prefix]  # every token advances the matcher
            if any(ended):  # the grammar ended: so does the request
                nxt[prefix] = p
                continue
            logits = prefill_logits(engine, prompt + list(prefix))[-1:].clone()
            apply_bitmask(logits, g.bitmasks(DraftTree.root_only(0)), engine.eos_token_ids)
            q = target_probs(apply_penalties(logits[0], params, prompt, list(prefix)), params)
            for tok in q.nonzero().flatten().tolist():
                nxt[prefix + (tok,)] = p * float(q[tok])
        probs = nxt
    return probs


def test_constrained_sampling_with_speculation_keeps_the_masked_distribution(tiny_gguf) -> None:
    prompt = [5, 17, 42, 99, 7, 3]
    spec = S(regex=r"[a-f][a-f0-9][0-9a-c]x")
    params = SamplingParams(temperature=1.3, presence_penalty=0.5, max_tokens=3, ignore_eos=True,
                            structured_outputs=spec)
    base = LLM(model=str(tiny_gguf), quantization="gguf", num_threads=2)
    compiler = base.engine.grammars
    exact = _exact_masked_joint(base.engine, prompt, params, compiler)
    support = sorted({t for key in exact for t in key})
    assert len(support) >= 8
    llm = LLM(model=str(tiny_gguf), quantization="gguf", num_threads=2, max_num_seqs=256,
              max_num_batched_tokens=4096, speculative="ngram", draft_sizing="full",
              custom_drafter=RandomTreeDrafter(support + [0, 1, 300]))
    n = 2000
    outs = llm.generate([prompt] * n, [SamplingParams(**{**_fields(params), "seed": 7000 + i})
                                       for i in range(n)])
    counts: dict[tuple, int] = {}
    for o in outs:
        counts[tuple(o.token_ids[:3])] = counts.get(tuple(o.token_ids[:3]), 0) + 1
    assert llm.engine.stats.num_accepted_tokens > 50
    p = _chi_square_p(counts, exact, n)
    assert p > 1e-3, f"chi-square p = {p:.3g}"
