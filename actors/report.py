"""ReplicaReport: what a replica tells the controller, a small named type rather than a stats dict.

The engine's figures travel as the adapter's ``PoolReport`` unchanged; the replica adds who it is and
whether it can serve. A replica without a working engine (starting, restarting after its engine died)
reports ``healthy=False`` with an all-zero pool and says why in ``error``.
"""

from __future__ import annotations

from typing import NamedTuple

from vtoken.pool_report import PoolReport


def empty_pool(block_size: int = 0, running: int = 0) -> PoolReport:
    """All figures zero: no engine, or an engine that cannot report its pool (vToken mode off)."""
    return PoolReport(0, 0, 0.0, running, 0, 0, 0, 0, 0, (), 0, 0, 0, 0.0, 0, block_size)


class ReplicaReport(NamedTuple):
    """A replica's state at ``time`` (wall clock). ``incarnation`` changes with every engine the replica
    builds (a new process, or a restart after its engine died), so the controller can tell a new engine
    from a late report of the old one and drop the promises the old one held."""

    name: str
    incarnation: str
    healthy: bool  # an engine that serves
    draining: bool
    inflight: int  # requests in the replica's generate()
    time: float
    pool: PoolReport
    error: str = ""  # why it is not healthy
    # Where it runs, so an operator can find it (vtoken status, /metrics' vtoken:replica_info): its Ray node's
    # address and id, and its process (a new one after every restart).
    node_ip: str = ""
    node_id: str = ""
    pid: int = 0


def unreported(name: str = "") -> ReplicaReport:
    """What the controller knows of a replica before its first report."""
    return ReplicaReport(name, "", False, False, 0, 0.0, empty_pool())
