"""The house's walls, held by tests: the decision core imports no torch, first-party modules import each other in no
circle, and nothing in cluster/ imports the benchmarks. Reads the source only (ast); no engine, no vLLM."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("vtoken", "actors", "cluster")
# Where a token's life is decided, and the messages that leave it: plain Python and NumPy.
DECISION_CORE = (
    "vtoken.budget",
    "vtoken.compactor",
    "vtoken.move_batch",
    "vtoken.packing",
    "vtoken.park",
    "vtoken.phase",
    "vtoken.planner",
    "vtoken.policies",
    "vtoken.records",
    "vtoken.replay",
    "vtoken.request_state",
    "vtoken.schedule",
    "vtoken.shedding",
    "vtoken.token_table",
    "vtoken.accounting",
    "vtoken.pool_report",
)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """First-party module -> the first-party modules it imports, anywhere in the file (a function-level import
    ties two modules as much as a top-level one)."""
    paths = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    modules = {module_name(p): p for p in paths}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            deps |= {t for t in targets if t in modules and t != name}
        graph[name] = deps
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_circle_finder_finds_a_planted_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_first_party_modules_import_each_other_in_a_circle():
    found = circles(import_graph())
    assert not found, f"import circles: {found}"


def test_nothing_in_cluster_imports_the_benchmarks():
    graph = import_graph()
    bad = sorted(f"{m} -> {d}" for m, deps in graph.items() if m.startswith("cluster") for d in deps
                 if d.startswith("vtoken.bench"))  # fmt: skip
    assert not bad, bad


def test_the_decision_core_imports_no_torch_and_no_vllm():
    code = (
        "import sys\n"
        f"for m in {DECISION_CORE!r}: __import__(m)\n"
        "print(sorted(m for m in ('torch', 'vllm', 'triton') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
