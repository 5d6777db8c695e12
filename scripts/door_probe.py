"""Issue 57's findings probed on a served gateway, before and after: one JSON document of what each abuse got and
what it cost the others (the fake engine, tiny-llama's (SmolLM2's) tokenizer and chat template at the door, one
replica of 256 blocks, the gateway in this process with the shipped gateway defaults):

  schema_bomb          a 5.3 KB schema vLLM's auto backend checks with outlines (seconds): its status, and the worst
                       /v1/models latency meanwhile (schema_bomb_chat: a plain chat's)
  tokenize_flood       24 x 900 KB /tokenize at once: statuses, a concurrent chat's worst latency, RSS growth
  n_bomb, prompt_list_bomb, too_big_for_any_pool, template_padding, two_content_types_bad_budget,
  metrics_subpath      the status (and body) each got
  slow_reader          a stream whose client never reads: how long until its admission was released

Run from a tree's root with that tree's environment, so two trees can be compared; --replica-ping instead times a
real tiny-llama replica's ping while it checks the same schema (the replica validates a grammar again):

    cd <tree> && PYTHONPATH=. .venv/bin/python <this tree>/scripts/door_probe.py OUT.json
    .venv/bin/python scripts/door_probe.py --replica-ping

A measurement, not a test: it depends on what else the machine runs.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import sys
import threading
import time

sys.path.insert(0, os.getcwd())  # the tree measured is the one this runs in
sys.path.insert(0, os.path.join(os.getcwd(), "tests"))

from cluster_harness import config, ensure_ray  # noqa: E402

from cluster.server import BackgroundServer  # noqa: E402

BOMB = {
    "type": "object",
    # xgrammar refuses multipleOf and guidance patternProperties: vLLM's auto backend checks it with outlines
    "properties": {
        **{f"field_{i}": {"type": "string"} for i in range(160)},
        "count": {"type": "integer", "multipleOf": 2},
    },
    "patternProperties": {"^x_": {"type": "string"}},
}


def rss_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024


def post(port, path, body, headers=None, timeout=120):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    h = {"content-type": "application/json"} if headers is None else headers
    t = time.time()
    c.request("POST", path, data, h)
    r = c.getresponse()
    out = r.read()
    return r.status, out[:240].decode(errors="replace"), round(time.time() - t, 3)


def get(port, path):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    t = time.time()
    c.request("GET", path)
    r = c.getresponse()
    r.read()
    return r.status, round(time.time() - t, 3)


CHAT = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def during(port, fn, probe):
    """fn() in a thread; probe() repeatedly meanwhile; (fn's result, max probe latency)."""
    res = {}
    th = threading.Thread(target=lambda: res.setdefault("r", fn()))
    th.start()
    lat = []
    while th.is_alive():
        lat.append(probe())
        time.sleep(0.05)
    th.join()
    return res["r"], max(lat) if lat else None


def replica_ping() -> dict:
    """A real tiny-llama replica's ping latency while the gateway and then the replica check BOMB."""
    import ray

    cfg = config("rping", model="tiny-llama", replicas=1, engine={"kind": "vllm", "max_model_len": 512},
                 gateway={"port": 0, "http_port": "any", "grammar_timeout_s": 30.0})  # fmt: skip
    with BackgroundServer(cfg, start_timeout_s=600) as s:
        port = s.http_port
        post(port, "/v1/chat/completions", CHAT)
        _, rep = next(iter(s.gateway.dispatcher.placer.handles.items()))
        fmt = {"type": "json_object"}
        post(port, "/v1/chat/completions", {**CHAT, "response_format": fmt})  # the grammar worker started
        body = {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": BOMB}}}

        def ping() -> float:
            t = time.time()
            ray.get(rep.ping.remote())
            return time.time() - t

        r, worst = during(port, lambda: post(port, "/v1/chat/completions", body), ping)
        return {"status": r[0], "seconds": r[2], "max_ping_s": round(worst, 3)}


if __name__ == "__main__":
    ensure_ray()
    if "--replica-ping" in sys.argv:
        print(json.dumps(replica_ping()))
        sys.exit(0)
    out = {}
    cfg = config(
        "cmp",
        model="tiny-llama",
        replicas=1,
        engine={"kind": "fake", "fake_total_blocks": 256, "fake_token_delay_s": 0.001, "max_model_len": 512},
        gateway={"port": 0, "http_port": "any"},
    )
    with BackgroundServer(cfg, start_timeout_s=180) as s:
        port = s.http_port
        get(port, "/v1/models")
        post(port, "/v1/chat/completions", CHAT)
        # warm the structured-output path with a small schema (the grammar worker's start is not the finding)
        small = {"type": "object", "properties": {"a": {"type": "string"}}}

        def fmt(sc):
            return {"type": "json_schema", "json_schema": {"name": "x", "schema": sc}}

        out["small_schema"] = post(port, "/v1/chat/completions", {**CHAT, "response_format": fmt(small)})[::2]
        bomb = BOMB
        body = {**CHAT, "response_format": fmt(bomb)}
        r, worst = during(port, lambda: post(port, "/v1/chat/completions", body), lambda: get(port, "/v1/models")[1])
        out["schema_bomb"] = {"status": r[0], "seconds": r[2], "max_models_latency_s": worst}
        r, worst = during(
            port,
            lambda: post(
                port,
                "/v1/chat/completions",
                {
                    **body,
                    "response_format": fmt({**bomb, "properties": {**bomb["properties"], "z": {"type": "integer"}}}),
                },
            ),
            lambda: post(port, "/v1/chat/completions", CHAT)[2],
        )
        out["schema_bomb_chat"] = {"status": r[0], "max_chat_latency_s": worst}
        # tokenize flood: 24 x 900 KB
        text = ("lorem ipsum dolor sit amet " * 40000)[:900_000]
        base = rss_mb()
        statuses = []

        def flood():
            ths = [
                threading.Thread(
                    target=lambda: statuses.append(
                        post(port, "/tokenize", {"model": "tiny-llama", "prompt": text}, timeout=300)[0]
                    )
                )
                for _ in range(24)
            ]
            [t.start() for t in ths]
            [t.join() for t in ths]
            return statuses

        peak = [base]

        def probe():
            peak.append(rss_mb())
            return post(port, "/v1/chat/completions", CHAT)[2]

        r, worst = during(port, flood, probe)
        out["tokenize_flood"] = {
            "statuses": {str(k): r.count(k) for k in set(r)},
            "max_chat_latency_s": worst,
            "rss_growth_mb": round(max(peak) - base),
        }
        # n and prompt-list bombs
        out["n_bomb"] = post(
            port, "/v1/completions", {"model": "tiny-llama", "prompt": "hi", "n": 16384, "max_tokens": 100}
        )
        base = rss_mb()
        peak = [base]
        r, _ = during(
            port,
            lambda: post(
                port,
                "/v1/completions",
                {"model": "tiny-llama", "prompt": ["hi"] * 1024, "n": 64, "max_tokens": 8, "stream": True},
                timeout=300,
            ),
            lambda: peak.append(rss_mb()) or 0,
        )
        out["prompt_list_bomb"] = {"status": r[0], "body": r[1][:160], "rss_growth_mb": round(max(peak) - base)}
        out["too_big_for_any_pool"] = post(
            port, "/v1/completions", {"model": "tiny-llama", "prompt": "hi", "n": 100, "max_tokens": 400}
        )
        # chat_template_kwargs
        out["template_padding"] = post(
            port,
            "/v1/chat/completions",
            {**CHAT, "chat_template_kwargs": {"padding": "max_length", "max_length": 4000}},
        )[::2]
        # two content types with a bad vtoken budget
        raw = json.dumps({"model": "tiny-llama", "prompt": "hi", "max_tokens": 2, "vtoken": {"budget": 7}}).encode()
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        c.putrequest("POST", "/v1/completions")
        c.putheader("content-type", "application/json")
        c.putheader("content-type", "text/plain")
        c.putheader("content-length", str(len(raw)))
        c.endheaders()
        c.send(raw)
        rr = c.getresponse()
        out["two_content_types_bad_budget"] = [rr.status, rr.read()[:160].decode()]
        out["metrics_subpath"] = get(port, "/metrics/anything")[0]
        # slow reader: a streamed answer nobody reads, with a small receive buffer
        sk = socket.socket()
        sk.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sk.connect(("127.0.0.1", port))
        b = json.dumps(
            {"model": "tiny-llama", "prompt": "hi", "max_tokens": 480, "n": 16, "stream": True, "logprobs": 5}
        ).encode()
        sk.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(b), b)
        )
        d = s.gateway.dispatcher
        t0 = time.time()
        seen = []
        while time.time() - t0 < 60:
            seen.append(d.inflight)
            time.sleep(0.5)
            if d.inflight == 0 and time.time() - t0 > 2:
                break
        out["slow_reader"] = {"inflight_after_s": round(time.time() - t0, 1), "inflight_now": d.inflight}
        sk.close()
    json.dump(out, open(sys.argv[1], "w"), indent=1)
    print(json.dumps(out, indent=1))
