"""The house's walls, held by tests, by folder: ``vtoken/core`` (where a token's life is decided) imports neither
torch nor vLLM nor ``vtoken/kv``; ``vtoken/kv`` (where its bytes move) imports no vLLM; only ``vtoken/vllm_adapter``
imports vLLM's internals; nothing in ``cluster/`` or ``actors/`` imports the benchmarks; first-party modules import
each other in no circle. ``cluster/`` stands on floors (``CLUSTER_FLOORS``), each importing only its own floor and
those below: the doors over the request path they share, over the control plane, over the config, over placement and
the protocol; neither door nor request path imports the control plane's internals (they reach the controller through
its Ray handle), and placement imports nothing else of ``cluster/``. Each wall and each floor is shown to fail on a
planted violation. Reads the source only (ast), except the one check that imports the core and looks for torch in
``sys.modules``."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("vtoken", "actors", "cluster")
# vLLM's private machinery: its scheduler, engine core, workers, executors, model code and attention layers.
# Its public surface (vllm, vllm.inputs, vllm.sampling_params, vllm.exceptions, vllm.v1.engine.exceptions,
# vllm.entrypoints, vllm.benchmarks, vllm.v1.metrics, ...) may be used anywhere.
VLLM_INTERNALS = (
    "vllm.v1.core",
    "vllm.v1.worker",
    "vllm.v1.engine.core",
    "vllm.v1.executor",
    "vllm.v1.attention",
    "vllm.model_executor",
    "vllm.distributed",
    "vllm.attention",
    "vllm.v1.kv_cache_interface",
)
# (the modules a wall holds, the imports they may not make, why)
WALLS = (
    (
        "vtoken.core",
        ("torch", "triton", "vllm", "vtoken.kv", "vtoken.vllm_adapter", "vtoken.bench", "actors", "cluster"),
        "the decisions run with no device and no engine",
    ),
    (
        "vtoken.kv",
        ("vllm", "vtoken.vllm_adapter", "vtoken.bench", "actors", "cluster"),
        "the bytes move with no engine; vLLM's knowledge stays in the adapter",
    ),
    (("vtoken", "actors", "cluster"), VLLM_INTERNALS, "only vtoken/vllm_adapter knows vLLM's internals"),
    (("cluster", "actors"), ("vtoken.bench",), "serving never imports the benchmarks"),
    (
        ("cluster.doors", "cluster.serving"),
        (
            "cluster.control.controller",
            "cluster.control.lifecycle",
            "cluster.control.autoscaler",
            "cluster.control.replica_status",
        ),
        "the request path reaches the controller through its Ray handle and reads only its published views",
    ),
    (
        "cluster.placement",
        (
            "cluster.cli",
            "cluster.server",
            "cluster.doors",
            "cluster.serving",
            "cluster.sim",
            "cluster.ray_connect",
            "cluster.control",
            "cluster.config",
        ),
        "placement decides from replica views alone, the same in the controller, a gateway and the simulator",
    ),
)
# cluster/ from the top floor down: a module imports only from its own floor or below (within a floor: no circle).
CLUSTER_FLOORS = (
    ("cluster.cli",),
    ("cluster.server",),
    ("cluster.doors",),
    ("cluster.serving", "cluster.sim", "cluster.ray_connect"),
    ("cluster.control",),
    ("cluster.config",),
    ("cluster.placement", "cluster.proto"),
)
ADAPTER = "vtoken.vllm_adapter"


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


def all_imports() -> dict[str, set[str]]:
    """First-party module -> every absolute module name it imports (first-party or not), anywhere in the file."""
    out: dict[str, set[str]] = {}
    for path in (p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        out[module_name(path)] = names
    return out


def _under(name: str, prefixes) -> bool:
    prefixes = (prefixes,) if isinstance(prefixes, str) else prefixes
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def wall_breaches(imports: dict[str, set[str]]) -> list[str]:
    """Every import that crosses a wall, as 'module -> import (why)'."""
    bad = []
    for module, deps in sorted(imports.items()):
        for holds, banned, why in WALLS:
            if not _under(module, holds) or (banned is VLLM_INTERNALS and _under(module, ADAPTER)):
                continue
            bad += [f"{module} -> {d} ({why})" for d in sorted(deps) if _under(d, banned)]
    return bad


def floor(name: str) -> int | None:
    """The floor of a ``cluster`` module, counted from the ground (1); None off the floors (``cluster`` itself)."""
    for i, rooms in enumerate(CLUSTER_FLOORS):
        if _under(name, rooms):
            return len(CLUSTER_FLOORS) - i
    return None


def upward(imports: dict[str, set[str]]) -> list[str]:
    """Every import of a ``cluster`` module from a floor above its own, as 'module -> import (floor a -> b)'."""
    bad = []
    for module, deps in sorted(imports.items()):
        here = floor(module)
        if here is None:
            continue
        for d in sorted(deps):
            there = floor(d)
            if there is not None and there > here:
                bad.append(f"{module} -> {d} (floor {here} -> {there})")
    return bad


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


def test_no_import_crosses_a_wall():
    assert not wall_breaches(all_imports())


@pytest.mark.parametrize(
    "module,planted",
    [
        ("vtoken.core.compactor", "torch"),
        ("vtoken.core.planner", "vtoken.kv.mover"),
        ("vtoken.core.policies.h2o", "vllm"),
        ("vtoken.kv.mover", "vllm.config"),
        ("vtoken.kv.tier", "vtoken.vllm_adapter.scheduler"),
        ("cluster.placement.strategies", "vllm.v1.core.sched.scheduler"),
        ("actors.engines", "vllm.v1.worker.gpu_worker"),
        ("vtoken.config", "vllm.model_executor.models"),
        ("cluster.serving.dispatch", "vtoken.bench.concurrency"),
        ("actors.replica", "vtoken.bench"),
        ("cluster.doors.http_middleware", "cluster.control.controller"),
        ("cluster.doors.grpc_server", "cluster.control.lifecycle"),
        ("cluster.serving.dispatch", "cluster.control.replica_status"),
        ("cluster.placement.placer", "cluster.doors.grpc_server"),
        ("cluster.placement.strategies", "cluster.config"),
    ],
)
def test_each_wall_fails_on_a_planted_violation(module, planted):
    assert caught(module, planted, wall_breaches)


def caught(module: str, planted: str, check) -> bool:
    """Whether ``check`` (imports -> breaches) names ``module -> planted`` once that import is planted."""
    imports = all_imports()
    assert module in imports, f"{module} moved: plant the violation elsewhere"
    imports[module] = imports[module] | {planted}
    return any(b.startswith(f"{module} -> {planted} ") for b in check(imports))


def test_cluster_imports_run_only_down_its_floors():
    assert not upward(all_imports())


def test_every_cluster_module_stands_on_a_floor():
    off = [m for m in all_imports() if _under(m, "cluster") and m != "cluster" and floor(m) is None]
    assert not off, f"place these on CLUSTER_FLOORS: {off}"


@pytest.mark.parametrize(
    "module,planted",
    [
        ("cluster.control.lifecycle", "cluster.serving.frontend"),  # engine_args lived there once
        ("cluster.config", "cluster.control.controller"),
        ("cluster.serving.metrics", "cluster.doors.http_server"),
        ("cluster.server", "cluster.cli"),
    ],
)
def test_each_floor_fails_on_a_planted_upward_import(module, planted):
    assert caught(module, planted, upward)


def test_a_floor_may_import_its_own_floor_and_those_below():
    imports = all_imports()
    imports["cluster.placement.prefix_index"] |= {"cluster.proto.vtoken_pb2"}  # the same floor
    imports["cluster.doors.auth"] |= {"cluster.placement.strategies", "cluster.serving.requests"}  # below
    assert not upward(imports)


def test_the_adapter_may_import_vllm_internals_and_public_vllm_is_fine_elsewhere():
    imports = all_imports()
    assert any(_under(d, VLLM_INTERNALS) for d in imports["vtoken.vllm_adapter.scheduler"])
    imports["cluster.serving.requests"] = imports["cluster.serving.requests"] | {
        "vllm.sampling_params",
        "vllm.entrypoints.utils",
    }
    assert not wall_breaches(imports)


def test_importing_the_decision_core_loads_no_torch_and_no_vllm():
    core = sorted(m for m in all_imports() if _under(m, "vtoken.core")) + ["vtoken.pool_report"]
    code = (
        "import sys\n"
        f"for m in {core!r}: __import__(m)\n"
        "print(sorted(m for m in ('torch', 'vllm', 'triton') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
