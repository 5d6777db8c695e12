"""Shared helpers for the cluster tests: one Ray instance per test process, configs, gRPC stubs."""

from __future__ import annotations

import os
import time

import grpc

from cluster.config import parse_config
from cluster.proto import vtoken_pb2 as pb
from cluster.proto import vtoken_pb2_grpc as pbg


def ensure_ray():
    import ray

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # Ray starts workers at niceness 15; on a machine shared with other jobs the replicas' engines then get
    # what is left of the CPUs and take minutes to start. Tests run them at the same priority as the rest.
    os.environ.setdefault("RAY_worker_niceness", "0")
    if not ray.is_initialized():
        ray.init(
            address="local",  # a Ray of this test process's own, never one RAY_ADDRESS or `ray start` left behind
            num_cpus=4,
            include_dashboard=False,
            namespace="vtoken-tests",
            log_to_driver=False,
            runtime_env={"env_vars": {"VLLM_LOGGING_LEVEL": "WARNING"}},
        )


def config(name: str, **over):
    raw = {
        "name": name,
        "model": "fake",
        "replicas": 2,
        "replica": {"num_cpus": 0.25},
        "engine": {"kind": "fake", "fake_total_blocks": 16, "fake_token_delay_s": 0.01},
        "gateway": {"port": 0, "http_port": 0},  # no HTTP unless a test asks for it ("any": a free port)
    }
    for k, v in over.items():
        raw[k] = {**raw[k], **v} if isinstance(v, dict) and isinstance(raw.get(k), dict) else v
    return parse_config(raw)


def stub(port: int, **kw):
    return pbg.VTokenStub(grpc.insecure_channel(f"127.0.0.1:{port}", **kw))


def generate(st, prompt="hello there", max_tokens=8, timeout=60, metadata=(), **sampling):
    req = pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(max_tokens=max_tokens, **sampling))
    return list(st.Generate(req, timeout=timeout, metadata=metadata))


def tokens(out) -> list[str]:
    """A stream's text per token (the fake's texts are one token each). Chunk boundaries are no contract: a gateway
    that falls behind merges a request's waiting deltas, as vLLM's AsyncLLM does."""
    return "".join(m.text for m in out).replace(" ", "\0 ").split("\0")[1:]


def status(st, metadata=()):
    from cluster.control.status import from_proto

    return from_proto(st.GetClusterStatus(pb.ClusterStatusRequest(), timeout=30, metadata=metadata))


def wait_for(pred, timeout=60, every=0.2, what="condition"):
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        got = pred()
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
