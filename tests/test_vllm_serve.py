"""vToken inside stock vLLM's own OpenAI server (what `vllm serve` runs), for users who keep their own vLLM
deployment and want only the memory: the server started with the flags `vtoken vllm-args` prints evicts (the
trace says so), holds fewer blocks than the prompt needs (the bound of docs/concepts.md holds at every forward), and
answers with the same tokens as the masked reference would - the server is vLLM's, only the engine is ours."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

import httpx
import pytest

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

BS, BUDGET, CHUNK = 32, 0.25, 64


def wait_ready(client: httpx.Client, proc: subprocess.Popen, log, timeout: float = 420) -> None:
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        if proc.poll() is not None:
            log.seek(0)
            raise AssertionError(f"vLLM's server exited with {proc.returncode}: {log.read()[-3000:]}")
        try:
            if client.get("/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1)
    raise AssertionError("vLLM's server did not become healthy")


def test_stock_vllm_openai_server_with_vtoken_switched_in_evicts_and_frees_blocks(tmp_path):
    from vtoken.models import model_path
    from vtoken.vllm_adapter.engine import serve_args

    trace = tmp_path / "trace.jsonl"
    cfg = {"policy": "streaming", "budget": BUDGET, "prefill_chunk": CHUNK, "evict": "always", "trace_path": str(trace)}
    sock = str(tmp_path / "vllm.sock")  # a Unix socket: no port to pick
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_path("tiny-llama")),
        "--served-model-name", "tiny-llama", "--uds", sock, "--dtype", "float32", "--block-size", str(BS),
        "--max-model-len", "1024", "--kv-cache-memory-bytes", str(64 << 20), "--max-num-seqs", "4",
        "--max-num-batched-tokens", str(CHUNK),
        *serve_args(cfg),
    ]  # fmt: skip
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"}
    with open(tmp_path / "server.log", "w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        client = httpx.Client(transport=httpx.HTTPTransport(uds=sock), base_url="http://vllm")
        try:
            wait_ready(client, proc, log)
            prompt = " ".join(f"word{i}" for i in range(120))
            body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                    "logprobs": 1}  # fmt: skip
            r = client.post("/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            out = r.json()
            n_prompt, n_out = out["usage"]["prompt_tokens"], out["usage"]["completion_tokens"]
            assert n_out == 24
            metrics = client.get("/metrics", timeout=30).text
            assert "vllm:kv_cache_usage_perc" in metrics
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    line = json.loads(trace.read_text().splitlines()[0])
    assert len(line["prompt_token_ids"]) == n_prompt and len(line["output_token_ids"]) == n_out
    evicted = len(line["evicted_positions"])
    total = n_prompt + n_out
    # the budget held to the end, but for the block a decoding request may grow by between two decisions
    assert evicted >= total - math.ceil(BUDGET * total) - 32
    chunks = line["prefill_chunks"]
    assert len(chunks) > 1 and max(chunks) <= CHUNK  # eviction between prefill chunks, as configured
    blocks = line["blocks_per_forward"]
    assert max(blocks) < math.ceil(total / BS)  # never held what the whole context needs
    assert max(blocks) <= math.ceil((math.ceil(BUDGET * total) + CHUNK) / BS) + 1
    # What the server answered is what a plain model answers with exactly the trace's keys hidden.
    sys.path.insert(0, os.path.dirname(__file__))
    from reference import load, masked_logprobs

    greedy, ref_lp = masked_logprobs(load(str(model_path("tiny-llama"))), line)
    assert greedy.tolist() == line["output_token_ids"]
    served_lp = out["choices"][0]["logprobs"]["token_logprobs"]
    assert max(abs(a - b) for a, b in zip(served_lp, ref_lp)) <= 1e-4
