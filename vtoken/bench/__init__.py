"""`vtoken bench <name>`: benchmarks as scripts with JSON output. Each module registers one name."""

from __future__ import annotations

import importlib
import json
import platform
import time
from pathlib import Path

BENCHMARKS = {"core": "vtoken.bench.core", "overhead": "vtoken.bench.overhead"}  # name -> module with add_args(parser) and run(args) -> dict


def add_cli(sub) -> None:
    p = sub.add_parser("bench", help="run a benchmark; writes JSON (and more) under --out")
    bsub = p.add_subparsers(dest="bench", required=True)
    for name, mod in BENCHMARKS.items():
        m = importlib.import_module(mod)
        bp = bsub.add_parser(name, help=m.__doc__.splitlines()[0])
        bp.add_argument("--out", default="bench_out", help="folder for the results")
        bp.add_argument("--quick", action="store_true", help="small settings for a smoke test")
        m.add_args(bp)
        bp.set_defaults(func=lambda args, m=m, name=name: _run(m, name, args))


def machine() -> dict:
    import numpy
    import torch

    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "python": platform.python_version(), "numpy": numpy.__version__, "torch": torch.__version__,
            "threads": torch.get_num_threads()}


def _run(module, name: str, args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    result = module.run(args)
    result = {"benchmark": name, "settings": {k: v for k, v in vars(args).items() if k != "func"},
              "machine": machine(), "seconds": round(time.perf_counter() - t0, 2), **result}
    path = out / f"{name}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return 0
