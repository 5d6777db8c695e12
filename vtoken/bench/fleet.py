"""Fleet simulation: placement strategies and the autoscaler at up to hundreds of replicas (no engine needed).

A discrete-event simulator (``cluster/sim/``) drives the project's own ``cluster/placement/strategies.py`` strategies
and ``cluster/control/autoscaler.py``; each replica is modelled from measurements of the real engine (step times,
blocks per forward from vToken's traces) in ``docs/results/fleet_calibration.json`` (``--calibrate`` remakes it
on this machine, a few minutes). It reports:

- validation: ``vtoken bench goodput``'s 2-replica load in the simulator (compare with the measured run);
- goodput vs load per setup at ``--sweep-replicas``, and the load where round_robin breaks the SLA;
- the SLA throughput per setup: the highest load it serves within the SLA, over ``--capacity-seeds`` workloads,
  on ``--sweep-replicas`` and on ``--scale`` replicas;
- replicas needed to meet the SLA at a fixed load sized for ``--scale`` replicas;
- a diurnal day: replica-hours and SLA attainment, static fleets sized for the peak against the autoscaler;
- conversations over shared system prompts on replicas with prefix caches: each placement's prefix hit rate and
  TTFT at ``--chat-replicas`` (16-256), against an oracle that knows every cache.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vtoken.bench.engine_run import log
from vtoken.bench.report import Table

MEASURED = Path(__file__).resolve().parents[2] / "docs" / "results" / "fleet_measured_goodput.json"
QUICK = {
    "chat_replicas": "16",
    "chat_horizon": 10.0,
    "sweep_replicas": 4,
    "scale": 16,
    "horizon": 8.0,
    "day_s": 240.0,
    "day_peak_replicas": 4,
    "capacity_seeds": 1,
    "scale_seeds": 1,
}


def add_args(p) -> None:
    p.add_argument("--calibration", help="calibration JSON (default: docs/results/fleet_calibration.json)")
    p.add_argument(
        "--measured",
        default=str(MEASURED),
        help="a `vtoken bench goodput` JSON to validate against (the simulator's error per strategy)",
    )
    p.add_argument(
        "--serving-from",
        default=str(MEASURED.with_name("goodput.json")),
        help="--calibrate: the goodput run whose heavy request alone gives the serving path's cost per token "
        "(an earlier run than --measured, so the validation is against a run the calibration never saw)",
    )
    p.add_argument("--calibrate", action="store_true", help="first measure the engine and rewrite the calibration")
    p.add_argument(
        "--strategies",
        default="free_blocks,power_of_two,best_fit,weighted",
        help="vtoken placements compared with round_robin",
    )
    p.add_argument("--sweep-replicas", type=int, default=16)
    p.add_argument("--scale", type=int, default=256, help="replicas the fixed load is sized for")
    p.add_argument("--horizon", type=float, default=20.0, help="seconds of arrivals per load point")
    p.add_argument("--day-s", type=float, default=1200.0, help="the simulated day, compressed to these seconds")
    p.add_argument("--day-peak-replicas", type=int, default=16)
    p.add_argument("--arrivals", choices=("poisson", "bursts"), default="poisson")
    p.add_argument("--pools", default="32,64", help="KV blocks of the replicas, cycled (replicas of two sizes)")
    p.add_argument("--prompt-median", type=float, default=300, help="median prompt tokens (log-normal, sigma 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--capacity-seeds", type=int, default=5, help="workloads (seeds from --seed) for each setup's SLA throughput"
    )
    p.add_argument("--scale-seeds", type=int, default=2, help="workloads for the SLA throughput on --scale replicas")
    p.add_argument("--chat-replicas", default="16,64,256", help="fleet sizes of the conversations' prefix-cache study")
    p.add_argument("--chat-rates", default="1,2", help="conversations started per second per replica")
    p.add_argument("--chat-horizon", type=float, default=60.0, help="seconds of conversation starts")
    p.add_argument("--chat-strategies", default="round_robin,weighted,prefix,prefix_oracle")


def run(args) -> dict:
    from cluster.sim import calibration, study
    from vtoken.bench import calibrate

    if args.calibrate:
        fresh = calibrate.serving(calibrate.run(), json.loads(Path(args.serving_from).read_text()))
        calibration.save(fresh, args.calibration)
    cal = calibration.load(args.calibration)
    a = {**vars(args), **(QUICK if args.quick else {})}
    from dataclasses import replace

    spec = study.FleetSpec(
        pools=tuple(int(x) for x in args.pools.split(",")),
        lengths=replace(study.FleetSpec().lengths, prompt_median=args.prompt_median),
        horizon_s=a["horizon"],
        arrivals=args.arrivals,
        seed=args.seed,
    )
    setups = list(study.SETUPS[:2]) + [
        study.Setup(f"vtoken+{s}", "vtoken", s) for s in args.strategies.split(",") if s != "round_robin"
    ]
    rr = setups[1]
    out: dict[str, Any] = {"calibration": {**cal.meta, "goodput_shape": cal.goodput}, "spec": _spec(spec)}
    out["validation"] = study.validate(cal)
    if args.measured and Path(args.measured).exists():
        out["validation"]["measured"] = _against(out["validation"], json.loads(Path(args.measured).read_text()))

    # Load grid, per replica: doubling until vtoken+round_robin misses the SLA, then quarters of that rate.
    n = a["sweep_replicas"]
    per = 1.0
    while study.at_load(cal, spec, rr, n, per * n)["attainment"] >= spec.sla.attainment and per < 512:
        per *= 2
    rates = [round(per * k / 4 * n, 2) for k in range(1, 9)]
    log(f"[sweep] {len(setups)} setups on {n} replicas at {', '.join(f'{r:g}' for r in rates)} req/s")
    out["sweep"] = {"replicas": n, "rates": rates, "results": study.sweep(cal, spec, setups, n, rates)}
    out["break"] = _break_point(out["sweep"], rr.name, spec.sla.attainment, spec.horizon_s)
    log(f"[capacity] SLA throughput on {n} replicas: {a['capacity_seeds']} seeds x {len(setups)} setups")
    out["capacity"] = _capacity(cal, spec, setups, n, rates[0], a["capacity_seeds"], rr.name)
    # The same at --scale replicas: a larger fleet gives a load-aware placement more replicas to choose from,
    # while round_robin's share of the arrivals per replica stays the same. Each probe simulates 16x the requests,
    # so the climb starts at the lowest SLA throughput per replica seen above (every setup met it there), and
    # fewer seeds suffice: 16x the requests per probe average out most of a seed's luck.
    m = a["scale"]
    low = min(x for r in out["capacity"]["results"].values() for x in r["per_seed"]) or rates[0]
    step = _capacity_step(m)
    start = max(step, (low / n * m) // step * step)
    log(
        f"[capacity] SLA throughput on {m} replicas from {start:g} req/s: "
        f"{a['scale_seeds']} seeds x {len(setups)} setups"
    )
    out["capacity_scale"] = _capacity(cal, spec, setups, m, start, a["scale_seeds"], rr.name)
    # The same mean load in bursts (4x the rate for 4 s of every 20 s), at round_robin's break point.
    b_rate = out["break"]["rate"] or rates[2]
    bursty = replace(spec, arrivals="bursts")
    out["bursts"] = {"rate": b_rate, "results": {s.name: study.at_load(cal, bursty, s, n, b_rate) for s in setups}}

    # Fixed load: the highest swept rate per replica at which the first strategy besides round_robin meets
    # the SLA, times --scale.
    best = setups[2].name
    passing = [p["rate"] for p in out["sweep"]["results"][best] if p["attainment"] >= spec.sla.attainment]
    per_ok = (max(passing) if passing else rates[0]) / n
    fixed = round(per_ok * a["scale"], 1)
    out["needed"] = {"rate": fixed, "scale": a["scale"], "results": {}}
    log(f"[needed] replicas for the SLA at {fixed:g} req/s")
    for s in setups:
        out["needed"]["results"][s.name] = study.replicas_needed(cal, spec, s, fixed, a["scale"])

    # The day: static fleets sized for the peak against the autoscaler (starting at the trough's share).
    from cluster.config import AutoscalingConfig

    peak = round(per_ok * a["day_peak_replicas"], 1)
    day_spec = replace(spec, horizon_s=min(30.0, a["horizon"]))
    # The autoscaler with the project's defaults (cluster/config.py), a cooldown for the compressed day; and the
    # old defaults (out below 15% effectively free, in above 1.25 replicas' spare), which scale out too late.
    limit = 8 * a["day_peak_replicas"]
    defaults = AutoscalingConfig(enabled=True, min_replicas=1, max_replicas=limit, cooldown_s=10)
    old = defaults.model_copy(update={"low_watermark": 0.15, "scale_in_margin": 0.25})
    out["day"] = {
        "day_s": a["day_s"],
        "peak_rate": peak,
        "autoscaling": {"defaults": defaults.model_dump(), "old defaults": old.model_dump()},
        "results": {},
    }
    from cluster.config import PlacementConfig

    runs = [(s, None) for s in setups]
    for x in dict.fromkeys(["free_blocks", PlacementConfig().strategy]):
        runs.append((study.Setup(f"vtoken+{x}+autoscaler", "vtoken", x, True), defaults))
    x = PlacementConfig().strategy
    runs.append((study.Setup(f"vtoken+{x}+autoscaler (old watermarks 15%, 0.25)", "vtoken", x, True), old))
    log(f"[day] {len(runs)} setups over a {a['day_s']:g} s day, peak {peak:g} req/s")
    for s, auto in runs:
        static = study.replicas_needed(cal, day_spec, s, peak, a["day_peak_replicas"])["replicas"]
        if static is None:  # no fleet size meets the SLA at the peak: no day to compare
            out["day"]["never_meets_sla"] = out["day"].get("never_meets_sla", []) + [s.name]
            continue
        start = max(1, round(static * 0.2)) if s.autoscale else static
        out["day"]["results"][s.name] = {
            "static_replicas": static,
            **study.day(cal, spec, s, peak, a["day_s"], start, autoscaling=auto),
            **({"autoscaling": "defaults" if auto is defaults else "old defaults"} if auto else {}),
        }
    out["chat"] = _chat(cal, a)
    out["targets"] = _targets(out, setups)
    return out


def _chat(cal, a: dict, spec=None) -> dict[str, Any]:
    """Conversations over shared system prompts on replicas that keep prefix caches: each strategy's hit rate and
    TTFT per fleet size and load, against the oracle that reads every cache (cluster/sim/oracle.py). ``spec``: the
    workload and pools (study.ChatFleetSpec; default: its defaults, with ``chat_horizon`` and ``seed``)."""
    from dataclasses import asdict

    from cluster.sim import study

    spec = spec or study.ChatFleetSpec(horizon_s=a["chat_horizon"], seed=a["seed"])
    sizes = [int(x) for x in str(a["chat_replicas"]).split(",")]
    rates = [float(x) for x in str(a["chat_rates"]).split(",")]
    strategies = a["chat_strategies"].split(",")
    log(f"[chat] {len(strategies)} strategies on {a['chat_replicas']} replicas at {a['chat_rates']} conv/s each")
    rows = [{**r, "per_replica": rate} for n in sizes for rate in rates
            for r in study.chat_study(cal, spec, strategies, [n], rate)["results"][n]]  # fmt: skip
    return {"spec": asdict(spec), "replicas": sizes, "per_replica": rates, "rows": rows}


def _capacity_step(replicas: int) -> float:
    """The SLA throughput's resolution: 1 req/s on 16 replicas, the same per replica on any fleet."""
    return max(0.25, round(replicas / 16, 2))


def _capacity(cal, spec, setups, replicas: int, start: float, seeds: int, rr: str) -> dict[str, Any]:
    """Each setup's SLA throughput on ``seeds`` workloads (the same seeds for every setup), and its mean
    against round_robin's: how much more load the fleet takes within the SLA, the paper's measure."""
    from dataclasses import replace

    from cluster.sim import study

    step, coarse = _capacity_step(replicas), 4  # 4 steps at a time at first
    seed_list = [spec.seed + k for k in range(seeds)]
    res: dict[str, Any] = {}
    for s in setups:
        runs = [study.capacity(cal, replace(spec, seed=k), s, replicas, start, step, coarse) for k in seed_list]
        rates = [r["rate"] or 0.0 for r in runs]
        res[s.name] = {"per_seed": rates, "mean": round(sum(rates) / len(rates), 2)}
    base = res[rr]["mean"]
    for r in res.values():
        r["vs_round_robin"] = round(r["mean"] / base, 3) if base else None
    return {"replicas": replicas, "seeds": seed_list, "step": step, "coarse": coarse, "start": start, "results": res}


def _against(sim: dict, measured: dict) -> dict[str, Any]:
    """Goodput per round, simulated against measured: the relative error per strategy."""
    rounds = measured["rounds"]
    out = {"file_command": measured.get("command"), "rounds": rounds, "strategies": {}}
    for s, got in measured["goodput"].items():
        if s in sim["goodput"]:
            m = got / rounds
            out["strategies"][s] = {
                "measured_per_round": m,
                "simulated": sim["goodput"][s],
                "error": round(sim["goodput"][s] / m - 1, 3) if m else None,
            }
    return out


def _spec(spec) -> dict[str, Any]:
    from dataclasses import asdict

    return asdict(spec)


def _break_point(sweep: dict, rr: str, attainment: float, horizon_s: float) -> dict[str, Any]:
    """At the lowest swept load where round_robin misses the SLA: every setup's goodput against it, and the
    ceiling of that ratio: no strategy serves more than the requests that arrived, so at a load where
    round_robin still serves most of them (it misses by a little there) no strategy can beat it by much."""
    res = sweep["results"]
    i = next((i for i, p in enumerate(res[rr]) if p["attainment"] < attainment), None)
    if i is None:
        return {"rate": None}
    g = res[rr][i]["goodput_rps"]
    offered = res[rr][i]["requests"] / horizon_s
    ratios = [
        max((p["goodput_rps"] / q["goodput_rps"] for p, q in zip(pts, res[rr]) if q["goodput_rps"]), default=None)
        for pts in res.values()
    ]
    return {
        "rate": sweep["rates"][i],
        "best_ratio_over_sweep": dict(zip(res, ratios)),
        "goodput_rps": {s: pts[i]["goodput_rps"] for s, pts in res.items()},
        "vs_round_robin": {s: round(pts[i]["goodput_rps"] / g, 3) if g else None for s, pts in res.items()},
        "offered_rps": offered,
        "ceiling_vs_round_robin": round(offered / g, 3) if g else None,
    }


def _targets(out: dict, setups) -> dict[str, Any]:
    day = out["day"]["results"]
    naive = day.get("naive+round_robin", {}).get("replica_hours")
    auto = day.get("vtoken+free_blocks+autoscaler", {}).get("replica_hours")
    fewer = round(1 - auto / naive, 3) if naive and auto else None
    fb = out["break"].get("vs_round_robin", {}).get("vtoken+free_blocks")
    cap = {k: r["vs_round_robin"] for k, r in out.get("capacity", {}).get("results", {}).items()}
    big = {k: r["vs_round_robin"] for k, r in out.get("capacity_scale", {}).get("results", {}).items()}
    return {
        "autoscaled_fewer_replica_hours_than_naive_rr": fewer,
        "autoscaled_sla_attainment": day.get("vtoken+free_blocks+autoscaler", {}).get("attainment"),
        "free_blocks_vs_round_robin_at_break": fb,
        # Every request served within the SLA at round_robin's break: the most any strategy can reach there.
        "ceiling_vs_round_robin_at_break": out["break"].get("ceiling_vs_round_robin"),
        # The highest load served within the SLA, against round_robin's (mean over the capacity seeds).
        "sla_throughput_vs_round_robin": cap,
        "sla_throughput_vs_round_robin_at_scale": big,
        "replica_hours_target_met": fewer is not None and fewer >= 0.30,
        "goodput_target_met": fb is not None and fb >= 1.3,
        # Conversations: prefix's hit rate and TTFT against weighted's (the default), per fleet size and load.
        "chat_prefix_vs_weighted": _chat_against(out.get("chat", {}).get("rows", []), "prefix", "weighted"),
    }


def _chat_against(rows: list[dict], a: str, b: str) -> list[dict[str, Any]]:
    by = {(r["replicas"], r["per_replica"], r["strategy"]): r for r in rows}
    out = []
    for (n, rate, s), r in by.items():
        other = by.get((n, rate, b))
        if s != a or other is None:
            continue
        out.append({
            "replicas": n,
            "per_replica": rate,
            "hit_rate_points": round(100 * (r["hit_rate"] - other["hit_rate"]), 1),
            "ttft_p50_ratio": _ratio(r["ttft_p50_s"], other["ttft_p50_s"]),
            "ttft_p99_ratio": _ratio(r["ttft_p99_s"], other["ttft_p99_s"]),
        })  # fmt: skip
    return out


def _ratio(x, y):
    return round(x / y, 3) if x is not None and y else None


def tables(result: dict) -> list[Table]:
    v = result["validation"]
    meas = v.get("measured", {}).get("strategies", {})
    t = [
        Table(
            f"Validation: vtoken bench goodput's load in the simulator (2 replicas, deadline {v['deadline_s']:.2f} s)",
            [
                "placement",
                "simulated: within deadline",
                "of",
                "heavy requests per replica",
                "measured per round",
                "error",
            ],
            [
                [
                    s,
                    v["goodput"][s],
                    v["requests"],
                    v["runs"][s]["heavy_per_replica"],
                    meas.get(s, {}).get("measured_per_round", "-"),
                    f"{meas[s]['error']:+.1%}" if meas.get(s, {}).get("error") is not None else "-",
                ]
                for s in v["goodput"]
            ],
            f"Measured: `{v['measured']['file_command']}` ({v['measured']['rounds']} rounds)" if meas else "",
        )
    ]
    sw = result["sweep"]
    t.append(
        Table(
            f"Goodput (req/s within SLA) vs load, {sw['replicas']} replicas",
            ["setup"] + [f"{r:g} req/s" for r in sw["rates"]],
            [
                [s] + [f"{p['goodput_rps']:.1f} ({p['attainment']:.0%})" for p in pts]
                for s, pts in sw["results"].items()
            ],
            "In brackets: SLA attainment (requests within factor x alone + slack).",
        )
    )
    b = result["break"]
    if b.get("rate") is not None:
        t.append(
            Table(
                f"Where round_robin breaks the SLA ({b['rate']:g} req/s on {sw['replicas']} replicas)",
                ["setup", "goodput req/s", "x round_robin"],
                [[s, g, b["vs_round_robin"][s]] for s, g in b["goodput_rps"].items()]
                + [
                    [
                        "(every request that arrived, within the SLA)",
                        round(b["offered_rps"], 2),
                        b["ceiling_vs_round_robin"],
                    ]
                ],  # fmt: skip
            )
        )
    for cp in (result.get("capacity"), result.get("capacity_scale")):
        if not cp:
            continue
        t.append(
            Table(
                f"SLA throughput: the highest load served within the SLA ({cp['replicas']} replicas, workload seeds "
                f"{', '.join(map(str, cp['seeds']))})",
                ["setup", "req/s per seed", "mean req/s", "x round_robin"],
                [
                    [s, ", ".join(f"{x:g}" for x in r["per_seed"]), r["mean"], r["vs_round_robin"]]
                    for s, r in cp["results"].items()
                ],
                f"The load climbs from {cp['start']:g} req/s in steps of {cp['coarse'] * cp['step']:g}, "
                f"then {cp['step']:g}; the rate is the last one met before the first miss.",
            )
        )
    bu = result["bursts"]
    t.append(
        Table(
            f"Bursts: {bu['rate']:g} req/s on {sw['replicas']} replicas on average, 4x for 4 s of every 20 s",
            ["setup", "goodput req/s", "SLA attainment"],
            [[s, p["goodput_rps"], f"{p['attainment']:.1%}"] for s, p in bu["results"].items()],
        )
    )
    nd = result["needed"]
    t.append(
        Table(
            f"Replicas needed for the SLA at {nd['rate']:g} req/s (sized for about {nd['scale']})",
            ["setup", "replicas", "attainment"],
            [
                [s, r["replicas"] or f"none up to {8 * nd['scale']}", f"{r['attainment']:.1%}"]
                for s, r in nd["results"].items()
            ],
        )
    )
    d = result["day"]
    t.append(
        Table(
            f"A day (compressed into {d['day_s']:g} s, peak {d['peak_rate']:g} req/s)",
            ["setup", "replica-hours", "mean replicas", "peak replicas", "SLA attainment", "scaling decisions"],
            [
                [
                    s,
                    r["replica_hours"],
                    r["mean_replicas"],
                    r["peak_replicas"],
                    f"{r['attainment']:.1%}",
                    r["decisions"],
                ]
                for s, r in d["results"].items()
            ],
            f"Targets: {result['targets']}",
        )
    )
    if result.get("chat"):
        t.append(chat_table(result["chat"]))
    return t


def chat_table(ch: dict) -> Table:
    """The conversation study's rows (``_chat``): per fleet size, load and placement, hit rates and TTFT."""
    c = ch["spec"]["chat"]
    return Table(
        f"Conversations over {c['systems']} shared system prompts ({c['system_tokens']} tokens), "
        f"{c['turns'][0]}-{c['turns'][1]} turns, {c['think_s']:g} s think time; replicas of "
        f"{ch['spec']['pools'][0]} blocks with prefix caches",
        [
            "replicas",
            "conv/s per replica",
            "placement",
            "prefix hit rate",
            "later turns",
            "TTFT p50 ms",
            "TTFT p99 ms",
            "tokens/s",
            "busiest / mean",
        ],  # fmt: skip
        [
            [
                r["replicas"],
                f"{r['per_replica']:g}",
                r["strategy"],
                f"{r['hit_rate']:.1%}",
                f"{r['hit_rate_later_turns']:.1%}",
                _ms(r["ttft_p50_s"]),
                _ms(r["ttft_p99_s"]),
                round(r["tokens_per_s"]),
                round(r["imbalance"], 2),
            ]  # fmt: skip
            for r in ch["rows"]
        ],
        "Hit rate: prompt tokens read from the prefix cache over all prompt tokens. prefix_oracle reads every "
        "replica's cache as it is (no controller can), under prefix's balance guard.",
    )


def _ms(s) -> str:
    return "-" if s is None else f"{1000 * s:.1f}"


def plot(result: dict, fig) -> None:
    ax1, ax2 = fig.subplots(1, 2)
    sw = result["sweep"]
    for s, pts in sw["results"].items():
        ax1.plot(sw["rates"], [p["goodput_rps"] for p in pts], "o-", label=s)
    ax1.plot(sw["rates"], sw["rates"], "k:", lw=0.8, label="offered")
    ax1.set(xlabel="offered load, req/s", ylabel="goodput, req/s", title=f"{sw['replicas']} replicas")
    ax1.legend(fontsize=7)
    d = result["day"]
    for s, r in d["results"].items():
        xs = [t / d["day_s"] * 24 for t, _ in r["timeline"]]
        ax2.step(xs, [n for _, n in r["timeline"]], where="post", label=f"{s} ({r['replica_hours']:g} h)")
    ax2.set(xlabel="hour of the day", ylabel="replicas", title="replicas over the day")
    ax2.legend(fontsize=7)
