"""ReplicaStatus: where a replica is in its life, and the transitions the controller may make.

    starting --first healthy report--> healthy --call failed, silent, engine died--> dead
    dead --healthy report of the new engine--> healthy;  dead --its engine died again--> dead
    starting, healthy, dead --engine failed to start--> failed
    starting, healthy, dead, failed --scale-in or shutdown--> draining --drained--> removed

Only ``healthy`` serves: placement and the autoscaler see no other replica, and a replica that leaves it holds
no promises (the controller voids them in the same step). ``draining`` and ``failed`` ignore reports.
The values are the strings the status table, ``/metrics`` and the capacity stream have always carried.
"""

from __future__ import annotations

import enum


class ReplicaStatus(enum.StrEnum):
    STARTING = "starting"  # created, its engine not yet reported healthy
    HEALTHY = "healthy"  # reported healthy since its last (re)start: the only status placement sees
    DEAD = "dead"  # a call failed, it went silent or its engine died; restarting
    DRAINING = "draining"  # scale-in or shutdown: no new requests, killed once its in-flight ones are done
    FAILED = "failed"  # its engine could not start (bad model, too small a pool); needs a person

    def serving(self) -> bool:
        """Takes new requests and holds promises."""
        return self is ReplicaStatus.HEALTHY

    def takes_reports(self) -> bool:
        """A report may change its status (a draining or failed replica's reports are ignored)."""
        return self not in (ReplicaStatus.DRAINING, ReplicaStatus.FAILED)

    def active(self) -> bool:
        """Counts towards the target replica count (a draining one is on its way out)."""
        return self is not ReplicaStatus.DRAINING


# Every transition the controller makes, and no other. DEAD -> DEAD: an engine that dies again (a replica
# already marked dead for silence whose engine reports itself down), restarted once more.
TRANSITIONS: dict[ReplicaStatus, frozenset[ReplicaStatus]] = {
    ReplicaStatus.STARTING: frozenset(
        {ReplicaStatus.HEALTHY, ReplicaStatus.DEAD, ReplicaStatus.FAILED, ReplicaStatus.DRAINING}
    ),
    ReplicaStatus.HEALTHY: frozenset({ReplicaStatus.DEAD, ReplicaStatus.FAILED, ReplicaStatus.DRAINING}),
    ReplicaStatus.DEAD: frozenset(
        {ReplicaStatus.HEALTHY, ReplicaStatus.DEAD, ReplicaStatus.FAILED, ReplicaStatus.DRAINING}
    ),
    ReplicaStatus.FAILED: frozenset({ReplicaStatus.DRAINING}),
    ReplicaStatus.DRAINING: frozenset(),  # removed once drained
}


class InvalidTransition(ValueError):
    """A transition not in ``TRANSITIONS``: a bug in the controller, never a replica's fault."""


def check_transition(name: str, frm: ReplicaStatus, to: ReplicaStatus, why: str) -> None:
    """Raise InvalidTransition unless ``frm -> to`` is in the table."""
    if to not in TRANSITIONS[frm]:
        allowed = ", ".join(sorted(TRANSITIONS[frm])) or "nothing"
        raise InvalidTransition(
            f"replica {name}: {frm} -> {to} is not a valid transition ({why}); from {frm} it may go to {allowed}"
        )
