"""Parking: every token a request gives up (a prefill chunk boundary, a shed, a decode decision, the losers of a
choice) leaves vLLM's pool but is kept in a second tier outside the KV budget (host memory; on a CPU machine a
tensor of its own that the pool does not count) while the tier has room. Scheduler side, plain NumPy; the
worker's half is vtoken/kv/tier.py. When the tier is full, the oldest parked tokens of any request are freed for
good first (``Parked.seq``, recall.py ``Recall.take``); admission reserves what each request may park
(shedding.py ``admit_to_tier``), so that this is rare.

Why: a decision can only judge tokens by the queries seen so far. Between prefill chunks the question at the end
of a prompt is not known yet, and while decoding a 32-token answer needs different parts of a document at
different tokens, chosen before those tokens were known. Parked, a token is not lost: it comes back when a later
window of queries asks for it.

    chunk boundary   victims -> parked
    the chunk that   ends one token before the prompt does (the scheduler stops the last chunk one token short):
      ends at n - 1  its window is scored over live + parked keys together (one softmax)
    boundary n - 1   policy.select over live + parked (the question): parked winners restored into the packed
                     request's free slots, live losers parked, parked losers stay parked
    token n - 1      its forward samples the first output token, and sees the survivors
    decoding         recall: every ``recall_every`` decode steps (and at each decision of a request keeping to its
                     budget) the request's window of recent decode queries is scored over live + parked keys, and
                     it chooses again among both (recall.py ``Recall.while_decoding``); page boxes of the parked
                     keys pick which parked tokens are scored exactly (vtoken/kv/query_window.py score_with_parked)
    room again       pressure mode: when the pool has room beyond the watermark and nothing waits, parked tokens
                     come back, the best first (recall.py Recall.reinflation)
    the end          what is still parked was hidden from the forward that parked it: evicted from there

The trace says when each restored token was parked and restored (each time), so the masked reference hides it
exactly for the forwards in between (tests/reference.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


class TierSlots:
    """The tier's slot allocator: ``capacity`` token slots, handed out and freed in any order.

    Invariant (``check_integrity``): every slot is either free or held, never both."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"tier capacity must be >= 0, got {capacity}")
        self.capacity = int(capacity)
        self._free = np.arange(self.capacity - 1, -1, -1, dtype=np.int64)  # a stack: pop from the end
        self._n = self.capacity
        self._freed: list[np.ndarray] = []  # slots given back since ``drain_freed`` (the worker's boxes follow)

    @property
    def num_free(self) -> int:
        return self._n

    def take(self, n: int) -> np.ndarray:
        """Up to ``n`` slots (fewer when the tier is nearly full)."""
        k = min(int(n), self._n)
        self._n -= k
        return self._free[self._n : self._n + k][::-1].copy()

    def give(self, slots: np.ndarray) -> None:
        slots = np.asarray(slots, dtype=np.int64).ravel()
        if slots.size == 0:
            return
        if self._n + slots.size > self.capacity:
            raise ValueError("tier slots freed twice")
        self._free[self._n : self._n + slots.size] = slots[::-1]
        self._n += slots.size
        self._freed.append(slots.copy())

    def drain_freed(self) -> np.ndarray:
        """The slots given back since the last call (each step's plan tells the worker)."""
        out = np.concatenate(self._freed) if self._freed else np.empty(0, np.int64)
        self._freed = []
        return out

    def check_integrity(self, held: np.ndarray) -> None:
        free = self._free[: self._n]
        both = np.concatenate([free, np.asarray(held, dtype=np.int64)])
        if both.size != self.capacity or np.unique(both).size != self.capacity:
            raise ValueError(f"tier slots: {free.size} free + {len(held)} held != {self.capacity}, or overlap")


@dataclass
class Parked:
    """One request's parked tokens, in the order they were parked. ``seq``: the compactor step that parked each
    (one order across requests: when the tier is full the oldest parked tokens of any request go first);
    ``at_step``: the decode step of the decision that parked it (0 at a chunk boundary or a shed), which its
    death keeps if it never comes back; ``score``: its latest score from a window over live and parked keys (the
    best come back first when the pool has room again; 0 until scored)."""

    logical: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    tier: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))  # their tier slots
    at_forward: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))  # first forward without them
    seq: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    at_step: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    score: np.ndarray = field(default_factory=lambda: np.empty(0, np.float64))

    FIELDS = ("logical", "tier", "at_forward", "seq", "at_step", "score")

    @property
    def size(self) -> int:
        return int(self.logical.size)

    def add(self, logical: np.ndarray, tier: np.ndarray, at_forward: int, seq: int = 0, at_step: int = 0) -> None:
        n = len(logical)
        self.logical = np.concatenate([self.logical, logical])
        self.tier = np.concatenate([self.tier, tier])
        self.at_forward = np.concatenate([self.at_forward, np.full(n, at_forward, np.int64)])
        self.seq = np.concatenate([self.seq, np.full(n, seq, np.int64)])
        self.at_step = np.concatenate([self.at_step, np.full(n, at_step, np.int64)])
        self.score = np.concatenate([self.score, np.zeros(n)])

    def drop(self, which: np.ndarray) -> None:
        """Forget the parked tokens at indices ``which`` (restored, or freed for good); the others keep their order."""
        if not len(which):
            return
        keep = np.ones(self.size, dtype=bool)
        keep[np.asarray(which, dtype=np.int64)] = False
        for name in self.FIELDS:
            setattr(self, name, getattr(self, name)[keep])

    def clear(self) -> None:
        self.drop(np.arange(self.size))
