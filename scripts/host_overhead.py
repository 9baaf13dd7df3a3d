"""Host-side cost of a speculative step at a large batch, without the model's compute.

At 64 requests on a GPU a step's forward takes a few ms, so the engine's Python work (drafting,
sizing, input building, verifying, committing) decides whether speculation pays there. This
measures that work on any machine:
  1. `Speculator._size` plus one `observe` per tree, on `--requests` synthetic 12-node trees;
  2. the whole engine on a tiny random Llama (2 layers, width 64: its forward is cheap), with
     `--requests` repetitive prompts decoding `--max-tokens` each, reporting the engine's own
     draft / forward / step ms per step.
Run from the repository root: `.venv/bin/python scripts/host_overhead.py [--draft-sizing full]`.
Compare two checkouts by running it in each, alternating (timings drift between runs).
"""

from __future__ import annotations

import argparse
import random
import shutil
import tempfile
import timeit
from pathlib import Path


def sizing_ms(requests: int, seed: int = 0) -> float:
    """Best-of-5 ms for one step's sizing of `requests` trees of 11 drafts."""
    from ngramspec.drafting.tree import DraftBatch, DraftTree
    from ngramspec.policy.cost import StepCost, VerifyCost
    from ngramspec.policy.sizing import size_trees

    rng = random.Random(seed)

    def tree() -> DraftTree:
        p, probs = 1.0, [1.0]
        for _ in range(11):
            p *= rng.random() ** 0.3
            probs.append(p)
        return DraftTree([7] * 12, [-1, *range(11)], probs)

    points = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 512, 1024]
    cost = StepCost(VerifyCost(points, [0.003 + 0.00002 * i for i in range(len(points))]))
    batch = DraftBatch.from_trees([tree() for _ in range(requests)], 12)
    lengths = batch.sizes

    def step() -> None:
        size_trees(batch.probs, lengths, requests, cost, requests)

    return min(timeit.repeat(step, number=30, repeat=5)) / 30 * 1e3


def tiny_model(out: Path) -> Path:
    """A random-weight Llama with the bundled model's tokenizer (nothing is downloaded)."""
    import torch
    import transformers

    from ngramspec.models.loader import resolve_model_dir

    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        rms_norm_eps=1e-5, eos_token_id=2, bos_token_id=1, pad_token_id=2, rope_theta=50000.0,
        tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(out))
    source = resolve_model_dir(None)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (source / name).is_file():
            shutil.copy(source / name, out / name)
    return out


def engine_ms(model: Path, requests: int, max_tokens: int, draft_sizing: str) -> dict:
    """The engine's ms per step (draft, forward, whole step) over one batch of requests."""
    from ngramspec import LLM
    from ngramspec.sampling_params import SamplingParams

    llm = LLM(model=str(model), num_threads=2, max_num_seqs=requests, dtype="float32",
              speculative="ngram", draft_sizing=draft_sizing)
    rng = random.Random(0)
    prompts = []
    for _ in range(requests):
        base = [rng.randrange(3, 512) for _ in range(24)]
        prompts.append(base + base[:12] + base)  # repetitive: the drafter has copies to offer
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:4], params)  # warm-up
    before = llm.engine.stats.as_dict()
    llm.generate(prompts, params)
    after = llm.engine.stats.as_dict()
    steps = after["num_steps"] - before["num_steps"]
    per_step = {k: 1e3 * (after[f"{k}_time"] - before[f"{k}_time"]) / steps
                for k in ("draft", "forward", "step")}
    return {"steps": steps, "mean_acceptance_length": after["mean_acceptance_length"],
            **{f"{k}_ms": round(v, 3) for k, v in per_step.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=600)
    parser.add_argument("--draft-sizing", default="full", choices=("auto", "cost", "full"))
    args = parser.parse_args()
    print(f"sizing, {args.requests} trees of 11 drafts: "
          f"{sizing_ms(args.requests):.3f} ms a step")
    with tempfile.TemporaryDirectory() as tmp:
        result = engine_ms(tiny_model(Path(tmp)), args.requests, args.max_tokens,
                           args.draft_sizing)
    print(f"tiny model, {args.requests} requests x {args.max_tokens} tokens, "
          f"--draft-sizing {args.draft_sizing}: {result}")


if __name__ == "__main__":
    main()
