"""Ray nodes of a test's own on this machine, as a user starts them: `ray start --head --block`, then a second
raylet with `ray start --address ... --block`, and `vtoken serve` joining them as a subprocess.

Everything lives in a private temporary directory (TMPDIR, so Ray's sessions and ``ray_current_cluster`` stay
out of /tmp/ray; HOME, so no ~/.ray/auth_token is read or written), on ports the OS picks. Each node is one
`ray start --block` process: Ray starts its GCS, raylet and agents with PR_SET_PDEATHSIG, so killing that one
process by its id (SIGKILL) takes the node's processes with it, as a machine that is lost does. ``stop()`` kills
every process it started by id, then any process still naming the private directory (there should be none:
``leftovers()``), and removes the directory. The test process never joins these clusters (it may already run a
Ray of its own): it reads them through the GCS's own gRPC services.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).with_name("ray"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without Ray's own variables (the test process may have set RAY_AUTH_MODE by starting a
    local Ray), plus ``extra``."""
    from vtoken.models import data_dir

    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    # The prepared models stay where they are whatever HOME the test gives: the gateway renders with tiny-llama's
    # tokenizer even over the fake engine.
    env["VTOKEN_DATA_DIR"] = str(data_dir())
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


@dataclass
class RayNodes:
    """A head (and optionally more raylets) of a test's own. ``token``: token authentication on, with this token
    (RAY_AUTH_MODE=token on every node), or None (RAY_AUTH_MODE=disabled)."""

    token: str | None = field(default_factory=lambda: secrets.token_hex(16))
    system_config: str = ""  # the head's --system-config (JSON), e.g. faster node-death detection
    dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="vt", dir="/tmp")))  # short: Ray's sockets
    port: int = 0
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    extra_env: dict[str, str] = field(default_factory=dict)  # for every node (and what runs there)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def env(self, **extra: str) -> dict[str, str]:
        """The nodes' environment: the private TMPDIR and HOME, the authentication mode (and token)."""
        (self.dir / "home").mkdir(exist_ok=True)
        auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token} if self.token else {"RAY_AUTH_MODE": "disabled"}
        return clean_env(TMPDIR=str(self.dir), HOME=str(self.dir / "home"), **auth, **self.extra_env, **extra)

    def start_head(self, num_cpus: int = 2) -> None:
        self.port = free_port()
        args = [f"--port={self.port}", f"--num-cpus={num_cpus}", "--include-dashboard=false", "--head"]
        if self.system_config:
            args.append(f"--system-config={self.system_config}")
        self._start("head", args)

    def add_node(self, name: str = "worker", num_cpus: int = 1) -> None:
        self._start(name, [f"--address={self.address}", f"--num-cpus={num_cpus}"])

    def _start(self, name: str, args: list[str]) -> None:
        log = open(self.dir / f"{name}.log", "w")  # noqa: SIM115 (the process's output, closed with it)
        extra = ["--disable-usage-stats", "--block", f"--dashboard-agent-listen-port={free_port()}"]
        self.procs[name] = subprocess.Popen(
            [RAY, "start", *args, *extra], stdout=log, stderr=subprocess.STDOUT, env=self.env(), cwd=self.dir
        )

    def wait_nodes(self, n: int, timeout: float = 60) -> list:
        """Wait until ``n`` nodes are alive and every `ray start` has finished starting (it records the head's
        address in ray_current_cluster last); returns the nodes' GcsNodeInfo."""
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end:
            logs = {name: (self.dir / f"{name}.log").read_text() for name in self.procs}
            for name, p in self.procs.items():
                assert p.poll() is None, f"ray start ({name}) exited: {logs[name][-2000:]}"
            with contextlib.suppress(Exception):
                alive = [x for x in self.nodes() if x.state == 0]
                if len(alive) >= n and all("will now block forever" in text for text in logs.values()):
                    return alive
            time.sleep(0.5)
        raise AssertionError(f"{n} Ray nodes not alive after {timeout}s")

    def kill(self, name: str) -> None:
        """Lose a node: SIGKILL its `ray start`, whose processes die with it (PR_SET_PDEATHSIG)."""
        p = self.procs.pop(name)
        p.send_signal(signal.SIGKILL)
        p.wait(30)

    # ---------------------------------------------------------------------------- the GCS, read over gRPC
    def _gcs(self, method: str, request):
        import grpc
        from ray.core.generated import gcs_service_pb2_grpc as gg

        stub = {"GetAllNodeInfo": gg.NodeInfoGcsServiceStub, "GetAllActorInfo": gg.ActorInfoGcsServiceStub,
                "GetAllJobInfo": gg.JobInfoGcsServiceStub}[method]  # fmt: skip
        metadata = (("authorization", f"Bearer {self.token}"),) if self.token else ()
        with grpc.insecure_channel(self.address) as ch:
            return getattr(stub(ch), method)(request, timeout=5, metadata=metadata)

    def nodes(self) -> list:
        from ray.core.generated import gcs_service_pb2 as g

        return list(self._gcs("GetAllNodeInfo", g.GetAllNodeInfoRequest()).node_info_list)

    def node_ids(self, alive: bool = True) -> dict[str, bool]:
        """node id (hex) -> whether it is the head, for the alive nodes (or all)."""
        return {n.node_id.hex(): n.is_head_node for n in self.nodes() if n.state == 0 or not alive}

    def actors(self) -> list[tuple[str, str, str, int]]:
        """(name, state, node id, pid) of every actor the GCS knows."""
        from ray.core.generated import gcs_pb2
        from ray.core.generated import gcs_service_pb2 as g

        states = gcs_pb2.ActorTableData.ActorState
        reply = self._gcs("GetAllActorInfo", g.GetAllActorInfoRequest())
        return [(a.name, states.Name(a.state), a.address.node_id.hex(), a.pid) for a in reply.actor_table_data]

    def jobs(self) -> int:
        from ray.core.generated import gcs_service_pb2 as g

        return len(self._gcs("GetAllJobInfo", g.GetAllJobInfoRequest()).job_info_list)

    # ---------------------------------------------------------------------------- cleanup
    def leftovers(self) -> list[int]:
        """Processes still naming this cluster's directory (Ray's processes carry it in their arguments)."""
        mine = str(self.dir)
        out = []
        for d in Path("/proc").iterdir():
            if d.name.isdigit() and int(d.name) != os.getpid():
                with contextlib.suppress(OSError):
                    if mine in (d / "cmdline").read_bytes().decode(errors="replace"):
                        out.append(int(d.name))
        return out

    def stop(self) -> list[int]:
        """Kill every node by its process id, then whatever still names the directory; returns those (none, if
        the nodes' processes died with them)."""
        for name in list(self.procs):
            self.kill(name)
        t_end = time.monotonic() + 15
        while (left := self.leftovers()) and time.monotonic() < t_end:
            time.sleep(0.5)  # processes that notice their raylet is gone exit by themselves
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.dir, ignore_errors=True)
        return left


def fake_config(path: Path, **over) -> str:
    """A serve config with the fake engine, ports the OS picks, and ``over`` merged in."""
    raw = {
        "name": "nodes",
        "model": "fake",
        "replicas": 2,
        "replica": {"num_cpus": 1, "report_interval_s": 0.5},
        "engine": {"kind": "fake", "fake_token_delay_s": 0.02},
        "placement": {"dead_after_s": 3.0},
        "gateway": {"port": 0, "http_port": "any", "place_timeout_s": 20},
        "ray": {"connect_timeout_s": 60},
    }
    for k, v in over.items():
        raw[k] = {**raw[k], **v} if isinstance(v, dict) and isinstance(raw.get(k), dict) else v
    path.write_text(yaml.safe_dump(raw))
    return str(path)


class Serve:
    """`vtoken serve` as a subprocess, its output collected; ``stop()`` sends Ctrl-C, then SIGKILL by its id."""

    def __init__(self, config: str, *args: str, env: dict[str, str], cwd: Path = ROOT):
        d = Path(config).parent
        self.port_file, self.http_file = d / "grpc.port", d / "http.port"
        for f in (self.port_file, self.http_file):
            f.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "vtoken.cli", "serve", "--config", config, "--port-file", str(self.port_file),
               "--http-port-file", str(self.http_file), *args]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd, env=env)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self._reader.start()

    @property
    def out(self) -> str:
        return "".join(self.lines)

    def wait_serving(self, timeout: float = 120, http: bool = True) -> None:
        t_end = time.monotonic() + timeout
        while not (self.port_file.exists() and (self.http_file.exists() or not http)):
            assert self.proc.poll() is None, self.out
            assert time.monotonic() < t_end, f"not serving after {timeout}s:\n{self.out}"
            time.sleep(0.2)
        self.grpc = f"127.0.0.1:{self.port_file.read_text()}"
        self.url = f"http://127.0.0.1:{self.http_file.read_text()}" if http else ""

    def stop(self, timeout: float = 60) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._reader.join(5)
        return self.proc.returncode

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)
        self._reader.join(5)


def status(grpc_address: str) -> dict:
    """`vtoken status --json` as a client calls it (through the gRPC door, in this process)."""
    import grpc

    from cluster.control.status import from_proto
    from cluster.proto import vtoken_pb2 as pb
    from cluster.proto import vtoken_pb2_grpc as pbg

    with grpc.insecure_channel(grpc_address) as ch:
        return from_proto(pbg.VTokenStub(ch).GetClusterStatus(pb.ClusterStatusRequest(), timeout=10))


class Load:
    """Clients streaming chat completions without pause, each outcome kept: "OK", "midstream-<code>" (an error
    event after the first chunk), the HTTP status of a refusal, or the exception's name."""

    def __init__(self, url: str, clients: int = 3, max_tokens: int = 20, model: str = "fake"):
        self.url, self.max_tokens, self.model = url, max_tokens, model
        self.outcomes: list[tuple[float, float, str]] = []  # (start, end, outcome), time.monotonic()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]
        for t in self._threads:
            t.start()

    def _one(self, client) -> str:
        import json

        body = {"model": self.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": self.max_tokens,
                "stream": True}  # fmt: skip
        try:
            with client.stream("POST", self.url + "/v1/chat/completions", json=body, timeout=120) as r:
                if r.status_code != 200:
                    r.read()
                    return str(r.status_code)
                for line in r.iter_lines():
                    if line.startswith("data: {") and '"error"' in line:
                        return f"midstream-{json.loads(line[6:])['error']['code']}"
                return "OK"
        except Exception as e:
            return type(e).__name__

    def _run(self) -> None:
        import httpx

        with httpx.Client() as c:
            while not self._stop.is_set():
                t0 = time.monotonic()
                outcome = self._one(c)
                self.outcomes.append((t0, time.monotonic(), outcome))

    def stop(self) -> list[tuple[float, float, str]]:
        self._stop.set()
        for t in self._threads:
            t.join(60)
        return self.outcomes

    def count(self, since: float = 0.0) -> dict[str, int]:
        import collections

        return dict(collections.Counter(o for t0, _, o in self.outcomes if t0 >= since))
