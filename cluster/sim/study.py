"""The experiments of ``vtoken bench fleet``, each a function of a calibration and a few numbers.

SLA: a request meets it when it completes within ``factor`` x its latency alone on an idle replica, plus
``slack_s`` (the client's deadline; past it the request is cancelled); a fleet meets the SLA when at least
``attainment`` of the requests do. Goodput: requests that met their deadline, per second of arrivals.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
from typing import Any

from cluster.config import AutoscalingConfig
from cluster.sim.calibration import Calibration
from cluster.sim.fleet import Fleet as _Fleet
from cluster.sim.fleet import FleetConfig, Outcome
from cluster.sim.replica import Limits
from cluster.sim.workload import (
    ChatSpec,
    LengthSpec,
    Request,
    burst_times,
    chat,
    diurnal_rate,
    goodput_load,
    poisson_times,
    requests,
    thinned,
    with_deadlines,
)


@dataclass(frozen=True)
class Sla:
    factor: float = 2.5
    slack_s: float = 1.0
    attainment: float = 0.95


@dataclass(frozen=True)
class Setup:
    """One line of the comparison: an eviction mode, a placement strategy, with or without the autoscaler."""

    name: str
    mode: str
    strategy: str
    autoscale: bool = False


SETUPS = (
    Setup("naive+round_robin", "naive", "round_robin"),
    Setup("vtoken+round_robin", "vtoken", "round_robin"),
    Setup("vtoken+free_blocks", "vtoken", "free_blocks"),
)


def alone_s(cal: Calibration, mode: str, chunk: int | None, prompt: int, output: int) -> float:
    """A request's latency on an idle replica: its prefill chunks, then one decode step per further token
    (reading about the live tokens at its middle)."""
    st, cap = cal.steps(mode), chunk or cal.max_num_batched_tokens
    full, rest = divmod(prompt, cap)
    pre = full * st.seconds(0, cap, 1) + (st.seconds(0, rest, 1) if rest else 0.0)
    lim = Limits(cal.block_size, cap, 1, chunk, cal.meta.get("budget", 0.5) if mode != "off" else None)
    return pre + (output - 1) * st.seconds(1, 0, 0, lim.live(prompt + output // 2))


def simulate(cal: Calibration, cfg: FleetConfig, reqs: list[Request], until: float | None = None) -> Outcome:
    return _Fleet(cfg, cal).run(reqs, until)


def score(reqs: list[Request], out: Outcome, horizon: float) -> dict[str, Any]:
    ok = sum(1 for r in reqs if r.id in out.done and out.done[r.id] - r.arrival <= (r.deadline_s or math.inf) + 1e-9)
    return {
        "requests": len(reqs),
        "ok": ok,
        "attainment": ok / len(reqs) if reqs else 1.0,
        "goodput_rps": ok / horizon,
        "preemptions": out.preemptions,
    }


# ---------------------------------------------------------------------------------------------- validation
def validate(cal: Calibration, strategies=("free_blocks", "round_robin"), factor: float = 2.5) -> dict[str, Any]:
    """``vtoken bench goodput``'s run in the simulator: 2 replicas of its pool, 12 requests alternating heavy
    and light 50 ms apart, deadline = ``factor`` x a heavy request alone, requests without eviction options
    (the gateway estimates the whole context), the replicas' vtoken settings of the calibration run (snapkv, its
    budget: 0.5 where it records none)."""
    g = cal.goodput
    heavy = alone_s(cal, "vtoken", None, g["heavy_prompt"], g["heavy_output"])
    reqs = [replace(r, deadline_s=factor * heavy) for r in goodput_load(g)]
    out = {"deadline_s": factor * heavy, "heavy_alone_s": heavy, "requests": len(reqs), "goodput": {}, "runs": {}}
    for s in strategies:
        o = simulate(cal, FleetConfig(strategy=s, replicas=2, pools=(g["pool_blocks"],)), reqs)
        out["goodput"][s] = score(reqs, o, 1.0)["ok"]
        heavy_on: dict[str, int] = {}
        for r in reqs[::2]:
            heavy_on[o.placed_on[r.id]] = heavy_on.get(o.placed_on[r.id], 0) + 1
        out["runs"][s] = {
            "heavy_per_replica": sorted(heavy_on.values(), reverse=True),
            "latencies_s": [round(o.done[r.id] - r.arrival, 3) if r.id in o.done else None for r in reqs],
        }
    return out


# ---------------------------------------------------------------------------------------------- fleet runs
@dataclass(frozen=True)
class FleetSpec:
    """The simulated fleet's replicas and load (tiny-llama on one core each; pools of two sizes)."""

    pools: tuple[int, ...] = (32, 64)  # KV pools near the goodput replicas' 44 blocks: memory binds
    prefill_chunk: int | None = 128
    lengths: LengthSpec = LengthSpec(prompt_median=300)
    sla: Sla = Sla()
    horizon_s: float = 30.0
    arrivals: str = "poisson"  # or "bursts"
    seed: int = 0

    def config(self, setup: Setup, replicas: int, **kw) -> FleetConfig:
        return FleetConfig(
            strategy=setup.strategy,
            mode=setup.mode,
            replicas=replicas,
            pools=self.pools,
            prefill_chunk=self.prefill_chunk,
            estimate_with_budget=True,
            **kw,
        )


def workload(cal: Calibration, spec: FleetSpec, mode: str, rate: float, times=None) -> list[Request]:
    rng = random.Random(spec.seed)
    if times is None:
        gen = poisson_times if spec.arrivals == "poisson" else burst_times
        times = gen(rng, rate, spec.horizon_s)
    reqs = requests(rng, times, spec.lengths)
    # The deadline is the same for every mode: what a request alone takes with vToken on an idle replica.
    return with_deadlines(
        reqs,
        lambda r: spec.sla.factor * alone_s(cal, "vtoken", spec.prefill_chunk, r.prompt, r.output) + spec.sla.slack_s,
    )


def at_load(cal: Calibration, spec: FleetSpec, setup: Setup, replicas: int, rate: float) -> dict[str, Any]:
    reqs = workload(cal, spec, setup.mode, rate)
    out = simulate(cal, spec.config(setup, replicas), reqs)
    return {"rate": rate, "replicas": replicas, **score(reqs, out, spec.horizon_s)}


def sweep(cal: Calibration, spec: FleetSpec, setups, replicas: int, rates: list[float]) -> dict[str, list[dict]]:
    return {s.name: [at_load(cal, spec, s, replicas, r) for r in rates] for s in setups}


def replicas_needed(cal: Calibration, spec: FleetSpec, setup: Setup, rate: float, guess: int) -> dict[str, Any]:
    """The fewest replicas meeting the SLA at ``rate`` (bisection from ``guess``; attainment grows with
    replicas). Each probe is a full simulation of the horizon. ``replicas`` is None when even 8 x ``guess``
    replicas miss the SLA."""
    tried: dict[int, float] = {}

    def ok(n: int) -> bool:
        if n not in tried:
            tried[n] = at_load(cal, spec, setup, n, rate)["attainment"]
        return tried[n] >= spec.sla.attainment

    lo, hi = max(1, guess // 2), max(2, guess)
    while not ok(hi):
        if hi >= 8 * guess:  # a strategy that piles work on few replicas gains nothing from more of them
            return {"replicas": None, "attainment": tried[hi], "probes": dict(sorted(tried.items()))}
        lo, hi = hi, hi * 2
    while ok(lo) and lo > 1:
        lo, hi = max(1, lo // 2), lo
    while hi - lo > max(1, hi // 50):  # to 2%: each probe at hundreds of replicas costs seconds
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return {"replicas": hi, "attainment": tried[hi], "probes": dict(sorted(tried.items()))}


def capacity(
    cal: Calibration, spec: FleetSpec, setup: Setup, replicas: int, start: float, step: float = 1.0, coarse: int = 4
) -> dict[str, Any]:
    """The SLA throughput (the paper's measure): the highest arrival rate at which ``setup`` still meets the SLA
    on ``replicas``. The load climbs from ``start`` in steps of ``coarse`` x ``step`` req/s to the first miss,
    then again in steps of ``step`` from the last rate that met it; ``rate`` is the last one met before the
    first miss (None when ``start`` itself misses). Attainment is not strictly monotone in the load for one
    seed, so the first miss is what counts, not the highest rate that happens to meet it."""

    def ok(rate: float) -> bool:
        return at_load(cal, spec, setup, replicas, rate)["attainment"] >= spec.sla.attainment

    if not ok(start):
        return {"rate": None, "first_miss": start}
    good, r = start, start + coarse * step
    while ok(r):
        good, r = r, r + coarse * step
    fine = good + step
    while fine < r and ok(fine):
        good, fine = fine, fine + step
    return {"rate": round(good, 3), "first_miss": round(min(fine, r), 3)}


# ---------------------------------------------------------------------------------------------- a day
def day(
    cal: Calibration,
    spec: FleetSpec,
    setup: Setup,
    peak_rate: float,
    day_s: float,
    replicas: int,
    trough_share: float = 0.2,
    autoscaling: AutoscalingConfig | None = None,
    start_s: float = 30.0,
) -> dict[str, Any]:
    """A diurnal day compressed into ``day_s`` seconds: static ``replicas``, or the autoscaler from there."""
    rng = random.Random(spec.seed + 1)
    times = thinned(rng, lambda t: diurnal_rate(t, day_s, peak_rate, trough_share * peak_rate), peak_rate, day_s)
    reqs = workload(cal, spec, setup.mode, peak_rate, times)
    cfg = spec.config(
        setup, replicas, autoscaling=autoscaling if setup.autoscale else None, start_s=start_s, tick_s=1.0
    )
    out = simulate(cal, cfg, reqs, until=day_s)
    replica_s, last_t, last_n = 0.0, 0.0, 0
    timeline = []
    for t, n in out.replicas:
        replica_s += (min(t, day_s) - last_t) * last_n
        last_t, last_n = min(t, day_s), n
        timeline.append((round(t, 1), n))
    replica_s += (day_s - last_t) * last_n
    return {
        **score(reqs, out, day_s),
        "replica_hours": round(24 * replica_s / day_s, 1),  # the day's mean replicas x 24 h
        "mean_replicas": round(replica_s / day_s, 2),
        "peak_replicas": max(n for _, n in out.replicas),
        "decisions": len(out.decisions),
        "timeline": _thin(timeline, 400),
    }


def _thin(xs: list, n: int) -> list:
    step = max(1, len(xs) // n)
    return xs[::step] + ([xs[-1]] if xs and (len(xs) - 1) % step else [])


# ---------------------------------------------------------------------------------------------- conversations
@dataclass(frozen=True)
class ChatFleetSpec:
    """Conversations over shared system prompts (workload.py ``chat``) on replicas that keep prefix caches. The
    replicas run without eviction (mode ``off``): vToken's default (pressure mode) keeps every token while the pool
    holds what runs, so blocks stay whole and its prefix cache works as stock vLLM's."""

    chat: ChatSpec = ChatSpec()
    pools: tuple[int, ...] = (512,)  # 16K tokens of tiny-llama (32 MiB): a few dozen conversations' contexts
    prefill_chunk: int | None = None
    horizon_s: float = 60.0  # seconds of conversation starts
    seed: int = 0


def chat_run(cal: Calibration, spec: ChatFleetSpec, strategy: str, replicas: int, rate: float) -> dict[str, Any]:
    """``rate`` conversations a second for ``spec.horizon_s`` on ``replicas``: each turn's TTFT (arrival to first
    token), the share of prompt tokens read from the prefix cache (all turns, and turns after the first), the
    tokens generated per second, and how unevenly the turns spread (the busiest replica's share over the mean)."""
    rng = random.Random(spec.seed)
    convs = chat(rng, poisson_times(rng, rate, spec.horizon_s), spec.chat)
    cfg = FleetConfig(strategy=strategy, mode="off", replicas=replicas, pools=spec.pools,
                      prefill_chunk=spec.prefill_chunk, prefix_cache=True)  # fmt: skip
    out = simulate(cal, cfg, convs)
    turns = [t for c in convs for t in c.turns() if t.id in out.done]
    later = [t for c in convs for t in c.turns()[1:] if t.id in out.done]
    ttft = sorted(out.first[t.id] - out.arrived[t.id] for t in turns)
    span = max(out.done[t.id] for t in turns) - min(out.arrived[t.id] for t in turns) if turns else 1.0
    per: dict[str, int] = {}
    for t in turns:
        per[out.placed_on[t.id]] = per.get(out.placed_on[t.id], 0) + 1
    return {
        "strategy": strategy,
        "replicas": replicas,
        "rate": rate,
        "conversations": len(convs),
        "turns": len(turns),
        "hit_rate": _share(turns, out),
        "hit_rate_later_turns": _share(later, out),
        "ttft_p50_s": _pct(ttft, 0.5),
        "ttft_p99_s": _pct(ttft, 0.99),
        "tokens_per_s": sum(t.output for t in turns) / span,
        "imbalance": max(per.values()) / (len(turns) / replicas) if turns else 0.0,
        "preemptions": out.preemptions,
    }


def chat_study(
    cal: Calibration, spec: ChatFleetSpec, strategies, replicas: list[int], per_replica: float
) -> dict[str, Any]:
    """Each strategy on each fleet size, at ``per_replica`` conversations a second per replica."""
    return {
        "per_replica": per_replica,
        "results": {n: [chat_run(cal, spec, s, n, per_replica * n) for s in strategies] for n in replicas},
    }


def _share(turns: list[Request], out: Outcome) -> float:
    prompt = sum(t.prompt for t in turns)
    return sum(out.hit[t.id] for t in turns) / prompt if prompt else 0.0


def _pct(xs: list[float], q: float) -> float | None:
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None
