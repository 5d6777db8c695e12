"""/metrics and the capacity stream from one controller snapshot: vLLM's names per replica, a registry per server,
the capacity feed's coalescing, and the Grafana dashboard plotting only exposed series. No Ray."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _snapshot(**pool):
    from actors.report import ReplicaReport, empty_pool
    from cluster.control.replica_status import ReplicaStatus
    from cluster.control.snapshot import ClusterSnapshot, ReplicaSnapshot

    p = empty_pool(32)._replace(**pool)
    report = ReplicaReport("r1", "i", True, False, 0, 1.0, p, prefix_queries=400, prefix_hits=96)
    return ClusterSnapshot(
        (ReplicaSnapshot("r1", ReplicaStatus.HEALTHY, report, 3, prefix_blocks=7),),
        {("free_blocks", "r1"): 5},
        {("out", "manual"): 1},
        1.0,
    )


def test_metrics_render_per_replica_series_with_vllm_names_in_a_registry_of_their_own():
    from prometheus_client.parser import text_string_to_metric_families

    from actors.wire import Chunk, Seq
    from cluster.serving.metrics import Metrics

    a, b = Metrics("m"), Metrics("m")  # two servers in one process share nothing
    t = a.timer("http", 7)
    t.chunk("r1", Chunk((Seq(0, "x", (1, 2)),)))
    t.chunk("r1", Chunk((Seq(0, "y", (3,), finish_reason="stop"),), True))
    t.done("ok")
    snap = _snapshot(running=2, kv_cache_usage=0.5, blocks_reclaimed=4, tokens_moved_total=9, total_blocks=10)
    got = {
        s.name: (s.labels, s.value)
        for f in text_string_to_metric_families(a.render(snap).decode())
        for s in f.samples
        if not s.name.endswith("_created")
    }
    assert got["vllm:num_requests_running"] == ({"model_name": "m", "replica": "r1"}, 2.0)
    assert got["vllm:kv_cache_usage_perc"][1] == 0.5 and got["vtoken:blocks_reclaimed"][1] == 4
    assert got["vtoken:tokens_moved_total"][1] == 9 and got["vtoken:promised_blocks"][1] == 3
    assert got["vllm:generation_tokens_total"][1] == 3 and got["vllm:prompt_tokens_total"][1] == 7
    assert got["vllm:time_to_first_token_seconds_count"][1] == 1
    assert got["vllm:inter_token_latency_seconds_count"][1] == 1
    assert got["vtoken:requests_total"] == ({"door": "http", "status": "ok"}, 1.0)
    assert got["vtoken:placements_total"] == ({"strategy": "free_blocks", "replica": "r1"}, 5.0)
    assert got["vtoken:autoscaler_decisions_total"] == ({"direction": "out", "trigger": "manual"}, 1.0)
    # vLLM's prefix-cache counters as vLLM names them, per replica; the blocks placement knows the cache holds
    assert got["vllm:prefix_cache_queries_total"] == ({"model_name": "m", "replica": "r1"}, 400.0)
    assert got["vllm:prefix_cache_hits_total"][1] == 96 and got["vtoken:prefix_cached_blocks"][1] == 7
    other = [s.name for f in text_string_to_metric_families(b.render(None).decode()) for s in f.samples]
    assert other == ["vtoken:inflight_requests"]  # nothing of a's requests, no replica series without a snapshot


def test_capacity_feed_sends_at_once_then_coalesces_changes_and_stops_polling_without_watchers():
    import asyncio

    from cluster.control.capacity import CapacityFeed

    class Ctl:
        def __init__(self):
            self.free, self.polls = 10, 0
            ctl = self

            class Snapshot:
                def remote(self):
                    ctl.polls += 1
                    fut = asyncio.get_running_loop().create_future()
                    fut.set_result(_snapshot(free_blocks=ctl.free, total_blocks=10))
                    return fut

            self.snapshot = Snapshot()

    async def go():
        ctl = Ctl()
        feed = CapacityFeed(ctl, poll_s=0.01)
        got, times = [], []

        async def watch():
            async for rows in feed.watch(0.3):
                got.append(rows[0].free_blocks)
                times.append(asyncio.get_running_loop().time())

        task = asyncio.ensure_future(watch())
        await asyncio.sleep(0.1)
        for free in (9, 8, 7):  # three changes within one interval: one update, the latest
            ctl.free = free
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.5)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        polls = ctl.polls
        await asyncio.sleep(0.1)
        return got, times, polls, ctl.polls, feed

    got, times, polls, later, feed = asyncio.run(go())
    assert got == [10, 7], got
    assert times[1] - times[0] >= 0.29
    assert later == polls and feed.watchers == 0  # no watcher, no polling


def test_the_grafana_dashboard_plots_only_series_the_server_exposes():
    import json
    import re

    from prometheus_client.parser import text_string_to_metric_families

    from actors.wire import Chunk, Seq
    from cluster.serving.metrics import Metrics

    m = Metrics("m")
    t = m.timer("http", 3)
    t.chunk("r1", Chunk((Seq(0, "x", (1,)),)))
    t.chunk("r1", Chunk((Seq(0, "y", (2,), finish_reason="stop"),), True))
    t.done("ok")
    text = m.render(_snapshot(total_blocks=10)).decode()
    exposed = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    dash = json.loads((ROOT / "configs" / "grafana-vtoken.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {n for e in exprs for n in re.findall(r"\b((?:vllm|vtoken):[a-z_]+)", e)}
    assert used and used <= exposed, used - exposed
    assert {"vtoken:blocks_reclaimed", "vllm:kv_cache_usage_perc"} <= {
        n for t in dash["panels"][0]["targets"] for n in re.findall(r"(?:vllm|vtoken):[a-z_]+", t["expr"])
    }  # the headline: reclaimed blocks against KV usage, per replica
    hit_rate = next(p for p in dash["panels"] if p["title"].startswith("Prefix-cache hit rate"))
    assert {"vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"} <= {
        n for t in hit_rate["targets"] for n in re.findall(r"(?:vllm|vtoken):[a-z_]+", t["expr"])
    }


def test_status_carries_each_replicas_prefix_cache_through_the_proto_and_the_table():
    from cluster.control.status import cluster_status, from_proto, render_table, to_proto

    st = from_proto(to_proto(cluster_status(_snapshot(total_blocks=10))))
    (row,) = st["replicas"]
    assert (row["prefix_queries"], row["prefix_hits"], row["prefix_blocks"]) == (400, 96, 7)
    assert (st["totals"]["prefix_queries"], st["totals"]["prefix_hits"]) == (400, 96)
    table = render_table(st)
    assert "prefix_hit" in table.splitlines()[0] and " 24% " in table  # 96 of 400 tokens
