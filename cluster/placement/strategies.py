"""Placement strategies: which live replica gets the next request. Chosen by name from ``STRATEGIES``.

A strategy sees only ``ReplicaView``s of replicas that may take work (healthy, not draining); the controller
has already filtered out the rest, so no strategy can place on a dead or draining replica.
"""

from __future__ import annotations

import collections
import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple


class ReplicaView(NamedTuple):
    """What placement knows of a replica. ``promised`` counts blocks of requests placed there that its last
    report does not count yet (not admitted when its figures were read); ``effective_free`` subtracts them.
    ``pending`` counts those requests: queued from the controller's side, though no report shows them yet.
    ``tokens_to_go``: the work left there, in tokens: what its running requests have still to read of their
    prompts and to generate (``max_tokens``), by its last report, plus the whole prompt and ``max_tokens`` of
    each pending request. ``prompt_blocks``: the full blocks of the prompt being placed; ``prefix_blocks``: how many
    of its leading blocks the replica's prefix cache holds (cluster/placement/prefix_index.py), so it would not compute
    them."""

    name: str
    free_blocks: int
    total_blocks: int
    promised: int = 0
    running: int = 0
    waiting: int = 0
    blocks_reclaimed: int = 0
    stale: bool = False
    pending: int = 0
    tokens_to_go: int = 0
    prompt_blocks: int = 0
    prefix_blocks: int = 0

    @property
    def effective_free(self) -> int:
        return self.free_blocks - self.promised

    @property
    def prefix_share(self) -> float:
        """The share of the prompt's full blocks it would read from its cache."""
        return self.prefix_blocks / self.prompt_blocks if self.prompt_blocks else 0.0

    def matched(self, prompt_blocks: int, prefix_blocks: int) -> ReplicaView:
        """This view for a prompt of ``prompt_blocks`` full blocks of which the replica holds ``prefix_blocks``.
        (``_replace`` builds through keywords: at 256 replicas, a third of a decision's time.)"""
        return tuple.__new__(ReplicaView, (*self[:-2], prompt_blocks, prefix_blocks))

    @property
    def requests(self) -> int:
        """Requests there by the controller's count: running and waiting by its last report, and placed since."""
        return self.running + self.waiting + self.pending


def promised_per_replica(promises: Iterable[Any]) -> tuple[collections.Counter[str], ...]:
    """Per replica, the blocks, requests and tokens of ``promises`` (each with ``replica``, ``blocks``, ``tokens``):
    what views add as ``promised``, ``pending`` and ``tokens_to_go``."""
    blocks: collections.Counter[str] = collections.Counter()
    count: collections.Counter[str] = collections.Counter()
    tokens: collections.Counter[str] = collections.Counter()
    for p in promises:
        blocks[p.replica] += p.blocks
        count[p.replica] += 1
        tokens[p.replica] += p.tokens
    return blocks, count, tokens


class TooLarge(Exception):
    """No replica's pool can ever hold the request (its blocks at their peak over the largest pool): placing it would
    only queue it forever ahead of others. The message names both numbers."""


def check_fits(replicas: Iterable[ReplicaView], need_blocks: int) -> None:
    """Raise TooLarge when ``need_blocks`` is over every replica's whole pool (replicas that report no pool yet are
    given the benefit of the doubt)."""
    largest = max((r.total_blocks for r in replicas), default=0)
    if largest and need_blocks > largest:
        raise TooLarge(
            f"the request needs {need_blocks} KV blocks at its peak (n x (prompt + max tokens), under its eviction "
            f"budget) and the largest replica's pool holds {largest}: no replica can ever serve it; ask for fewer "
            "tokens or sequences"
        )


class PlacementStrategy(ABC):
    # Whether choose() reads ``prefix_blocks``: the replicas' prefix indexes, of which the controller then sends
    # each gateway what its copies need (cluster/placement/placer.py).
    reads_prefix = False

    @abstractmethod
    def choose(self, replicas: list[ReplicaView], need_blocks: int) -> ReplicaView:
        """Pick one of ``replicas`` (never empty) for a request that will need ``need_blocks``."""


class FreeBlocks(PlacementStrategy):
    """The most effective free capacity. A replica whose last report is stale is trusted only when no
    fresh replica has room for the request; ties go to the fewest waiting requests."""

    def choose(self, replicas, need_blocks):
        return max(
            replicas,
            key=lambda r: (r.effective_free >= need_blocks, not r.stale, r.effective_free, -r.waiting, -r.running),
        )


class RoundRobin(PlacementStrategy):
    def __init__(self):
        self.n = 0

    def choose(self, replicas, need_blocks):
        self.n += 1
        return sorted(replicas, key=lambda r: r.name)[(self.n - 1) % len(replicas)]


class PowerOfTwo(PlacementStrategy):
    """Two replicas at random, the one with more effective free capacity (Mitzenmacher's two choices)."""

    def __init__(self, seed: int | None = None):
        self.rng = random.Random(seed)

    def choose(self, replicas, need_blocks):
        pair = self.rng.sample(replicas, min(2, len(replicas)))
        return max(pair, key=lambda r: (r.effective_free, -r.waiting))


class BestFit(PlacementStrategy):
    """The replica whose effective free capacity fits the request most tightly: small requests fill the gaps of
    busy replicas and whole replicas stay open for long ones (first-fit-decreasing's reasoning, applied online).
    ``need_blocks`` should be what the request will really hold (the gateway's estimate under its budget).
    When nothing fits, the most effective free capacity, like ``free_blocks``; stale reports only as a last
    resort; ties go to the fewest waiting, then running, requests."""

    def choose(self, replicas, need_blocks):
        fits = [r for r in replicas if r.effective_free >= need_blocks and not r.stale]
        if not fits:
            return FreeBlocks().choose(replicas, need_blocks)
        return min(fits, key=lambda r: (r.effective_free, r.waiting, r.running, r.name))


class Weighted(PlacementStrategy):
    """A weighted score over the replicas that fit the request, as llm-d's scheduler sums its scorers: the share
    of the pool effectively free, less the work left there (``tokens_to_go``) and less the waiting requests,
    each against the busiest replica. Free blocks alone send a large pool twice the requests of a small one,
    though both compute at the same speed; the work term spreads the compute. Work is counted in tokens, not
    requests: a light request counts as little as it is, and one placed since the replica's last report counts
    at once (its prompt and max_tokens), so a burst between two reports spreads too. Waiting requests are the
    ones the replica reports queued (for blocks or a batch slot). Replicas that fit come first; stale reports
    last."""

    def __init__(self, w_free: float = 1.0, w_work: float = 1.0, w_waiting: float = 1.0):
        self.w = (w_free, w_work, w_waiting)

    def scores(self, replicas: list[ReplicaView]) -> dict[str, float]:
        most_work = max(r.tokens_to_go for r in replicas) or 1
        most_waiting = max(r.waiting for r in replicas) or 1
        wf, ww, wq = self.w

        def score(r: ReplicaView) -> float:
            free = r.effective_free / r.total_blocks if r.total_blocks else 0.0
            return wf * free - ww * r.tokens_to_go / most_work - wq * r.waiting / most_waiting

        return {r.name: score(r) for r in replicas}

    def choose(self, replicas, need_blocks):
        score = self.scores(replicas)
        return max(replicas, key=lambda r: (r.effective_free >= need_blocks, not r.stale, score[r.name], r.name))


class Prefix(PlacementStrategy):
    """Weighted's score plus the share of the prompt a replica would read from its prefix cache (``w_prefix`` x
    ``prefix_share``), as llm-d's scheduler adds its prefix-cache scorer to its load scorers and Ray Serve's
    PrefixCacheAffinityRouter prefers the replica with the longest match. A conversation's next turn then goes where
    its last turn left its blocks, and skips their prefill there. Weighted's three terms span up to 3 (each against
    the busiest replica, so the busier of two counts fully busy however little it holds): at the default weight, 3
    (llm-d's default profile weighs its prefix-cache scorer 3 to its queue scorer's 2), a whole prompt in the cache
    outweighs them, and the guard alone keeps the load in balance.

    Balance guard: one hot prefix must not pile every request onto the replica that holds it. The weighted choice is
    taken instead when the best match covers less than ``min_share`` of the prompt (too little to pay for a busier
    replica), or when the replica it picked carries more than ``max_extra_requests`` requests or ``max_extra_work``
    tokens of work beyond the least loaded replica that fits (the Router's imbalance threshold). Replicas that fit the
    request come first and stale reports last, as for ``weighted``."""

    reads_prefix = True

    def __init__(
        self,
        w_prefix: float = 3.0,
        min_share: float = 0.1,
        max_extra_requests: int = 2,
        max_extra_work: int = 4096,
        weighted: Weighted | None = None,
    ):
        self.w_prefix, self.min_share = w_prefix, min_share
        self.max_extra_requests, self.max_extra_work = max_extra_requests, max_extra_work
        self.weighted = weighted or Weighted()

    def choose(self, replicas, need_blocks):
        score = self.weighted.scores(replicas)

        def rank(r: ReplicaView, prefix: float) -> tuple:
            return r.effective_free >= need_blocks, not r.stale, score[r.name] + prefix * r.prefix_share, r.name

        fallback = max(replicas, key=lambda r: rank(r, 0.0))
        if all(r.prefix_share < self.min_share for r in replicas):  # no match worth a busier replica: the common case
            return fallback
        best = max(replicas, key=lambda r: rank(r, self.w_prefix))
        if best is fallback or best.prefix_share < self.min_share or self.overloaded(best, replicas, need_blocks):
            return fallback
        return best

    def overloaded(self, r: ReplicaView, replicas: list[ReplicaView], need_blocks: int) -> bool:
        """More requests or work on ``r`` than the guard allows beyond the least loaded replica that fits."""
        fit = [v for v in replicas if v.effective_free >= need_blocks and not v.stale] or replicas
        return (
            r.requests - min(v.requests for v in fit) > self.max_extra_requests
            or r.tokens_to_go - min(v.tokens_to_go for v in fit) > self.max_extra_work
        )


STRATEGIES: dict[str, Callable[[], PlacementStrategy]] = {
    "free_blocks": FreeBlocks,
    "round_robin": RoundRobin,
    "power_of_two": PowerOfTwo,
    "best_fit": BestFit,
    "weighted": Weighted,
    "prefix": Prefix,
}


def make_strategy(name: str) -> PlacementStrategy:
    if name not in STRATEGIES:
        raise ValueError(f"unknown placement strategy {name!r}; known: {', '.join(sorted(STRATEGIES))}")
    return STRATEGIES[name]()
