"""ClusterSnapshot: what the controller tells the gateway for ``/metrics`` and the capacity stream, in one call.

A small named type rather than a stats dict: each replica's state, its last report (the engine's PoolReport
unchanged) and the blocks promised to requests placed there; and the controller's cumulative counts of
placements (by strategy and replica) and scaling decisions (by direction and trigger).
"""

from __future__ import annotations

import collections
import time
from typing import Any, NamedTuple

from actors.report import ReplicaReport


class ReplicaSnapshot(NamedTuple):
    name: str
    state: str  # starting, healthy, dead, draining, failed
    report: ReplicaReport  # the last one received (all zeros before the first)
    promised_blocks: int


class ClusterSnapshot(NamedTuple):
    replicas: tuple[ReplicaSnapshot, ...]  # sorted by name
    placements: dict[tuple[str, str], int]  # (strategy, replica) -> requests placed, since the start
    decisions: dict[tuple[str, str], int]  # (direction "out"|"in", trigger "autoscaler"|"manual") -> count
    time: float  # wall clock


def take_snapshot(ctl: Any) -> ClusterSnapshot:
    promised: collections.Counter[str] = collections.Counter()
    for p in ctl.promises.values():
        promised[p.replica] += p.blocks
    return ClusterSnapshot(
        tuple(
            ReplicaSnapshot(st.name, st.state, st.report, promised[st.name])
            for st in sorted(ctl.replicas.values(), key=lambda s: s.name)
        ),
        dict(ctl.placements),
        dict(ctl.decision_counts),
        time.time(),
    )
