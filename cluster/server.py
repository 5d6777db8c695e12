"""Starting and stopping a whole deployment: Ray (embedded or joined), the controller actor, the gateway.

async with serving(cfg) as s:          # in an asyncio program (vtoken serve)
    print(s.port)
with BackgroundServer(cfg) as s:       # from synchronous code (tests, the goodput script)
    grpc.insecure_channel(f"127.0.0.1:{s.port}")
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import ray

from actors.report import ReplicaReport
from cluster.config import ServeConfig, preflight
from cluster.controller import REPLICA_ENV, Controller
from cluster.gateway import Gateway, check_port
from cluster.requests import Tokenizer

log = logging.getLogger("vtoken.server")


def start_ray(cfg: ServeConfig, address: str | None = None) -> bool:
    """Join ``address`` (or cfg.ray.address), else start an embedded local Ray. True when local."""
    address = address or cfg.ray.address
    if not ray.is_initialized():
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        kw: dict[str, Any] = {
            "namespace": cfg.ray.namespace,
            "include_dashboard": False,
            "runtime_env": {"env_vars": REPLICA_ENV},
        }
        if address:
            ray.init(address=address, **kw)
        else:
            ray.init(num_cpus=cfg.ray.num_cpus, **kw)
    return address is None


@dataclass
class Served:
    port: int
    controller: Any
    gateway: Gateway
    final_reports: list[ReplicaReport] = field(default_factory=list)


@contextlib.asynccontextmanager
async def serving(cfg: ServeConfig, local: bool = True, start_timeout_s: float = 600) -> AsyncIterator[Served]:
    """Controller + replicas + gateway; on exit the gateway stops, every replica drains, and ``final_reports``
    holds each replica's last report (all blocks free after a clean drain). Raises ConfigError or PortInUse
    before starting anything when the deployment cannot start here."""
    preflight(cfg, local)
    check_port(cfg.gateway.host, cfg.gateway.port)
    ctl = (
        ray.remote(Controller)
        .options(name=f"{cfg.name}-controller", num_cpus=0, max_concurrency=10000)
        .remote(cfg.model_dump(), local)
    )
    gateway = None
    try:
        healthy = await ctl.start.remote(start_timeout_s)
        if healthy < cfg.replicas:
            raise RuntimeError(f"only {healthy} of {cfg.replicas} replicas started")
        folder = None if cfg.engine.kind == "fake" else cfg.model_folder()
        gateway = Gateway(cfg, ctl, await asyncio.to_thread(Tokenizer, folder))
        served = Served(await gateway.start(), ctl, gateway)
        log.info("vtoken serving %s on %s:%d with %d replicas", cfg.model, cfg.gateway.host, served.port, healthy)
        yield served
    finally:
        if gateway is not None:
            await gateway.stop()
        try:
            finals = await ctl.shutdown.remote()
        except ray.exceptions.RayError:
            finals = []
        ray.kill(ctl, no_restart=True)
        if "served" in locals():
            served.final_reports = finals


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
