"""PrefixIndex: what one replica's prefix cache holds, as the controller knows it from the replica's reports.

A replica's reports carry ``PrefixDelta``s (actors/report.py) cut from its PrefixTracker (actors/prefix_tracker.py):
the hashes (vtoken/prefix_hash.py) its cache gained and lost, numbered from 1 for each incarnation. The controller
keeps one index per serving replica and applies the deltas in order. A delta that does not follow the last one
applied (a report lost or timed out, a controller restarted with empty indexes) empties the index and asks for a
snapshot, which replaces it whole: an index that missed a removal would send requests to a replica for blocks it no
longer has, so a gap is never papered over. A new incarnation (a restarted engine), a replica that stops serving
and a replica removed drop the index (cluster/control/controller.py).

Gateways place from copies of these indexes (cluster/placement/placer.py), so a request placed by ``prefix`` needs no
call to the controller. A copy follows its index as the index follows its replica: by the changes applied since the
copy's (``epoch``, ``version``), kept for the last ``LOG`` changes, or by the whole index when the copy is of another
epoch (a snapshot or a gap began a new one) or further behind (``since``, ``follow``). The changes replay in order
with the same bound, so a copy that followed every update holds exactly what its index holds.

Invariants (``check_integrity``): at most ``capacity`` hashes (the replica's pool and a margin; beyond it the
oldest go first); ``seq`` is the last delta applied, -1 while waiting for a snapshot; at most ``LOG`` changes kept,
the last ones of this epoch, ``version`` counting every change of it.
"""

from __future__ import annotations

import collections
import secrets
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from actors.report import PrefixDelta

AWAITING_SNAPSHOT = -1
LOG = 64  # changes kept for copies: a report's worth each, so a copy refreshed ten times a second never falls behind

Change = tuple[tuple[int, ...], tuple[int, ...]]  # (added, removed)


class PrefixUpdate(NamedTuple):
    """What a copy at some (epoch, version) needs to equal its index (``PrefixIndex.since``): ``full``, the whole
    index, oldest first, or None and ``changes`` to apply in order."""

    epoch: int
    version: int
    capacity: int
    full: tuple[int, ...] | None
    changes: tuple[Change, ...] = ()


class PrefixIndex:
    def __init__(self, capacity: int):
        if capacity <= 0:
            raise ValueError(f"PrefixIndex: capacity must be > 0, got {capacity}")
        self.capacity = capacity
        self.seq = 0
        self.hashes: dict[int, None] = {}  # insertion ordered: the oldest first
        self._new_epoch()

    def _new_epoch(self) -> None:
        self.epoch = secrets.randbits(62) + 1  # never 0, the epoch of a copy that holds nothing yet
        self.version = 0
        self.log: collections.deque[Change] = collections.deque(maxlen=LOG)

    def apply(self, d: PrefixDelta) -> bool:
        """Apply one delta; False when it does not follow the last one: the index is then empty until a snapshot. An
        empty delta repeats the last number (nothing changed since): it follows when that number is the last."""
        unchanged = not d.added and not d.removed
        if d.full:
            self.hashes = dict.fromkeys(d.added)
            self._trim()
            self._new_epoch()
        elif self.seq != AWAITING_SNAPSHOT and (d.seq == self.seq + 1 or (unchanged and d.seq == self.seq)):
            if not unchanged:
                self._change(d.added, d.removed)
                self.version += 1
                self.log.append((d.added, d.removed))
        else:
            self.hashes.clear()
            self.seq = AWAITING_SNAPSHOT
            self._new_epoch()
            return False
        self.seq = d.seq
        return True

    def _change(self, added: Iterable[int], removed: Iterable[int]) -> None:
        for h in removed:
            self.hashes.pop(h, None)
        for h in added:
            self.hashes.pop(h, None)  # to the newest end
            self.hashes[h] = None
        self._trim()

    def _trim(self) -> None:
        while len(self.hashes) > self.capacity:
            del self.hashes[next(iter(self.hashes))]

    # ------------------------------------------------------------------ copies (a gateway's)
    def since(self, epoch: int, version: int) -> PrefixUpdate | None:
        """What a copy at (``epoch``, ``version``) needs to equal this index; None when it does already."""
        behind = self.version - version
        if epoch == self.epoch and behind == 0:
            return None
        if epoch == self.epoch and 0 < behind <= len(self.log):
            changes = tuple(self.log)[len(self.log) - behind :]
            return PrefixUpdate(self.epoch, self.version, self.capacity, None, changes)
        return PrefixUpdate(self.epoch, self.version, self.capacity, tuple(self.hashes))

    @classmethod
    def copy_of(cls, u: PrefixUpdate) -> PrefixIndex:
        """An empty copy for ``u``'s index (epoch 0: its first update must be whole)."""
        copy = cls(u.capacity)
        copy.epoch = 0
        return copy

    def follow(self, u: PrefixUpdate) -> None:
        """Apply an update cut by ``since`` for this copy's (epoch, version). One cut for another (epoch, version)
        empties the copy, which then asks for the whole index (epoch 0)."""
        self.capacity = u.capacity
        if u.full is not None:
            self.hashes = dict.fromkeys(u.full)
            self._trim()
        elif u.epoch == self.epoch and u.version - len(u.changes) == self.version:
            for added, removed in u.changes:
                self._change(added, removed)
        else:
            self.hashes.clear()
            self.epoch, self.version = 0, 0
            return
        self.epoch, self.version = u.epoch, u.version

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
        if len(self.log) > min(self.version, LOG):
            raise AssertionError(f"{len(self.log)} changes kept at version {self.version}")


def with_prefix(views: Iterable[Any], indexes: dict[str, PrefixIndex], prefix: Sequence[int]) -> list[Any]:
    """``views`` (cluster/placement/strategies.py's ReplicaView) with how many of the prompt's ``prefix`` blocks each
    replica's index holds: what ``prefix`` placement weighs, in the controller and in a gateway alike."""
    out = []
    for v in views:
        index = indexes.get(v.name)
        hit = index.match(prefix) if index is not None and prefix else 0
        out.append(v.matched(len(prefix), hit))
    return out
