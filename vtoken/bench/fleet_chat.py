"""Conversations on a simulated fleet: prefix-aware placement against weighted, when prompts fit and when not.

The fleet simulator's conversation study (the ``chat`` part of `vtoken bench fleet`, alone, in minutes): each
placement's prefix-cache hit rate and TTFT on ``--replicas`` simulated replicas (``cluster/sim/``, modelled from
``docs/results/fleet_calibration.json``), against the oracle that reads every cache, for each of ``--workloads``:

  cached  4 system prompts of 384 tokens (the study's defaults): every replica soon caches every system prompt,
          so any placement reads them from a cache and only a conversation's own turns are at stake
  long    32 system prompts of 1,536 tokens, more than one replica's pool holds: a placement that spreads a
          system prompt over every replica makes each cache churn through all of them

A simulation, not a measurement: its TTFTs come from the calibration's step times (the tiny model on this CPU).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from vtoken.bench.engine_run import log
from vtoken.bench.report import Table

# name -> (system prompts, tokens each, pool blocks per replica, max_model_len)
WORKLOADS = {"cached": (4, 384, 512, 1024), "long": (32, 1536, 512, 4096)}
QUICK = {"replicas": "16", "horizon": 10.0}


def add_args(p) -> None:
    p.add_argument("--calibration", help="calibration JSON (default: docs/results/fleet_calibration.json)")
    p.add_argument("--replicas", default="16,256", help="fleet sizes")
    p.add_argument("--rates", default="1", help="conversations started per second per replica")
    p.add_argument("--horizon", type=float, default=20.0, help="seconds of conversation starts")
    p.add_argument("--strategies", default="round_robin,weighted,prefix,prefix_oracle")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"any of {', '.join(WORKLOADS)}")
    p.add_argument("--seed", type=int, default=0)


def spec(name: str, horizon_s: float, seed: int):
    from cluster.sim import study
    from cluster.sim.workload import ChatSpec

    systems, tokens, pool, max_len = WORKLOADS[name]
    chat = replace(ChatSpec(), systems=systems, system_tokens=tokens, max_model_len=max_len)
    return study.ChatFleetSpec(chat=chat, pools=(pool,), horizon_s=horizon_s, seed=seed)


def run(args) -> dict:
    from cluster.sim import calibration
    from vtoken.bench import fleet

    a = {**vars(args), **(QUICK if args.quick else {})}
    names = [w for w in a["workloads"].split(",") if w]
    if not names or set(names) - set(WORKLOADS):
        raise SystemExit(f"--workloads: any of {', '.join(WORKLOADS)}, not {a['workloads']!r}")
    cal = calibration.load(a["calibration"])
    study_args = {"chat_replicas": a["replicas"], "chat_rates": a["rates"], "chat_strategies": a["strategies"]}
    out: dict[str, Any] = {"workloads": {}}
    for name in names:
        log(f"[fleet_chat] workload {name}")
        ch = fleet._chat(cal, study_args, spec(name, a["horizon"], a["seed"]))
        ch["prefix_vs_weighted"] = fleet._chat_against(ch["rows"], "prefix", "weighted")
        out["workloads"][name] = ch
    # What --quick changed; each workload's spec is in its own entry (``spec``)
    out["settings_used"] = {"replicas": a["replicas"], "horizon": a["horizon"], "workloads": names}
    return out


def tables(result: dict) -> list[Table]:
    from vtoken.bench.fleet import chat_table

    out = []
    for name, ch in result["workloads"].items():
        t = chat_table(ch)
        out.append(t._replace(title=f"{name}: {t.title}"))
        out.append(
            Table(
                f"{name}: prefix against weighted",
                ["replicas", "conv/s per replica", "hit rate, points", "TTFT p50, x weighted", "TTFT p99, x weighted"],
                [
                    [
                        r["replicas"],
                        f"{r['per_replica']:g}",
                        r["hit_rate_points"],
                        r["ttft_p50_ratio"],
                        r["ttft_p99_ratio"],
                    ]
                    for r in ch["prefix_vs_weighted"]
                ],  # fmt: skip
            )
        )
    return out


def plot(result: dict, fig) -> None:
    names = list(result["workloads"])
    axes = fig.subplots(1, len(names), squeeze=False)[0]
    for ax, name in zip(axes, names):
        rows = result["workloads"][name]["rows"]
        sizes = sorted({r["replicas"] for r in rows})
        strategies = list(dict.fromkeys(r["strategy"] for r in rows))
        width = 0.8 / max(1, len(strategies))
        for k, s in enumerate(strategies):
            ys = [next((1000 * (r["ttft_p50_s"] or 0) for r in rows if r["replicas"] == n and r["strategy"] == s), 0)
                  for n in sizes]  # fmt: skip
            ax.bar([i + k * width for i in range(len(sizes))], ys, width, label=s)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(sizes))], [f"{n} replicas" for n in sizes])
        ax.set(ylabel="TTFT p50, ms (simulated)", title=name)
        ax.legend(fontsize=7)
