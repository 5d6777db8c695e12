"""ClusterSnapshot: the controller's state in one read, for status, ``/metrics``, the capacity stream,
placement and the autoscaler alike.

A small named type rather than a stats dict: each replica's status, its last report (the engine's PoolReport
unchanged), the report's age and the blocks promised to requests placed there; the controller's cumulative
counts of placements (by strategy and replica) and scaling decisions (by direction and trigger); and what
the status table adds (strategy, target, recent decisions, last recovery). ``replica_views`` turns it into
what placement and the autoscaler decide on, so they see the replicas exactly as status and metrics show them.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

from actors.report import ReplicaReport
from cluster.control.replica_status import ReplicaStatus
from cluster.placement.strategies import ReplicaView, promised_per_replica


class ReplicaSnapshot(NamedTuple):
    name: str
    state: ReplicaStatus  # a str enum: "starting", "healthy", "dead", "draining", "failed"
    report: ReplicaReport  # the last one received (all zeros before the first)
    promised_blocks: int
    report_age_s: float = -1.0  # seconds since the last report was received, -1 before the first
    promised_requests: int = 0  # the requests those promised blocks belong to
    promised_tokens: int = 0  # their prompts and max_tokens: work left there that no report counts yet
    prefix_blocks: int = (
        0  # blocks of its prefix cache the controller's index holds (cluster/placement/prefix_index.py)
    )


class ClusterSnapshot(NamedTuple):
    replicas: tuple[ReplicaSnapshot, ...]  # sorted by name
    placements: dict[tuple[str, str], int]  # (strategy, replica) -> requests placed, since the start
    decisions: dict[tuple[str, str], int]  # (direction "out"|"in", trigger "autoscaler"|"manual") -> count
    time: float  # wall clock
    strategy: str = ""  # the placement strategy now
    target: int = 0  # the target replica count now
    recent_decisions: tuple[dict[str, Any], ...] = ()  # the last few scaling decisions, oldest first
    last_recovery_s: float = 0.0  # seconds from the last replica death to serving again (0: none yet)
    controller: tuple[str, str, int] = ("", "", 0)  # where the controller runs: node ip, node id, pid


def take_snapshot(ctl: Any) -> ClusterSnapshot:
    now = time.monotonic()
    promised, pending, tokens = promised_per_replica(ctl.promises.values())
    return ClusterSnapshot(
        tuple(
            ReplicaSnapshot(
                st.name,
                st.state,
                st.report,
                promised[st.name],
                now - st.reported_at if st.reported_at else -1.0,
                pending[st.name],
                tokens[st.name],
                len(ctl.prefix[st.name]) if st.name in getattr(ctl, "prefix", {}) else 0,
            )
            for st in sorted(ctl.replicas.values(), key=lambda s: s.name)
        ),
        dict(ctl.placements),
        dict(ctl.decision_counts),
        time.time(),
        ctl.cfg.placement.strategy,
        ctl.target,
        tuple(ctl.decisions),
        ctl.lifecycle.recoveries[-1] if ctl.lifecycle.recoveries else 0.0,
        getattr(ctl, "where", ("", "", 0)),
    )


def replica_views(snap: ClusterSnapshot, stale_after_s: float) -> list[ReplicaView]:
    """The serving replicas as placement and the autoscaler see them; a report older than ``stale_after_s``
    (or none at all) is stale."""
    return [
        ReplicaView(
            r.name,
            p.free_blocks,
            p.total_blocks,
            r.promised_blocks,
            p.running,
            p.waiting,
            p.blocks_reclaimed,
            not 0 <= r.report_age_s <= stale_after_s,
            r.promised_requests,
            p.tokens_to_go + r.promised_tokens,
        )
        for r in snap.replicas
        if r.state.serving()
        for p in (r.report.pool,)
    ]
