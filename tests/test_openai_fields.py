"""Real benchmark clients' bodies at the HTTP door, served as vLLM serves them: the request bodies GuideLLM 0.8.1 and
AIPerf 0.13.0 really send (captured from the tools, tests/data/openai_clients/) go to a served door as they are, and
``stream_options.continuous_usage_stats`` puts the usage in every chunk. Which fields the door accepts is vLLM's own
business now (its protocol models and serving classes answer: tests/test_cluster_http.py), so the field-by-field
audit against vLLM's models that stood here went with the hand-written parser."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from cluster_harness import config, ensure_ray

from cluster.server import BackgroundServer

pytestmark = pytest.mark.timeout(120)
CLIENTS = Path(__file__).parent / "data" / "openai_clients"
MSG = [{"role": "user", "content": "hi"}]


# ------------------------------------------------------------------------------ the tools' own bodies, served
@pytest.fixture(scope="module")
def served():
    ensure_ray()
    with BackgroundServer(config("fields", replicas=1, gateway={"http_port": "any"})) as s:
        s.url = f"http://127.0.0.1:{s.http_port}"
        yield s


def events(r: httpx.Response) -> list[dict]:
    out = []
    for line in r.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line.removeprefix("data: ")))
    return out


def captured() -> list[tuple[str, str, dict]]:
    """(tool, path, body) of every request body captured from GuideLLM and AIPerf (see the README there)."""
    out = []
    for f in sorted(CLIENTS.glob("*.json")):
        rec = json.loads(f.read_text())
        out.append((f.stem, rec["path"], rec["body"]))
    return out


@pytest.mark.parametrize("tool, path, body", captured(), ids=[c[0] for c in captured()])
def test_guidellm_and_aiperf_bodies_are_served_as_sent(served, tool, path, body):
    body = {**body, "model": "fake"}  # the captured bodies name the model they were sent to
    with httpx.Client(timeout=60) as c, c.stream("POST", served.url + path, json=body) as r:
        assert r.status_code == 200, r.read()
        chunks = events(r)
    assert chunks and all("error" not in ch for ch in chunks), chunks
    text = "".join((ch["choices"][0].get("delta", {}).get("content") or ch["choices"][0].get("text") or "")
                   for ch in chunks if ch["choices"])  # fmt: skip
    assert re.fullmatch(r"( t\d+)+", text), text
    opts = body.get("stream_options") or {}
    if opts.get("include_usage"):
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len(text.split())
    if opts.get("include_usage") and opts.get("continuous_usage_stats"):
        usages = [ch.get("usage") for ch in chunks]
        assert all(usages), "continuous usage stats: every chunk carries the usage so far"
        done = [u["completion_tokens"] for u in usages]
        assert done == sorted(done) and done[-1] == done[-2] == len(text.split())
        assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_continuous_usage_stats_put_the_usage_in_every_chunk_as_vllm_does(served, path):
    base = {"messages": MSG} if "chat" in path else {"prompt": "hello"}
    body = {**base, "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True,
            "continuous_usage_stats": True}}  # fmt: skip
    with httpx.Client(timeout=60) as c, c.stream("POST", served.url + path, json=body) as r:
        chunks = events(r)
    done = [ch["usage"]["completion_tokens"] for ch in chunks]
    # vLLM: chat opens with the role chunk (0 tokens); one chunk per token; the closing usage chunk
    assert done == ([0] if "chat" in path else []) + [1, 2, 3, 4, 4], done
    # without include_usage, vLLM sends no usage at all (continuous_usage_stats needs it)
    body["stream_options"] = {"continuous_usage_stats": True}
    with httpx.Client(timeout=60) as c, c.stream("POST", served.url + path, json=body) as r:
        assert not [ch for ch in events(r) if ch.get("usage")]
