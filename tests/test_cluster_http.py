"""The OpenAI-compatible HTTP door, /metrics and the capacity stream on real Ray with the fake engine (no vLLM):
the official `openai` client (chat and completion, whole and streamed, log-probabilities), a request's own
eviction options reaching the engine through both doors, bad input in OpenAI's error JSON with the right status,
the bearer token, the admission limit, a client that disconnects freeing its blocks, Prometheus' text parser on
/metrics, and WatchCapacity's updates. The same on tiny-llama: tests/test_cluster_e2e.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import grpc
import httpx
import openai
import pytest
from cluster_harness import config, ensure_ray, status, stub, wait_for
from prometheus_client.parser import text_string_to_metric_families

from cluster.config import PlacementConfig
from cluster.proto import vtoken_pb2 as pb
from cluster.server import BackgroundServer

pytestmark = pytest.mark.timeout(180)
TOKEN = "s3cret-http"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MSG = [{"role": "user", "content": "hi"}]
# vLLM's names (and meanings) where vLLM has one, vToken's own under vtoken:
METRICS = {
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:num_preemptions",
    "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds", "vllm:request_success",
    "vtoken:blocks_reclaimed", "vtoken:retained_blocks", "vtoken:naive_retained_blocks", "vtoken:live_tokens",
    "vtoken:fragmentation_ratio", "vtoken:tokens_moved", "vtoken:tokens_evicted", "vtoken:compaction_seconds",
    "vtoken:blocks_freed", "vtoken:free_blocks", "vtoken:total_blocks", "vtoken:requests", "vtoken:placements",
    "vtoken:autoscaler_decisions", "vtoken:tokens_to_go",
}  # fmt: skip


@pytest.fixture(scope="module")
def served():
    ensure_ray()
    os.environ["VTOKEN_HTTP_TEST_TOKEN"] = TOKEN
    cfg = config(
        "http",
        # streaming collects no attention scores: h2o per request must be refused, by both doors alike
        vtoken={"mode": "vtoken", "policy": "streaming", "budget": 0.5},
        engine={"fake_reclaim_fraction": 0.5},
        gateway={
            "http_port": "any",
            "auth_token_env": "VTOKEN_HTTP_TEST_TOKEN",
            "max_inflight": 6,
            "max_request_bytes": 200_000,
        },
    )
    try:
        with BackgroundServer(cfg) as s:
            s.url = f"http://127.0.0.1:{s.http_port}"
            s.client = openai.OpenAI(base_url=s.url + "/v1", api_key=TOKEN, max_retries=0, timeout=60)
            yield s
    finally:
        os.environ.pop("VTOKEN_HTTP_TEST_TOKEN", None)
    assert s.final_reports and all(r.pool.free_blocks == r.pool.total_blocks for r in s.final_reports)


def post(served, path, body, token=TOKEN, **kw):
    headers = {"content-type": "application/json", **({"authorization": f"Bearer {token}"} if token else {})}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(served.url + path, content=content, headers=headers, timeout=60, **kw)


def scrape(served) -> dict:
    """Sample name -> [(labels, value)], and the family names under "families", through prometheus_client's
    own text parser."""
    r = httpx.get(served.url + "/metrics", headers={"authorization": f"Bearer {TOKEN}"}, timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out: dict = {"families": set()}
    for f in text_string_to_metric_families(r.text):
        out["families"].add(f.name)
        for s in f.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def count(m: dict, name: str, **labels) -> float:
    return sum(v for lab, v in m.get(name, []) if labels.items() <= lab.items())


def engine_requests(served) -> list[dict]:
    """What every request reaching a replica's engine arrived with (the fake engine's record)."""
    import ray

    names = [r["name"] for r in status(stub(served.port), AUTH)["replicas"]]
    return [x for n in names for x in ray.get(ray.get_actor(n).stats.remote(), timeout=30)["requests"]]


def test_openai_client_chat_and_completions_whole_and_streamed(served):
    c = served.client
    assert [m.id for m in c.models.list().data] == ["fake"]
    r = c.chat.completions.create(model="fake", messages=MSG, max_tokens=5, temperature=0, seed=7)
    assert r.choices[0].message.content == " t0 t1 t2 t3 t4" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5 and r.usage.prompt_tokens > 0 and r.id.startswith("chatcmpl-")
    chunks = list(
        c.chat.completions.create(
            model="fake", messages=MSG, max_completion_tokens=3, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == " t0 t1 t2"
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 3 and not chunks[-1].choices
    assert len({ch.id for ch in chunks}) == 1
    r = c.completions.create(model="fake", prompt="hello", max_tokens=4, logprobs=2, stop=["never"], top_p=0.9)
    assert r.choices[0].text == " t0 t1 t2 t3" and r.choices[0].logprobs.tokens == [" t0", " t1", " t2", " t3"]
    assert len(r.choices[0].logprobs.top_logprobs[0]) == 2
    parts = [ch.choices[0].text for ch in c.completions.create(model="fake", prompt="hello", max_tokens=3, stream=True)]
    assert "".join(parts) == " t0 t1 t2"  # chunk boundaries are no contract (a loaded gateway merges deltas)
    r = c.chat.completions.create(model="fake", messages=MSG, max_tokens=2, logprobs=True, top_logprobs=3)
    lp = r.choices[0].logprobs.content
    assert [t.token for t in lp] == [" t0", " t1"] and len(lp[0].top_logprobs) == 3 and lp[0].logprob == -0.5
    # what reached the engine: the sampling the client chose
    seen = engine_requests(served)
    assert any(x.get("seed") == 7 and x.get("temperature") == 0 and x["max_tokens"] == 5 for x in seen)
    assert any(x.get("stop") == ["never"] and x.get("top_p") == 0.9 and x.get("logprobs") == 2 for x in seen)


def test_vllms_sampling_fields_reach_the_engine_through_both_doors(served):
    """What vLLM's own benchmark client sends (repetition_penalty 1.0, the neutral value) is served, and the
    other sampling fields vLLM honours arrive at the replica as the client set them, by HTTP and by gRPC."""
    r = post(served, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "repetition_penalty": 1.0, "stream": True,
                                         "stream_options": {"include_usage": True}})  # fmt: skip
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n"), r.text
    body = {"max_tokens": 2, "min_p": 0.25, "repetition_penalty": 1.5, "min_tokens": 1, "stop_token_ids": [3]}
    served.client.chat.completions.create(model="fake", messages=MSG, seed=123, extra_body=body)
    sampling = pb.SamplingParams(max_tokens=2, seed=456, min_p=0.25, repetition_penalty=1.5, min_tokens=1,
                                 stop_token_ids=[3], logprobs=1)  # fmt: skip
    out = list(
        stub(served.port).Generate(pb.GenerateRequest(prompt="hi", sampling=sampling), metadata=AUTH, timeout=30)
    )
    assert [len(m.logprobs) for m in out] == [len(m.token_ids) for m in out] and out[0].logprobs[0].top
    seen = {x.get("seed"): x for x in engine_requests(served)}
    for seed in (123, 456):
        got = {k: seen[seed].get(k) for k in ("min_p", "repetition_penalty", "min_tokens", "stop_token_ids")}
        assert got == {"min_p": 0.25, "repetition_penalty": 1.5, "min_tokens": 1, "stop_token_ids": [3]}, seed
    tok = post(served, "/tokenize", {"model": "fake", "prompt": "hey", "add_special_tokens": False}).json()
    assert tok["count"] == len(tok["tokens"]) > 0  # tiny-llama's tokenizer renders at a fake deployment's door
    assert post(served, "/detokenize", {"model": "fake", "tokens": tok["tokens"]}).json()["prompt"] == "hey"
    assert post(served, "/tokenize", {"prompt": "hey"}, token=None).status_code == 401


def test_vtoken_options_reach_the_engine_through_both_doors_and_are_refused_alike(served):
    r = served.client.chat.completions.create(
        model="fake", messages=MSG, max_tokens=2, extra_body={"vtoken": {"policy": "random", "budget": 0.25}}
    )
    assert r.choices[0].message.content
    opts = pb.VTokenOptions(policy="random", budget=0.3, sink=2)
    list(stub(served.port).Generate(pb.GenerateRequest(prompt="hi", vtoken=opts), metadata=AUTH, timeout=30))
    seen = [x.get("extra_args") for x in engine_requests(served)]
    assert {"vtoken": {"policy": "random", "budget": 0.25}} in seen
    assert {"vtoken": {"policy": "random", "budget": 0.3, "sink": 2}} in seen
    # h2o needs attention scores that this deployment's engine (policy streaming) does not collect
    with pytest.raises(openai.BadRequestError) as e:
        served.client.chat.completions.create(
            model="fake", messages=MSG, max_tokens=2, extra_body={"vtoken": {"policy": "h2o"}}
        )
    http_message = e.value.body["message"]
    assert e.value.body["param"] == "vtoken.policy" and "attention statistics" in http_message
    with pytest.raises(grpc.RpcError) as g:
        list(
            stub(served.port).Generate(
                pb.GenerateRequest(prompt="hi", vtoken=pb.VTokenOptions(policy="h2o")), metadata=AUTH, timeout=30
            )
        )
    assert g.value.code() == grpc.StatusCode.INVALID_ARGUMENT and g.value.details() == http_message


@pytest.mark.parametrize(
    "path, body, code, param, needle",
    [
        # The door's own: the body's JSON, its size, the vtoken extension (one line, naming the field)
        ("/v1/chat/completions", b'{"messages": [', 400, None, "malformed JSON"),
        ("/v1/completions", b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", 400, None, "nested too deeply"),
        ("/v1/chat/completions", {"messages": MSG, "temperature": float("nan")}, 400, None, "NaN"),
        ("/v1/chat/completions", {"messages": MSG, "vtoken": {"polcy": "h2o"}}, 400, "vtoken.polcy", "per-request"),
        ("/v1/chat/completions", {"messages": MSG, "vtoken": {"budget": -1}}, 400, "vtoken.budget", "budget"),
        ("/v1/chat/completions", {"messages": MSG, "vtoken": "h2o"}, 400, "vtoken", "object"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 250_000}]}, 413, None, "max_request"),
        # vLLM's own, as `vllm serve` answers them
        ("/v1/chat/completions", b"[1, 2]", 400, "body", "valid dictionary"),
        ("/v1/chat/completions", {"messages": MSG, "temperature": "hot"}, 400, "body.temperature", "valid number"),
        ("/v1/chat/completions", {"messages": MSG, "max_tokens": "ten"}, 400, "body.max_tokens", "integer"),
        ("/v1/chat/completions", {"messages": "hi"}, 400, "body.messages", "valid list"),
        ("/v1/chat/completions", {"messages": []}, 400, None, "empty conversation"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": 5}]},
            400,
            "body.messages.0.ChatCompletionDeveloperMessageParam.content",
            "valid string",
        ),  # fmt: skip
        ("/v1/chat/completions", {"messages": MSG, "max_tokens": -3}, 400, "max_tokens", "at least 1"),
        ("/v1/chat/completions", {"messages": MSG, "max_completion_tokens": 0}, 400, "max_tokens", "at least 1"),
        ("/v1/chat/completions", {"messages": MSG, "max_tokens": 10**9}, 400, "max_tokens", "max_model_len"),
        ("/v1/chat/completions", {"messages": MSG, "logit_bias": {"x": 5}}, 400, "logit_bias", "integer token"),
        (
            "/v1/chat/completions",
            {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}]},
            400,
            None,
            "--tool-call-parser",
        ),  # fmt: skip
        (
            "/v1/chat/completions",
            {
                "messages": MSG,
                "max_tokens": 2,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
                },
            },
            400,
            "response_format",  # the gateway names the field the grammar came in (issue 57)
            "Grammar error",
        ),  # fmt: skip
        ("/v1/completions", {"prompt": "", "max_tokens": 2}, 400, "prompt", "non-empty"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "logprobs": 50}, 400, "logprobs", "max allowed"),
        ("/v1/chat/completions", {"model": "gpt-4", "messages": MSG}, 404, "model", "gpt-4"),
        # the fake's pool holds 16 blocks of 32 tokens: a request that can never fit is refused, not queued forever
        ("/v1/chat/completions", {"messages": MSG, "max_tokens": 600}, 400, None, "the pool has 16"),
    ],
)
def test_bad_input_gets_openai_error_json_and_the_server_keeps_serving(served, path, body, code, param, needle):
    if isinstance(body, dict):
        body = json.dumps({"model": "fake", **body}).encode()  # NaN as Python writes it: not JSON
    r = post(served, path, body)
    assert r.status_code == code, r.text
    err = r.json()["error"]
    assert err["code"] == code and needle in err["message"] and err["param"] == param, err
    assert "Traceback" not in err["message"]
    assert served.client.chat.completions.create(model="fake", messages=MSG, max_tokens=1).choices[0].finish_reason


@pytest.mark.parametrize("stream", [False, True])
def test_a_responses_request_refused_before_its_first_output_keeps_its_status(served, stream):
    """A Responses request that can never fit the pool (the fake's 16 blocks of 32 tokens) is a 400 with the reason,
    streamed or not; streamed, vLLM's generator lets the refusal out after the held start (it was a 500)."""
    r = post(served, "/v1/responses", {"model": "fake", "input": "hi", "max_output_tokens": 600, "stream": stream})
    assert r.status_code == 400 and "the pool has 16" in r.json()["error"]["message"], r.text
    assert served.client.responses.create(model="fake", input="hi", max_output_tokens=2).output_text


def test_an_unknown_path_is_404(served):
    assert post(served, "/v1/embeddings", {"model": "fake", "input": "hi"}).status_code == 404
    assert post(served, "/scale_elastic_ep", {"new_data_parallel_size": 2}).status_code == 404  # one engine's knob


def test_bearer_token_on_every_path_but_health(served):
    for token in (None, "wrong"):
        for path in ("/v1/models", "/metrics"):
            h = {"authorization": f"Bearer {token}"} if token else {}
            assert httpx.get(served.url + path, headers=h, timeout=10).status_code == 401
        r = post(served, "/v1/chat/completions", {"messages": MSG}, token=token)
        assert r.status_code == 401 and r.json()["error"]["code"] == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=served.url + "/v1", api_key="wrong", max_retries=0).models.list()
    r = httpx.get(served.url + "/v1/models", headers={"authorization": f"bEaReR {TOKEN}"}, timeout=10)
    assert r.status_code == 200  # the scheme in any case, as gRPC
    r = httpx.get(served.url + "/health", timeout=10)
    assert r.status_code == 200 and r.json()["healthy_replicas"] == 2


def test_an_unexpected_failure_is_500_with_the_request_id_and_no_traceback(served):
    engine = served.gateway.engine

    def broken(*args):
        raise RuntimeError("boom in /srv/secret/path.py")

    engine._valid = broken
    try:
        r = post(served, "/v1/chat/completions", {"messages": MSG})
    finally:
        del engine._valid
    err = r.json()["error"]
    assert r.status_code == 500 and "server id" in err["message"] and "secret" not in err["message"], err
    assert served.client.chat.completions.create(model="fake", messages=MSG, max_tokens=1).choices


# ------------------------------------------------------------------ chat templates (issue 46, on vLLM's door)
SMUGGLED = "X {{ messages[0].content }}"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
@pytest.mark.parametrize(
    "extra, needle",
    [
        ({"chat_template": SMUGGLED}, "untrusted chat template"),
        ({"chat_template_kwargs": {"chat_template": SMUGGLED}}, "chat_template_kwargs.chat_template"),
    ],
)
def test_a_clients_chat_template_never_reaches_the_renderer(served, path, extra, needle):
    """Issue 46: a template sent with the request is refused by vLLM's renderer (the deployment's template is the
    only one), one smuggled in chat_template_kwargs by the door (issue 57: not a variable the template reads); the
    door keeps serving."""
    r = post(served, path, {"model": "fake", "messages": MSG, "max_tokens": 1, **extra})
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    assert post(served, "/tokenize", {"model": "fake", "messages": MSG}).json()["count"] > 1


def test_a_template_that_renders_too_long_is_413_for_both_doors_and_health_answers_meanwhile(served):
    """Issue 46: rendering runs off the event loop (vLLM's renderer threads) and is bounded by
    gateway.render_timeout_s: past it, HTTP 413 and gRPC RESOURCE_EXHAUSTED (vLLM's server would answer 500), while
    /health answers throughout; the stuck thread is replaced and the next request renders."""
    from cluster.serving.requests import RENDER_TIMEOUT_ENV

    tok = served.gateway.state.openai_serving_chat.renderer.tokenizer
    plain, before = tok.apply_chat_template, os.environ[RENDER_TIMEOUT_ENV]
    spinning = threading.Event()

    def slow(*args, **kwargs):  # pure Python holding the GIL between switches, as a template's loop does
        if not spinning.is_set():
            end = time.monotonic() + 4
            while time.monotonic() < end:
                pass
        return plain(*args, **kwargs)

    tok.apply_chat_template, os.environ[RENDER_TIMEOUT_ENV] = slow, "1"
    try:
        out: dict = {}
        body = {"model": "fake", "messages": MSG}
        t = threading.Thread(target=lambda: out.update(r=post(served, "/v1/chat/completions", body)))
        t.start()
        waits = []
        while t.is_alive():
            t0 = time.monotonic()
            assert httpx.get(served.url + "/health", timeout=30).status_code == 200
            waits.append(time.monotonic() - t0)
            time.sleep(0.05)
        r = out["r"]
        assert r.status_code == 413 and "gateway.render_timeout_s (1 s)" in r.json()["error"]["message"], r.text
        assert max(waits) < 1.0, f"/health waited {max(waits):.2f} s while a template rendered"
        chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")])
        with pytest.raises(grpc.RpcError) as e:
            list(stub(served.port).Generate(pb.GenerateRequest(messages=chat), metadata=AUTH, timeout=60))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "render_timeout_s" in e.value.details()
    finally:
        spinning.set()
        tok.apply_chat_template, os.environ[RENDER_TIMEOUT_ENV] = plain, before
    assert served.client.chat.completions.create(model="fake", messages=MSG, max_tokens=1).choices


def test_over_max_inflight_is_429_for_http_and_grpc_together(served):
    """max_inflight (6) bounds both doors at once: four HTTP streams and two gRPC streams fill it. (The pools
    admit one of these requests per replica at a time: the others wait in the engines, admitted by the gateway.)"""
    done = threading.Event()

    def hold():
        with httpx.Client(timeout=60) as h:
            body = {"prompt": "hi", "max_tokens": 300, "stream": True}
            with h.stream(
                "POST", served.url + "/v1/completions", json=body, headers={"authorization": f"Bearer {TOKEN}"}
            ):
                done.wait(30)  # leaving the block closes the stream: the request is aborted

    grpc_calls = [
        stub(served.port).Generate(
            pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=300)), metadata=AUTH, timeout=60
        )
        for _ in range(2)
    ]
    holders = [threading.Thread(target=hold) for _ in range(4)]
    [t.start() for t in holders]
    try:
        wait_for(lambda: served.gateway.dispatcher.inflight >= 6, 10, what="six requests in flight")
        with pytest.raises(openai.RateLimitError) as e:
            served.client.completions.create(model="fake", prompt="hi", max_tokens=1)
        assert e.value.status_code == 429 and "limit 6" in e.value.body["message"]
    finally:
        done.set()
        for c in grpc_calls:
            c.cancel()
        [t.join(30) for t in holders]
    wait_for(lambda: served.gateway.dispatcher.inflight == 0, 10, what="the streams released")
    assert served.client.completions.create(model="fake", prompt="hi", max_tokens=1).choices


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_frees_its_blocks_within_2s(served, stream):
    st = stub(served.port)
    body = {"model": "fake", "messages": MSG, "max_tokens": 400, "stream": stream}
    h = {"authorization": f"Bearer {TOKEN}"}
    with httpx.Client(timeout=httpx.Timeout(60, read=1.0 if not stream else 60)) as client:
        if stream:
            with client.stream("POST", served.url + "/v1/chat/completions", json=body, headers=h) as r:
                lines = r.iter_lines()
                assert [next(lines) for _ in range(4)]  # a few events in: the request runs
        else:  # a client that gives up waiting for a whole answer
            with pytest.raises(httpx.ReadTimeout):
                client.post(served.url + "/v1/chat/completions", json=body, headers=h)
    t0 = time.monotonic()
    wait_for(
        lambda: (lambda t: t["free_blocks"] == t["total_blocks"] and t["running"] == 0)(status(st, AUTH)["totals"]),
        2.0,
        0.05,
        what="all blocks free within 2 s of the disconnect",
    )
    print(f"blocks free {time.monotonic() - t0:.2f}s after the disconnect")
    cli = subprocess.run(
        [sys.executable, "-m", "vtoken.cli", "status", "--server", f"127.0.0.1:{served.port}", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, "VTOKEN_TOKEN": TOKEN},
    )
    totals = json.loads(cli.stdout)["totals"]
    assert totals["free_blocks"] == totals["total_blocks"] and totals["running"] == 0, cli.stdout


def test_metrics_have_vllm_and_vtoken_names_and_move_with_load(served):
    before = scrape(served)
    assert METRICS <= before["families"], METRICS - before["families"]
    running = [lab["replica"] for lab, _ in before["vllm:num_requests_running"]]
    assert sorted(running) == ["http-replica-1", "http-replica-2"]  # one series per replica
    assert all(lab["model_name"] == "fake" for lab, _ in before["vtoken:blocks_reclaimed"])

    # an evicting request under way: the fake engine reports half its blocks as reclaimed
    call = stub(served.port).Generate(
        pb.GenerateRequest(prompt="x" * 100, sampling=pb.SamplingParams(max_tokens=150)), metadata=AUTH, timeout=60
    )
    next(call)
    during = wait_for(
        lambda: (lambda m: m if count(m, "vtoken:blocks_reclaimed") > 0 else None)(scrape(served)),
        10,
        0.1,
        what="blocks reclaimed while the request runs",
    )
    assert count(during, "vllm:num_requests_running") >= 1 and count(during, "vllm:kv_cache_usage_perc") > 0
    call.cancel()
    for _ in range(2):
        served.client.chat.completions.create(model="fake", messages=MSG, max_tokens=4)
    after = scrape(served)
    assert count(after, "vllm:generation_tokens_total") >= count(before, "vllm:generation_tokens_total") + 8
    assert count(after, "vllm:prompt_tokens_total") > count(before, "vllm:prompt_tokens_total")
    assert count(after, "vtoken:requests_total", door="http", status="ok") >= (
        count(before, "vtoken:requests_total", door="http", status="ok") + 2
    )
    assert count(after, "vtoken:requests_total", door="grpc", status="cancelled") >= 1
    default = PlacementConfig().strategy  # the fixture's config names none
    assert count(after, "vtoken:placements_total", strategy=default) >= (
        count(before, "vtoken:placements_total", strategy=default) + 3
    )
    ttft = count(after, "vllm:time_to_first_token_seconds_count")
    assert ttft >= count(before, "vllm:time_to_first_token_seconds_count") + 2
    assert count(after, "vllm:e2e_request_latency_seconds_count") >= 2
    assert count(after, "vllm:request_success_total", finished_reason="length") >= 2


def test_capacity_stream_updates_when_a_request_starts_and_ends(served):
    """WatchCapacity: the figures at once, an update once a request holds blocks, another once they are free."""
    got: list[tuple[float, pb.CapacityUpdate]] = []
    watch = stub(served.port).WatchCapacity(pb.WatchCapacityRequest(min_interval_s=0.25), metadata=AUTH, timeout=60)

    def read():
        try:
            for u in watch:
                got.append((time.monotonic(), u))
        except grpc.RpcError:
            pass

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        first = wait_for(lambda: got and got[0][1], 10, 0.05, what="the first update")
        assert {r.name for r in first.replicas} == {"http-replica-1", "http-replica-2"}
        assert all(r.total_blocks == 16 and r.block_size == 32 for r in first.replicas)
        # The replicas are shared with the tests before this one: start from an update that shows them idle.
        wait_for(
            lambda: all(r.free_blocks == 16 and r.state == "healthy" and not r.running for r in got[-1][1].replicas),
            15,
            0.05,
            what="an update with both replicas idle",
        )
        n = len(got)
        served.client.chat.completions.create(model="fake", messages=MSG, max_tokens=150)  # ~1.5 s
        busy = [
            u
            for _, u in got[n:]
            if any(r.running or r.promised_blocks or r.free_blocks < r.total_blocks for r in u.replicas)
        ]
        assert busy, [u for _, u in got]
        wait_for(
            lambda: (
                got[-1][1] is not busy[-1]
                and all(r.free_blocks == r.total_blocks and not r.running for r in got[-1][1].replicas)
            ),
            5,
            0.05,
            what="an update with every block free again",
        )
    finally:
        watch.cancel()
        reader.join(5)
    seqs = [u.sequence for _, u in got]
    assert seqs == list(range(1, len(seqs) + 1))
    gaps = [b.time - a.time for (_, a), (_, b) in zip(got, got[1:])]
    assert min(gaps) >= 0.24, gaps  # coalesced: at most one update per min_interval_s (the server's clock)


def test_a_stream_the_server_aborts_mid_way_ends_in_an_error_event():
    """A drain that runs out of time aborts the requests in flight: an HTTP stream then ends with an error event
    (the OpenAI client raises), never a clean end after a truncated answer."""
    import ray

    ensure_ray()
    with BackgroundServer(config("http-abort", replicas=1, gateway={"http_port": "any"})) as s:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{s.http_port}/v1", api_key="none", max_retries=0)
        stream = c.chat.completions.create(model="fake", messages=MSG, max_tokens=400, stream=True)
        got = [next(stream), next(stream)]
        replica = ray.get_actor(status(stub(s.port))["replicas"][0]["name"])
        ray.get(replica.drain.remote(0.1), timeout=30)
        with pytest.raises(openai.APIError) as e:
            got.extend(stream)
        assert "abort" in e.value.message, e.value.message
        assert len(got) < 400


def _self_signed(tmp_path):
    """A certificate for 127.0.0.1 and its key, as PEM files."""
    import datetime
    import ipaddress

    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return str(cert_file), str(key_file)


def test_http_with_tls_serves_https_only_and_never_shares_a_port(tmp_path):
    """gateway.tls_cert/tls_key apply to the HTTP door too; a port another server holds is PortInUse naming
    gateway.http_port (we bind the socket ourselves, without SO_REUSEPORT). No Ray: /v1/models needs none."""
    import asyncio
    import socket

    from cluster.doors.http_server import HttpGateway
    from cluster.doors.sockets import PortInUse
    from cluster.serving.dispatch import Dispatcher
    from cluster.serving.frontend import serving_app

    cert, key = _self_signed(tmp_path)
    cfg = config("tls", gateway={"http_port": "any", "tls_cert": cert, "tls_key": key})

    async def go():
        dispatcher = Dispatcher(cfg, None)
        app = await serving_app(cfg, dispatcher)
        gw = HttpGateway(cfg, None, dispatcher, app)
        port = await gw.start()
        try:
            async with httpx.AsyncClient(verify=cert) as c:
                r = await c.get(f"https://127.0.0.1:{port}/v1/models", timeout=10)
                assert r.status_code == 200 and r.json()["data"][0]["id"] == "fake"
            async with httpx.AsyncClient() as c:
                with pytest.raises(httpx.HTTPError):  # clear text is not served
                    await c.get(f"http://127.0.0.1:{port}/v1/models", timeout=10)
            with socket.socket() as held:
                held.bind(("127.0.0.1", 0))
                held.listen()
                busy = config("busy", gateway={"http_port": held.getsockname()[1]})
                with pytest.raises(PortInUse, match="gateway.http_port: 127.0.0.1:.* is in use"):
                    await HttpGateway(busy, None, dispatcher, app).start()
        finally:
            await gw.stop()

    asyncio.run(go())


def test_what_vllm_serve_answers_the_door_answers(served):
    """vLLM's serving layer at the door: n > 1 (fanned out in the replica's engine, placed once), structured outputs
    (the grammar goes to the engine), a batch of prompts with echo and prompt log-probabilities, the Responses API."""
    c = served.client
    fmt = {"type": "json_object"}
    r = c.chat.completions.create(model="fake", messages=MSG, max_tokens=3, n=2, response_format=fmt)
    assert [ch.index for ch in r.choices] == [0, 1] and r.usage.completion_tokens == 6
    assert all(ch.message.content == " t0 t1 t2" for ch in r.choices)
    sent = [x for x in engine_requests(served) if x.get("n") == 2]
    assert sent and sent[-1]["structured_outputs"].json_object  # one placement, the grammar for the engine
    r = c.completions.create(model="fake", prompt=["a", "b c"], max_tokens=2, echo=True, logprobs=1)
    assert [ch.text for ch in r.choices] == ["a t0 t1", "b c t0 t1"]
    assert r.choices[0].logprobs.token_logprobs[0] is None  # the prompt's first token has none, as vLLM answers
    streamed = list(c.completions.create(model="fake", prompt=["a", "b"], max_tokens=2, stream=True))
    assert sorted({ch.choices[0].index for ch in streamed if ch.choices}) == [0, 1]
    r = c.responses.create(model="fake", input="hi", max_output_tokens=3)
    assert r.output_text == " t0 t1 t2" and r.usage.output_tokens == 3


def test_a_replica_lost_mid_answer_is_that_requests_503_and_the_server_serves_on():
    """One replica's death is its requests' error, never the server's: vLLM's server exits when its engine is dead,
    so the engine client never says so (cluster/serving/remote_engine.py). A whole answer gets a 503, a stream an error
    event; the door answers meanwhile and serves again once Ray has restarted the replica."""
    import ray

    ensure_ray()
    cfg = config("http-death", replicas=1, gateway={"http_port": "any", "place_timeout_s": 2})
    with BackgroundServer(cfg) as s:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{s.http_port}/v1", api_key="none", max_retries=0, timeout=60)
        # 150 tokens of 10 ms each; both requests fit the replica's 16 blocks at once
        stream = c.chat.completions.create(model="fake", messages=MSG, max_tokens=150, stream=True)
        got: list = [next(stream), next(stream)]
        whole: list = []

        def ask():
            try:
                whole.append(c.chat.completions.create(model="fake", messages=MSG, max_tokens=150))
            except openai.APIStatusError as e:
                whole.append(e)

        asker = threading.Thread(target=ask)
        asker.start()
        wait_for(lambda: s.gateway.dispatcher.inflight == 2, 10, 0.05, what="both requests placed")
        time.sleep(0.3)  # the whole answer has tokens under way: no retry elsewhere
        ray.kill(ray.get_actor(status(stub(s.port))["replicas"][0]["name"]), no_restart=False)
        with pytest.raises(openai.APIError):
            got.extend(stream)
        asker.join(60)
        assert isinstance(whole[0], openai.APIStatusError) and whole[0].status_code == 503, whole
        assert [m.id for m in c.models.list().data] == ["fake"]  # the server is up
        wait_for(lambda: status(stub(s.port))["replicas"][0]["state"] == "healthy", 60, 0.2, what="the restart")
        assert c.chat.completions.create(model="fake", messages=MSG, max_tokens=2).choices[0].message.content
