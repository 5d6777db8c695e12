"""The cluster status: built from the controller's snapshot, carried as a dict and as the proto, shown as a table."""

from __future__ import annotations

import time
from typing import Any

from cluster.control.replica_status import ReplicaStatus
from cluster.control.snapshot import ClusterSnapshot

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
    "prefix_queries",
    "prefix_hits",
    "prefix_blocks",
)


def cluster_status(snap: ClusterSnapshot) -> dict[str, Any]:
    """The status dict (what ``to_proto`` carries) from the controller's snapshot; states as plain strings."""
    rows = []
    for r in snap.replicas:
        pool = r.report.pool
        rows.append(
            {
                "name": r.name,
                "state": str(r.state),
                **{k: int(getattr(pool, f)) for k, f in POOL_FIELDS.items()},
                "report_age_s": round(r.report_age_s, 2) if r.report_age_s >= 0 else -1.0,
                "promised_blocks": r.promised_blocks,
                # its prefix cache: vLLM's counters (prompt tokens looked up, found), the blocks placement knows of
                "prefix_queries": r.report.prefix_queries,
                "prefix_hits": r.report.prefix_hits,
                "prefix_blocks": r.prefix_blocks,
                # where it runs (from its last report; empty before the first)
                "node_ip": r.report.node_ip,
                "node_id": r.report.node_id,
                "pid": r.report.pid,
            }
        )
    live = [row for r, row in zip(snap.replicas, rows) if r.state.serving()]
    totals = {
        "name": "total",
        "state": f"{len(live)}/{len(rows)} {ReplicaStatus.HEALTHY}",
        **{k: sum(row[k] for row in live) for k in FIELDS},
        "report_age_s": 0.0,
    }
    return {
        "replicas": rows,
        "totals": totals,
        "placement": snap.strategy,
        "target_replicas": snap.target,
        "decisions": list(snap.recent_decisions),
        "last_recovery_s": snap.last_recovery_s,
        "controller_node_ip": snap.controller[0],
        "controller_node_id": snap.controller[1],
        "controller_pid": snap.controller[2],
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
        controller_node_ip=status.get("controller_node_ip", ""),
        controller_node_id=status.get("controller_node_id", ""),
        controller_pid=status.get("controller_pid", 0),
    )


def from_proto(msg) -> dict[str, Any]:
    from google.protobuf.json_format import MessageToDict

    d = MessageToDict(msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    for row in [*d.get("replicas", []), d.get("totals", {})]:  # JSON carries int64 as strings
        row.update({k: int(row[k]) for k in (*FIELDS, "pid") if k in row})
    for k in ("node_ip", "node_id", "pid"):  # the totals row runs nowhere
        d.get("totals", {}).pop(k, None)
    if "controller_pid" in d:
        d["controller_pid"] = int(d["controller_pid"])
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
    ("prefix_hit_rate", "prefix_hit"),
    ("prefix_blocks", "cached"),
    ("report_age_s", "age_s"),
    ("node_ip", "node"),
    ("node_id", "node_id"),
    ("pid", "pid"),
)
SHORT_ID = 8  # a node id in the table: its first 8 hex digits, enough to tell nodes apart (--json: all of it)


def render_table(status: dict[str, Any]) -> str:
    rows = [*status.get("replicas", []), status.get("totals", {})]
    table = [[h for _, h in COLUMNS]] + [[_cell(r, k) for k, _ in COLUMNS] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.insert(-1, "  ".join("-" * w for w in widths))
    lines.append(
        f"placement: {status.get('placement')}   target replicas: {status.get('target_replicas')}"
        f"   last recovery: {float(status.get('last_recovery_s', 0)):.1f}s"
    )
    if status.get("controller_pid"):
        lines.append(
            f"controller: node {status.get('controller_node_ip')} {str(status.get('controller_node_id'))[:SHORT_ID]}"
            f", pid {status.get('controller_pid')}"
        )
    for d in status.get("decisions", [])[-5:]:
        when = time.strftime("%H:%M:%S", time.localtime(float(d.get("time", 0))))
        lines.append(f"  {when} {d.get('from_replicas')} -> {d.get('to_replicas')}: {d.get('reason')}")
    return "\n".join(lines)


def hit_rate(row: dict[str, Any]) -> float | None:
    """The share of prompt tokens looked up in the prefix cache that were found there (None: none looked up)."""
    queries = int(row.get("prefix_queries") or 0)
    return int(row.get("prefix_hits") or 0) / queries if queries else None


def _cell(row: dict[str, Any], key: str) -> str:
    if key == "prefix_hit_rate":
        rate = hit_rate(row)
        return "-" if rate is None else f"{100 * rate:.0f}%"
    value = row.get(key, "")
    if key == "node_id":
        return str(value)[:SHORT_ID]
    if key == "pid" and not value:
        return ""  # no report yet, or the totals row
    return str(value)
