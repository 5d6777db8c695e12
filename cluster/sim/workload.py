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
    the whole prompt while it is read (retrieval over long prompts).
    A conversation's turn (``chat``): ``prefix`` names the prompt's full blocks (as vtoken/prefix_hash.py would:
    two prompts share block i's name only if they share blocks 0..i); ``then`` is the next turn, which arrives
    ``then.think_s`` after this one ends (its ``arrival`` is set then), unless this one was cancelled."""

    id: int
    arrival: float
    prompt: int
    output: int
    prefill_evict: bool = True
    deadline_s: float | None = None
    kind: str = ""
    prefix: tuple[int, ...] = ()
    then: Request | None = None
    think_s: float = 0.0

    def turns(self) -> list[Request]:
        """This request and the turns after it."""
        out, r = [], self
        while r is not None:
            out.append(r)
            r = r.then
        return out


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


# ---------------------------------------------------------------------------------------------- conversations
@dataclass(frozen=True)
class ChatSpec:
    """Conversations over a few shared system prompts: each conversation picks one of ``systems`` system prompts
    (``system_tokens`` each), then ``turns`` user messages (log-normal lengths), each answered before the next
    arrives ``think_s`` (exponential mean) later. A turn's prompt is the system prompt, every earlier message and
    answer, and its message; a conversation ends early rather than outgrow ``max_model_len``."""

    systems: int = 4
    system_tokens: int = 384
    turns: tuple[int, int] = (4, 8)
    user_median: float = 40
    user_sigma: float = 0.6
    output_median: float = 48
    output_sigma: float = 0.5
    think_s: float = 5.0
    max_model_len: int = 1024
    block_size: int = 32


def chat_block(system: int, conversation: int, i: int, spec: ChatSpec) -> int:
    """Block i of a conversation's token stream: the system prompt's own while it lies inside it, else the
    conversation's."""
    if (i + 1) * spec.block_size <= spec.system_tokens:
        return (1 << 62) | (system << 32) | i
    return (2 << 62) | (conversation << 20) | i


def chat(rng: random.Random, times: list[float], spec: ChatSpec, first_id: int = 0) -> list[Request]:
    """One conversation starting at each of ``times``: its first turns, each carrying the turns after it."""
    out, rid = [], first_id
    for c, t in enumerate(times):
        system = rng.randrange(spec.systems)
        turns: list[tuple[int, int, float]] = []  # (prompt, output, think_s)
        context = spec.system_tokens
        for k in range(rng.randint(*spec.turns)):
            user = lognormal(rng, spec.user_median, spec.user_sigma, 1, spec.max_model_len)
            output = lognormal(rng, spec.output_median, spec.output_sigma, 1, spec.max_model_len)
            if context + user + output > spec.max_model_len:
                break
            turns.append((context + user, output, rng.expovariate(1 / spec.think_s) if k else 0.0))
            context += user + output
        nxt: Request | None = None
        for k in range(len(turns) - 1, -1, -1):
            prompt, output, think = turns[k]
            prefix = tuple(chat_block(system, c, i, spec) for i in range(prompt // spec.block_size))
            nxt = Request(rid + k, t if k == 0 else 0.0, prompt, output, kind=f"chat{system}", prefix=prefix,
                          then=nxt, think_s=think)  # fmt: skip
        rid += len(turns)
        if nxt is not None:
            out.append(nxt)
    return out
