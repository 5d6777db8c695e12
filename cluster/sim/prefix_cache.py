"""A simulated replica's prefix cache: block names (workload.py ``Request.prefix``), least recently used dropped first.

vLLM keeps a block's hash while the block is in use or free but not yet reused, and reuses free blocks least
recently freed first; so at most the pool's blocks are named at once, and a prefix not read for a while goes first.
Modelled as an LRU of ``capacity`` (the pool's blocks) names: a request admitted reads its cached leading blocks
(``match`` and ``touch``), its prompt's blocks are stored when its prefill ends, its answer's whole blocks when it
ends. What the cache gained and lost since the last report is cut as a ``PrefixDelta``, which the simulated
controller applies to the real ``cluster/placement/prefix_index.py`` PrefixIndex, as a replica's report does.

Left out: blocks shared by running requests count once per request in the pool's accounting (the simulated
replica holds a hit's blocks again), so the model errs towards fewer requests fitting, never more.
Invariant (``check_integrity``): at most ``capacity`` names.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

from actors.report import PrefixDelta


class PrefixCache:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self.names: collections.OrderedDict[int, None] = collections.OrderedDict()  # least recently used first
        self.touched: dict[int, bool] = {}  # name -> held at the last cut, for the names changed since
        self.seq = 0

    def match(self, prefix: Sequence[int]) -> int:
        """Leading blocks of ``prefix`` held (vLLM reads from the first block to the first it lacks)."""
        n = 0
        for h in prefix:
            if h not in self.names:
                break
            n += 1
        return n

    def touch(self, prefix: Sequence[int]) -> None:
        for h in prefix:
            self.names.move_to_end(h)

    def store(self, names: Sequence[int]) -> None:
        for h in names:
            if h in self.names:
                self.names.move_to_end(h)
                continue
            self.touched.setdefault(h, False)
            self.names[h] = None
        while len(self.names) > self.capacity:
            h, _ = self.names.popitem(last=False)
            self.touched.setdefault(h, True)

    def cut(self) -> PrefixDelta:
        added = tuple(h for h, was in self.touched.items() if not was and h in self.names)
        removed = tuple(h for h, was in self.touched.items() if was and h not in self.names)
        self.touched.clear()
        if not added and not removed:
            return PrefixDelta(self.seq)
        self.seq += 1
        return PrefixDelta(self.seq, added, removed)

    def check_integrity(self) -> None:
        if len(self.names) > self.capacity:
            raise AssertionError(f"{len(self.names)} names in a cache of {self.capacity}")
