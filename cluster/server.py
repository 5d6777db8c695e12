"""Starting and stopping a whole deployment: Ray (embedded or joined), the controller actor, the gateways
(gRPC, and OpenAI-compatible HTTP unless ``gateway.http_port`` is 0), which share one dispatcher.

async with serving(cfg) as s:          # in an asyncio program (vtoken serve)
    print(s.port, s.http_port)
with BackgroundServer(cfg) as s:       # from synchronous code (tests, the goodput script)
    grpc.insecure_channel(f"127.0.0.1:{s.port}")
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import ray

from actors.report import ReplicaReport
from cluster.config import ServeConfig, preflight
from cluster.control.controller import Controller
from cluster.doors.grpc_server import Gateway
from cluster.doors.sockets import check_port
from cluster.ray_connect import RayUnavailable, connect  # noqa: F401 (RayUnavailable: re-exported)
from cluster.serving.dispatch import Dispatcher
from cluster.serving.frontend import serving_app
from cluster.serving.metrics import Metrics

log = logging.getLogger("vtoken.server")


def start_ray(cfg: ServeConfig, address: str | None = None, verbose: bool = True) -> bool:
    """Join ``address`` (or cfg.ray.address), else start a local Ray of our own (never one ``ray start`` left
    behind), within ``ray.connect_timeout_s`` (cluster/ray_connect.py; RayUnavailable with one line otherwise).
    True when local. Not ``verbose``: Ray's own messages go to the log (ERROR and up on the terminal), and the
    workers' output (the replicas, vLLM's EngineCore under them) stays in Ray's session logs; the workers log
    quietly too, through the environment they inherit (vtoken.cli.QUIET_ENV), so those files stay small."""
    if not ray.is_initialized():
        log.info("vtoken: %s", connect(cfg, address, verbose))
    return not (address or cfg.ray.address)


@dataclass
class Served:
    port: int  # gRPC
    controller: Any
    gateway: Gateway
    http_port: int | None = None  # None: HTTP off
    http: Any = None  # cluster.doors.http_server.HttpGateway
    final_reports: list[ReplicaReport] = field(default_factory=list)


@contextlib.asynccontextmanager
async def serving(
    cfg: ServeConfig,
    local: bool = True,
    start_timeout_s: float = 600,
    progress: Callable[[list[dict[str, str]], float], None] | None = None,
) -> AsyncIterator[Served]:
    """Controller + replicas + gateway; on exit the gateway stops, every replica drains, and ``final_reports``
    holds each replica's last report (all blocks free after a clean drain). Raises ConfigError or PortInUse
    before starting anything when the deployment cannot start here, RuntimeError (one line: vLLM's own reason)
    when a replica's engine cannot start. ``progress(rows, seconds)``: called about once a second while the
    replicas start, with each replica's state, what it is doing and why it failed (Controller.progress)."""
    preflight(cfg, local)
    check_ports(cfg)
    clear_leftovers(cfg)
    ctl = start_controller(cfg, local)
    gateway = http = None
    try:
        # vLLM's serving layer (both doors render with it) imports for ~10 s: while the replicas start, not after.
        doors_module = _import_doors()
        healthy = await _start_replicas(ctl, start_timeout_s, progress)
        if healthy < cfg.replicas:
            raise RuntimeError(f"only {healthy} of {cfg.replicas} replicas started in {start_timeout_s:g} s")
        # One import of transformers at a time: its lazy modules (and accelerate's) are not safe to import from
        # two threads at once, and vLLM's serving layer reaches them ("cannot import name 'AutoTokenizer' ...
        # partially initialized module", seen when the replicas started faster than the import). So the gateway's
        # config and tokenizer load after the import.
        http_module = await doors_module
        dispatcher = Dispatcher(cfg, ctl, Metrics(cfg.model_name))
        app = await serving_app(cfg, dispatcher)
        gateway = Gateway(cfg, ctl, dispatcher, app)
        served = Served(await gateway.start(), ctl, gateway)
        if cfg.gateway.http_enabled:
            http = http_module.HttpGateway(cfg, ctl, dispatcher, app)
            served.http, served.http_port = http, await http.start()
        log.info(
            "vtoken serving %s on %s:%d (gRPC), HTTP %s, with %d replicas",
            cfg.model,
            cfg.gateway.host,
            served.port,
            served.http_port or "off",
            healthy,
        )
        yield served
    finally:
        if http is not None:
            await http.stop()
        if gateway is not None:
            await gateway.stop()
            if gateway.engine is not None:
                gateway.engine.shutdown()
            await gateway.dispatcher.aclose()
        try:
            finals = await ctl.shutdown.remote()
        except ray.exceptions.RayError:
            finals = []
        ray.kill(ctl, no_restart=True)
        kill_replicas(cfg, "left after the controller's shutdown")  # a controller that died while draining
        if "served" in locals():
            served.final_reports = finals


async def _start_replicas(ctl, timeout_s: float, progress) -> int:
    """The controller's start (replicas created, waited for until healthy), watched: ``progress`` sees each
    replica's state about once a second. A replica whose engine cannot start ends it with a RuntimeError of one
    line (the controller's reason, not Ray's remote traceback)."""
    from cluster.control.lifecycle import start_error

    loop = asyncio.get_running_loop()
    t0 = loop.time()
    start = asyncio.ensure_future(ctl.start.remote(timeout_s))
    try:
        while True:
            done, _ = await asyncio.wait({start}, timeout=1.0)
            if progress is not None:
                with contextlib.suppress(Exception):  # progress is for people: never a reason to fail
                    progress(await asyncio.wait_for(ctl.progress.remote(), 5), loop.time() - t0)
            if done:
                return start.result()
    except ray.exceptions.RayTaskError as e:
        raise RuntimeError(start_error(e)) from None
    finally:
        start.cancel()


def start_controller(cfg: ServeConfig, local: bool):
    """The controller actor, on this node (the one `vtoken serve` runs on) and nowhere else: a controller on a
    node that may go took the service with it (replicas then died with their owner; now they are detached, see
    cluster/control/lifecycle.py). Pinned with Ray's node affinity, not soft: if this node goes, so does `vtoken serve`
    and its gateways, and the controller has nothing left to serve. Ray restarts it when it dies
    (``max_restarts``); the new incarnation takes over the live replicas (cluster/control/controller.py)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    return (
        ray.remote(Controller)
        .options(
            name=f"{cfg.name}-controller",
            num_cpus=0,
            max_concurrency=10000,
            max_restarts=-1,
            scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False),
        )
        .remote(cfg.model_dump(), local)
    )


def clear_leftovers(cfg: ServeConfig) -> None:
    """Before a start: a service of this name that still serves in this namespace is an error (ValueError, one
    line); replicas left by one that ended without a shutdown (killed, its node lost) are killed, so a new start
    never finds their names taken."""
    try:
        ray.get_actor(f"{cfg.name}-controller")
    except ValueError:  # no controller of this name: no service of this name runs
        kill_replicas(cfg, "left by an earlier vtoken serve of this name")
        return
    raise ValueError(
        f"name: a service named {cfg.name!r} already runs in Ray namespace {cfg.ray.namespace!r} (its controller "
        "is alive); stop it, or give this one another name or ray.namespace"
    )


def kill_replicas(cfg: ServeConfig, why: str) -> int:
    """Kill every replica of this service still registered under its name (they are detached: nothing else
    would). Returns how many."""
    from cluster.control.lifecycle import replica_names

    killed = 0
    for name in replica_names(cfg.name):
        with contextlib.suppress(ValueError):  # gone meanwhile
            ray.kill(ray.get_actor(name), no_restart=True)
            killed += 1
            log.warning("replica %s killed: %s", name, why)
    return killed


def _import_doors() -> asyncio.Future:
    """cluster.doors.http_server (and vLLM's serving layer under it), imported in a daemon thread: a Ctrl-C during
    start-up then exits at once instead of waiting for the import to finish (asyncio.to_thread's threads are joined
    at exit)."""
    loop, done = asyncio.get_running_loop(), asyncio.get_running_loop().create_future()

    def settle(set_it) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is gone: start-up was interrupted
            loop.call_soon_threadsafe(lambda: done.done() or set_it())

    def run():
        try:
            import cluster.doors.http_server as module
        except BaseException as e:  # handed to the coroutine that awaits the import
            settle(lambda e=e: done.set_exception(e))
        else:
            settle(lambda: done.set_result(module))

    threading.Thread(target=run, name="import-doors", daemon=True).start()
    return done


def check_ports(cfg: ServeConfig) -> None:
    """Both doors' ports are free (PortInUse naming the field and the flag otherwise), before anything starts."""
    g = cfg.gateway
    check_port(g.host, g.port)
    if g.http_enabled:
        check_port(g.host, g.http_bind_port, "gateway.http_port", "--http-port")


class BackgroundServer:
    """``serving`` on an event loop in a thread, for synchronous callers."""

    def __init__(self, cfg: ServeConfig, local: bool = True, start_timeout_s: float = 600):
        self.cfg, self.local, self.timeout = cfg, local, start_timeout_s
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._cm = None
        self.served: Served | None = None

    def __enter__(self) -> Served:
        self._thread.start()
        self._cm = serving(self.cfg, self.local, self.timeout)
        try:
            self.served = self.call(self._cm.__aenter__(), self.timeout + 60)
        except BaseException:
            self.loop.call_soon_threadsafe(self.loop.stop)
            raise
        return self.served

    def call(self, coro, timeout: float | None = None):
        """Run a coroutine on the server's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def ray_call(self, ref, timeout: float = 60):
        async def wait():
            return await ref

        return self.call(wait(), timeout)

    def __exit__(self, *exc) -> None:
        try:
            self.call(self._cm.__aexit__(None, None, None), 120)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
