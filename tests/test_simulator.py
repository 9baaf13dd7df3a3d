"""The replay simulator: exact greedy acceptance, step accounting, interleaving, loop detection."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ngramspec.drafting.tree import DraftTree
from ngramspec.simulator.replay import (
    Stream,
    is_looping,
    read_streams,
    replay,
    report,
    simulate,
    summarize,
)


class Requests:
    """Per-request token bookkeeping shared by the stub drafters; checks the lifecycle."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.prompt_len: dict[str, int] = {}
        self.log: list[tuple[str, str]] = []

    def start(self, request_id, prompt_ids, references=None):
        assert request_id not in self.tokens, "started twice"
        self.tokens[request_id] = list(prompt_ids)
        self.prompt_len[request_id] = len(prompt_ids)
        self.log.append(("start", request_id))

    def commit(self, request_id, accepted_token_ids):
        assert accepted_token_ids, "a commit always carries at least one token"
        self.tokens[request_id] += accepted_token_ids
        self.log.append(("commit", request_id))

    def stop(self, request_id):
        del self.tokens[request_id]
        self.log.append(("stop", request_id))

    def reset(self):
        pass


class OracleDrafter(Requests):
    """Proposes the true next `k` output tokens as a chain (tagged source 0)."""

    def __init__(self, outputs: dict[str, list[int]], k: int) -> None:
        super().__init__()
        self.outputs, self.k = outputs, k

    def propose(self, request_ids, budgets):
        trees = []
        for rid, budget in zip(request_ids, budgets):
            ctx = self.tokens[rid]
            done = len(ctx) - self.prompt_len[rid]
            nxt = self.outputs[rid][done:done + min(self.k, budget)]
            trees.append(DraftTree([ctx[-1], *nxt], list(range(-1, len(nxt))),
                                   sources=[-1] + [0] * len(nxt)))
        return trees


class LookupDrafter(Requests):
    """Prompt lookup on the request's own tokens: deterministic, no cross-request state."""

    def propose(self, request_ids, budgets):
        trees = []
        for rid, budget in zip(request_ids, budgets):
            ctx = self.tokens[rid]
            last = ctx[-1]
            starts = [i + 1 for i in range(len(ctx) - 1) if ctx[i] == last]
            drafts = ctx[starts[-1]:starts[-1] + budget] if starts else []
            trees.append(DraftTree([last, *drafts], list(range(-1, len(drafts))),
                                   sources=[-1] + [1] * len(drafts)))
        return trees


def streams_from(outputs: dict[str, list[int]], prompt=(1, 2, 3)) -> list[Stream]:
    return [Stream(rid, list(prompt), out, category=f"cat{len(out) % 2}", file="f.jsonl")
            for rid, out in outputs.items()]


def test_oracle_accepts_k_plus_bonus_every_step():
    out = list(range(100, 130))  # 30 tokens: 1 from prefill, 29 decoded
    drafter = OracleDrafter({"a": out}, k=3)
    [r] = replay(drafter, streams_from({"a": out}), budget=11)
    assert r.tokens == 29
    assert r.steps == math.ceil(29 / 4) == 8  # 7 full steps of 4, then 1 token left
    assert r.drafted == 7 * 3 + 1  # the last tree only has 1 token left to propose
    assert drafter.tokens == {}  # stopped
    # The last step drafts the one remaining token and accepts it (no bonus: the output ended).
    assert r.accepted_by_source == {0: 22} and r.drafted_by_source == {0: 22}


def test_budget_caps_the_oracle():
    out = list(range(50))
    [r] = replay(OracleDrafter({"a": out}, k=8), streams_from({"a": out}), budget=2)
    assert r.steps == math.ceil(49 / 3)


def test_branching_tree_exact_acceptance():
    """A hand-built tree: the matching branch is the second child, two levels deep."""

    class Fixed(Requests):
        def propose(self, request_ids, budgets):
            root = self.tokens[request_ids[0]][-1]
            # root -> 7 -> 8 ; root -> 5 -> 6 -> 9 ; root -> 5 -> 4
            return [DraftTree([root, 7, 8, 5, 6, 4, 9], [-1, 0, 1, 0, 3, 3, 4])]

    out = [0, 5, 6, 1, 2]
    drafter = Fixed()
    [r] = replay(drafter, [Stream("a", [3], out)], budget=11)
    # step 1 from [0]: accepts 5, 6 (9 != 1), bonus 1 -> 3 tokens; step 2 from [.., 1]: 2 left,
    # nothing matches 2 -> the bonus 2 alone.
    assert (r.steps, r.tokens) == (2, 4)
    assert [kind for kind, _ in drafter.log] == ["start", "commit", "commit", "commit", "stop"]


def test_prefill_token_is_committed_before_the_first_propose_and_not_a_step():
    calls = []

    class Spy(Requests):
        def propose(self, request_ids, budgets):
            calls.append(list(self.tokens[request_ids[0]]))
            return [DraftTree.root_only(self.tokens[request_ids[0]][-1])]

    [r] = replay(Spy(), [Stream("a", [9, 8], [1, 2, 3])], budget=11)
    assert calls == [[9, 8, 1], [9, 8, 1, 2]]  # root = the prefill token at the first step
    assert (r.steps, r.tokens) == (2, 2)
    # Outputs of 0 or 1 tokens need no verify step at all.
    results = replay(Spy(), [Stream("b", [1], [4]), Stream("c", [1], [])], budget=11)
    assert [(x.steps, x.tokens) for x in results] == [(0, 0), (0, 0)]


outputs_strategy = st.dictionaries(
    st.text("abcdefgh", min_size=1, max_size=3),
    st.lists(st.integers(0, 5), min_size=0, max_size=40), min_size=1, max_size=6)


@settings(max_examples=40, deadline=None)
@given(outputs_strategy, st.integers(1, 8), st.integers(0, 6))
def test_interleaving_keeps_per_request_results(outputs, concurrency, budget):
    streams = streams_from(outputs)
    alone = replay(LookupDrafter(), streams, budget=budget)
    mixed_drafter = LookupDrafter()
    mixed = replay(mixed_drafter, streams, budget=budget, concurrency=concurrency)
    key = [(r.id, r.steps, r.tokens, r.drafted, r.accepted_by_source) for r in alone]
    assert key == [(r.id, r.steps, r.tokens, r.drafted, r.accepted_by_source) for r in mixed]
    assert mixed_drafter.tokens == {}  # every request stopped
    for r, s in zip(mixed, streams):
        assert r.tokens == max(0, len(s.output_ids) - 1)
        assert r.steps <= r.tokens and (r.steps > 0) == (r.tokens > 0)
    # At most `concurrency` requests are in flight at once.
    live, peak = 0, 0
    for kind, _ in mixed_drafter.log:
        live += {"start": 1, "stop": -1}.get(kind, 0)
        peak = max(peak, live)
    assert peak <= concurrency


def brute_force_steps(output: list[int], prompt: list[int], budget: int) -> int:
    """Prompt lookup chain + greedy acceptance, written out directly."""
    ctx, pos, steps = prompt + output[:1], 1, 0
    while pos < len(output):
        starts = [i + 1 for i in range(len(ctx) - 1) if ctx[i] == ctx[-1]]
        draft = ctx[starts[-1]:starts[-1] + budget] if starts else []
        n = 0
        while n < len(draft) and pos + n < len(output) and draft[n] == output[pos + n]:
            n += 1
        emitted = output[pos:pos + n + 1]
        ctx += emitted
        pos += len(emitted)
        steps += 1
    return steps


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=60), st.integers(0, 11))
def test_replay_matches_brute_force(output, budget):
    [r] = replay(LookupDrafter(), [Stream("a", [0, 1, 2], output)], budget=budget)
    assert r.steps == brute_force_steps(output, [0, 1, 2], budget)


@pytest.mark.parametrize(("tail", "looping"), [
    ([1, 2, 3] * 20, True),  # period 3
    ([7] * 60, True),  # period 1
    ((list(range(24)) * 3)[:60], True),  # period 24: the longest that counts
    ((list(range(25)) * 3)[:60], False),  # period 25: too long
    (list(range(60)), False),
    ([1, 2] * 20, False),  # only 40 tokens: too short to tell
])
def test_is_looping(tail, looping):
    assert is_looping(tail) is looping


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 2), min_size=48, max_size=80))
def test_is_looping_brute_force(out):
    tail = out[-48:]
    expected = any(all(tail[i] == tail[i % p] for i in range(48)) for p in range(1, 25))
    assert is_looping(out) is expected


def test_report_groups_and_excludes_loops(tmp_path):
    rows = [
        {"id": "loop", "category": "chat", "prompt_ids": [1], "output_ids": [5, 6] * 30},
        {"id": "plain", "category": "chat", "prompt_ids": [1], "output_ids": list(range(60))},
        {"id": "code", "category": "code", "prompt_ids": [1], "output_ids": list(range(9))},
    ]
    path = tmp_path / "s.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[:2]) + "\n")
    path2 = tmp_path / "t.jsonl"
    path2.write_text(json.dumps(rows[2]) + "\n")
    streams = read_streams([path, path2])
    outputs = {r["id"]: r["output_ids"] for r in rows}
    rep = simulate(OracleDrafter(outputs, k=3), streams, budget=11)
    assert rep.looping_ids == ["loop"]
    assert rep.overall.requests == 3 and rep.overall_no_loops.requests == 2
    assert rep.overall.tokens == 59 + 59 + 8
    assert rep.overall.steps == 15 + 15 + 2
    assert rep.overall.mean_accepted == pytest.approx(126 / 32)
    assert set(rep.by_file) == {str(path), str(path2)}
    assert rep.by_category_no_loops["chat"].requests == 1
    assert rep.by_file_no_loops[str(path)].tokens == 59
    assert rep.overall.by_source["context"]["accepted"] == 3 * (15 + 15 + 2)
    assert rep.overall.propose_us > 0 and rep.overall.commit_us > 0
    assert rep.to_dict()["overall"]["steps"] == 32


def test_bad_stream_files_name_the_line(tmp_path):
    path = tmp_path / "s.jsonl"
    path.write_text('{"id": 1, "prompt_ids": [1], "output_ids": [2]}\n{"id": 2}\n')
    with pytest.raises(ValueError, match=r"s\.jsonl:2: not a stream line"):
        read_streams([path])
    with pytest.raises(ValueError, match="unique"):
        replay(LookupDrafter(), [Stream("a", [1], [2]), Stream("a", [1], [3])])


def test_summary_of_real_drafter_is_consistent():
    """Smoke test with the real drafter: every token is accounted for."""
    from ngramspec.drafting.config import DrafterConfig
    from ngramspec.drafting.factory import make_drafter

    text = [3, 4, 5, 6, 7, 8] * 5 + [9, 10, 11] * 4
    streams = [Stream(f"r{i}", text[:10], text[i:]) for i in range(3)]
    rep = report(replay(make_drafter(DrafterConfig()), streams, budget=11, concurrency=2))
    assert rep.overall.tokens == sum(len(s.output_ids) - 1 for s in streams)
    assert 1.0 <= rep.overall.mean_accepted <= 12.0
    # Repetitive text with its prompt indexed: the real drafter must accept well above 1.
    assert rep.overall.mean_accepted > 2.0


# ---- CLI ----------------------------------------------------------------------------------------

def parse_drafter(argv: list[str]):
    import argparse

    from ngramspec.cli.drafter_args import add_drafter_args, drafter_config_from_args

    parser = argparse.ArgumentParser()
    add_drafter_args(parser)
    return drafter_config_from_args(parser.parse_args(argv))


def test_every_config_field_is_an_option():
    import argparse
    from dataclasses import fields

    from ngramspec.cli.drafter_args import add_drafter_args
    from ngramspec.drafting.config import DrafterConfig

    parser = argparse.ArgumentParser()
    add_drafter_args(parser)
    options = {o for a in parser._actions for o in a.option_strings}
    for f in fields(DrafterConfig):
        assert f"--{f.name.replace('_', '-')}" in options, f.name


def test_drafter_options_and_sglang_aliases():
    from ngramspec.drafting.config import DrafterConfig

    assert parse_drafter([]) == DrafterConfig()
    assert parse_drafter(["--preset", "sglang"]) == DrafterConfig.sglang()
    cfg = parse_drafter(["--preset", "sglang", "--speculative-num-draft-tokens", "8",
                         "--speculative-ngram-max-trie-depth", "6", "--match-type", "prob"])
    assert cfg == DrafterConfig.sglang(draft_token_num=8, max_trie_depth=6, match_type="PROB")
    assert parse_drafter(["--speculative-ngram-branch-length", "7"]).max_trie_depth == 7
    assert parse_drafter(["--no-insert-prompt"]).insert_prompt is False
    with pytest.raises(ValueError, match="max_bfs_breadth"):
        parse_drafter(["--min-bfs-breadth", "5", "--max-bfs-breadth", "2"])


def test_replay_with_a_step_cost_sizes_trees_and_models_the_speedup():
    from ngramspec.policy.cost import StepCost, VerifyCost

    out = list(range(100, 161))
    streams = [Stream("a", [1, 2], out)]
    steep = StepCost(VerifyCost([1, 2], [0.01, 1.0]), learn=False)  # no draft ever pays
    [r] = replay(OracleDrafter({"a": out}, k=4), streams, budget=11, cost=steep)
    assert r.drafted == 0 and r.steps == r.tokens == len(out) - 1
    assert summarize([r]).modelled_speedup == 1.0
    # Chains of 4 sure drafts on a mild curve: all kept, 5 tokens a step for
    # curve(5) + the host guess (~0.0119 s) against 0.05 s of plain steps.
    mild = StepCost(VerifyCost([1, 8], [0.01, 0.012]), learn=False)
    [r] = replay(OracleDrafter({"a": out}, k=4), streams, budget=11, cost=mild)
    assert r.steps == 12 and r.drafted == 4 * 12
    assert 4.1 < summarize([r]).modelled_speedup < 4.3
    assert summarize([r]).modelled_speedup == r.tokens * 0.01 / r.seconds
    # Without a cost nothing is modelled.
    [r] = replay(OracleDrafter({"a": out}, k=4), streams, budget=11)
    assert summarize([r]).modelled_speedup is None


def test_simulate_command_json_and_compare(tmp_path, capsys):
    from ngramspec.cli import main

    text = [5, 6, 7, 8, 9] * 8
    path = tmp_path / "s.jsonl"
    path.write_text("".join(json.dumps({"id": f"r{i}", "category": "c", "prompt_ids": text[:8],
                                        "output_ids": text[i:]}) + "\n" for i in range(3)))
    assert main(["simulate", "--streams", str(path), "--preset", "sglang", "--json",
                 "--concurrency", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["sglang"]["overall"]["tokens"] == sum(len(text) - i - 1 for i in range(3))
    assert main(["simulate", "--streams", str(path), "--preset", "sglang", "--compare"]) == 0
    table = capsys.readouterr().out
    assert "sglang-prob" in table and "sglang-bfs+prompt" in table
    assert main(["simulate", "--streams", str(path), "--json", "--step-ms", "5,5.5,6.5"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ngramspec"]["overall"]["modelled_speedup"] > 0


def test_corpus_bench_runs_on_a_tiny_stream():
    from ngramspec.bench.corpus_bench import run_bench
    from ngramspec.drafting.config import DrafterConfig

    text = [5, 6, 7, 8, 9] * 8
    streams = [Stream(f"r{i}", text[:8], text[i:]) for i in range(3)]
    out = run_bench({"sglang": DrafterConfig.sglang()}, streams, (1, 2), repeats=2)
    steps = out["sglang"]["steps"]
    assert [s["concurrency"] for s in steps] == [1, 2]
    assert all(s["median_us"] > 0 and s["steps"] > 0 for s in steps)
    # The reported run is the fastest of the repeats.
    assert all(len(s["run_medians_us"]) == 2 and s["median_us"] == min(s["run_medians_us"])
               for s in steps)
    assert out["sglang"]["memory"]["traced_bytes"] > 0
