"""bench llama-server's harness against a stand-in llama-server: servers started and stopped,
every prompt sent to each, tok/s and the equal-to-plain counts per workload."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from ngramspec.bench import llama_server_bench as bench


def test_the_harness_times_every_server_and_counts_equal_outputs(tmp_path: Path, monkeypatch,
                                                                  llama_server_stub: Path) -> None:
    prompts = [bench.BenchPrompt(f"p{i}", "chat", f"question {i}") for i in range(3)]
    monkeypatch.setattr(bench, "workload_prompts", lambda name, limit: prompts[:limit])
    args = argparse.Namespace(model=None, llama_server=str(llama_server_stub),
                              workloads=["chat", "summarize"],
                              modes=["ngram-mod", "ngram-simple"], limit=2, max_tokens=5, threads=2,
                              isa=None, start_timeout=60.0, log_dir=str(tmp_path / "logs"), json=True,
                              ignore_eos=True, phases=True)
    r = bench.run(args)
    assert set(r["phases"]) == {"llama plain"}  # plain servers only
    assert r["phases"]["llama plain"]["prefill_tok_s"] > 0 and r["phases"]["llama plain"]["decode_ms"] > 0
    assert set(r["workloads"]) == {"chat", "summarize"}
    for row in r["workloads"].values():
        assert row["num_prompts"] == 2
        assert set(row["tok_s"]) == {"llama plain", "llama ngram-mod", "llama ngram-simple"}
        assert all(v > 0 for v in row["tok_s"].values())
        assert row["equal_to_plain"] == {"llama ngram-mod": 2, "llama ngram-simple": 0}
        assert set(row["completion_tokens"].values()) == {2 * 5}  # ignore_eos: max_tokens each
    assert set(r["all"]) == set(r["workloads"]["chat"]["tok_s"])
    json.dumps(r)  # the --json output
    args.ignore_eos, args.phases = False, False  # the stand-in then ends each text after one token
    r = bench.run(args)
    assert set(r["workloads"]["chat"]["completion_tokens"].values()) == {2}


def test_servers_are_composed_from_the_modes(tmp_path: Path) -> None:
    fake = tmp_path / "llama-server"
    pool = bench.servers(Path("m.gguf"), fake, 3, ["plain", "spec", "ngram-map-k"], "avx2")
    assert [s.name for s in pool] == ["ngramspec plain", "ngramspec spec", "llama plain",
                                      "llama ngram-map-k"]
    assert pool[0].env == {"NGRAMSPEC_CPU_ISA": "avx2"}
    assert pool[1].argv[pool[1].argv.index("--speculative") + 1] == "ngram"
    assert pool[3].argv[-2:] == ["--spec-type", "ngram-map-k"] and "-t" in pool[3].argv
    assert len({s.port for s in pool}) == 4
    assert [s.name for s in bench.servers(Path("m.gguf"), None, 2, ["spec"], None)] == ["ngramspec spec"]
    with pytest.raises(ValueError, match="unknown workload"):
        bench.workload_prompts("poetry", 1)
