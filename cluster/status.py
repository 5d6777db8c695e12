"""The cluster status: built from the controller's state, carried as a dict and as the proto, shown as a table."""

from __future__ import annotations

import time
from typing import Any

# Status field -> PoolReport field (promised_blocks is the controller's own).
POOL_FIELDS = {
    "free_blocks": "free_blocks",
    "total_blocks": "total_blocks",
    "blocks_reclaimed": "blocks_reclaimed",
    "blocks_freed": "blocks_freed_total",
    "live_tokens": "live_tokens",
    "running": "running",
    "waiting": "waiting",
}
FIELDS = (
    "free_blocks",
    "total_blocks",
    "promised_blocks",
    "blocks_reclaimed",
    "blocks_freed",
    "live_tokens",
    "running",
    "waiting",
)


def cluster_status(ctl) -> dict[str, Any]:
    now = time.monotonic()
    promised: dict[str, int] = {}
    for p in ctl.promises.values():
        promised[p.replica] = promised.get(p.replica, 0) + p.blocks
    rows = []
    for st in sorted(ctl.replicas.values(), key=lambda s: s.name):
        pool = st.report.pool
        row = {
            "name": st.name,
            "state": st.state,
            **{k: int(getattr(pool, f)) for k, f in POOL_FIELDS.items()},
            "report_age_s": round(now - st.reported_at, 2) if st.reported_at else -1.0,
        }
        row["promised_blocks"] = promised.get(st.name, 0)
        rows.append(row)
    live = [r for r in rows if r["state"] == "healthy"]
    totals = {
        "name": "total",
        "state": f"{len(live)}/{len(rows)} healthy",
        **{k: sum(r[k] for r in live) for k in FIELDS},
        "report_age_s": 0.0,
    }
    return {
        "replicas": rows,
        "totals": totals,
        "placement": ctl.cfg.placement.strategy,
        "target_replicas": ctl.target,
        "decisions": list(ctl.decisions),
        "last_recovery_s": ctl.recoveries[-1] if ctl.recoveries else 0.0,
    }


def to_proto(status: dict[str, Any]):
    from cluster.proto import vtoken_pb2 as pb

    return pb.ClusterStatus(
        replicas=[pb.ReplicaStatus(**r) for r in status["replicas"]],
        totals=pb.ReplicaStatus(**status["totals"]),
        placement=status["placement"],
        target_replicas=status["target_replicas"],
        decisions=[pb.ScalingDecision(**d) for d in status["decisions"]],
        last_recovery_s=status["last_recovery_s"],
    )


def from_proto(msg) -> dict[str, Any]:
    from google.protobuf.json_format import MessageToDict

    d = MessageToDict(msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    for row in [*d.get("replicas", []), d.get("totals", {})]:  # JSON carries int64 as strings
        row.update({k: int(row[k]) for k in FIELDS if k in row})
    return d


COLUMNS = (
    ("name", "replica"),
    ("state", "state"),
    ("free_blocks", "free"),
    ("total_blocks", "total"),
    ("promised_blocks", "promised"),
    ("blocks_reclaimed", "reclaimed"),
    ("live_tokens", "live"),
    ("running", "running"),
    ("waiting", "waiting"),
    ("report_age_s", "age_s"),
)


def render_table(status: dict[str, Any]) -> str:
    rows = [*status.get("replicas", []), status.get("totals", {})]
    table = [[h for _, h in COLUMNS]] + [[str(r.get(k, "")) for k, _ in COLUMNS] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.insert(-1, "  ".join("-" * w for w in widths))
    lines.append(
        f"placement: {status.get('placement')}   target replicas: {status.get('target_replicas')}"
        f"   last recovery: {float(status.get('last_recovery_s', 0)):.1f}s"
    )
    for d in status.get("decisions", [])[-5:]:
        when = time.strftime("%H:%M:%S", time.localtime(float(d.get("time", 0))))
        lines.append(f"  {when} {d.get('from_replicas')} -> {d.get('to_replicas')}: {d.get('reason')}")
    return "\n".join(lines)
