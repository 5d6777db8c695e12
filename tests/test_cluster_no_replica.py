"""While no replica serves, the doors say so: HTTP 503 "no replica" and gRPC UNAVAILABLE, one line, never a 500
(or INTERNAL); /health 503; `vtoken status` UNAVAILABLE in one line. Two ways to get there: every replica
restarting, and the controller gone for good. Before, a controller gone meant HTTP 500 for every request and a
multi-line ActorDiedError from `vtoken status` (UNKNOWN)."""

from __future__ import annotations

import threading

import grpc
import httpx
import pytest
import ray
from cluster_harness import config, ensure_ray, generate, status, stub, wait_for

from cluster.server import BackgroundServer

pytestmark = pytest.mark.timeout(120)
MSG = [{"role": "user", "content": "hi"}]


def serve(name: str, **over):
    ensure_ray()
    cfg = config(name, gateway={"http_port": "any", "place_timeout_s": 0.3}, **over)
    return BackgroundServer(cfg)


def assert_no_replica(s) -> None:
    url = f"http://127.0.0.1:{s.http_port}"
    r = httpx.post(url + "/v1/chat/completions", json={"messages": MSG, "max_tokens": 2}, timeout=30)
    assert r.status_code == 503 and r.json()["error"]["message"].startswith("no replica: "), r.text
    assert "\n" not in r.json()["error"]["message"]
    with pytest.raises(grpc.RpcError) as e:
        generate(stub(s.port), max_tokens=2)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "no replica" in e.value.details(), e.value.details()
    assert httpx.get(url + "/health", timeout=30).status_code == 503


def test_every_replica_restarting_is_503_not_500():
    fast = {"replica": {"report_interval_s": 0.3}, "placement": {"dead_after_s": 1.5}}
    with serve("none-serving", engine={"fake_start_s": 4.0}, **fast) as s:
        for r in status(stub(s.port))["replicas"]:
            ray.kill(ray.get_actor(r["name"]), no_restart=False)  # Ray restarts them; their engines take 4 s
        wait_for(lambda: all(r["state"] != "healthy" for r in status(stub(s.port))["replicas"]), 20, 0.1,
                 what="both replicas down")  # fmt: skip
        assert_no_replica(s)
        wait_for(lambda: all(r["state"] == "healthy" for r in status(stub(s.port))["replicas"]), 60,
                 what="both replicas serving again")  # fmt: skip
        assert generate(stub(s.port), max_tokens=2)[-1].finished


def test_a_controller_gone_for_good_is_503_and_status_says_so_in_one_line():
    with serve("no-controller", replicas=1) as s:
        ray.kill(s.controller, no_restart=True)  # gone for good: what a controller on a lost node was
        codes: list[int] = []

        def client():
            url = f"http://127.0.0.1:{s.http_port}/v1/chat/completions"
            codes.append(httpx.post(url, json={"messages": MSG, "max_tokens": 2}, timeout=30).status_code)

        threads = [threading.Thread(target=client) for _ in range(4)]
        [t.start() for t in threads]
        [t.join(30) for t in threads]
        assert codes == [503] * 4, codes
        assert_no_replica(s)
        with pytest.raises(grpc.RpcError) as e:
            status(stub(s.port))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "controller is not answering" in e.value.details()
        assert "\n" not in e.value.details(), e.value.details()
    # the controller could not drain them: vtoken serve's own sweep killed the detached replicas
    assert not [n for n in ray.util.list_named_actors() if n.startswith("no-controller-replica-")]
