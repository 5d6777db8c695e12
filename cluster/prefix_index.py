"""PrefixIndex: what one replica's prefix cache holds, as the controller knows it from the replica's reports.

A replica's reports carry ``PrefixDelta``s (actors/report.py) cut from its PrefixTracker (actors/prefix_tracker.py):
the hashes (vtoken/prefix_hash.py) its cache gained and lost, numbered from 1 for each incarnation. The controller
keeps one index per serving replica and applies the deltas in order. A delta that does not follow the last one
applied (a report lost or timed out, a controller restarted with empty indexes) empties the index and asks for a
snapshot, which replaces it whole: an index that missed a removal would send requests to a replica for blocks it no
longer has, so a gap is never papered over. A new incarnation (a restarted engine), a replica that stops serving
and a replica removed drop the index (cluster/controller.py).

Invariants (``check_integrity``): at most ``capacity`` hashes (the replica's pool and a margin; beyond it the
oldest go first); ``seq`` is the last delta applied, -1 while waiting for a snapshot.
"""

from __future__ import annotations

from collections.abc import Sequence

from actors.report import PrefixDelta

AWAITING_SNAPSHOT = -1


class PrefixIndex:
    def __init__(self, capacity: int):
        if capacity <= 0:
            raise ValueError(f"PrefixIndex: capacity must be > 0, got {capacity}")
        self.capacity = capacity
        self.seq = 0
        self.hashes: dict[int, None] = {}  # insertion ordered: the oldest first

    def apply(self, d: PrefixDelta) -> bool:
        """Apply one delta; False when it does not follow the last one: the index is then empty until a snapshot. An
        empty delta repeats the last number (nothing changed since): it follows when that number is the last."""
        unchanged = not d.added and not d.removed
        if d.full:
            self.hashes = dict.fromkeys(d.added)
        elif self.seq != AWAITING_SNAPSHOT and (d.seq == self.seq + 1 or (unchanged and d.seq == self.seq)):
            for h in d.removed:
                self.hashes.pop(h, None)
            for h in d.added:
                self.hashes.pop(h, None)  # to the newest end
                self.hashes[h] = None
        else:
            self.hashes.clear()
            self.seq = AWAITING_SNAPSHOT
            return False
        self.seq = d.seq
        while len(self.hashes) > self.capacity:
            del self.hashes[next(iter(self.hashes))]
        return True

    @property
    def synced(self) -> bool:
        return self.seq != AWAITING_SNAPSHOT

    def match(self, prefix: Sequence[int]) -> int:
        """How many of the leading blocks of a prompt with hashes ``prefix`` the replica holds: vLLM reads a prompt's
        cached blocks from the first on and stops at the first it lacks."""
        n = 0
        for h in prefix:
            if h not in self.hashes:
                break
            n += 1
        return n

    def __len__(self) -> int:
        return len(self.hashes)

    def check_integrity(self) -> None:
        if len(self.hashes) > self.capacity:
            raise AssertionError(f"{len(self.hashes)} hashes, capacity {self.capacity}")
        if self.seq < AWAITING_SNAPSHOT or (self.seq == AWAITING_SNAPSHOT and self.hashes):
            raise AssertionError(f"seq {self.seq} with {len(self.hashes)} hashes")
