"""Import rules: the drafting side and the policy never reach the engine, and nothing is a cycle.

Every `import` is read from the source (top-level and function-level alike, since a lazy import
is still a dependency), so the rule holds whatever a test happens to import first.
"""

from __future__ import annotations

import ast
from pathlib import Path

import ngramspec

ROOT = Path(ngramspec.__file__).parent
TORCH_FREE = ("drafting", "corpus", "simulator", "policy")
FORBIDDEN = ("torch", "ngramspec.engine", "ngramspec.server", "ngramspec.models",
             "ngramspec.layers")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Absolute module names `path` imports (`from a import b` yields a.b when that is a module)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{alias.name}" for alias in node.names)
    return out


def graph() -> dict[str, set[str]]:
    mods = {module_name(p): p for p in ROOT.rglob("*.py")}
    return {name: {m for m in imports_of(p) if m in mods and m != name}
            for name, p in mods.items()}


def test_drafting_corpus_simulator_policy_import_no_torch_nor_engine() -> None:
    bad = []
    for pkg in TORCH_FREE:
        for path in (ROOT / pkg).rglob("*.py"):
            for mod in imports_of(path):
                if any(mod == f or mod.startswith(f + ".") for f in FORBIDDEN):
                    bad.append(f"{module_name(path)} imports {mod}")
    assert not bad, "\n".join(bad)


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (as a path that returns to its start), or None; iterative DFS."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    for start in sorted(edges):
        if start in state:
            continue
        stack = [(start, iter(sorted(edges[start])))]
        path = [start]
        state[start] = 1
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                state[node] = 2
                stack.pop()
                path.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                stack.append((nxt, iter(sorted(edges.get(nxt, ())))))
                path.append(nxt)
    return None


def test_find_cycle_finds_a_planted_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_package_has_no_import_cycles() -> None:
    edges = graph()
    # A package's __init__ importing its own submodules is not a cycle of the code's design.
    for name in edges:
        edges[name] = {m for m in edges[name] if not name.startswith(m + ".")}
    cycle = find_cycle(edges)
    assert cycle is None, " -> ".join(cycle)


def allocator_calls(path: Path) -> list[str]:
    """`x.allocate(...)` / `x.free(...)` calls on anything named or ending in `allocator`."""
    calls = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("allocate", "free")):
            owner = ast.unparse(node.func.value)
            if owner == "allocator" or owner.endswith(".allocator"):
                calls.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} {owner}.{node.func.attr}")
    return calls


def test_only_the_scheduler_allocates_or_frees_kv_slots() -> None:
    owner = ROOT / "engine" / "scheduler.py"
    assert allocator_calls(owner), "the scanner found no calls in the owner: it cannot work"
    outside = [c for p in sorted(ROOT.rglob("*.py")) if p != owner for c in allocator_calls(p)]
    assert outside == []
