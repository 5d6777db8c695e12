"""PrefixTracker: which blocks a replica's prefix cache holds, in the hashes the gateway can compute, and what changed.

vLLM announces its cache as KV events (vllm/distributed/kv_events.py: ``BlockStored`` with the blocks' hashes, their
parent's hash and their token ids; ``BlockRemoved``; ``AllBlocksCleared``), keyed by hashes seeded per process. The
tracker keeps vLLM's hash -> ours (vtoken/prefix_hash.py) for every block the cache holds, so a removal, which names
only vLLM's hash, finds ours. vToken's compactor drops a block that lost or gained tokens from the cache through
vLLM's own ``BlockPool.evict_blocks``, so those removals arrive the same way.

The replica's report loop ``cut``s a ``PrefixDelta`` (actors/report.py) from it: the hashes gained and lost since
the last cut, numbered, or everything held when the controller asks for a snapshot.

Invariants (``check_integrity``): ``held`` counts, per hash of ours, the vLLM blocks that carry it (two vLLM blocks
can carry one: vLLM's hash also covers a cache salt or LoRA, ours only tokens), and nothing else; at most
``capacity`` vLLM blocks are kept (the oldest go first: more than the pool can hold means removals were missed).
A block whose parent is unknown is not kept: no prompt can read it without its parent, nor can we name it.
vLLM does not deduplicate blocks: two requests that computed the same block at once cache it twice under one hash,
and removing one announces the hash as removed; the tracker then forgets it while the other copy may remain, so it
can claim less than the cache holds, never more. Thread-safe: the KV-event subscriber writes while the report loop
cuts.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Hashable, Sequence

from actors.report import PrefixDelta
from vtoken.prefix_hash import ROOT, block_hash


class PrefixTracker:
    def __init__(self, block_size: int, capacity: int):
        if block_size <= 0 or capacity <= 0:
            raise ValueError("PrefixTracker: block_size and capacity must be > 0")
        self.block_size, self.capacity = block_size, capacity
        self.engine: collections.OrderedDict[Hashable, int] = collections.OrderedDict()  # vLLM's -> ours, oldest 1st
        self.held: collections.Counter[int] = collections.Counter()
        self.touched: dict[int, bool] = {}  # ours -> whether it was held at the last cut, for those changed since
        self.seq = 0  # deltas cut so far
        self.ignored = 0  # blocks not kept: another block size, or an unknown parent
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ events
    def stored(self, hashes: Sequence[Hashable], parent: Hashable | None, token_ids: Sequence[int], size: int) -> None:
        """vLLM cached ``hashes``, one per ``size`` tokens of ``token_ids``, after the block hashed ``parent``."""
        with self._lock:
            ours = ROOT if parent is None else self.engine.get(parent)
            if ours is None or size != self.block_size:
                self.ignored += len(hashes)
                return
            for i, h in enumerate(hashes):
                tokens = token_ids[i * size : (i + 1) * size]
                if len(tokens) < size:
                    self.ignored += len(hashes) - i
                    return
                ours = block_hash(ours, tokens)
                self._add(h, ours)

    def removed(self, hashes: Sequence[Hashable]) -> None:
        with self._lock:
            for h in hashes:
                self._drop(h)

    def cleared(self) -> None:
        """Everything is gone (vLLM reset its cache, or events were lost and nothing held can be trusted)."""
        with self._lock:
            for h in list(self.engine):
                self._drop(h)

    def _add(self, h: Hashable, ours: int) -> None:
        old = self.engine.get(h)
        if old == ours:
            self.engine.move_to_end(h)
            return
        if old is not None:
            self._drop(h)
        self._touch(ours)
        self.engine[h] = ours
        self.held[ours] += 1
        while len(self.engine) > self.capacity:
            self._drop(next(iter(self.engine)))

    def _drop(self, h: Hashable) -> None:
        ours = self.engine.pop(h, None)
        if ours is None:
            return
        self._touch(ours)
        self.held[ours] -= 1
        if not self.held[ours]:
            del self.held[ours]

    def _touch(self, ours: int) -> None:
        if ours not in self.touched:
            self.touched[ours] = ours in self.held

    # ------------------------------------------------------------------ deltas
    def pending(self) -> bool:
        """Something changed since the last cut (possibly nothing in the end: a block stored and removed again)."""
        return bool(self.touched)

    def cut(self, full: bool = False) -> PrefixDelta:
        """The change since the last cut, numbered. Nothing changed: an empty delta under the last number, which
        tells a controller that lost its index (restarted) that it has to ask for a snapshot."""
        with self._lock:
            if full:
                delta = PrefixDelta(self.seq + 1, tuple(self.held), (), True)
            else:
                added = tuple(h for h, was in self.touched.items() if not was and h in self.held)
                removed = tuple(h for h, was in self.touched.items() if was and h not in self.held)
                if not added and not removed:
                    self.touched.clear()
                    return PrefixDelta(self.seq)
                delta = PrefixDelta(self.seq + 1, added, removed)
            self.touched.clear()
            self.seq += 1
            return delta

    def hashes(self) -> frozenset[int]:
        with self._lock:
            return frozenset(self.held)

    def check_integrity(self) -> None:
        with self._lock:
            counts = collections.Counter(self.engine.values())
            if counts != self.held:
                raise AssertionError(f"held {dict(self.held)} != the engine's blocks {dict(counts)}")
            if len(self.engine) > self.capacity:
                raise AssertionError(f"{len(self.engine)} blocks kept, capacity {self.capacity}")
