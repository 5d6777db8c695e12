"""Where replicas run: `vtoken status` (table and --json) and /metrics name each replica's node (its address and
Ray node id) and its process, and where the controller runs. (On two nodes: tests/test_cluster_node_loss.py.)"""

from __future__ import annotations

import httpx
import pytest
import ray
from cluster_harness import config, ensure_ray, status, stub
from prometheus_client.parser import text_string_to_metric_families

from cluster.control.status import render_table
from cluster.server import BackgroundServer

pytestmark = pytest.mark.timeout(120)


def test_status_and_metrics_name_each_replicas_node_and_process():
    ensure_ray()
    with BackgroundServer(config("where", gateway={"http_port": "any"})) as s:
        st = status(stub(s.port))
        node = ray.get_runtime_context().get_node_id()  # one node here: the test's own Ray
        for r in st["replicas"]:
            incarnation = ray.get(ray.get_actor(r["name"]).ping.remote(), timeout=30)["incarnation"]
            assert r["pid"] == int(incarnation.split("-")[0])  # the replica actor's own process
            assert r["node_id"] == node and r["node_ip"] == ray.util.get_node_ip_address()
        assert len({r["pid"] for r in st["replicas"]}) == 2  # a process each
        assert st["controller_node_id"] == node and st["controller_pid"] not in {r["pid"] for r in st["replicas"]}
        table = render_table(st)
        assert " node " in table.splitlines()[0] and "node_id" in table and "pid" in table
        assert all(f"{r['node_id'][:8]}  {r['pid']}" in table for r in st["replicas"])
        assert f"controller: node {st['controller_node_ip']} {node[:8]}, pid {st['controller_pid']}" in table
        text = httpx.get(f"http://127.0.0.1:{s.http_port}/metrics", timeout=30).text
        info = {x.labels["replica"]: x.labels for f in text_string_to_metric_families(text) for x in f.samples
                if f.name == "vtoken:replica_info"}  # fmt: skip
        for r in st["replicas"]:
            assert info[r["name"]]["node_id"] == node and info[r["name"]]["pid"] == str(r["pid"])
            assert info[r["name"]]["node_ip"] == r["node_ip"] and info[r["name"]]["state"] == "healthy"
