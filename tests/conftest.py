"""Shared fixtures: the bundled model (ours and HF's), tiny random HF model directories, and a
probe that records the raw logits the engine samples from."""

from __future__ import annotations

import json
import os
import random
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from ngramspec.engine.engine import LLMEngine
from ngramspec.engine.model_runner import ForwardItem
from ngramspec.sampling_params import SamplingParams

# One torch thread by default: on 2 cores shared with other jobs, a second OpenMP thread waits at
# every barrier for a descheduled peer (measured: batch-8 decoding 20x slower than with 1 thread).
NUM_THREADS = int(os.environ.get("NGRAMSPEC_TEST_THREADS", "1"))
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
# Batch composition changes float summation order (~1e-4 in logits), so a choice this close to a
# tie may legitimately flip; anything wider is a real bug.
NEAR_TIE = 2e-3

_LONG_TEXT = (
    "The history of the lighthouse at Cape Verity begins in 1821, when a merchant named Elias "
    "Thorne lost two ships on the reef within a single winter. He petitioned the harbour board "
    "for a tower, offering to pay a third of the cost himself. The board hesitated for four "
    "years, arguing over whether the light should burn whale oil or the newer coal gas, and "
    "whether the keeper should be paid by the board or by a levy on every ship that entered the "
    "port. When the tower was finally lit in 1826 it stood forty-two feet tall, built of local "
    "granite, and its lamp could be seen eleven miles out to sea on a clear night. The first "
    "keeper, Margaret Olsen, kept a logbook that survives to this day: it records storms, "
    "shipwrecks she witnessed, the price of lamp oil, and the names of the sailors she pulled "
    "from the water. In 1874 the tower was raised by a further twenty feet and fitted with a "
    "Fresnel lens, which tripled its range. Electricity arrived in 1931, automation in 1989, and "
    "today the keeper's cottage is a small museum where visitors can read Olsen's logbook, climb "
    "the one hundred and twelve steps to the lamp room, and look out over the same reef that "
    "sank Thorne's ships two centuries ago."
)

# (kind, text): "chat" prompts go through the chat template, "raw" ones are plain text.
PROMPTS: list[tuple[str, str]] = [
    ("chat", "What is the capital of France? Answer in one sentence."),
    ("raw", "The quick brown fox"),
    ("raw", 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'),
    ("raw", "Count along: 1, 2, 3, 5, 8, 13, 21,"),
    ("chat", "Écris un court poème sur la mer, s'il te plaît."),
    ("raw", "Die Hauptstadt von Deutschland ist"),
    ("chat", _LONG_TEXT + "\n\nSummarise the text above in three bullet points."),
    ("raw", '{"name": "Alice", "age": 30, "languages": ["Python", "Rust",'),
]


@pytest.fixture(scope="session")
def model_dir() -> Path:
    from ngramspec.models.loader import resolve_model_dir

    return resolve_model_dir(None)


@pytest.fixture(scope="session")
def llm():
    from ngramspec import LLM

    return LLM(num_threads=NUM_THREADS, dtype="float32")  # golden against HF transformers


@pytest.fixture(scope="session")
def prompt_ids(llm) -> list[list[int]]:
    """Token ids of PROMPTS (the long one is about 300 tokens)."""
    return [llm.apply_chat_template([{"role": "user", "content": text}]) if kind == "chat"
            else llm.encode(text) for kind, text in PROMPTS]


@dataclass(slots=True)
class GreedyRef:
    tokens: list[int]
    gaps: list[float]  # top-2 logit gap at each step: how close to a tie each choice was


@pytest.fixture(scope="session")
def greedy_alone(llm, prompt_ids: list[list[int]]) -> list[GreedyRef]:
    """GREEDY output of each prompt run on its own: the reference for batching, chunking,
    preemption and stop tests."""
    refs = []
    for ids in prompt_ids:
        rec = LogitsProbe(llm.engine)
        try:
            out = llm.generate(ids, GREEDY)[0]
        finally:
            rec.close()
        refs.append(GreedyRef(out.token_ids, [top2_gap(r) for r in rec.rows[out.request_id]]))
    return refs


@pytest.fixture(scope="module")  # ~0.7 GB; the module that uses it frees it at its end
def hf_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(NUM_THREADS)
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def _tiny_config(arch: str):
    """A small config per family that still exercises GQA, biases, q/k norm and rope theta."""
    import transformers

    common = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-5, eos_token_id=2, bos_token_id=1, pad_token_id=2)
    if arch == "llama":
        return transformers.LlamaConfig(**common, rope_theta=50000.0, tie_word_embeddings=False)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common, rope_theta=1000000.0, tie_word_embeddings=True)
    if arch == "qwen3":
        # head_dim != hidden / heads on purpose: Qwen3 sets it explicitly.
        return transformers.Qwen3Config(**common, head_dim=24, rope_theta=1000000.0,
                                        tie_word_embeddings=False)
    raise ValueError(arch)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    # HF initialises biases to 0 and norms to 1, which would leave those code paths untested;
    # large weights also keep argmax ties rare and logit differences meaningful.
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            else:
                p.copy_(noise * (0.5 / p.shape[-1] ** 0.5 if p.dim() == 2 else 0.2))


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory, model_dir: Path) -> dict[str, Path]:
    """Random-weight Llama, Qwen2 and Qwen3 models saved by transformers, with our tokenizer."""
    from transformers import AutoModelForCausalLM

    dirs = {}
    for seed, arch in enumerate(("llama", "qwen2", "qwen3")):
        out = tmp_path_factory.mktemp(f"tiny-{arch}")
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(_tiny_config(arch), dtype=torch.float32)
        _randomize(model, seed)
        model.save_pretrained(str(out))
        for name in TOKENIZER_FILES:
            if (model_dir / name).is_file():
                shutil.copy(model_dir / name, out / name)
        dirs[arch] = out
    return dirs


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory, model_dir: Path) -> Path:
    """A random-weight 2-layer Llama GGUF whose matrices are Q8_0, Q4_1 and Q4_0 blocks (all
    three kernel types), with the bundled GGUF's tokenizer (so its 49152-token vocabulary)."""
    import gguf
    import numpy as np
    from gguf.quants import quantize

    from ngramspec.models.loader import default_model_path

    source = gguf.GGUFReader(str(default_model_path()))
    vocab = len(source.fields["tokenizer.ggml.tokens"].contents())
    hidden, ffn, heads, kv_heads, layers = 64, 96, 4, 2, 2
    path = tmp_path_factory.mktemp("tiny-gguf") / "tiny-q.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("context_length", 512), ("embedding_length", hidden), ("block_count", layers),
                       ("feed_forward_length", ffn), ("attention.head_count", heads),
                       ("attention.head_count_kv", kv_heads), ("vocab_size", vocab),
                       ("rope.dimension_count", hidden // heads)):
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.rope.freq_base", 50000.0)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    for key, field in source.fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(key, field.contents(), field.types[0], sub)
    rng = np.random.default_rng(7)
    Q = gguf.GGMLQuantizationType

    def matrix(name: str, rows: int, cols: int, qtype) -> None:
        x = (rng.standard_normal((rows, cols)) * 0.5 / cols ** 0.5).astype(np.float32)
        w.add_tensor(name, quantize(x, qtype), raw_dtype=qtype)  # shape from the block bytes

    def vector(name: str, n: int) -> None:
        w.add_tensor(name, (1.0 + 0.2 * rng.standard_normal(n)).astype(np.float32))

    matrix("token_embd.weight", vocab, hidden, Q.Q8_0)
    matrix("output.weight", vocab, hidden, Q.Q4_1)
    vector("output_norm.weight", hidden)
    head_dim = hidden // heads
    for i in range(layers):
        vector(f"blk.{i}.attn_norm.weight", hidden)
        vector(f"blk.{i}.ffn_norm.weight", hidden)
        # layer 0 mixes types inside q/k/v and gate/up (one kernel per matrix), layer 1 does not
        mixed = i == 0
        matrix(f"blk.{i}.attn_q.weight", hidden, hidden, Q.Q8_0)
        matrix(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden, Q.Q4_0 if mixed else Q.Q8_0)
        matrix(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden, Q.Q4_1 if mixed else Q.Q8_0)
        matrix(f"blk.{i}.attn_output.weight", hidden, hidden, Q.Q4_0)
        matrix(f"blk.{i}.ffn_gate.weight", ffn, hidden, Q.Q4_1)
        matrix(f"blk.{i}.ffn_up.weight", ffn, hidden, Q.Q8_0 if mixed else Q.Q4_1)
        matrix(f"blk.{i}.ffn_down.weight", hidden, ffn, Q.Q4_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="session")
def tiny_hf_models(tiny_model_dirs: dict[str, Path]) -> dict[str, torch.nn.Module]:
    from transformers import AutoModelForCausalLM

    return {arch: AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
            for arch, d in tiny_model_dirs.items()}


class LogitsProbe:
    """Wraps an engine's post-processing to record, per request, the raw logits row used to pick
    each new token (one row per sampling step: a prefill's last position or a decode)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.rows: dict[str, list[torch.Tensor]] = {}
        self._original = engine._postprocess
        self._nested = "_postprocess" in vars(engine)  # another probe is already recording
        engine._postprocess = self._postprocess  # instance attribute shadows the method

    def _postprocess(self, schedule, trees, logits, *rest):
        row = 0
        for chunk in schedule.chunks:
            if not chunk.samples:
                continue
            n = len(trees[chunk.seq.seq_id]) if chunk.seq.seq_id in trees else 1
            self.rows.setdefault(chunk.seq.request_id, []).append(logits[row].clone())
            row += n
        return self._original(schedule, trees, logits, *rest)

    def close(self) -> None:
        if self._nested:
            self.engine._postprocess = self._original
        else:
            del self.engine._postprocess


@pytest.fixture
def probe() -> Callable[[LLMEngine], LogitsProbe]:
    """probe(engine) starts recording; every probe is removed when the test ends."""
    made: list[LogitsProbe] = []

    def start(engine: LLMEngine) -> LogitsProbe:
        made.append(LogitsProbe(engine))
        return made[-1]

    yield start
    for p in reversed(made):
        p.close()


def first_difference(ours: list[int], ref: list[int]) -> int | None:
    """Index of the first differing token (a length difference counts), or None."""
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            return i
    return None if len(ours) == len(ref) else min(len(ours), len(ref))


def top2_gap(logits: torch.Tensor) -> float:
    top = logits.float().topk(2).values
    return float(top[0] - top[1])


def prefill_logits(engine: LLMEngine, token_ids: list[int],
                   chunk: int | None = None) -> torch.Tensor:
    """Logits at every position of `token_ids`, computed by our runner in chunks of `chunk` tokens
    (each chunk attends to the cached K/V of the previous ones). Leaves the allocator as it was."""
    chunk = chunk or len(token_ids)
    rows = []
    with engine.scheduler.scratch_slots(len(token_ids)) as slots:
        for start in range(0, len(token_ids), chunk):
            end = min(start + chunk, len(token_ids))
            item = ForwardItem(token_ids[start:end], list(range(start, end)), slots[:start],
                               slots[start:end], None, list(range(end - start)))
            rows.append(engine.runner.run([item]))
    return torch.cat(rows)


def describe_mismatch(ours: torch.Tensor, ref: torch.Tensor, what: str) -> str:
    """llm.c style: where the first out-of-tolerance row is and how far off it is."""
    diff = (ours - ref).abs().amax(-1)
    bad = int((diff > 1e-3).nonzero()[0]) if bool((diff > 1e-3).any()) else -1
    return (f"{what}: max abs diff {float(diff.max()):.3g}; first position over 1e-3: {bad} "
            f"(diff {float(diff[bad]):.3g}, ours argmax {int(ours[bad].argmax())}, "
            f"ref argmax {int(ref[bad].argmax())})")


def assert_same_tokens(ours: list[int], ref: GreedyRef, what: str) -> None:
    """Identical tokens, except that a flip exactly at a near-tie of the reference is reported
    (with its gap) rather than failed: kernels are not batch-invariant to the last bit."""
    k = first_difference(ours, ref.tokens)
    if k is None:
        return
    assert k < len(ref.gaps) and ref.gaps[k] < NEAR_TIE, (
        f"{what}: first differing token at step {k}: {ours[k:k + 1]} vs {ref.tokens[k:k + 1]} "
        f"(reference top-2 gap {ref.gaps[k] if k < len(ref.gaps) else float('nan'):.3g})")
    warnings.warn(f"{what}: near-tie flip at step {k} (top-2 gap {ref.gaps[k]:.2e})", stacklevel=2)


STREAMS = Path(__file__).resolve().parent.parent / "data" / "streams"
MAX_GAP = 1e-4  # a greedy divergence between spec and plain is acceptable only at a tie this close


def repetitive_prompts(n: int, vocab: int, length: int = 24, seed: int = 0) -> list[list[int]]:
    """Random token prompts that repeat themselves: copies give the drafter something to propose
    (for the tiny random models)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        base = [rng.randrange(3, vocab) for _ in range(length)]
        out.append(base + base[: length // 2] + base)
    return out


def spec_prompts() -> list[tuple[str, list[int], int]]:
    """(name, prompt ids, max_tokens): one per Spec-Bench category and every code edit (long)."""
    out, seen = [], set()
    for line in (STREAMS / "spec_bench.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["category"] not in seen or rec["category"] in ("summarization", "rag", "coding"):
            seen.add(rec["category"])
            out.append((rec["id"], rec["prompt_ids"], 64))
    for line in (STREAMS / "code_edit.jsonl").read_text().splitlines()[:4]:
        rec = json.loads(line)
        out.append((rec["id"], rec["prompt_ids"], 260))
    return out


def check_divergence(llm, name: str, prompt: list[int], ours: list[int], ref: list[int]) -> None:
    k = first_difference(ours, ref)
    if k is None:
        return
    logits = prefill_logits(llm.engine, prompt + ref[:k])[-1]
    gap = top2_gap(logits)
    print(f"{name}: spec and plain differ first at output token {k}; top-2 logit gap there {gap:.3g}")
    assert gap < MAX_GAP, f"{name}: divergence at token {k} with top-2 gap {gap:.3g} >= {MAX_GAP}"


def held_slots(engine: LLMEngine) -> tuple[list[int], list[int]]:
    """(slots running requests own, slots the prefix cache holds): disjoint, no duplicates."""
    sched = engine.scheduler
    own = [s for seq in sched.running for s in seq.slots[seq.num_shared:]]
    cached = sched.cache.slots() if sched.cache is not None else []
    assert len(own) + len(cached) == len(set(own) | set(cached)), "a slot is held twice"
    return own, cached


def assert_no_kv_leak(engine: LLMEngine) -> None:
    """Every KV slot is free, held by a running request, or cached; with nothing running, every
    cached slot can be evicted."""
    own, cached = held_slots(engine)
    alloc = engine.allocator
    assert len(own) + len(cached) + alloc.num_free == alloc.num_usable, "K/V slots leaked"
    cache = engine.scheduler.cache
    if not engine.has_unfinished() and cache is not None:
        assert cache.num_evictable == cache.num_nodes, "a finished request still locks the cache"


@pytest.fixture
def llama_server_stub(tmp_path: Path) -> Path:
    """An executable stand-in for llama-server (tests/llama_server_stub.py)."""
    import sys

    stub = tmp_path / "llama-server"
    source = (Path(__file__).parent / "llama_server_stub.py").read_text()
    stub.write_text(f"#!{sys.executable}\n{source}")
    stub.chmod(0o755)
    return stub


# Fixtures that load a model (the bundled one, HF's copy of it, or tiny random ones): a test that
# uses any of them, directly or through another fixture, is marked `model` and is left out of
# `make test-fast`.
MODEL_FIXTURES = frozenset({"llm", "model_dir", "hf_model", "tiny_model_dirs", "tiny_gguf",
                            "tiny_hf_models", "spec_llm", "chunked_llm"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if MODEL_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.model)
