"""Simulated requests and their arrivals: Poisson, bursts, a diurnal day; heavy-tailed lengths.

Every generator takes a seeded ``random.Random``: the same seed gives the same workload, bit for bit.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Request:
    """``deadline_s``: the client gives up this long after ``arrival`` (None: never); the request is then
    cancelled on its replica, as the gateway does when a gRPC deadline passes. ``prefill_evict=False`` keeps
    the whole prompt while it is read (retrieval over long prompts)."""

    id: int
    arrival: float
    prompt: int
    output: int
    prefill_evict: bool = True
    deadline_s: float | None = None
    kind: str = ""


@dataclass(frozen=True)
class LengthSpec:
    """Log-normal prompt and output lengths (median, sigma of the log), clipped to the model's context."""

    prompt_median: float = 200
    prompt_sigma: float = 1.0
    output_median: float = 64
    output_sigma: float = 0.8
    max_model_len: int = 1024  # the serving config's default; every request fits the smallest pool unevicted
    keep_prompt_share: float = 0.2  # requests with prefill_evict=False


def lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma)))))


def poisson_times(rng: random.Random, rate: float, horizon: float, start: float = 0.0) -> list[float]:
    out, t = [], start
    while rate > 0:
        t += rng.expovariate(rate)
        if t >= start + horizon:
            return out
        out.append(t)
    return out


def burst_times(
    rng: random.Random, rate: float, horizon: float, every_s: float = 20.0, burst_s: float = 4.0, factor: float = 4.0
) -> list[float]:
    """Poisson at ``rate`` with a burst of ``factor`` x the rate for ``burst_s`` every ``every_s``; the mean rate
    is kept at ``rate`` (the quiet part runs slower), so bursts compare with Poisson at the same load."""
    quiet = rate * (every_s - factor * burst_s) / (every_s - burst_s)
    if quiet < 0:
        raise ValueError(f"bursts of {factor}x for {burst_s}s every {every_s}s exceed the mean rate")
    return thinned(rng, lambda t: rate * factor if t % every_s < burst_s else quiet, rate * factor, horizon)


def diurnal_rate(t: float, day_s: float, peak: float, trough: float) -> float:
    """Lowest at midnight (t = 0), highest at midday."""
    return trough + (peak - trough) * (1 - math.cos(2 * math.pi * t / day_s)) / 2


def thinned(rng: random.Random, rate_at, max_rate: float, horizon: float) -> list[float]:
    """A Poisson process with a time-varying rate (Lewis and Shedler's thinning)."""
    return [t for t in poisson_times(rng, max_rate, horizon) if rng.random() * max_rate < rate_at(t)]


def requests(rng: random.Random, times: list[float], spec: LengthSpec, first_id: int = 0) -> list[Request]:
    out = []
    for i, t in enumerate(times):
        prompt = lognormal(rng, spec.prompt_median, spec.prompt_sigma, 4, spec.max_model_len // 2)
        output = lognormal(rng, spec.output_median, spec.output_sigma, 1, spec.max_model_len - prompt)
        keep = rng.random() < spec.keep_prompt_share
        out.append(Request(first_id + i, t, prompt, output, prefill_evict=not keep, kind="keep" if keep else ""))
    return out


def with_deadlines(reqs: list[Request], deadline_of) -> list[Request]:
    return [replace(r, deadline_s=deadline_of(r)) for r in reqs]


def goodput_load(shape: dict[str, int], n: int = 12, gap_s: float = 0.05) -> list[Request]:
    """``vtoken bench goodput``'s load: heavy and light alternating, one every ``gap_s``."""
    out = []
    for i in range(n):
        heavy = i % 2 == 0
        p, o = (
            (shape["heavy_prompt"], shape["heavy_output"]) if heavy else (shape["light_prompt"], shape["light_output"])
        )
        out.append(Request(i, i * gap_s, p, o, kind="heavy" if heavy else "light"))
    return out
