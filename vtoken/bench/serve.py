"""Side by side with stock vLLM, measured by vLLM's own benchmark client (`vllm bench serve`).

On one machine, with the same model, engine settings and KV pool, four servers take the same requests:

  stock    stock vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``: what `vllm serve` runs)
  off      `vtoken serve`, one replica, vToken off: what the Ray stack (gateway, controller, replica) costs
  vtoken   the same with vToken on (``--policy`` at ``--budget``): what eviction and repacking buy
  two      `vtoken serve` with two replicas, vToken on (on a CPU machine each replica gets its own cores)

and, when named in ``--servers``, ``off-ray``: ``off`` with its tokens streamed through Ray
(``gateway.token_channel: ray``) instead of the ZeroMQ token channel, what that channel saves.

The client is vLLM's, unchanged (vllm/benchmarks/serve.py through ``python -m vtoken.bench.vllm_client``):
random prompts of ``--input-len`` tokens, ``--output-len`` tokens each (ignore_eos), Poisson arrivals at each
rate of ``--rates``, and vLLM's own metric names: TTFT, TPOT, ITL and E2E percentiles, request throughput,
and goodput (requests per second that met ``--goodput``'s SLA). Ratios are to stock vLLM at the same rate, in
the same run. A measurement, not a test: it depends on what else the machine runs (the result says the load).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vtoken.bench.engine_run import log
from vtoken.bench.report import Table
from vtoken.config import SHIPPED_BUDGET

SERVERS = ("stock", "off", "vtoken", "two")  # the default; "off-ray" on request
EXTRA_SERVERS = ("off-ray",)
METRICS = ("ttft", "tpot", "itl", "e2el")


def add_args(p) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--servers", default=",".join(SERVERS), help=f"any of {', '.join(SERVERS + EXTRA_SERVERS)}")
    p.add_argument("--rates", default="0.15,2", help="request rates (requests/s), one client run each")
    p.add_argument("--num-prompts", type=int, default=30)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--kv-bytes", type=int, default=64 << 20, help="KV pool of every server (each replica)")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--policy", default="snapkv")
    p.add_argument("--budget", type=float, default=SHIPPED_BUDGET)
    p.add_argument("--goodput", default="ttft:4000,tpot:250", help="SLA in ms, vLLM's --goodput KEY:VALUE pairs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--rounds", type=int, default=1, help="run every server this many times, the order reversed each round"
    )
    p.add_argument(
        "--paired", action="store_true",
        help="start every server once and keep them all up; each round is then one client run per server, back "
        "to back (the order reversed each round), so many short rounds fit and each pair sees the same machine",
    )  # fmt: skip
    p.add_argument("--max-concurrency", type=int, default=0, help="vLLM client's --max-concurrency (0: no limit)")


# ---------------------------------------------------------------------------------------------- servers
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _engine(args) -> dict[str, Any]:
    return {"dtype": "float32", "block_size": 32, "max_model_len": args.max_model_len,
            "kv_cache_memory_bytes": args.kv_bytes, "enforce_eager": True}  # fmt: skip


@contextlib.contextmanager
def stock_server(args, folder: str, flags: list[str] = (), env: dict[str, str] | None = None) -> Iterator[str]:
    """vLLM's own OpenAI server with the engine arguments every vToken replica gets (cluster/control/controller.py), and
    ``flags`` and ``env`` of its own (a tool parser, the Responses store)."""
    import httpx

    e, port = _engine(args), _free_port()
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", folder,
        "--served-model-name", args.model, "--host", "127.0.0.1", "--port", str(port), "--seed", "0",
        "--dtype", e["dtype"], "--block-size", str(e["block_size"]), "--max-model-len", str(e["max_model_len"]),
        "--kv-cache-memory-bytes", str(e["kv_cache_memory_bytes"]), "--enforce-eager", *flags,
    ]  # fmt: skip
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        url = f"http://127.0.0.1:{port}"
        try:
            t_end = time.monotonic() + 600
            while True:
                if proc.poll() is not None:
                    out.seek(0)
                    errors = [line for line in out.read().splitlines() if "Error:" in line] or ["(no error line)"]
                    raise RuntimeError(f"stock vLLM server exited ({proc.returncode}): {errors[-1][-1000:]}")
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(url + "/health", timeout=5).status_code == 200:
                        break
                if time.monotonic() > t_end:
                    raise RuntimeError("stock vLLM server did not become healthy in 600 s")
                time.sleep(1)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


def vtoken_config(args, replicas: int, vtoken: dict[str, Any], channel: str = "zmq", engine: dict | None = None,
                  gateway: dict | None = None):  # fmt: skip
    """The config of `vtoken serve` as this benchmark runs it; ``engine`` and ``gateway``: keys of serve.yaml's
    sections beside these (a tool parser, the Responses store)."""
    from cluster.config import parse_config

    return parse_config(
        {
            "name": f"bench-serve-{replicas}-{vtoken['mode']}-{channel}",
            "model": args.model,
            "replicas": replicas,
            "vtoken": vtoken,
            "engine": {**_engine(args), **(engine or {})},
            # One replica may use every core, as stock vLLM does; two get a core each (one "device" each).
            "replica": {"num_cpus": 1 if replicas > 1 else 0, "pin_cpus": replicas > 1},
            "gateway": {
                "port": 0,
                "http_port": "any",
                "max_inflight": 4096,
                "token_channel": channel,
                **(gateway or {}),
            },
        }
    )


@contextlib.contextmanager
def vtoken_server(args, replicas: int, vtoken: dict[str, Any], channel: str = "zmq", engine: dict | None = None,
                  gateway: dict | None = None) -> Iterator[str]:  # fmt: skip
    """`vtoken serve` in this process (an embedded Ray): controller, replicas, the OpenAI door (``vtoken_config``)."""
    from cluster.server import BackgroundServer, start_ray

    cfg = vtoken_config(args, replicas, vtoken, channel, engine, gateway)
    start_ray(cfg, verbose=False)
    with BackgroundServer(cfg) as s:
        yield f"http://127.0.0.1:{s.http_port}"


def server(args, name: str, folder: str):
    on = {"mode": "vtoken", "policy": args.policy, "budget": args.budget}
    return {
        "stock": lambda: stock_server(args, folder),
        "off": lambda: vtoken_server(args, 1, {"mode": "off"}),
        "off-ray": lambda: vtoken_server(args, 1, {"mode": "off"}, channel="ray"),
        "vtoken": lambda: vtoken_server(args, 1, on),
        "two": lambda: vtoken_server(args, 2, on),
    }[name]()


# ---------------------------------------------------------------------------------------------- client
def client(
    args, url: str, folder: str, rate: float, out_dir: str, seed: int | None = None, num_prompts: int | None = None
) -> dict[str, Any]:
    """One run of vLLM's benchmark client; its saved result (vLLM's own field names). ``seed`` picks the random
    prompts (default ``--seed``). No warm-up requests: vLLM's client warms up with its first prompt, which a
    server with a prefix cache (stock vLLM by default; vToken only when asked) would then serve from the cache
    in a fraction of the time. ``warm`` warms a server once, on prompts of its own."""
    name = f"client-{time.monotonic_ns()}.json"
    cmd = [
        sys.executable, "-m", "vtoken.bench.vllm_client", "--backend", "openai", "--base-url", url,
        "--model", args.model, "--tokenizer", folder, "--dataset-name", "random",
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
        "--num-prompts", str(num_prompts or args.num_prompts), "--request-rate", str(rate),
        "--seed", str(args.seed if seed is None else seed),
        "--ignore-eos", "--temperature", "0", "--num-warmups", "0", "--disable-tqdm",
        "--percentile-metrics", ",".join(METRICS), "--metric-percentiles", "50,90,99",
        "--goodput", *args.goodput.replace(",", " ").split(),
        *(["--max-concurrency", str(args.max_concurrency)] if args.max_concurrency else []),
        "--save-result", "--result-dir", out_dir, "--result-filename", name,
    ]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=7200)
    if r.returncode:
        raise RuntimeError(f"vLLM's benchmark client failed: {r.stderr[-2000:]}")
    raw = json.loads((Path(out_dir) / name).read_text())
    keep = ("completed", "failed", "duration", "request_throughput", "request_goodput", "output_throughput")
    out = {k: raw.get(k) for k in keep}
    out.update({k: v for k, v in raw.items() if k.endswith("_ms") and k.split("_")[1] in METRICS})
    return out


WARM_SEED = 1_000_003  # the warm-up's prompts: none of the measured rounds' (seeds --seed + round)


def warm(args, url: str, folder: str, out_dir: str) -> None:
    """Two requests on prompts no round uses, one after the other, before a server is measured."""
    log("[serve] warming up")
    client(args, url, folder, float("inf"), out_dir, seed=WARM_SEED, num_prompts=2)


def run(args) -> dict:
    from vtoken.models import model_path

    if args.quick:
        args.model, args.num_prompts, args.input_len, args.output_len = "tiny-llama", 6, 64, 8
        args.rates, args.kv_bytes = "4", 4 << 20
    names = [s for s in args.servers.split(",") if s]
    bad = sorted(set(names) - set(SERVERS + EXTRA_SERVERS))
    if bad:
        raise SystemExit(f"--servers: unknown {bad}; choose from {', '.join(SERVERS + EXTRA_SERVERS)}")
    rates = [float(r) for r in args.rates.split(",")]
    # Servers run vLLM as deployed: the EngineCore in a process of its own (`vtoken bench` defaults offline
    # engines to in-process), in Ray's replicas and in the stock server alike.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    folder = str(model_path(args.model))
    load_before = os.getloadavg()
    rounds: list[dict[str, dict[str, Any]]] = []
    n_rounds = max(args.rounds, 1)

    def measure(name: str, url: str, i: int) -> dict[str, Any]:
        out = {}
        for rate in rates:
            log(f"[serve] round {i + 1}/{n_rounds}, {name}: {args.num_prompts} requests at {rate}/s")
            # Each round its own prompts (the same for every server): a server kept up would otherwise find the
            # last round's prompts in its prefix cache.
            out[str(rate)] = r = client(args, url, folder, rate, tmp, seed=args.seed + i)
            log(f"[serve] {name} @ {rate}/s: {r['completed']} ok, {r['failed']} failed, "
                f"{r['request_throughput']:.3f} req/s, TTFT {r['mean_ttft_ms']:.0f} ms, "
                f"TPOT {r['mean_tpot_ms']:.1f} ms")  # fmt: skip
        return out

    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as up:
        urls: dict[str, str] = {}
        if args.paired:  # every server up at once; an idle one waits on its sockets (its replica reads its
            for name in names:  # engine once a report interval, actors/replica.py _idle_pool)
                log(f"[serve] starting {name}")
                urls[name] = up.enter_context(server(args, name, folder))
                warm(args, urls[name], folder, tmp)
        for i in range(n_rounds):
            runs: dict[str, dict[str, Any]] = {}
            for name in names if i % 2 == 0 else names[::-1]:  # drift between rounds hits every server alike
                if args.paired:
                    runs[name] = measure(name, urls[name], i)
                    continue
                log(f"[serve] round {i + 1}: starting {name}")
                with server(args, name, folder) as url:
                    warm(args, url, folder, tmp)
                    runs[name] = measure(name, url, i)
            rounds.append({name: runs[name] for name in names})
    runs = rounds[0]
    return {
        "model": args.model,
        "servers": names,
        "rates": rates,
        "sla": args.goodput,
        "runs": runs,
        "ratios": ratios(runs),
        "rounds": rounds,
        "paired": bool(args.paired),
        "max_concurrency": args.max_concurrency or None,
        "vs_off": vs_off(rounds),
        "load": {"cpus": os.cpu_count(), "loadavg_before": load_before[0], "loadavg_after": os.getloadavg()[0]},
    }


def ratios(runs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each server's figures over stock vLLM's at the same rate (absent without a stock run)."""
    stock = runs.get("stock")
    if not stock:
        return {}
    out: dict[str, dict[str, Any]] = {}
    for name, by_rate in runs.items():
        for rate, r in by_rate.items():
            s = stock.get(rate)
            if s is None or name == "stock":
                continue
            keys = ("request_throughput", "request_goodput", "mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms",
                    "median_tpot_ms", "mean_e2el_ms")  # fmt: skip
            out.setdefault(name, {})[rate] = {k: r[k] / s[k] if r.get(k) and s.get(k) else None for k in keys}
    return out


def vs_off(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Each server's mean TPOT and TTFT (and median TTFT) over vToken off's, round by round (each round's servers ran
    back to back), with the median over rounds: what turning vToken on costs, in one run. The median TTFT is the
    steadier one where a round's requests include a prefix-cache hit (runs before ``warm``: vLLM's client warmed up
    with the round's first prompt, which stock vLLM's prefix cache, on by default and off under vToken unless
    asked for, then served in a fraction of the time)."""
    out: dict[str, dict[str, Any]] = {}
    for name in rounds[0]:
        if name == "off" or "off" not in rounds[0]:
            continue
        for rate in rounds[0][name]:
            keys = ("mean_tpot_ms", "mean_ttft_ms", "median_ttft_ms")
            per = {k: [r[name][rate][k] / r["off"][rate][k] for r in rounds] for k in keys}
            out.setdefault(name, {})[rate] = {
                **{f"{k}_rounds": v for k, v in per.items()},
                **{k: statistics.median(v) for k, v in per.items()},
                **{f"{k}_geomean_ci95": geomean_interval(v) for k, v in per.items()},
            }
    return out


# Two-sided 95% quantiles of Student's t for 1..30 degrees of freedom (no scipy here).
T95 = tuple(
    map(
        float,
        "12.706 4.303 3.182 2.776 2.571 2.447 2.365 2.306 2.262 2.228 2.201 2.179 2.160 2.145"
        " 2.131 2.120 2.110 2.101 2.093 2.086 2.080 2.074 2.069 2.064 2.060 2.056 2.052 2.048 2.045 2.042".split(),
    )
)


def geomean_interval(ratios: list[float]) -> list[float] | None:
    """[geometric mean, low, high]: the rounds' ratios' geometric mean and its 95% interval, Student's t on their
    logarithms (the rounds taken as independent pairs). None below three rounds."""
    n = len(ratios)
    if n < 3:
        return None
    logs = [math.log(r) for r in ratios]
    mean, sd = statistics.fmean(logs), statistics.stdev(logs)
    half = T95[min(n - 1, len(T95)) - 1] * sd / math.sqrt(n)
    return [math.exp(mean), math.exp(mean - half), math.exp(mean + half)]


# ---------------------------------------------------------------------------------------------- report
def tables(result: dict) -> list[Table]:
    rows = []
    for name in result["servers"]:
        for rate, r in result["runs"][name].items():
            q = result["ratios"].get(name, {}).get(rate, {})

            def x(key, q=q):
                return f" (x{q[key]:.3f})" if q.get(key) else ""

            rows.append(
                [
                    name, rate, f"{r['completed']}/{r['completed'] + r['failed']}",
                    f"{r['request_throughput']:.3f}{x('request_throughput')}",
                    f"{r['request_goodput'] or 0:.3f}{x('request_goodput')}",
                    f"{r['mean_ttft_ms']:.0f}{x('mean_ttft_ms')}", f"{r['p99_ttft_ms']:.0f}",
                    f"{r['mean_tpot_ms']:.1f}{x('mean_tpot_ms')}", f"{r['p99_tpot_ms']:.1f}",
                    f"{r['mean_itl_ms']:.1f}", f"{r['mean_e2el_ms'] / 1000:.1f}",
                ]
            )  # fmt: skip
    load = result["load"]
    extra = []
    if result.get("vs_off"):

        def ci(v):
            return f"x{v[0]:.3f} [{v[1]:.3f}, {v[2]:.3f}]" if v else "-"

        vrows = [[name, rate, f"x{q['mean_tpot_ms']:.3f}", ci(q.get("mean_tpot_ms_geomean_ci95")),
                  " ".join(f"x{v:.3f}" for v in q["mean_tpot_ms_rounds"]), f"x{q['mean_ttft_ms']:.3f}",
                  ci(q.get("mean_ttft_ms_geomean_ci95")), ci(q.get("median_ttft_ms_geomean_ci95"))]
                 for name, by_rate in result["vs_off"].items() for rate, q in by_rate.items()]  # fmt: skip
        how = "servers kept up, one client run each per round" if result.get("paired") else "servers restarted"
        extra.append(
            Table(
                f"Over vToken off, round by round ({len(result.get('rounds', [1]))} rounds, servers alternated, {how})",
                [
                    "server",
                    "rate/s",
                    "TPOT (median)",
                    "TPOT geomean [95%]",
                    "TPOT per round",
                    "TTFT (median)",
                    "TTFT geomean [95%]",
                    "median TTFT geomean [95%]",
                ],  # fmt: skip
                vrows,
                "TPOT and TTFT: each round's mean over its requests; median TTFT: each round's median request. "
                "Each server is warmed once on prompts no round sends (before this, vLLM's client warmed up with "
                "a round's first prompt, which off's prefix cache then served fast). "
                "Geometric mean of the rounds' ratios with its 95% interval (Student's t on the logarithms); "
                "- below three rounds.",
            )
        )
    return [
        Table(
            f"vLLM's own benchmark client against stock vLLM and vtoken serve ({result['model']}, same engine "
            f"settings and KV pool; SLA for goodput: {result['sla']} ms)",
            [
                "server",
                "rate/s",
                "ok",
                "req/s",
                "goodput req/s",
                "TTFT mean ms",
                "TTFT p99",
                "TPOT mean ms",
                "TPOT p99",
                "ITL mean ms",
                "E2E mean s",
            ],  # fmt: skip
            rows,
            "(xN): over stock vLLM at the same rate, in the same run. stock: vLLM's OpenAI server; off: vtoken serve, "
            "one replica, vToken off; off-ray: the same, tokens through Ray streams instead of the ZeroMQ channel; "
            "vtoken: the same as off, vToken on; two: two replicas, vToken on. "
            f"Load average {load['loadavg_before']:.2f} before, {load['loadavg_after']:.2f} after "
            f"({load['cpus']} CPUs).",
        ),
        *extra,
    ]


def plot(result: dict, fig) -> None:
    rates = [str(r) for r in result["rates"]]
    names = result["servers"]
    axes = fig.subplots(1, 3)
    for ax, key, label in zip(
        axes, ("request_goodput", "mean_ttft_ms", "mean_tpot_ms"), ("goodput req/s", "mean TTFT ms", "mean TPOT ms")
    ):
        width = 0.8 / max(len(names), 1)
        for i, name in enumerate(names):
            ys = [result["runs"][name].get(r, {}).get(key) or 0 for r in rates]
            ax.bar([j + i * width for j in range(len(rates))], ys, width, label=name)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rates))], [f"{r}/s" for r in rates])
        ax.set(title=label, xlabel="request rate")
    axes[0].legend()
