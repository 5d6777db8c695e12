"""Losing a node, measured: two Ray nodes on this machine (`ray start` twice, token authentication on), `vtoken
serve --address` joined to them with two replicas (one per node), clients streaming chat completions, then a
loss, and what the clients saw. The same machinery as tests/test_cluster_node_loss.py (tests/ray_nodes.py), with
Ray's own node-death detection unless --fast.

    python scripts/node_loss_drill.py --kill worker        # the node without the controller: SIGKILL its ray start
    python scripts/node_loss_drill.py --kill controller    # the controller's process: SIGKILL
    python scripts/node_loss_drill.py --kill worker --engine tiny-llama   # real vLLM engines (a replacement starts one)

Prints one JSON object: seconds from the kill to the lost replica (or the controller) serving again, the longest
gap between two completed requests around the kill, and the clients' outcomes (OK, midstream-503: a stream cut
by the loss, 503/500: refusals) before, during and after.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from ray_nodes import Load, RayNodes, Serve, clean_env, fake_config, status  # noqa: E402

FAST = '{"health_check_period_ms": 1000, "health_check_failure_threshold": 3}'


def wait(pred, timeout: float):
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        try:
            got = pred()
        except Exception:
            got = None
        if got:
            return got
        time.sleep(0.1)
    raise TimeoutError(f"not within {timeout}s")


def longest_gap(outcomes, t0: float, t1: float) -> float:
    """The longest time around [t0, t1] in which no request completed OK."""
    ends = sorted(e for _, e, o in outcomes if o == "OK")
    marks = [t0] + [e for e in ends if t0 <= e <= t1] + [min([e for e in ends if e > t1], default=t1)]
    return max(b - a for a, b in zip(marks, marks[1:]))


def main() -> int:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--kill", choices=("worker", "controller"), required=True)
    p.add_argument("--engine", choices=("fake", "tiny-llama"), default="fake")
    p.add_argument("--fast", action="store_true", help="node death detected in ~3 s (Ray's default: ~15 s)")
    p.add_argument("--clients", type=int, default=3)
    p.add_argument("--steady-s", type=float, default=10.0, help="load before the kill, and after recovery")
    a = p.parse_args()

    over: dict = {"replica": {"orphan_after_s": 10.0}}
    if a.engine == "tiny-llama":
        over |= {"model": "tiny-llama", "engine": {"kind": "vllm", "kv_cache_memory_bytes": 16 << 20},
                 "replica": {"num_cpus": 1, "orphan_after_s": 10.0}, "vtoken": {"mode": "vtoken"}}  # fmt: skip
    # the models prepared here (the nodes' HOME is a private one)
    data = os.environ.get("VTOKEN_DATA_DIR") or os.path.expanduser("~/.cache/vtoken")
    nodes = RayNodes(system_config=FAST if a.fast else "", extra_env={"VTOKEN_DATA_DIR": data})
    serve = None
    result: dict = {"kill": a.kill, "engine": a.engine, "node_death_detection": "fast" if a.fast else "ray default",
                    "load_before": os.getloadavg()[0]}  # fmt: skip
    try:
        nodes.start_head(num_cpus=2)
        nodes.wait_nodes(1)
        nodes.add_node("worker", num_cpus=1)
        nodes.wait_nodes(2)
        cfg = fake_config(Path(tempfile.mkdtemp(prefix="drill")) / "serve.yaml", **over)
        env = clean_env(TMPDIR=str(nodes.dir), HOME=str(nodes.dir / "home"), RAY_AUTH_TOKEN=nodes.token,
                        VTOKEN_DATA_DIR=data)  # fmt: skip
        serve = Serve(cfg, "--address", nodes.address, env=env)
        serve.wait_serving(timeout=600)
        before = status(serve.grpc)
        head = next(i for i, is_head in nodes.node_ids().items() if is_head)
        lost = next((r for r in before["replicas"] if r["node_id"] != head), None)
        load = Load(serve.url, clients=a.clients, model="fake" if a.engine == "fake" else a.engine)
        time.sleep(a.steady_s)
        t_kill = time.monotonic()
        if a.kill == "worker":
            nodes.kill("worker")
            replica = lambda: next(r for r in status(serve.grpc)["replicas"] if r["name"] == lost["name"])  # noqa: E731
            wait(lambda: replica()["state"] != "healthy", 120)
            result["marked_dead_s"] = round(time.monotonic() - t_kill, 1)
            back = wait(lambda: (lambda r: r["state"] == "healthy" and r["pid"] != lost["pid"])(replica()), 900)
        else:
            os.kill(before["controller_pid"], signal.SIGKILL)
            back = wait(lambda: (lambda s: s["controller_pid"] != before["controller_pid"]
                                 and all(r["state"] == "healthy" for r in s["replicas"]))(status(serve.grpc)),
                        300)  # fmt: skip
        t_back = time.monotonic()
        assert back
        time.sleep(a.steady_s)
        outcomes = load.stop()
        after = status(serve.grpc)
        result.update(
            serving_again_s=round(t_back - t_kill, 1),
            longest_gap_without_a_completed_request_s=round(longest_gap(outcomes, t_kill, t_back), 1),
            clients_before=_count(outcomes, 0, t_kill),
            clients_during=_count(outcomes, t_kill, t_back),
            clients_after=_count(outcomes, t_back, float("inf")),
            replicas_before=[(r["name"], r["node_id"][:8], r["pid"]) for r in before["replicas"]],
            replicas_after=[(r["name"], r["node_id"][:8], r["pid"]) for r in after["replicas"]],
            controller_pid=(before["controller_pid"], after["controller_pid"]),
            vtoken_serve_said=[x for x in serve.out.splitlines() if "replica " in x or "controller" in x][-6:],
            load_after=os.getloadavg()[0],
        )
    finally:
        if serve is not None:
            serve.stop()
        result["processes_left"] = nodes.stop()
    print(json.dumps(result, indent=1))
    return 0


def _count(outcomes, t0: float, t1: float) -> dict[str, int]:
    """Outcomes of the requests that were under way at some point in [t0, t1)."""
    import collections

    return dict(collections.Counter(o for s, e, o in outcomes if s < t1 and e >= t0))


if __name__ == "__main__":
    sys.exit(main())
