"""Two Ray nodes on this machine, as a user starts them (a head and a second raylet, each `ray start --block`, token
authentication on as Ray 2.60 turns it on): joining them, not joining them, and losing one. One cluster for all
of it, started once (the fake engine; clients streaming the whole time while something is lost).

Joining is easy, and not joining one is certain (cluster/ray_connect.py):
* what cannot work is one line at once, with the authentication mode and the fix: no token, a wrong one,
  RAY_AUTH_MODE=disabled - not a 57-line traceback after 31 s;
* a plain `vtoken serve` (no --address) starts a local Ray of its own, although this cluster is where a plain
  ``ray.init()`` looks (RAY_ADDRESS, ``ray_current_cluster``, its token in ~/.ray/auth_token);
* `vtoken serve --address` with the head's token, RAY_AUTH_MODE unset, joins.

No single node takes the service with it:
* the controller runs on the node of `vtoken serve` (the head here), the replicas on both nodes (spread);
* the second node is lost (its `ray start` SIGKILLed, its raylet and the replica with it): the replica on the
  head keeps serving throughout (the same process), streams cut on the lost one end UNAVAILABLE, nothing gets a
  500, and the lost replica is replaced on the head, where there is room;
* the controller's process is killed: Ray restarts it, it takes the live replicas over from their reports, and
  they serve throughout (the same processes); nothing fails;
* `vtoken serve` is killed (SIGKILL, no shutdown): its replicas, detached, stop themselves.

Bounds stated here, on this 2-core machine with the head's node-death detection at 1 s x 3 health checks (Ray's
default is 3 s x 5): the lost replica serves again within REPLACED_S of the kill; the restarted controller
answers with both replicas serving within CONTROLLER_BACK_S.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from ray_nodes import ROOT, Load, RayNodes, Serve, clean_env, fake_config, status

pytestmark = pytest.mark.timeout(240)
REPLACED_S = 45.0
CONTROLLER_BACK_S = 30.0
FAST_NODE_DEATH = '{"health_check_period_ms": 1000, "health_check_failure_threshold": 3}'


@pytest.fixture(scope="module")
def nodes():
    n = RayNodes(system_config=FAST_NODE_DEATH)
    try:
        n.start_head(num_cpus=2)
        n.wait_nodes(1)
        n.add_node("worker", num_cpus=1)
        n.wait_nodes(2)
        yield n
    finally:
        left = n.stop()
    assert not left, f"processes left after the nodes were killed: {left}"


def one_line(r: subprocess.CompletedProcess, code: int, *needles: str) -> str:
    err = r.stderr.strip()
    assert r.returncode == code, (r.returncode, r.stdout, err)
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    for n in needles:
        assert n in err, err
    return err


# How cluster/ray_connect.py's check comes out, without vtoken's CLI around it (a third of the start-up time).
CHECK = """
import sys, time
from cluster.ray_connect import RayUnavailable, check_auth
try:
    print(check_auth(sys.argv[1], time.monotonic() + 20))
except RayUnavailable as e:
    sys.exit(f"vtoken serve: {e}")
"""


def test_every_way_joining_fails_is_one_line_with_the_mode_and_the_fix(nodes, tmp_path):
    """No token (through `vtoken serve` itself), a wrong one, RAY_AUTH_MODE=disabled; and the token, right.
    (Nothing at the address at all, and the deadline: tests/test_ray_connect.py.)"""
    cfg = fake_config(tmp_path / "serve.yaml", ray={"connect_timeout_s": 20})
    home = {"TMPDIR": str(nodes.dir), "HOME": str(tmp_path)}  # no ~/.ray/auth_token there
    serve = [sys.executable, "-m", "vtoken.cli", "serve", "--config", cfg, "--address", nodes.address]
    check = [sys.executable, "-c", CHECK, nodes.address]
    runs = {
        "no token": (serve, clean_env(**home)),
        "wrong token": (check, clean_env(**home, RAY_AUTH_TOKEN="not-the-token")),
        "disabled": (check, clean_env(**home, RAY_AUTH_MODE="disabled", RAY_AUTH_TOKEN=nodes.token)),
        "right token": (check, clean_env(**home, RAY_AUTH_TOKEN=nodes.token)),
    }
    procs = {k: subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
             for k, (cmd, env) in runs.items()}  # fmt: skip
    done = {k: subprocess.CompletedProcess(p.args, p.wait(90), *p.communicate()) for k, p in procs.items()}
    fix = "RAY_AUTH_TOKEN=<the head's token: `ray get-auth-token` on the head>"
    one_line(done["no token"], 1, f"Ray at {nodes.address} requires token authentication", "has no token",
             "auth mode unset", fix)  # fmt: skip
    one_line(done["wrong token"], 1, f"Ray at {nodes.address} refused the token from RAY_AUTH_TOKEN", fix)
    one_line(done["disabled"], 1, "requires token authentication (auth mode disabled)", fix)
    assert done["right token"].returncode == 0, done["right token"].stderr
    assert "with token authentication (token from RAY_AUTH_TOKEN)" in done["right token"].stdout
    assert nodes.jobs() == 0  # none of them got in (the right one only asked)


def test_a_plain_serve_starts_its_own_ray_and_never_joins_one_left_on_the_machine(nodes, tmp_path):
    # Where a plain ray.init() looks, this cluster is: RAY_ADDRESS, ray_current_cluster in TMPDIR, and its token
    # in ~/.ray/auth_token (where `ray start --head` finds it, turning authentication on).
    assert (nodes.dir / "ray" / "ray_current_cluster").read_text().strip().endswith(str(nodes.port))
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text(nodes.token)
    env = clean_env(TMPDIR=str(nodes.dir), HOME=str(home), RAY_ADDRESS=nodes.address)
    cfg = fake_config(tmp_path / "serve.yaml", replicas=1, replica={"num_cpus": 0.25}, ray={"num_cpus": 1},
                      gateway={"http_port": 0})  # fmt: skip
    s = Serve(cfg, env=env)
    try:
        s.wait_serving(http=False)
        st = status(s.grpc)
    finally:
        assert s.stop() == 0, s.out
    assert "vtoken: started a local Ray" in s.out, s.out
    theirs = nodes.node_ids(alive=False)
    assert st["replicas"][0]["node_id"] and st["replicas"][0]["node_id"] not in theirs
    assert st["controller_node_id"] not in theirs
    assert nodes.jobs() == 0  # no driver of ours ever connected to this cluster


@pytest.fixture(scope="module")
def served(nodes, tmp_path_factory):
    cfg = fake_config(tmp_path_factory.mktemp("serve") / "serve.yaml", replica={"orphan_after_s": 3.0})
    # The token as a user has it from the head (`ray get-auth-token`), RAY_AUTH_MODE unset: vtoken serve turns
    # token mode on itself when the head asks for a token.
    env = clean_env(TMPDIR=str(nodes.dir), HOME=str(nodes.dir / "home"), RAY_AUTH_TOKEN=nodes.token)
    s = Serve(cfg, "--address", nodes.address, env=env)
    try:
        s.wait_serving()
        yield s
    finally:
        s.stop()


def replicas(served) -> dict[str, dict]:
    return {r["name"]: r for r in status(served.grpc)["replicas"]}


def wait_until(pred, timeout: float, what: str, every: float = 0.25):
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        try:
            got = pred()
        except Exception:  # the controller restarting: status is UNAVAILABLE meanwhile
            got = None
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def test_the_controller_runs_on_the_node_of_vtoken_serve_and_replicas_on_both(nodes, served):
    ids = nodes.node_ids()
    head = next(i for i, is_head in ids.items() if is_head)
    st = status(served.grpc)
    assert st["controller_node_id"] == head and f"node {head[:8]}" in served.out  # pinned where vtoken serve runs
    assert "with token authentication (token from RAY_AUTH_TOKEN)" in served.out, served.out
    where = {r["node_id"] for r in st["replicas"]}
    assert where == set(ids), (where, ids)  # spread: one replica per node
    assert all(r["state"] == "healthy" and r["pid"] > 0 and r["node_ip"] for r in st["replicas"])


def test_losing_the_other_node_keeps_serving_and_replaces_its_replica(nodes, served):
    head = next(i for i, is_head in nodes.node_ids().items() if is_head)
    before = replicas(served)
    (survivor,) = [r for r in before.values() if r["node_id"] == head]
    (lost,) = [r for r in before.values() if r["node_id"] != head]
    load = Load(served.url, clients=3)
    try:
        wait_until(lambda: load.count().get("OK", 0) >= 6, 30, "requests served before the loss")
        t_kill = time.monotonic()
        nodes.kill("worker")
        back = wait_until(
            lambda: (lambda rs: rs if rs[lost["name"]]["state"] == "healthy" and rs[lost["name"]]["pid"] != lost["pid"]
                     else None)(replicas(served)),
            REPLACED_S,
            "the lost replica serving again",
        )  # fmt: skip
        replaced_s = time.monotonic() - t_kill
        wait_until(lambda: load.count(since=time.monotonic() - 1).get("OK", 0) >= 1, 10, "requests served after")
    finally:
        outcomes = load.stop()
    print(f"lost replica serving again {replaced_s:.1f}s after the node was killed; clients saw {load.count()}")
    seen = {o for *_, o in outcomes}
    assert seen <= {"OK", "midstream-503"}, load.count()  # never a 500, never a refusal before the first token
    during = [o for t0, t1, o in outcomes if t0 <= t_kill + replaced_s and t1 >= t_kill]
    assert during.count("OK") >= 3, load.count()  # the head's replica served while the other was being replaced
    assert back[survivor["name"]]["pid"] == survivor["pid"]  # the same process throughout: it never stopped
    assert back[lost["name"]]["node_id"] == head  # replaced where there was room
    wait_until(lambda: f"pid {back[lost['name']]['pid']})" in served.out, 10, "vtoken serve's line on the new replica")


def test_a_killed_controller_is_restarted_and_takes_the_live_replicas_over(served):
    before = status(served.grpc)
    pids = {r["name"]: r["pid"] for r in before["replicas"]}
    load = Load(served.url, clients=3)
    try:
        wait_until(lambda: load.count().get("OK", 0) >= 6, 30, "requests served before")
        t_kill = time.monotonic()
        os.kill(before["controller_pid"], signal.SIGKILL)
        after = wait_until(
            lambda: (lambda s: s if s["controller_pid"] != before["controller_pid"]
                     and [r["state"] for r in s["replicas"]] == ["healthy", "healthy"] else None)(status(served.grpc)),
            CONTROLLER_BACK_S,
            "the restarted controller with both replicas serving",
        )  # fmt: skip
        back_s = time.monotonic() - t_kill
        wait_until(lambda: load.count(since=time.monotonic() - 1).get("OK", 0) >= 1, 10, "requests served after")
    finally:
        load.stop()
    print(f"controller answering again {back_s:.1f}s after its process was killed; clients saw {load.count()}")
    assert set(load.count()) == {"OK"}, load.count()  # the replicas served throughout; nothing failed
    assert {r["name"]: r["pid"] for r in after["replicas"]} == pids  # taken over, not restarted
    assert after["controller_node_id"] == before["controller_node_id"]
    wait_until(lambda: "the controller answers again" in served.out, 10, "vtoken serve's line")


def test_replicas_of_a_killed_vtoken_serve_stop_themselves(nodes, served):
    names = set(replicas(served))
    served.kill()  # SIGKILL: no shutdown, the controller dies with its owner; the replicas are detached
    alive = lambda: {n for n, state, *_ in nodes.actors() if n in names and state != "DEAD"}  # noqa: E731
    wait_until(lambda: not alive(), 30, "the orphaned replicas gone (replica.orphan_after_s is 3 s here)")
    assert not [n for n, state, *_ in nodes.actors() if state != "DEAD"]
