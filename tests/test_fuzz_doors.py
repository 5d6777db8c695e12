"""Both doors fuzzed (issue 46): generated bodies (tests/fuzz_bodies.py: vLLM's own protocol models' schemas at
their edges, eviction options valid or not) against the HTTP door and generated protobuf messages and bytes
against the gRPC door, on a service whose gateway renders and tokenizes with a real tokenizer (tiny-llama's,
SmolLM2's) over the fake engine: every request gets a 2xx, or a 4xx in OpenAI's error shape (gRPC: a status
that names the client's error), never a 5xx / INTERNAL, never a stall; afterwards every block is free and the
service answers. Then valid eviction options and sampling at their edges through both doors into a real vLLM
engine (tiny-llama), which must keep serving with no restart. Fixed seeds and budgets (derandomized hypothesis)
keep CI deterministic; ``scripts/fuzz_doors.py`` runs longer."""

from __future__ import annotations

import contextlib
import json
import os

import pytest
from cluster_harness import config, ensure_ray, status, stub, wait_for
from fuzz_bodies import DoorFuzz, grpc_bytes, http_body, valid_options, valid_sampling
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster.server import BackgroundServer

pytestmark = pytest.mark.timeout(900)
EXAMPLES = int(os.environ.get("VTOKEN_FUZZ_EXAMPLES", "120"))
FUZZ = settings(
    max_examples=EXAMPLES,
    derandomize=True,  # the same bodies on every run: a CI run is reproducible
    database=None,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)


@pytest.fixture(scope="module")
def fake_service():
    ensure_ray()
    cfg = config(
        "fuzz-fake",
        model="tiny-llama",  # the fake engine, with tiny-llama's (SmolLM2's) tokenizer and chat template at the door
        replicas=1,
        engine={"kind": "fake", "fake_total_blocks": 64, "fake_token_delay_s": 0.001, "max_model_len": 512},
        gateway={"port": 0, "http_port": "any", "max_request_bytes": 1 << 16},
    )
    with BackgroundServer(cfg, start_timeout_s=120) as served:
        fuzz = DoorFuzz(served.http_port, served.port)
        yield served, fuzz
        fuzz.close()


def every_block_free(port: int) -> bool:
    rows = status(stub(port))["replicas"]
    return bool(rows) and all(r["state"] == "healthy" and r["free_blocks"] == r["total_blocks"] > 0 for r in rows)


def test_generated_http_bodies_get_a_2xx_or_an_openai_4xx_never_a_5xx_or_a_stall(fake_service):
    served, fuzz = fake_service
    kinds = st.sampled_from(["chat", "completion"])

    @FUZZ
    @given(kinds.flatmap(lambda k: st.tuples(st.just(k), http_body(k, "tiny-llama"))), st.booleans())
    def send(kind_body, tokenize):
        kind, body = kind_body
        path = "/tokenize" if tokenize else ("/v1/chat/completions" if kind == "chat" else "/v1/completions")
        fuzz.http_post(path, body)

    send()
    print("http fuzz:", fuzz.counts)
    assert not fuzz.faults, json.dumps(fuzz.counts) + "\n" + "\n".join(fuzz.faults)
    assert fuzz.counts["http"] >= EXAMPLES and fuzz.counts["http_2xx"] > 0


def test_generated_grpc_messages_get_an_answer_or_a_client_error_never_internal_or_a_stall(fake_service):
    served, fuzz = fake_service

    @FUZZ
    @given(grpc_bytes())
    def send(raw):
        fuzz.grpc_generate(raw, deadline_asked=True)  # a message may ask a deadline of 1 ms: then it is exceeded

    send()
    print("grpc fuzz:", fuzz.counts)
    assert not fuzz.faults, json.dumps(fuzz.counts) + "\n" + "\n".join(fuzz.faults)
    assert fuzz.counts["grpc"] >= EXAMPLES and fuzz.counts["grpc_ok"] > 0


def test_after_the_fuzz_every_block_is_free_and_the_service_answers(fake_service):
    import httpx

    served, _ = fake_service
    wait_for(lambda: every_block_free(served.port), timeout=30, what="every block free")
    assert httpx.get(f"http://127.0.0.1:{served.http_port}/health", timeout=1).status_code == 200
    r = httpx.post(f"http://127.0.0.1:{served.http_port}/v1/completions", json={"prompt": "hello", "max_tokens": 2},
                   timeout=10)  # fmt: skip
    assert r.status_code == 200 and r.json()["choices"][0]["text"]


# ------------------------------------------------------------------ into a real engine
ENGINE_EXAMPLES = int(os.environ.get("VTOKEN_FUZZ_ENGINE_EXAMPLES", "40"))


@pytest.fixture(scope="module")
def vllm_service():
    ensure_ray()
    cfg = config(
        "fuzz-vllm",
        model="tiny-llama",
        replicas=1,
        replica={"num_cpus": 1},
        # A small pool (64 blocks of 32 tokens): requests sent together run short, so sheds and parking run too.
        engine={"kind": "vllm", "max_model_len": 512, "kv_cache_memory_bytes": 4 << 20},
        vtoken={"mode": "vtoken", "prefill_chunk": 64},
        gateway={"port": 0, "http_port": "any"},
    )
    with BackgroundServer(cfg, start_timeout_s=300) as served:
        fuzz = DoorFuzz(served.http_port, served.port, stall_s=60)
        yield served, fuzz
        fuzz.close()


@pytest.mark.vllm
def test_valid_options_and_sampling_at_their_edges_reach_the_engine_and_it_keeps_serving(vllm_service):
    """Eviction options and sampling that every check accepts, at the edges of their ranges (tests/fuzz_bodies.py
    valid_options, valid_sampling), one to four requests at once through both doors into vLLM with vToken: no 5xx,
    no stall, the engine never dies (the replica's process is the same at the end), every block free after."""
    from concurrent.futures import ThreadPoolExecutor

    from cluster.proto import vtoken_pb2 as pb

    served, fuzz = vllm_service
    start = status(stub(served.port))["replicas"][0]
    prompts = st.sampled_from(["The capital of France is", "Once upon a time " * 20, "a b c d e " * 60, "Hi"])
    one = st.tuples(st.sampled_from(["http", "grpc"]), prompts, valid_sampling(), valid_options())

    def send(door, prompt, sampling, options):
        if door == "http":
            fuzz.http_post("/v1/completions", {"model": "tiny-llama", "prompt": prompt, **sampling, "vtoken": options})
            return
        req = pb.GenerateRequest(prompt=prompt)
        for k, v in sampling.items():
            target = getattr(req.sampling, k)
            if isinstance(v, dict):
                target.update({int(t): b for t, b in v.items()})
            elif isinstance(v, list):
                target.extend(v)
            else:
                setattr(req.sampling, k, v)
        for k, v in options.items():
            if k == "policy_params":
                req.vtoken.policy_params.update(v)
            elif k != "interval" or v != "block":  # VTokenOptions.interval is a count
                with contextlib.suppress(ValueError):  # a seed of 2**64 - 1 does not fit VTokenOptions' int64
                    setattr(req.vtoken, k, v)
        fuzz.grpc_generate(req.SerializeToString())

    @settings(FUZZ, max_examples=ENGINE_EXAMPLES)
    @given(st.lists(one, min_size=1, max_size=4))
    def batch(requests):
        with ThreadPoolExecutor(len(requests)) as pool:
            list(pool.map(lambda r: send(*r), requests))

    batch()
    print("engine fuzz:", fuzz.counts)
    assert not fuzz.faults, json.dumps(fuzz.counts) + "\n" + "\n".join(fuzz.faults)
    assert fuzz.counts["http_2xx"] + fuzz.counts["grpc_ok"] > 0
    wait_for(lambda: every_block_free(served.port), timeout=60, what="every block free")
    end = status(stub(served.port))["replicas"][0]
    assert (end["state"], end["pid"]) == ("healthy", start["pid"]), "the engine died and its replica restarted"
