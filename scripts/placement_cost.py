"""What a placement strategy costs a request that has no prefix to follow: vLLM's benchmark client (random prompts,
``--concurrency`` streams as fast as they go) against one `vtoken serve` (one replica, vToken off), the strategies
switched live on the same server (Controller.set_placement) and measured in turns, the order reversed every round,
each client run on prompts of its own. Under ``prefix`` the controller places every request (its index lives
there), a Ray call per request; under the others the gateway places it from its copy (cluster/placer.py).

    .venv/bin/python scripts/placement_cost.py --strategies weighted,prefix --rounds 4 --out /tmp/placement_cost.json

A measurement, not a test: it depends on what else the machine runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

KEYS = ("median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--strategies", default="weighted,prefix")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--prompts-per-stream", type=int, default=8)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--out", default="placement_cost.json")
    args = p.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # the EngineCore in a process of its own, as deployed

    import ray

    from cluster.placer import MAX_AGE_S
    from cluster.server import BackgroundServer, start_ray
    from vtoken.bench import machine
    from vtoken.bench import serve as bench_serve
    from vtoken.models import model_path

    sp = argparse.ArgumentParser()
    bench_serve.add_args(sp)
    a = sp.parse_args(["--model", args.model, "--input-len", str(args.input_len), "--output-len",
                       str(args.output_len), "--max-concurrency", str(args.concurrency)])  # fmt: skip
    folder = str(model_path(args.model))
    strategies = args.strategies.split(",")
    cfg = bench_serve.vtoken_config(a, 1, {"mode": "off"})  # vtoken bench serve's server "off"
    start_ray(cfg, verbose=False)
    runs: dict[str, list[dict]] = {s: [] for s in strategies}
    t0, load_before = time.time(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp, BackgroundServer(cfg) as served:
        url = f"http://127.0.0.1:{served.http_port}"
        bench_serve.warm(a, url, folder, tmp)
        for i in range(args.rounds):
            order = strategies if i % 2 == 0 else strategies[::-1]
            for j, s in enumerate(order):
                ray.get(served.controller.set_placement.remote(s), timeout=60)
                time.sleep(MAX_AGE_S + 0.1)  # the gateway's next request waits for a copy with the new strategy
                n = args.prompts_per_stream * args.concurrency
                r = bench_serve.client(a, url, folder, float("inf"), tmp, seed=100 + len(strategies) * i + j,
                                       num_prompts=n)  # fmt: skip
                runs[s].append({k: r[k] for k in ("completed", "failed", *KEYS)})
                print(f"round {i + 1}/{args.rounds} {s}: " + ", ".join(f"{k} {r[k]:.1f}" for k in KEYS), flush=True)
    base = strategies[0]
    summary = {s: {k: statistics.median(r[k] for r in runs[s]) for k in KEYS} for s in strategies}
    ratios = {s: {k: round(summary[s][k] / summary[base][k], 3) for k in KEYS} for s in strategies}
    out = {"command": " ".join(sys.argv), "machine": machine(), "seconds": round(time.time() - t0, 1),
           "load": {"before": load_before, "after": os.getloadavg()[0]}, "settings": vars(args), "runs": runs,
           "median_over_rounds": summary, f"ratio_to_{base}": ratios}  # fmt: skip
    Path(args.out).write_text(json.dumps(out, indent=1))
    for s in strategies:
        print(s, summary[s], ratios[s])


if __name__ == "__main__":
    main()
