"""Joining Ray is easy, and not joining one is certain (cluster/ray_connect.py).

* A plain `vtoken serve` (no --address) starts a local Ray of its own, even with a cluster that `ray start`
  left running on the machine, recorded in ``ray_current_cluster`` and named by RAY_ADDRESS, and the token it
  wants in ~/.ray/auth_token: before, it joined that stranger (or hung for minutes when the stranger was dead).
* Connecting has a deadline: past it, one line (what failed, the address, the authentication mode, the fix) and
  exit code 1. Ctrl-C while connecting stops at once.
* A head with token authentication (Ray 2.60's default once a token exists): a missing or wrong token is one
  line naming the mode and the fix, not a 57-line traceback after 31 s. (Joining it with the token:
  tests/test_cluster_node_loss.py.)
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
from ray_nodes import ROOT, RayNodes, Serve, clean_env, fake_config, free_port, status

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def stranger():
    """A cluster someone started earlier on this machine with `ray start --head`, token authentication on."""
    n = RayNodes()
    try:
        n.start_head(num_cpus=1)
        n.wait_nodes(1)
        yield n
    finally:
        left = n.stop()
    assert not left, left


def one_line(r: subprocess.CompletedProcess, code: int, *needles: str) -> str:
    err = r.stderr.strip()
    assert r.returncode == code, (r.returncode, r.stdout, err)
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    for n in needles:
        assert n in err, err
    return err


def test_a_plain_serve_starts_its_own_ray_and_never_joins_one_left_on_the_machine(stranger, tmp_path):
    # Where a plain ray.init() looks, the stranger is: RAY_ADDRESS, ray_current_cluster in TMPDIR, and its token
    # in ~/.ray/auth_token (where `ray start --head` found it, turning authentication on).
    assert (stranger.dir / "ray" / "ray_current_cluster").read_text().strip().endswith(str(stranger.port))
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text(stranger.token)
    env = clean_env(TMPDIR=str(stranger.dir), HOME=str(home), RAY_ADDRESS=stranger.address)
    cfg = fake_config(tmp_path / "serve.yaml", replicas=1, replica={"num_cpus": 0.25}, ray={"num_cpus": 1},
                      gateway={"http_port": 0})  # fmt: skip
    s = Serve(cfg, env=env)
    try:
        s.wait_serving(http=False)
        st = status(s.grpc)
    finally:
        assert s.stop() == 0, s.out
    assert "vtoken: started a local Ray" in s.out, s.out
    theirs = stranger.node_ids(alive=False)
    assert st["replicas"][0]["node_id"] and st["replicas"][0]["node_id"] not in theirs
    assert st["controller_node_id"] not in theirs
    assert stranger.jobs() == 0  # no driver of ours ever connected to the stranger


def test_every_way_joining_fails_is_one_line_with_the_mode_and_the_fix(stranger, tmp_path):
    nowhere = f"127.0.0.1:{free_port()}"  # nothing listens there
    cfg = fake_config(tmp_path / "serve.yaml", ray={"connect_timeout_s": 3})
    home = {"TMPDIR": str(stranger.dir), "HOME": str(tmp_path)}  # no ~/.ray/auth_token there
    runs = {
        "nowhere": (nowhere, clean_env(**home)),
        "no token": (stranger.address, clean_env(**home)),
        "wrong token": (stranger.address, clean_env(**home, RAY_AUTH_TOKEN="not-the-token")),
        "disabled": (stranger.address, clean_env(**home, RAY_AUTH_MODE="disabled")),
    }
    t0 = time.monotonic()
    procs = {k: subprocess.Popen([sys.executable, "-m", "vtoken.cli", "serve", "--config", cfg, "--address", a],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
             for k, (a, env) in runs.items()}  # fmt: skip
    done = {k: subprocess.CompletedProcess(p.args, p.wait(90), *p.communicate()) for k, p in procs.items()}
    assert time.monotonic() - t0 < 60
    fix = "RAY_AUTH_TOKEN=<the head's token: `ray get-auth-token` on the head>"
    one_line(done["nowhere"], 1, f"cannot reach Ray at {nowhere}", "auth mode unset", "ray start --head")
    one_line(done["no token"], 1, f"Ray at {stranger.address} requires token authentication", "has no token",
             "auth mode unset", fix)  # fmt: skip
    one_line(done["wrong token"], 1, f"Ray at {stranger.address} refused the token from RAY_AUTH_TOKEN", fix)
    one_line(done["disabled"], 1, "requires token authentication (auth mode disabled)", fix)
    assert stranger.jobs() == 0


def test_ctrl_c_while_connecting_stops_at_once(tmp_path):
    nowhere = f"127.0.0.1:{free_port()}"
    s = Serve(fake_config(tmp_path / "serve.yaml", ray={"connect_timeout_s": 600}), "--address", nowhere,
              env=clean_env())  # fmt: skip
    t_end = time.monotonic() + 60
    while f"joining Ray at {nowhere}" not in s.out:
        assert s.proc.poll() is None and time.monotonic() < t_end, s.out
        time.sleep(0.2)
    time.sleep(1)  # probing the address
    t0 = time.monotonic()
    s.proc.send_signal(signal.SIGINT)
    s.proc.wait(15)
    s.stop()
    assert s.proc.returncode == 130 and "interrupted while starting Ray" in s.out, s.out
    assert "Traceback" not in s.out and time.monotonic() - t0 < 10
