"""The OpenAI-compatible HTTP front door: vLLM's own OpenAI app (its routes and serving classes: chat, completions,
Responses, models, tokenize and detokenize, with vLLM's validation and error shapes), served by uvicorn in the
`vtoken serve` process and event loop, next to gRPC. Every generation goes to the replicas through the remote engine
client (cluster/serving/remote_engine.py) and the one request path both doors share (cluster/serving/dispatch.py:
admission, placement, retries, aborts, metrics).

What is vToken's own sits around vLLM's app (cluster/doors/http_middleware.py: the bearer token, the body limit, the
``vtoken`` extension, admission, client disconnects, statuses that survive streaming) and beside it: ``GET /health``
(503 while no replica takes requests, for load balancers) and ``GET /metrics`` (the cluster's Prometheus series) answer
here, not in vLLM's app, whose versions know one engine.

The port is never shared (we bind it ourselves, without SO_REUSEPORT); another address than loopback needs TLS or
``allow_insecure_remote``; with ``auth_token_env`` every path but ``/health`` needs the same bearer token.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from cluster.config import ServeConfig
from cluster.doors.auth import auth_token
from cluster.doors.http_middleware import Door
from cluster.doors.sockets import bind_socket
from cluster.serving.dispatch import Dispatcher
from cluster.serving.frontend import Served
from cluster.serving.metrics import CONTENT_TYPE

log = logging.getLogger("vtoken.http")


class HttpGateway:
    def __init__(self, cfg: ServeConfig, controller: Any, dispatcher: Dispatcher, served: Served):
        self.cfg, self.g, self.controller, self.dispatcher = cfg, cfg.gateway, controller, dispatcher
        self.metrics = dispatcher.metrics
        self.vllm_app = served.app
        self.max_model_len = served.engine.model_config.max_model_len  # what bounds a request's max tokens
        self.template_variables = served.engine.template_variables  # what chat_template_kwargs may set
        self.own = Starlette(routes=[Route("/health", self.health), Route("/metrics", self.scrape)])
        self.server: _Server | None = None
        self._task: asyncio.Task | None = None

    # ------------------------------------------------------------------ server
    async def start(self) -> int:
        """Bind and serve; returns the port (``http_port: any`` picks a free one). Raises PortInUse."""
        sock = bind_socket(self.g.host, self.g.http_bind_port, "gateway.http_port", "--http-port")
        open_paths = () if self.g.health_requires_auth else ("/health",)
        door = Door(self.vllm_app, self, auth_token(self.g), open_paths, own=self.own)
        config = uvicorn.Config(
            door,
            log_config=None,  # the process's logging stays ours (a file by default, see cluster/cli.py)
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=5,
            ssl_certfile=self.g.tls_cert,
            ssl_keyfile=self.g.tls_key,
        )
        self.server = _Server(config)
        self._task = asyncio.ensure_future(self.server.serve(sockets=[sock]))
        while not self.server.started:
            if self._task.done():  # failed to start (a bad certificate): its exception, not a hang
                self._task.result()
                raise RuntimeError("the HTTP server stopped while starting")
            await asyncio.sleep(0.02)
        return sock.getsockname()[1]

    async def stop(self) -> None:
        if self.server is None or self._task is None:
            return
        self.server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(self._task), 10)
        if not self._task.done():
            self._task.cancel()

    # ------------------------------------------------------------------ our own routes
    async def health(self, request) -> Response:
        """200 while at least one replica takes requests, else 503 (for load balancers)."""
        try:
            snap = await asyncio.wait_for(self.controller.snapshot.remote(), 5)
        except Exception:
            return JSONResponse({"status": "controller unreachable"}, 503)
        healthy = sum(r.state.serving() for r in snap.replicas)
        return JSONResponse({"status": "ok" if healthy else "no healthy replica", "healthy_replicas": healthy},
                            200 if healthy else 503)  # fmt: skip

    async def scrape(self, request) -> Response:
        try:
            snap = await asyncio.wait_for(self.controller.snapshot.remote(), 5)
        except Exception as e:  # the gateway's own series still tell something
            log.warning("metrics: cannot read the controller: %s", e)
            snap = None
        return Response(self.metrics.render(snap), media_type=CONTENT_TYPE)


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: `vtoken serve` handles Ctrl-C itself (drain, then stop)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield
