"""The cluster on real Ray and real gRPC with the fake engine (no vLLM): bad input, overload, cancel,
deadlines, auth, health and reflection, manual and automatic scaling, drains that free every block."""

from __future__ import annotations

import threading

import grpc
import pytest
from cluster_harness import config, ensure_ray, generate, status, stub, tokens, wait_for

from cluster.proto import vtoken_pb2 as pb
from cluster.server import BackgroundServer

pytestmark = pytest.mark.timeout(180)
Code = grpc.StatusCode


@pytest.fixture(scope="module")
def served():
    ensure_ray()
    with BackgroundServer(config("fake", gateway={"max_inflight": 6, "max_request_bytes": 4096})) as s:
        yield s
    assert s.final_reports and all(r.pool.free_blocks == r.pool.total_blocks for r in s.final_reports)


def test_streams_and_reports(served):
    out = generate(stub(served.port), max_tokens=5)
    assert tokens(out) == [" t0", " t1", " t2", " t3", " t4"] and out[-1].finished
    st = status(stub(served.port))
    assert len(st["replicas"]) == 2 and st["totals"]["total_blocks"] == 32


@pytest.mark.parametrize(
    "sampling, prompt, code, needle",
    [
        ({}, "", Code.INVALID_ARGUMENT, "prompt: Either prompt or prompt_embeds must be provided"),
        ({"temperature": -0.5}, "hi", Code.INVALID_ARGUMENT, "temperature"),
        ({"top_k": -7}, "hi", Code.INVALID_ARGUMENT, "top_k"),
        ({"max_tokens": 2_000_000_000}, "hi", Code.INVALID_ARGUMENT, "cannot be greater than max_model_len"),
        ({}, "x" * 5000, Code.RESOURCE_EXHAUSTED, ""),  # over max_request_bytes
    ],
)
def test_bad_input_is_refused_and_the_server_keeps_serving(served, sampling, prompt, code, needle):
    with pytest.raises(grpc.RpcError) as e:
        generate(stub(served.port), prompt=prompt, **sampling)
    assert e.value.code() == code and needle in e.value.details()
    assert generate(stub(served.port), max_tokens=2)[-1].finished


@pytest.mark.parametrize(
    "raw, needle",
    [
        (b"\x12\xff\xff", "malformed"),
        (pb.GenerateRequest(prompt="hi").SerializeToString() + b"\xa8\x06\x01", "unknown field"),
    ],
)
def test_malformed_and_unknown_fields(served, raw, needle):
    ch = grpc.insecure_channel(f"127.0.0.1:{served.port}")
    call = ch.unary_stream("/vtoken.v1.VToken/Generate", request_serializer=None, response_deserializer=None)
    with pytest.raises(grpc.RpcError) as e:
        list(call(raw, timeout=10))
    assert e.value.code() == Code.INVALID_ARGUMENT and needle in e.value.details()


def test_overload_is_bounded(served):
    results = []

    def one():
        try:
            generate(stub(served.port), max_tokens=60)
            results.append("OK")
        except grpc.RpcError as e:
            results.append(e.code().name)

    threads = [threading.Thread(target=one) for _ in range(16)]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    assert len(results) == 16 and set(results) == {"OK", "RESOURCE_EXHAUSTED"}
    assert results.count("OK") >= 6


def test_streams_sharing_a_client_request_id_are_independent(served):
    """Four streams with the same client request_id: cancelling one leaves the others whole. The gateway keys
    engine requests and promises by an id of its own and keeps the client's id in the responses."""
    s = stub(served.port)
    req = pb.GenerateRequest(request_id="same", prompt="hi", sampling=pb.SamplingParams(max_tokens=40))
    calls = [s.Generate(req, timeout=60) for _ in range(4)]
    firsts = [next(c) for c in calls]
    calls[0].cancel()
    for c, first in zip(calls[1:], firsts[1:]):
        msgs = [first, *c]
        assert sum(len(m.token_ids) for m in msgs) == 40 and msgs[-1].finish_reason == "length"
        assert {m.request_id for m in msgs} == {"same"}
    wait_for(lambda: status(s)["totals"]["free_blocks"] == 32, 10, what="blocks back")


def test_a_stream_the_server_aborts_ends_in_an_error_not_ok():
    """A drain that runs out of time aborts the requests in flight: their streams end UNAVAILABLE, never OK
    with a truncated completion (vLLM's finish_reason "abort")."""
    import ray

    ensure_ray()
    with BackgroundServer(config("fake-abort", replicas=1)) as s:
        st = stub(s.port)
        call = st.Generate(pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=400)), timeout=60)
        got = [next(call), next(call)]
        replica = ray.get_actor(status(st)["replicas"][0]["name"])
        ray.get(replica.drain.remote(0.1), timeout=30)
        with pytest.raises(grpc.RpcError) as e:
            got.extend(call)
        assert e.value.code() == Code.UNAVAILABLE and "abort" in e.value.details(), e.value.details()
        assert len(got) < 400


def test_cancel_and_deadline_free_blocks(served):
    s = stub(served.port)
    call = s.Generate(pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=500)))
    next(call), next(call)
    call.cancel()
    wait_for(
        lambda: status(s)["totals"]["free_blocks"] == 32 and status(s)["totals"]["running"] == 0,
        10,
        what="blocks back after cancel",
    )
    with pytest.raises(grpc.RpcError) as e:
        generate(s, max_tokens=500, timeout=0.5)
    assert e.value.code() == Code.DEADLINE_EXCEEDED
    with pytest.raises(grpc.RpcError) as e:
        list(
            s.Generate(
                pb.GenerateRequest(prompt="hi", deadline_ms=300, sampling=pb.SamplingParams(max_tokens=500)), timeout=30
            )
        )
    assert e.value.code() == Code.DEADLINE_EXCEEDED
    wait_for(lambda: status(s)["totals"]["free_blocks"] == 32, 10, what="blocks back after deadlines")


def test_health_and_reflection(served):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    ch = grpc.insecure_channel(f"127.0.0.1:{served.port}")
    h = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="vtoken.v1.VToken"), timeout=5)
    assert h.status == health_pb2.HealthCheckResponse.SERVING
    resp = next(
        reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
        )
    )
    assert "vtoken.v1.VToken" in {s.name for s in resp.list_services_response.service}


def test_bearer_token_on_every_call_but_health(monkeypatch):
    """Every call needs the token, the scheme in any case (RFC 7235); health checks are open by default
    (load-balancer probes cannot send a token)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    ensure_ray()
    monkeypatch.setenv("VTOKEN_TEST_TOKEN", "s3cret")
    with BackgroundServer(config("fake-auth", replicas=1, gateway={"auth_token_env": "VTOKEN_TEST_TOKEN"})) as s:
        for md in ((), (("authorization", "Bearer wrong"),), (("authorization", "s3cret"),)):
            with pytest.raises(grpc.RpcError) as e:
                generate(stub(s.port), metadata=md)
            assert e.value.code() == Code.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as e:
                status(stub(s.port), metadata=md)
            assert e.value.code() == Code.UNAUTHENTICATED
        for scheme in ("Bearer", "bearer", "BEARER"):
            assert generate(stub(s.port), metadata=(("authorization", f"{scheme} s3cret"),))[-1].finished
        ch = grpc.insecure_channel(f"127.0.0.1:{s.port}")
        h = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert h.status == health_pb2.HealthCheckResponse.SERVING


def test_live_scale_out_then_in_by_free_capacity():
    """Autoscaling on: a burst that fills the pool scales out (a new replica serves); idle capacity scales in."""
    ensure_ray()
    cfg = config(
        "fake-auto",
        replicas=1,
        engine={"fake_token_delay_s": 0.02},
        autoscaling={
            "enabled": True,
            "min_replicas": 1,
            "max_replicas": 2,
            "sustain_s": 0.5,
            "cooldown_s": 2,
            "low_watermark": 0.3,
        },
    )
    with BackgroundServer(cfg) as s:
        st = stub(s.port)
        threads = [
            threading.Thread(target=generate, args=(st,), kwargs={"max_tokens": 150, "prompt": "x" * 100})
            for _ in range(6)
        ]
        [t.start() for t in threads]
        grown = wait_for(
            lambda: (lambda x: x if sum(r["state"] == "healthy" for r in x["replicas"]) == 2 else None)(status(st)),
            60,
            what="scale out to 2 healthy replicas",
        )
        assert any("scale out" in d["reason"] for d in grown["decisions"])
        [t.join(60) for t in threads]
        shrunk = wait_for(
            lambda: (lambda x: x if len(x["replicas"]) == 1 else None)(status(st)), 60, what="scale in to 1 replica"
        )
        assert any("scale in" in d["reason"] for d in shrunk["decisions"])
        assert generate(st, max_tokens=3)[-1].finished
    assert all(r.pool.free_blocks == r.pool.total_blocks for r in s.final_reports)


def test_manual_scale(served):
    s = stub(served.port)
    assert s.Scale(pb.ScaleRequest(replicas=3), timeout=10).target_replicas == 3
    wait_for(lambda: sum(r["state"] == "healthy" for r in status(s)["replicas"]) == 3, 60, what="3 replicas")
    s.Scale(pb.ScaleRequest(replicas=2), timeout=10)
    wait_for(lambda: len(status(s)["replicas"]) == 2, 60, what="back to 2")
    with pytest.raises(grpc.RpcError) as e:
        s.Scale(pb.ScaleRequest(replicas=0), timeout=10)
    assert e.value.code() == Code.INVALID_ARGUMENT
    try:
        with pytest.raises(grpc.RpcError) as e:  # bounded by autoscaling.max_replicas (4 by default)
            s.Scale(pb.ScaleRequest(replicas=5), timeout=10)
        assert e.value.code() == Code.INVALID_ARGUMENT and "between 1 and 4" in e.value.details()
        assert "autoscaling.max_replicas" in e.value.details()
    finally:
        s.Scale(pb.ScaleRequest(replicas=2), timeout=10)
    assert status(s)["target_replicas"] == 2


def test_killed_replica_loses_no_unstarted_request_and_serves_again(served):
    """Ray restarts the killed process, the controller rebuilds its engine; requests arriving meanwhile go to
    the live replica, streams under way on the dead one end UNAVAILABLE."""
    import ray

    s = stub(served.port)
    outcomes: list[str] = []

    def one():
        try:
            generate(s, max_tokens=40, timeout=60)
            outcomes.append("OK")
        except grpc.RpcError as e:
            outcomes.append(e.code().name)

    threads = [threading.Thread(target=one) for _ in range(3)]  # max_inflight is 6
    [t.start() for t in threads]
    victim = wait_for(
        lambda: next((r["name"] for r in status(s)["replicas"] if r["running"] > 0), None),
        10,
        0.05,
        what="a busy replica",
    )
    ray.kill(ray.get_actor(victim), no_restart=False)
    late = [threading.Thread(target=one) for _ in range(3)]
    [t.start() for t in late]
    [t.join(60) for t in threads + late]
    assert len(outcomes) == 6 and set(outcomes) <= {"OK", "UNAVAILABLE"} and outcomes.count("OK") >= 3
    wait_for(
        lambda: [r["state"] for r in status(s)["replicas"]] == ["healthy", "healthy"],
        60,
        0.2,
        what="the killed replica serving again",
    )
    assert 0 < status(s)["last_recovery_s"] < 60
