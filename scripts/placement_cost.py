"""What a placement strategy costs a request that has no prefix to follow: vLLM's benchmark client (random prompts,
``--concurrency`` streams as fast as they go) against one `vtoken serve` (one replica, vToken off), the strategies
switched live on the same server (Controller.set_placement) and measured in turns, the order reversed every round,
each client run on prompts of its own. Every strategy places in the gateway from its copy of the controller's views
(cluster/placement/placer.py); ``prefix`` also keeps copies of the replicas' prefix indexes there and matches each
prompt's block hashes against them.

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
    p.add_argument("--decisions-only", action="store_true", help="only the gateway's time per decision, no server")
    args = p.parse_args()
    decisions = {s: {n: decision_us(s, n) for n in (2, 16, 256)} for s in args.strategies.split(",")}
    print("gateway's time per placement and per refresh, us:", json.dumps(decisions), flush=True)
    if args.decisions_only:
        return
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # the EngineCore in a process of its own, as deployed

    import ray

    from cluster.placement.placer import SETTLE_S
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
                time.sleep(SETTLE_S)  # until the gateway places by the new strategy
                n = args.prompts_per_stream * args.concurrency
                r = bench_serve.client(a, url, folder, float("inf"), tmp, seed=100 + len(strategies) * i + j,
                                       num_prompts=n)  # fmt: skip
                runs[s].append({k: r[k] for k in ("completed", "failed", *KEYS)})
                print(f"round {i + 1}/{args.rounds} {s}: " + ", ".join(f"{k} {r[k]:.1f}" for k in KEYS), flush=True)
    base = strategies[0]
    summary = {s: {k: statistics.median(r[k] for r in runs[s]) for k in KEYS} for s in strategies}
    ratios = {s: {k: round(summary[s][k] / summary[base][k], 3) for k in KEYS} for s in strategies}
    # each round's ratio, the two measured next to each other: the machine's drift over the run cancels
    paired = {s: {k: round(statistics.median(r[k] / b[k] for r, b in zip(runs[s], runs[base], strict=True)), 3)
                  for k in KEYS} for s in strategies}  # fmt: skip
    out = {"command": " ".join(sys.argv), "machine": machine(), "seconds": round(time.time() - t0, 1),
           "load": {"before": load_before, "after": os.getloadavg()[0]}, "settings": vars(args), "runs": runs,
           "decision_us": decisions, "median_over_rounds": summary, f"ratio_to_{base}": ratios,
           f"median_round_ratio_to_{base}": paired}  # fmt: skip
    Path(args.out).write_text(json.dumps(out, indent=1))
    for s in strategies:
        print(s, summary[s], ratios[s], "by round:", paired[s])


def decision_us(strategy: str, replicas: int, held: int = 2048, blocks: int = 32, n: int = 2000) -> dict:
    """What the gateway spends per placement (Placer.place) and per refresh (Controller.placement_state and
    Placer.apply, in one process, no Ray), in us, over ``replicas`` replicas whose prefix caches hold ``held`` blocks
    each, for prompts of ``blocks`` full blocks found whole on one replica: the decision's own cost."""
    import asyncio

    from actors.report import PrefixDelta, empty_pool, unreported
    from cluster.config import parse_config
    from cluster.control.controller import Controller, ReplicaState
    from cluster.placement.placer import Placer

    class Local:  # the controller's methods called as a Ray actor's are, in this event loop
        def __init__(self, obj):
            self.obj = obj

        def __getattr__(self, name):
            method = getattr(self.obj, name)
            return type("M", (), {"remote": staticmethod(lambda *a: asyncio.ensure_future(method(*a)))})

    async def run() -> dict:
        cfg = {"model": "fake", "engine": {"kind": "fake"}, "placement": {"strategy": strategy}}
        ctl = Controller(parse_config(cfg).model_dump())
        now = time.monotonic()
        for i in range(replicas):
            pool = empty_pool(32)._replace(free_blocks=4000, total_blocks=held, running=i % 3, tokens_to_go=100 * i)
            name = f"r{i}"
            ctl.replicas[name] = ReplicaState(name, handle=name, state="healthy", reported_at=now,
                                              report=unreported(name)._replace(pool=pool, healthy=True))  # fmt: skip
            hashes = tuple(range(i * held, (i + 1) * held))
            await ctl.report(name, ctl.replicas[name].report._replace(prefix=PrefixDelta(1, hashes, full=True)))
        placer = Placer(Local(ctl), refresh_s=3600)
        await placer._refresh()
        prompt = tuple(range(held, held + blocks))  # whole on r1
        t = time.perf_counter()
        for k in range(n):
            await placer.place(f"q{k}", 4, [], 100, prompt)
            placer.finished(f"q{k}")
        place = (time.perf_counter() - t) / n * 1e6
        await asyncio.sleep(0.01)
        t = time.perf_counter()
        for _ in range(50):
            await placer._refresh()
        refresh = (time.perf_counter() - t) / 50 * 1e6
        await placer.aclose()
        return {"place": round(place, 1), "refresh": round(refresh, 1)}

    return asyncio.run(run())


if __name__ == "__main__":
    main()
