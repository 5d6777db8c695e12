"""Parking: tokens that a prefill chunk boundary drops leave vLLM's pool but are kept, for a while, in a second
tier outside the KV budget (host memory; on a CPU machine a tensor of its own that the pool does not count).
Scheduler side, plain NumPy; the worker's half is vtoken/kv/tier.py.

Why: between prefill chunks a policy can only judge tokens by the attention of the text read so far, before the
question at the end of a prompt is known. A fact that the question will ask for (a needle) is often dropped.
Parked, it is not lost: once the last chunk has run, its observation window holds the question, and the final
survivors are chosen among live AND parked tokens by that window's attention; parked survivors come back into
pool slots, the rest are freed for good. The pool's peak stays bounded (parked tokens hold no pool block), and
the choice sees the question, as decode-only eviction's does.

    chunk boundary   victims -> parked (tier slots while the tier has room; otherwise evicted, as without it)
    the chunk that   ends one token before the prompt does (the scheduler stops the last chunk one token short):
      ends at n - 1  its window is scored over live + parked keys together (one softmax)
    boundary n - 1   policy.select over live + parked: live losers evicted, parked winners restored into the
                     packed request's free slots, parked losers freed (evicted from the forward that parked them)
    token n - 1      its forward samples the first output token, and sees the survivors

The trace says when each restored token was parked and restored, so the masked reference hides it exactly
for the forwards in between (tests/reference.py).
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

    def check_integrity(self, held: np.ndarray) -> None:
        free = self._free[: self._n]
        both = np.concatenate([free, np.asarray(held, dtype=np.int64)])
        if both.size != self.capacity or np.unique(both).size != self.capacity:
            raise ValueError(f"tier slots: {free.size} free + {len(held)} held != {self.capacity}, or overlap")


@dataclass
class Parked:
    """One request's parked tokens, in the order they were parked."""

    logical: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    tier: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))  # their tier slots
    at_forward: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))  # first forward without them

    @property
    def size(self) -> int:
        return int(self.logical.size)

    def add(self, logical: np.ndarray, tier: np.ndarray, at_forward: int) -> None:
        self.logical = np.concatenate([self.logical, logical])
        self.tier = np.concatenate([self.tier, tier])
        self.at_forward = np.concatenate([self.at_forward, np.full(len(logical), at_forward, np.int64)])

    def clear(self) -> None:
        self.logical, self.tier, self.at_forward = (np.empty(0, np.int64) for _ in range(3))
