"""SmolLM2 through the real commands: `vtoken serve` with the shipped config (embedded Ray; quiet: nothing but our
own lines reach the terminal), the OpenAI client streaming a chat completion over HTTP, `vtoken generate`,
`vtoken status`, then Ctrl-C: a clean shutdown that drains the replica and reports its blocks free."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.smollm, pytest.mark.timeout(420)]


def vtoken(*args, **kw):
    return subprocess.run(
        [sys.executable, "-m", "vtoken.cli", *args], capture_output=True, text=True, timeout=120, **kw
    )


def test_serve_generate_status_and_ctrl_c(tmp_path):
    from vtoken.models import model_path

    model_path("smollm2-135m")  # prepared, or a clear error
    cfg = yaml.safe_load(open("configs/serve.yaml"))
    assert cfg["model"] == "smollm2-135m"  # a newcomer's first request returns text, not tiny-llama's noise
    cfg.update(name="smoke", replicas=1)
    cfg["ray"]["num_cpus"] = 2
    (tmp_path / "serve.yaml").write_text(yaml.safe_dump(cfg))
    port_file, http_file = tmp_path / "port", tmp_path / "http-port"
    env = {k: v for k, v in os.environ.items() if k != "VLLM_LOGGING_LEVEL"}  # as a user runs it
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vtoken.cli",
            "serve",
            "--config",
            str(tmp_path / "serve.yaml"),
            "--port",
            "0",
            "--port-file",
            str(port_file),
            "--http-port",
            "any",
            "--http-port-file",
            str(http_file),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        t_end = time.monotonic() + 300
        while not (port_file.exists() and http_file.exists()):
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < t_end, "vtoken serve did not come up"
            time.sleep(1)
        import openai

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_file.read_text()}/v1", api_key="-", max_retries=0)
        stream = client.chat.completions.create(
            model="smollm2-135m",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=16,
            temperature=0,
            stream=True,
        )
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        print("SmolLM2 over HTTP says:", text)
        assert "Paris" in text, text
        server = f"127.0.0.1:{port_file.read_text()}"
        out = vtoken(
            "generate",
            "--server",
            server,
            "--max-tokens",
            "12",
            "--json",
            "--chat",
            "user:What is the capital of France?",
        )
        assert out.returncode == 0, out.stderr
        got = json.loads(out.stdout)
        assert len(got["token_ids"]) >= 1 and got["text"].strip(), got
        print("SmolLM2 says:", got["text"])
        st = vtoken("status", "--server", server, "--json")
        assert st.returncode == 0, st.stderr
        status = json.loads(st.stdout)
        assert status["replicas"][0]["state"] == "healthy" and status["totals"]["total_blocks"] > 0
        assert "replica" in vtoken("status", "--server", server).stdout  # the table
        bad = vtoken("generate", "--server", server, "")
        assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            log, _ = proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode == 0, log
    noise = [x for x in log.splitlines() if not x.startswith("vtoken: ")]
    assert not noise, log  # quiet: vLLM's, Ray's and PyTorch's messages are in the log file, not here
    assert "free blocks after drain" in log
    line = next(x for x in log.splitlines() if "free blocks after drain" in x)
    free, total = line.rsplit(" ", 1)[-1].split("/")
    assert free == total, line
