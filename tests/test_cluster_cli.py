"""`vtoken serve` as a user meets it: every start-up problem fails at once with one line that names the field
or the port and the fix (exit code 2, no traceback), and Ctrl-C during start-up stops at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
import yaml

pytestmark = pytest.mark.timeout(180)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fake_config(tmp_path, **over) -> str:
    raw = {
        "name": "cli-test",
        "model": "fake",
        "replicas": 1,
        "replica": {"num_cpus": 0.25},
        "engine": {"kind": "fake"},
        "gateway": {"port": 0, "http_port": "any"},
        "ray": {"num_cpus": 2},
    }
    for k, v in over.items():
        raw[k] = {**raw[k], **v} if isinstance(v, dict) and isinstance(raw.get(k), dict) else v
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def serve(config: str, *args: str, timeout: float = 60, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vtoken.cli", "serve", "--config", config, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )


def assert_one_line_error(r: subprocess.CompletedProcess, *needles: str) -> None:
    err = r.stderr.strip()
    assert r.returncode == 2, (r.returncode, r.stdout, err)
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    for n in needles:
        assert n in err, err


def test_a_busy_port_is_an_error_naming_the_port(tmp_path):
    """gRPC shares a port by default (SO_REUSEPORT): a second server must not start on a busy one."""
    from concurrent.futures import ThreadPoolExecutor

    other = grpc.server(ThreadPoolExecutor(1))
    port = other.add_insecure_port("127.0.0.1:0")
    other.start()
    try:
        t0 = time.monotonic()
        r = serve(fake_config(tmp_path), "--port", str(port))
        assert_one_line_error(r, f"127.0.0.1:{port}", "gateway.port", "--port")
        assert time.monotonic() - t0 < 30  # before Ray and the replicas start
    finally:
        other.stop(0)


def test_the_gateway_refuses_a_port_another_grpc_server_holds():
    """The same check where the gateway binds (a port taken after the start-up check)."""
    import asyncio

    from cluster.config import parse_config
    from cluster.doors.grpc_server import Gateway
    from cluster.doors.sockets import PortInUse
    from cluster.serving.dispatch import Dispatcher

    async def go():
        other = grpc.aio.server()
        port = other.add_insecure_port("127.0.0.1:0")
        await other.start()
        cfg = parse_config({"model": "fake", "engine": {"kind": "fake"}, "gateway": {"port": port, "http_port": 0}})
        try:
            with pytest.raises(PortInUse, match=f"127.0.0.1:{port} is in use"):
                await Gateway(cfg, None, Dispatcher(cfg, None), None).start()
        finally:
            await other.stop(0)

    asyncio.run(go())


def test_an_unset_auth_token_variable_fails_before_ray_starts(tmp_path):
    cfg = fake_config(tmp_path, gateway={"auth_token_env": "VTOKEN_TEST_NEVER_SET"})
    env = {k: v for k, v in os.environ.items() if k != "VTOKEN_TEST_NEVER_SET"}
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "vtoken.cli", "serve", "--config", cfg],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=env,
    )
    assert_one_line_error(r, "gateway.auth_token_env", "VTOKEN_TEST_NEVER_SET", "export")
    assert time.monotonic() - t0 < 30


@pytest.mark.parametrize(
    "over, needles",
    [
        ({"model": "no-such-model", "engine": {"kind": "vllm"}}, ("model:", "'no-such-model'", "tiny-llama")),
        ({"vtoken": {"mode": "vtoken", "budget": float("inf")}}, ("vtoken.budget", "finite")),
    ],
)
def test_config_errors_fail_at_once_in_one_line(tmp_path, over, needles):
    t0 = time.monotonic()
    assert_one_line_error(serve(fake_config(tmp_path, **over)), *needles)
    assert time.monotonic() - t0 < 30


def test_ctrl_c_during_start_up_stops_at_once(tmp_path):
    """Replicas that take two minutes to start: Ctrl-C a few seconds in stops everything within seconds."""
    cfg = fake_config(tmp_path, engine={"fake_start_s": 120})
    proc = subprocess.Popen(
        [sys.executable, "-m", "vtoken.cli", "serve", "--config", cfg],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
    )
    lines: list[str] = []
    starting = threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line)
            if "starting 1 replicas" in line:
                starting.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert starting.wait(90), "".join(lines)
        time.sleep(3)  # Ray is up, the controller is starting the replica
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=40)
        stopped_s = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(5)
    out = "".join(lines)
    assert proc.returncode == 130 and "interrupted during start-up" in out, out
    assert "Traceback" not in out, out
    assert stopped_s < 30, f"took {stopped_s:.0f}s to stop"


def test_a_busy_http_port_is_an_error_naming_the_field_and_flag(tmp_path):
    import socket

    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        r = serve(fake_config(tmp_path), "--http-port", str(port))
    assert_one_line_error(r, f"127.0.0.1:{port}", "gateway.http_port", "--http-port")


def test_serve_is_quiet_and_speaks_openai_and_grpc(tmp_path):
    """`vtoken serve` as a newcomer meets it: our own progress lines only (Ray's and vLLM's messages go to a log
    file, its path printed), the official OpenAI client streams a chat completion from it, `vtoken status` and
    `vtoken generate` work on the same deployment, and Ctrl-C drains it."""
    import openai

    from vtoken.models import models_dir

    port_file, http_file = tmp_path / "grpc-port", tmp_path / "http-port"
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "models").symlink_to(models_dir())  # the door renders with tiny-llama's tokenizer
    proc = subprocess.Popen(
        [sys.executable, "-m", "vtoken.cli", "serve", "--config", fake_config(tmp_path), "--port-file", str(port_file),
         "--http-port-file", str(http_file)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        env={**os.environ, "VTOKEN_DATA_DIR": str(tmp_path / "data")},
    )  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        t_end = time.monotonic() + 120
        while not (port_file.exists() and http_file.exists()):
            assert proc.poll() is None and time.monotonic() < t_end, "".join(lines)
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_file.read_text()}/v1", api_key="-", max_retries=0)
        stream = client.chat.completions.create(
            model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == " t0 t1 t2 t3"
        server = f"127.0.0.1:{port_file.read_text()}"
        for args in (("status", "--json"), ("generate", "hello", "--max-tokens", "2")):
            out = subprocess.run(
                [sys.executable, "-m", "vtoken.cli", *args, "--server", server],
                capture_output=True, text=True, timeout=60, cwd=ROOT,
            )  # fmt: skip
            assert out.returncode == 0, out.stderr
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
        reader.join(5)
    out = "".join(lines)
    assert proc.returncode == 0, out
    noise = [x for x in out.splitlines() if not x.startswith("vtoken: ")]
    assert not noise, out  # nothing but our own lines: no Ray or vLLM warnings, no INFO records
    assert "OpenAI API http://127.0.0.1:" in out and "free blocks after drain" in out
    log = next(x for x in out.splitlines() if "library logs go to" in x).split(" go to ")[1].split(",")[0]
    assert os.path.exists(log) and log.startswith(str(tmp_path / "data")), log


def test_generate_carries_a_request_s_own_eviction_options_and_names_a_wrong_one():
    """`vtoken generate --vtoken JSON`: the request's own options (gRPC VTokenOptions, the gateway checks them as
    for HTTP's "vtoken" field); a field that is not one, or broken JSON, is one line and exit 2 before connecting."""
    import argparse

    from cluster import cli

    p = argparse.ArgumentParser()
    cli.add_cli(p.add_subparsers())
    req = cli.generate_request(p.parse_args(["generate", "hi", "--vtoken", '{"pressure_floor": 0.5, "budget": 0.25}']))
    assert req.prompt == "hi" and req.vtoken.pressure_floor == 0.5 and req.vtoken.budget == 0.25
    assert not cli.generate_request(p.parse_args(["generate", "hi"])).HasField("vtoken")
    for bad, needle in (('{"floor": 0.5}', 'no field named "floor"'), ('{"budget": ', "Failed to load JSON")):
        with pytest.raises(ValueError, match=needle):
            cli.generate_request(p.parse_args(["generate", "hi", "--vtoken", bad]))
    r = subprocess.run([sys.executable, "-m", "vtoken.cli", "generate", "hi", "--vtoken", "{"], capture_output=True,
                       text=True, timeout=60, cwd=ROOT)  # fmt: skip
    assert r.returncode == 2 and r.stderr.startswith("vtoken generate: --vtoken:"), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


@pytest.mark.vllm
def test_the_start_shows_each_replica_and_a_failed_engine_says_why_in_vllms_words(tmp_path):
    """A pool too small for max_model_len (tiny-llama: 2 KiB a token, 2,048 tokens, a 1 MiB pool), vToken off:
    the console follows the replica (placed on a node and loading, then failed) and the error is vLLM's own
    line, not a traceback ending in vLLM's "Engine core initialization failed. See root cause above"."""
    cfg = fake_config(
        tmp_path,
        model="tiny-llama",
        vtoken={"mode": "off"},
        engine={"kind": "vllm", "max_model_len": 2048, "kv_cache_memory_bytes": 1 << 20},
        replica={"num_cpus": 1},
    )
    r = serve(cfg, timeout=170)
    err = r.stderr.strip()
    assert r.returncode == 1, (r.returncode, r.stdout[-3000:], err[-3000:])
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert "ValueError: To serve at least one request with the model's max seq len (2048)" in err, err
    said = r.stdout
    assert "loading its engine on node" in said and "failed: ValueError: To serve at least one request" in said, said


def test_the_start_progress_says_each_move_once_and_how_long_it_waits():
    import io

    from cluster.cli import StartProgress

    out = io.StringIO()
    p = StartProgress(2, every_s=15, out=out)
    row = {"name": "r1", "state": "starting", "phase": "loading its engine on node 10.0.0.1 (pid 7)", "error": ""}
    p([row], 1.0)
    p([row], 2.0)  # unchanged: nothing new
    p([row, {**row, "name": "r2", "phase": "waiting for Ray to place it"}], 3.0)
    p([{**row, "state": "healthy"}, {**row, "name": "r2"}], 20.0)
    p([{**row, "state": "healthy"}, {**row, "name": "r2"}], 36.0)
    p([{**row, "state": "healthy"}, {**row, "name": "r2", "state": "failed", "error": "ValueError: no room"}], 40.0)
    assert out.getvalue().splitlines() == [
        "vtoken: replica r1: loading its engine on node 10.0.0.1 (pid 7) (1s)",
        "vtoken: replica r2: waiting for Ray to place it (3s)",
        "vtoken: replica r1: healthy (20s)",
        "vtoken: replica r2: loading its engine on node 10.0.0.1 (pid 7) (20s)",
        "vtoken: waiting for replicas: 1 of 2 healthy (36s)",
        "vtoken: replica r2: failed: ValueError: no room (40s)",
    ]


def test_a_start_error_is_the_remote_cause_in_one_line_never_rays_traceback():
    from cluster.control.lifecycle import start_error

    class RemoteTaskError(RuntimeError):  # what Ray raises: its text the remote traceback, .cause the exception
        def __init__(self, cause):
            super().__init__("Traceback (most recent call last):\n  File ...\nRuntimeError: re_engines(")
            self.cause = cause

    assert start_error(RemoteTaskError(RuntimeError("ValueError: To serve at least one request"))) == (
        "ValueError: To serve at least one request"
    )
    assert start_error(RuntimeError("one\ntwo")) == "one"
