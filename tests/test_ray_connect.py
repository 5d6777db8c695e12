"""Getting Ray without a cluster to join (cluster/ray_connect.py; with one: tests/test_cluster_node_loss.py):
connecting has a deadline (``ray.connect_timeout_s``; past it one line with the address, the authentication
mode and the fix, exit code 1), and Ctrl-C while connecting stops at once (exit code 130), even while the
connection attempt is stuck. Before, `vtoken serve` aimed at a dead address printed nothing for minutes and
only SIGKILL ended it."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
from ray_nodes import ROOT, Serve, clean_env, fake_config, free_port

pytestmark = pytest.mark.timeout(120)


def test_connecting_has_a_deadline_and_ctrl_c_stops_it_at_once(tmp_path):
    nowhere = f"127.0.0.1:{free_port()}"  # nothing listens there: the probe retries until the deadline
    short = fake_config(tmp_path / "short.yaml", ray={"connect_timeout_s": 3})
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "vtoken.cli", "serve", "--config", short, "--address", nowhere]
    timed = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=clean_env())
    s = Serve(fake_config(tmp_path / "long.yaml", ray={"connect_timeout_s": 600}), "--address", nowhere,
              env=clean_env())  # fmt: skip
    t_end = time.monotonic() + 60
    while f"joining Ray at {nowhere}" not in s.out:
        assert s.proc.poll() is None and time.monotonic() < t_end, s.out
        time.sleep(0.2)
    time.sleep(1)  # probing the address
    t_int = time.monotonic()
    s.proc.send_signal(signal.SIGINT)
    s.proc.wait(15)
    s.stop()
    assert s.proc.returncode == 130 and "interrupted while starting Ray" in s.out, s.out
    assert "Traceback" not in s.out and time.monotonic() - t_int < 10

    out, err = timed.communicate(timeout=60)
    err = err.strip()
    assert timed.returncode == 1 and len(err.splitlines()) == 1 and "Traceback" not in err, (out, err)
    assert f"cannot reach Ray at {nowhere}" in err and "auth mode unset" in err and "ray start --head" in err, err
    assert time.monotonic() - t0 < 60
