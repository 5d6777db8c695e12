"""A longer fuzz of both doors than CI's: tests/test_fuzz_doors.py with bigger budgets (the same generators,
tests/fuzz_bodies.py). Prints the requests tried per door and the faults (5xx, stalls, bodies of the wrong shape,
an engine that died); exit status 0 only when there were none.

    .venv/bin/python scripts/fuzz_doors.py --examples 2000 --engine-examples 300
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--examples", type=int, default=2000, help="generated requests per door (fake engine)")
    p.add_argument("--engine-examples", type=int, default=300, help="batches of 1-4 requests into a real engine")
    p.add_argument("--no-engine", action="store_true", help="only the doors (no vLLM engine)")
    args = p.parse_args()
    env = {**os.environ, "VTOKEN_FUZZ_EXAMPLES": str(args.examples),
           "VTOKEN_FUZZ_ENGINE_EXAMPLES": str(args.engine_examples)}  # fmt: skip
    cmd = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "tests/test_fuzz_doors.py",
           "--timeout", "0"]  # fmt: skip
    if args.no_engine:
        cmd += ["-m", "not vllm"]
    print("running:", " ".join(cmd), flush=True)
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    for line in out.stdout.splitlines():
        if line.startswith(("http fuzz:", "grpc fuzz:", "engine fuzz:")) or " fuzz: " in line:
            print(line.split("fuzz:")[0].strip(".").strip() + " fuzz:", line.split("fuzz:", 1)[1].strip())
    tail = [ln for ln in out.stdout.splitlines() if "passed" in ln or "failed" in ln]
    print(tail[-1] if tail else out.stdout[-2000:])
    if out.returncode:
        print(out.stdout[-6000:], out.stderr[-2000:], sep="\n")
    return out.returncode


if __name__ == "__main__":
    sys.exit(main())
