"""What the OpenAI door costs: this tree's door against another tree's (``--against``), side by side in one run.

Each tree serves with its own virtual environment (``<tree>/.venv``), `vtoken serve` with one replica and vToken
off, the same model and engine settings, so the door is what differs. Per round, in turns (the order reversed
every round, so drift hits both alike):

  cpu      scripts/serve_cpu_per_token.py: one streamed completion at a time; every process's CPU time per
           streamed token. The gateway runs in that script's process, beside its client (the same client for
           both trees), so the difference of that process's figure is the door's
  streams  `vtoken bench serve` (vLLM's own benchmark client): ``--concurrency`` streams at once, as fast as they
           go; TTFT and ITL p50 and p99

A measurement, not a test: it depends on what else the machine runs (the result says the load).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from vtoken.bench.engine_run import log
from vtoken.bench.report import Table
from vtoken.bench.serve import geomean_interval

ROOT = Path(__file__).resolve().parents[2]
LATENCY = ("median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms")


def add_args(p) -> None:
    p.add_argument("--against", required=False, default="", help="the other tree (a checkout with its own .venv)")
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--concurrency", default="16,64", help="streams at once, one client run each")
    p.add_argument("--prompts-per-stream", type=int, default=4, help="requests per run: this x the concurrency")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--requests", type=int, default=6, help="the cpu phase's streams, one after another")
    p.add_argument("--tokens", type=int, default=256, help="the cpu phase's tokens per stream")


def _tree(path: Path) -> dict[str, str]:
    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", str(path), *a], capture_output=True, text=True).stdout.strip()

    return {"commit": git("rev-parse", "--short", "HEAD"), "subject": git("log", "-1", "--format=%s")[:100]}


def _python(tree: Path) -> str:
    py = tree / ".venv" / "bin" / "python"
    if not py.exists():
        raise SystemExit(f"{tree}: no .venv (run scripts/setup.sh there)")
    return str(py)


def _run(tree: Path, cmd: list[str]) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PYTHONPATH", "VIRTUAL_ENV")}
    r = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, timeout=3600, env=env)
    if r.returncode:
        raise RuntimeError(f"{' '.join(cmd[:4])} in {tree} failed: {r.stderr[-2000:]}")


def _cpu(tree: Path, args, tmp: str) -> dict[str, Any]:
    out = Path(tmp) / f"cpu-{os.urandom(4).hex()}"
    _run(tree, [_python(tree), "scripts/serve_cpu_per_token.py", "--servers", "off", "--model", args.model,
                "--requests", str(args.requests), "--tokens", str(args.tokens), "--out", str(out)])  # fmt: skip
    r = json.loads((out / "serve_cpu.json").read_text())["servers"]["off"]
    driver = sum(ms for ms, cmd in r["cpu_ms_per_token"] if "serve_cpu_per_token" in cmd)
    return {"gateway_and_client_ms": round(driver, 3), "total_ms": r["cpu_ms_per_token_total"],
            "tpot_median_ms": r["tpot_median_ms"], "processes": r["cpu_ms_per_token"][:8]}  # fmt: skip


def _streams(tree: Path, args, concurrency: int, tmp: str) -> dict[str, Any]:
    out = Path(tmp) / f"serve-{os.urandom(4).hex()}"
    _run(tree, [_python(tree), "-m", "vtoken.bench", "serve", "--servers", "off", "--model", args.model,
                "--rates", "inf", "--max-concurrency", str(concurrency),
                "--num-prompts", str(args.prompts_per_stream * concurrency), "--input-len", str(args.input_len),
                "--output-len", str(args.output_len), "--out", str(out)])  # fmt: skip
    r = json.loads((out / "serve.json").read_text())["runs"]["off"]["inf"]
    return {k: r[k] for k in ("completed", "failed", "output_throughput", *LATENCY)}


def run(args) -> dict:
    if args.quick:
        raise SystemExit("doorcost has no --quick form: it serves two trees (see its docstring)")
    if not args.against:
        raise SystemExit("--against: the other tree to compare this one's door with")
    trees = {"this": ROOT, "against": Path(args.against).resolve()}
    levels = [int(c) for c in args.concurrency.split(",")]
    load_before = os.getloadavg()
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            order = list(trees) if i % 2 == 0 else list(trees)[::-1]
            this_round: dict[str, dict] = {}
            for name in order:
                tree = trees[name]
                log(f"[doorcost] round {i + 1}/{args.rounds}, {name}: cpu per token")
                this_round[name] = {"cpu": _cpu(tree, args, tmp), "streams": {}}
                for c in levels:
                    log(f"[doorcost] round {i + 1}/{args.rounds}, {name}: {c} streams")
                    this_round[name]["streams"][str(c)] = _streams(tree, args, c, tmp)
            rounds.append(this_round)
    return {
        "model": args.model,
        "trees": {name: {**_tree(path), "role": name} for name, path in trees.items()},
        "concurrency": levels,
        "rounds": rounds,
        "summary": summary(rounds, levels),
        "load": {"cpus": os.cpu_count(), "loadavg_before": load_before[0], "loadavg_after": os.getloadavg()[0]},
    }


def summary(rounds: list[dict], levels: list[int]) -> dict[str, Any]:
    """Each figure's median over rounds, per tree, and this tree's over the other's; with the round-by-round ratios
    (the two trees of a round ran back to back) and their geometric mean's 95% interval (three rounds or more). On a
    machine whose engine speed changes from one server start to the next, the interval says what the rounds can
    tell apart."""
    per_round: dict[str, list[dict[str, float]]] = {}
    for key in ("gateway_and_client_ms", "total_ms", "tpot_median_ms"):
        per_round[f"cpu.{key}"] = [{t: r[t]["cpu"][key] for t in ("this", "against")} for r in rounds]
    for c in levels:
        for key in LATENCY:
            per_round[f"c{c}.{key}"] = [{t: r[t]["streams"][str(c)][key] for t in ("this", "against")} for r in rounds]
    out: dict[str, Any] = {}
    for name, values in per_round.items():
        per = {t: statistics.median(v[t] for v in values) for t in ("this", "against")}
        ratios = [v["this"] / v["against"] for v in values if v["this"] and v["against"]]
        out[name] = {
            **per,
            "ratio": per["this"] / per["against"] if per["against"] else None,
            "round_ratios": [round(x, 4) for x in ratios],
            "geomean_ci95": geomean_interval(ratios) if len(ratios) == len(values) else None,
        }
    return out


def tables(result: dict) -> list[Table]:
    t, a = result["trees"]["this"], result["trees"]["against"]

    def interval(v: dict) -> str:
        ci = v.get("geomean_ci95")
        return "-" if not ci else f"{ci[0]:.3f} [{ci[1]:.3f}, {ci[2]:.3f}]"

    rows = [[name, f"{v['against']:.2f}", f"{v['this']:.2f}", "-" if v["ratio"] is None else f"{v['ratio']:.3f}",
             interval(v)] for name, v in result["summary"].items()]  # fmt: skip
    load = result["load"]
    columns = ["figure", f"{a['commit']} (against)", f"{t['commit']} (this)", "this / against", "by round [95%]"]
    return [
        Table(
            f"The door's cost ({result['model']}, one replica, vToken off): {t['commit']} against {a['commit']}",
            columns,
            rows,
            f"Medians over {len(result['rounds'])} rounds, the trees in turns. cpu.*: one stream at a time, CPU ms per "
            "streamed token (gateway_and_client: the process that runs the gateway and the client; total: every "
            "process). c<N>.*: N streams at once (vLLM's client), ms. by round: the geometric mean of each round's "
            "ratio (the trees back to back) and its 95% interval (Student's t on the logarithms). Load average "
            f"{load['loadavg_before']:.2f} before, {load['loadavg_after']:.2f} after, {load['cpus']} CPUs. this: "
            f"the tree the command ran in, at {t['commit']}; against: {a['commit']} (git show names each).",
        )
    ]
