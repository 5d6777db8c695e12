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
        "gateway": {"port": 0},
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
    from cluster.gateway import Gateway, PortInUse
    from cluster.requests import Tokenizer

    async def go():
        other = grpc.aio.server()
        port = other.add_insecure_port("127.0.0.1:0")
        await other.start()
        cfg = parse_config({"model": "fake", "engine": {"kind": "fake"}, "gateway": {"port": port}})
        try:
            with pytest.raises(PortInUse, match=f"127.0.0.1:{port} is in use"):
                await Gateway(cfg, None, Tokenizer(None)).start()
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
