"""Goodput of placement strategies (free_blocks vs round_robin) through the whole serving stack.

Two replicas (Ray actors, each a vToken AsyncLLM with a small KV pool and, on CPUs, a core of its own), the
controller and the gRPC gateway, started in this process on an embedded Ray. The skewed load alternates a heavy
request (long prompt, long completion) with a light one, so ``round_robin`` sends every heavy request to the
same replica, whose pool then makes them queue; ``free_blocks`` sends each request where the blocks are.
Goodput: requests that complete within the deadline, by default ``--deadline-factor`` x the latency of a heavy
request served alone (measured in the run after a warm-up). Each strategy runs ``--rounds`` times, alternating,
on the same replicas.

This is a measurement, not a test: on CPUs the replicas share the machine with whatever else runs, and a
loaded machine erases the difference (one wave of heavy requests on each replica then costs as much as two
waves on one). So the result states the load: ``os.getloadavg()`` before and after, and the CPU count.
``--engine fake`` runs the same path on the fake engine in seconds (structure only, no vLLM).
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from cluster.proto import vtoken_pb2 as pb
from cluster.proto import vtoken_pb2_grpc as pbg
from vtoken.bench.report import Table

# 45 blocks of 32 tokens of tiny-llama (2 layers x K,V x 2 heads x 64 x fp32 = 64 KiB a block): a replica
# admits three heavy requests (575-token prompt, 18 blocks until vToken compacts it to about 10) at once.
KV_BYTES = 45 * 64 * 1024
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()


def add_args(p) -> None:
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--engine", choices=("vllm", "fake"), default="vllm", help="fake: structure only, seconds")
    p.add_argument("--requests", type=int, default=12, help="heavy and light alternating")
    p.add_argument("--rounds", type=int, default=2, help="runs per strategy, alternating")
    p.add_argument("--strategies", default="free_blocks,round_robin")
    p.add_argument("--deadline", type=float, help="seconds (default: --deadline-factor x a heavy request alone)")
    p.add_argument("--deadline-factor", type=float, default=2.5)
    p.add_argument(
        "--deadline-sweep",
        default="2.0,2.25,2.5,3.0",
        help="more deadlines (x a heavy request alone) counted on the same runs; requests then run to the largest",
    )
    p.add_argument("--kv-bytes", type=int, default=KV_BYTES, help="KV pool of each replica")


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


def run_load(
    port: int,
    load: list[tuple[str, int]],
    deadline_s: float,
    gap_s: float = 0.05,
    sweep: dict[str, float] | None = None,
) -> dict[str, Any]:
    """Submits the load (one request every ``gap_s``) and counts completions within the deadline, and within
    each deadline of ``sweep`` (label -> seconds). The gRPC timeout is the largest of them all, so a request
    past ``deadline_s`` but inside a longer sweep deadline runs to its end (and counts only there)."""
    sweep = sweep or {}
    timeout_s = max([deadline_s, *sweep.values()])
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch, ThreadPoolExecutor(len(load)) as pool:
        stub = pbg.VTokenStub(ch)
        futures = []
        for prompt, max_tokens in load:
            futures.append(pool.submit(one_request, stub, prompt, max_tokens, timeout_s))
            time.sleep(gap_s)
        results = [f.result() for f in futures]

    def within(d: float) -> list[dict[str, Any]]:
        return [r for r in results if r["code"] == "OK" and r["seconds"] <= d]

    ok = within(deadline_s)
    per_replica: dict[str, int] = {}
    for i, r in enumerate(results):
        if i % 2 == 0 and r["replica"]:
            per_replica[r["replica"]] = per_replica.get(r["replica"], 0) + 1
    return {
        "completed_within_deadline": len(ok),
        "completed_within": {label: len(within(d)) for label, d in sweep.items()},
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
    deadline_factor: float = 2.5,
    sweep_factors: tuple[float, ...] = (),
) -> dict[str, Any]:
    """``controller_call(ref)`` waits for a controller call; returns goodput per strategy. Without
    ``deadline_s`` the deadline is ``deadline_factor`` times the latency of the first (heavy) request of the
    load served alone (the smaller of two tries, after a warm-up): long enough for one wave of heavy
    requests served side by side, too short for two waves one after the other. ``sweep_factors``: more
    deadlines, as multiples of that latency, counted on the same runs (``completed_within``)."""
    out: dict[str, Any] = {s: [] for s in strategies}
    controller_call(served.controller.set_placement.remote("round_robin"))
    run_load(served.port, load[:4], 600)  # warm both replicas: first steps are slow on CPU
    with grpc.insecure_channel(f"127.0.0.1:{served.port}") as ch:
        alone = min(one_request(pbg.VTokenStub(ch), *load[0], 600)["seconds"] for _ in range(2))
    deadline_s = deadline_s or deadline_factor * alone
    sweep = {f"{f:g}": f * alone for f in sweep_factors}
    for _ in range(rounds):
        for s in strategies:
            controller_call(served.controller.set_placement.remote(s))
            time.sleep(1.5)  # let the pools drain and fresh reports arrive
            out[s].append(run_load(served.port, load, deadline_s, sweep=sweep))
    return {
        "deadline_s": deadline_s,
        "heavy_alone_s": alone,
        "deadline_sweep_s": sweep,
        "requests": len(load),
        "rounds": rounds,
        "goodput": {s: sum(r["completed_within_deadline"] for r in out[s]) for s in strategies},
        "runs": out,
    }


def serve_config(args, requests: int):
    from cluster.config import parse_config

    raw: dict[str, Any] = {
        "name": "goodput",
        "model": args.model,
        "replicas": 2,
        "replica": {"num_cpus": 0.5, "pin_cpus": args.engine == "vllm"},
        "gateway": {"port": 0, "http_port": 0, "max_inflight": max(64, 2 * requests)},  # gRPC only
    }
    if args.engine == "fake":  # the same shape in blocks: a heavy request ~20 of 45, a light one 3
        raw["engine"] = {"kind": "fake", "fake_total_blocks": 45, "fake_token_delay_s": 0.01}
    else:
        raw["engine"] = {"kv_cache_memory_bytes": args.kv_bytes}
    return parse_config(raw, source="vtoken bench goodput")


def run(args) -> dict:
    import ray

    from cluster.server import BackgroundServer, start_ray

    requests, rounds = (6, 1) if args.quick else (args.requests, args.rounds)
    heavy_words = 80 if args.engine == "fake" else 450  # the fake tokenizer counts bytes
    load = skewed_load(requests, heavy_words=heavy_words)
    cfg = serve_config(args, requests)
    load_before = os.getloadavg()
    started_ray = not ray.is_initialized()
    start_ray(cfg)
    try:
        with BackgroundServer(cfg) as served:
            t0 = time.monotonic()
            result = compare(
                served,
                lambda ref: ray.get(ref),
                load,
                args.deadline,
                rounds,
                tuple(args.strategies.split(",")),
                args.deadline_factor,
                tuple(float(f) for f in args.deadline_sweep.split(",") if f.strip()),
            )
            measured_s = time.monotonic() - t0
    finally:
        if started_ray:
            ray.shutdown()
    return {
        "model": args.model if args.engine == "vllm" else "fake",
        "engine": args.engine,
        "kv_cache_memory_bytes": args.kv_bytes if args.engine == "vllm" else None,
        "load": {
            "cpus": os.cpu_count(),
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
            "measured_s": round(measured_s, 1),
        },
        **result,
    }


def tables(result: dict) -> list[Table]:
    rows = []
    vs = rounds_against(result)
    for s, runs in result["runs"].items():
        lat = [r["mean_latency_s"] for r in runs if r["mean_latency_s"] is not None]
        rows.append(
            [
                s,
                result["goodput"][s],
                result["requests"] * result["rounds"],
                ", ".join(map(str, per_round(result, s))),
                "{} / {} / {}".format(*vs[s]) if s in vs else "-",
                " / ".join(str(sorted(r["heavy_per_replica"].values(), reverse=True)) for r in runs),
                round(sum(lat) / len(lat), 2) if lat else "-",
            ]
        )
    load = result["load"]
    return [
        Table(
            f"Goodput by placement ({result['model']}, 2 replicas, {result['requests']} requests alternating "
            f"heavy and light, {result['rounds']} round(s), deadline {result['deadline_s']:.1f} s = "
            f"{result['deadline_s'] / result['heavy_alone_s']:.1f} x a heavy request alone)",
            [
                "placement",
                "completed within deadline",
                "of",
                "per round",
                "rounds won / tied / lost vs round_robin",
                "heavy requests per replica",
                "mean latency s (ok)",
            ],
            rows,
            f"Load on the machine ({load['cpus']} CPUs): load average {load['loadavg_before'][0]} before, "
            f"{load['loadavg_after'][0]} after (1 min). Replicas share the CPUs with whatever else runs: "
            "under load the difference between strategies shrinks or vanishes.",
        ),
        *sweep_table(result),
    ]


def per_round(result: dict, strategy: str, label: str | None = None) -> list[int]:
    """``strategy``'s completions in each round within the deadline ``label`` of the sweep (None: the run's)."""
    runs = result["runs"][strategy]
    if label is None:
        return [r["completed_within_deadline"] for r in runs]
    return [r["completed_within"][label] for r in runs]


def rounds_against(result: dict, label: str | None = None, base: str = "round_robin") -> dict[str, list[int]]:
    """Per strategy (not ``base``): rounds won, tied and lost against ``base``, round by round, counting
    completions within the deadline ``label`` of the sweep (None: the run's deadline)."""
    out = {}
    for s in result["runs"]:
        if s != base and base in result["runs"]:
            pairs = list(zip(per_round(result, s, label), per_round(result, base, label), strict=True))
            out[s] = [sum(a > b for a, b in pairs), sum(a == b for a, b in pairs), sum(a < b for a, b in pairs)]
    return out


def sweep_table(result: dict) -> list[Table]:
    """Completions per round at each deadline of the sweep, and rounds won against round_robin."""
    sweep = result.get("deadline_sweep_s") or {}
    if not sweep or "round_robin" not in result["runs"]:
        return []
    names = list(result["runs"])
    rows = []
    for label, d in sweep.items():
        vs = rounds_against(result, label)
        row: list = [f"{label} x ({d:.1f} s)"]
        for s in names:
            row.append(", ".join(map(str, per_round(result, s, label))))
        row.extend("{} / {} / {}".format(*vs[s]) for s in names if s in vs)
        rows.append(row)
    others = [s for s in names if s != "round_robin"]
    return [
        Table(
            f"The same runs counted at other deadlines (x the heavy request alone, {result['heavy_alone_s']:.2f} s): "
            "completions per round, and rounds won / tied / lost against round_robin",
            ["deadline", *[f"{s} per round" for s in names], *[f"{s} vs round_robin" for s in others]],
            rows,
            "Every request ran to the largest deadline (its gRPC timeout), so each row counts the requests that "
            "ended within that row's deadline; the rows are one experiment, not independent ones.",
        )
    ]


def plot(result: dict, fig) -> None:
    ax1, ax2 = fig.subplots(1, 2)
    names = list(result["goodput"])
    ax1.bar(names, [result["goodput"][s] for s in names], color=["tab:green", "tab:gray", "tab:blue"][: len(names)])
    ax1.axhline(result["requests"] * result["rounds"], color="k", ls="--", label="all requests")
    ax1.set(ylabel="completed within the deadline", title=f"goodput, load avg {result['load']['loadavg_before'][0]}")
    ax1.legend()
    for s in names:
        lat = result["runs"][s][0]["latencies_s"]
        xs = [i for i, v in enumerate(lat) if not isinstance(v, str)]
        ax2.plot(xs, [lat[i] for i in xs], "o-", label=s)
    ax2.axhline(result["deadline_s"], color="r", ls="--", label="deadline")
    ax2.set(xlabel="request (even: heavy)", ylabel="latency s", title="first round")
    ax2.legend()
