"""Prefix-aware placement on real Ray and gRPC with the fake engine (issue 43, items 2-4): a replica's prefix cache
reaches the controller through its reports, a conversation's next turns go where its first turn left its blocks
(round_robin would alternate), and the hit rate shows per replica in `vtoken status` and /metrics."""

from __future__ import annotations

import time

import httpx
import pytest
import ray
from cluster_harness import config, ensure_ray, generate, status, stub, wait_for
from prometheus_client.parser import text_string_to_metric_families

from cluster.control.status import render_table
from cluster.placement.placer import SETTLE_S
from cluster.server import BackgroundServer

pytestmark = pytest.mark.timeout(180)
SYSTEM = "You are a careful assistant. " * 40  # 241 tokens of tiny-llama's tokenizer (the door's): 7 blocks of 32


def test_a_conversation_follows_its_cache_and_the_hit_rate_shows():
    ensure_ray()
    cfg = config("prefix", placement={"strategy": "prefix"}, gateway={"http_port": "any"},
                 engine={"fake_total_blocks": 64})  # fmt: skip
    with BackgroundServer(cfg) as s:
        st = stub(s.port)
        first = generate(st, SYSTEM + "turn 1", max_tokens=2)[-1].replica
        wait_for(lambda: any(r["prefix_blocks"] >= 7 for r in status(st)["replicas"]), what="the cache reported")
        turns = [generate(st, SYSTEM + "turn 1" + " and more" * k, max_tokens=2)[-1].replica for k in range(1, 5)]
        assert turns == [first] * 4, (first, turns)
        # the counters travel with the replica's next report (at least one a second)
        rows = wait_for(lambda: {r["name"]: r for r in status(st)["replicas"] if r["prefix_hits"] >= 4 * 7 * 32},
                        what="the hits reported")  # fmt: skip
        assert rows[first]["prefix_queries"] > rows[first]["prefix_hits"]
        rows = {r["name"]: r for r in status(st)["replicas"]}
        assert "%" in render_table(status(st))
        text = httpx.get(f"http://127.0.0.1:{s.http_port}/metrics", timeout=30).text
        hits = {x.labels["replica"]: x.value for f in text_string_to_metric_families(text) for x in f.samples
                if x.name == "vllm:prefix_cache_hits_total"}  # fmt: skip
        assert hits[first] == rows[first]["prefix_hits"] and set(hits) == set(rows)
        # the same conversation under round_robin is spread over both replicas: the cache is no reason to it
        ray.get(s.controller.set_placement.remote("round_robin"), timeout=30)
        time.sleep(SETTLE_S)  # until the gateway places by the new strategy
        spread = {generate(st, SYSTEM + "turn 1" + " and more" * k, max_tokens=2)[-1].replica for k in range(2)}
        assert len(spread) == 2
