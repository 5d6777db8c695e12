"""Goodput of placement strategies on a skewed load, side by side on the same replicas.

    python -m cluster.goodput --out bench_out/goodput.json       # two tiny-llama replicas, embedded Ray

The skewed load alternates a heavy request (long prompt, long completion) with a light one, so
``round_robin`` over two replicas sends every heavy request to the same replica, whose pool then makes
them queue; ``free_blocks`` sends each request where the blocks are. Goodput: requests that complete
within the deadline. Each strategy runs ``rounds`` times, alternating, on the same engines.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from cluster.proto import vtoken_pb2 as pb
from cluster.proto import vtoken_pb2_grpc as pbg

# 45 blocks of 32 tokens of tiny-llama (2 layers x K,V x 2 heads x 64 x fp32 = 64 KiB a block): a replica
# admits three heavy requests (575-token prompt, 18 blocks until vToken compacts it to about 10) at once.
KV_BYTES = 45 * 64 * 1024
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()


def skewed_load(
    n: int, heavy_words: int = 450, heavy_tokens: int = 160, light_words: int = 8, light_tokens: int = 16
) -> list[tuple[str, int]]:
    """``n`` requests, heavy at even positions: (prompt, max_tokens)."""
    load = []
    for i in range(n):
        words, tokens = (heavy_words, heavy_tokens) if i % 2 == 0 else (light_words, light_tokens)
        load.append((" ".join(WORDS[(i + j) % len(WORDS)] for j in range(words)), tokens))
    return load


def one_request(stub, prompt: str, max_tokens: int, deadline_s: float, metadata=()) -> dict[str, Any]:
    t0 = time.monotonic()
    req = pb.GenerateRequest(
        prompt=prompt, sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    )
    tokens, replica, code = 0, "", "OK"
    try:
        for msg in stub.Generate(req, timeout=deadline_s, metadata=metadata):
            tokens += len(msg.token_ids)
            replica = msg.replica
    except grpc.RpcError as e:
        code = e.code().name
    return {"code": code, "tokens": tokens, "replica": replica, "seconds": time.monotonic() - t0}


def run_load(port: int, load: list[tuple[str, int]], deadline_s: float, gap_s: float = 0.05) -> dict[str, Any]:
    """Submits the load (one request every ``gap_s``) and counts completions within the deadline."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch, ThreadPoolExecutor(len(load)) as pool:
        stub = pbg.VTokenStub(ch)
        futures = []
        for prompt, max_tokens in load:
            futures.append(pool.submit(one_request, stub, prompt, max_tokens, deadline_s))
            time.sleep(gap_s)
        results = [f.result() for f in futures]
    ok = [r for r in results if r["code"] == "OK"]
    per_replica: dict[str, int] = {}
    for i, r in enumerate(results):
        if i % 2 == 0 and r["replica"]:
            per_replica[r["replica"]] = per_replica.get(r["replica"], 0) + 1
    return {
        "completed_within_deadline": len(ok),
        "requests": len(results),
        "codes": sorted({r["code"] for r in results}),
        "heavy_per_replica": per_replica,
        "mean_latency_s": sum(r["seconds"] for r in ok) / len(ok) if ok else None,
        "latencies_s": [round(r["seconds"], 2) if r["code"] == "OK" else r["code"] for r in results],
    }


def compare(
    served,
    controller_call,
    load,
    deadline_s: float | None = None,
    rounds: int = 1,
    strategies=("free_blocks", "round_robin"),
    deadline_factor: float = 1.8,
) -> dict[str, Any]:
    """``controller_call(coro_ref)`` waits for a controller call; returns goodput per strategy. Without
    ``deadline_s`` the deadline is ``deadline_factor`` times the latency of the first (heavy) request of the
    load served alone (the smaller of two tries, after a warm-up): long enough for one wave of heavy
    requests served side by side, too short for two waves one after the other."""
    out: dict[str, Any] = {s: [] for s in strategies}
    controller_call(served.controller.set_placement.remote("round_robin"))
    run_load(served.port, load[:4], 600)  # warm both replicas: first steps are slow on CPU
    with grpc.insecure_channel(f"127.0.0.1:{served.port}") as ch:
        alone = min(one_request(pbg.VTokenStub(ch), *load[0], 600)["seconds"] for _ in range(2))
    deadline_s = deadline_s or deadline_factor * alone
    for _ in range(rounds):
        for s in strategies:
            controller_call(served.controller.set_placement.remote(s))
            time.sleep(1.5)  # let the pools drain and fresh reports arrive
            out[s].append(run_load(served.port, load, deadline_s))
    return {
        "deadline_s": deadline_s,
        "heavy_alone_s": alone,
        "requests": len(load),
        "rounds": rounds,
        "goodput": {s: sum(r["completed_within_deadline"] for r in out[s]) for s in strategies},
        "runs": out,
    }


def main(argv: list[str] | None = None) -> int:
    import ray

    from cluster.config import parse_config
    from cluster.server import BackgroundServer, start_ray

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--deadline", type=float, help="seconds (default: 1.8 x a heavy request's latency alone)")
    ap.add_argument(
        "--deadline-factor", type=float, default=1.8, help="without --deadline: this x a heavy request's latency alone"
    )
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--kv-bytes", type=int, default=KV_BYTES)
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args(argv)
    cfg = parse_config(
        {
            "name": "goodput",
            "model": args.model,
            "replicas": 2,
            "engine": {"kv_cache_memory_bytes": args.kv_bytes},
            "replica": {"num_cpus": 0.5, "pin_cpus": True},
            "gateway": {"port": 0},
        }
    )
    start_ray(cfg)
    with BackgroundServer(cfg) as served:
        result = compare(
            served,
            lambda ref: ray.get(ref),
            skewed_load(args.requests),
            args.deadline,
            args.rounds,
            deadline_factor=args.deadline_factor,
        )
    result.update(model=args.model, kv_cache_memory_bytes=args.kv_bytes)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
