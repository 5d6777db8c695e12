"""The gRPC front door: Generate (server streaming), GetClusterStatus, Scale, plus the standard health
service and server reflection (so `grpcurl` works). Runs in the `vtoken serve` process on asyncio.

A request's path: admission (bounded: ``max_inflight``, else RESOURCE_EXHAUSTED) -> validation
(INVALID_ARGUMENT) -> placement by the controller -> a Ray streaming call to the replica. A replica that
dies before the first token: the request is placed again elsewhere (``max_attempts``); after it: the
stream ends with UNAVAILABLE. Deadlines and client cancellation abort the request in the engine.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import socket
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import ray
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from actors.engines import Chunk, GenerateSpec
from cluster.config import ConfigError, ServeConfig
from cluster.placement import estimate_blocks
from cluster.proto import vtoken_pb2 as pb
from cluster.requests import BadRequest, Tokenizer, parse, validate
from cluster.status import to_proto

log = logging.getLogger("vtoken.gateway")
SERVICE = pb.DESCRIPTOR.services_by_name["VToken"].full_name
Code = grpc.StatusCode


class Gateway:
    def __init__(self, cfg: ServeConfig, controller: Any, tokenizer: Tokenizer):
        self.cfg, self.g, self.controller, self.tok = cfg, cfg.gateway, controller, tokenizer
        self.inflight = 0
        self.server: grpc.aio.Server | None = None
        self.health = health.aio.HealthServicer()
        v = cfg.vtoken
        self._budget = (v.get("budget"), v.get("sink", 0), v.get("recent", 0)) if v.get("mode") != "off" else None

    # ------------------------------------------------------------------ server
    async def start(self) -> int:
        """Bind and serve; returns the port (``port: 0`` picks a free one). Raises PortInUse."""
        token = os.environ.get(self.g.auth_token_env) if self.g.auth_token_env else None
        if self.g.auth_token_env and not token:
            raise ConfigError(f"gateway.auth_token_env: the environment variable {self.g.auth_token_env} is not set")
        open_methods = () if self.g.health_requires_auth else (HEALTH_PREFIX,)
        self.server = grpc.aio.server(
            interceptors=[BearerAuth(token, open_methods)] if token else [],
            options=[
                ("grpc.max_receive_message_length", self.g.max_request_bytes),
                # gRPC sets SO_REUSEPORT by default: a second server on a busy port would start and share the
                # connections with whatever holds it. A busy port must be an error instead.
                ("grpc.so_reuseport", 0),
            ],
        )
        self.server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    SERVICE,
                    {
                        "Generate": grpc.unary_stream_rpc_method_handler(
                            self.generate, response_serializer=pb.GenerateResponse.SerializeToString
                        ),
                        "GetClusterStatus": grpc.unary_unary_rpc_method_handler(
                            self.get_cluster_status,
                            request_deserializer=pb.ClusterStatusRequest.FromString,
                            response_serializer=pb.ClusterStatus.SerializeToString,
                        ),
                        "Scale": grpc.unary_unary_rpc_method_handler(
                            self.scale,
                            request_deserializer=pb.ScaleRequest.FromString,
                            response_serializer=pb.ScaleResponse.SerializeToString,
                        ),
                    },
                ),
            )
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), self.server
        )
        addr = f"{self.g.host}:{self.g.port}"
        creds = None
        if self.g.tls_cert:
            creds = grpc.ssl_server_credentials(
                [(Path(self.g.tls_key).read_bytes(), Path(self.g.tls_cert).read_bytes())]
            )
        try:
            port = self.server.add_secure_port(addr, creds) if self.g.tls_cert else self.server.add_insecure_port(addr)
        except RuntimeError:  # gRPC's "Failed to bind to address"
            raise PortInUse(self.g.host, self.g.port) from None
        await self.server.start()
        for name in ("", SERVICE):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        return port

    async def stop(self, grace_s: float = 5.0) -> None:
        await self.health.enter_graceful_shutdown()
        if self.server is not None:
            await self.server.stop(grace_s)

    # ------------------------------------------------------------------ RPCs
    async def get_cluster_status(self, request, context) -> pb.ClusterStatus:
        return to_proto(await self.controller.status.remote())

    async def scale(self, request, context) -> pb.ScaleResponse:
        limit, why = await self.controller.replica_limit.remote()
        if not 1 <= request.replicas <= limit:
            await context.abort(Code.INVALID_ARGUMENT, f"replicas must be between 1 and {limit} ({why})")
        return pb.ScaleResponse(target_replicas=await self.controller.scale.remote(request.replicas))

    async def generate(self, raw: bytes, context) -> AsyncIterator[pb.GenerateResponse]:
        if self.inflight >= self.g.max_inflight:
            await context.abort(
                Code.RESOURCE_EXHAUSTED,
                f"server busy: {self.inflight} requests in flight (limit {self.g.max_inflight}); retry later",
            )
        try:
            req = validate(parse(raw), self.tok, self.cfg.engine.max_model_len, self.g.max_prompt_chars)
        except BadRequest as e:
            await context.abort(Code.INVALID_ARGUMENT, str(e))
        # The engine, the replica and the controller know a request by this id only: clients may reuse theirs
        # (or send the same one on several streams), and cancelling one stream must not touch another.
        rid = uuid.uuid4().hex
        self.inflight += 1
        try:
            async for msg in self._serve(req, rid, context):
                yield msg
        except grpc.aio.AbortError:  # context.abort: the status is set
            raise
        except Exception:  # a bug or a Ray failure: the traceback goes to the log, never to the client
            log.exception("request %s (client id %r) failed", rid, req.request_id)
            await context.abort(Code.INTERNAL, internal_message(req.request_id, rid))
        finally:
            self.inflight -= 1
            self.controller.finished.remote(rid)  # release the promise whatever happened

    async def _serve(self, req, rid: str, context) -> AsyncIterator[pb.GenerateResponse]:
        loop = asyncio.get_running_loop()
        limits = [t for t in (context.time_remaining(), req.deadline_s) if t is not None]
        deadline = loop.time() + min(limits) if limits else None
        need = estimate_blocks(
            len(req.prompt_token_ids), req.sampling.max_tokens, self.cfg.engine.block_size, *(self._budget or ())
        )
        spec = GenerateSpec(rid, req.prompt_token_ids, _vllm_sampling(req.sampling))
        tried: list[str] = []
        for _ in range(self.g.max_attempts):
            placed = await self._place(rid, need, tried, deadline)
            if placed is None:
                await context.abort(Code.UNAVAILABLE, "no live replica could take the request")
            name, replica = placed
            tried.append(name)
            stream = replica.generate.options(num_returns="streaming").remote(spec)
            streamed, done = 0, False
            try:
                while True:
                    timeout = None if deadline is None else max(deadline - loop.time(), 0.001)
                    try:
                        chunk = await asyncio.wait_for(_next(stream), timeout)
                    except TimeoutError:
                        await context.abort(Code.DEADLINE_EXCEEDED, "deadline exceeded")
                    if chunk is None or chunk.error or chunk.finish_reason == "abort":
                        done = True  # the server ended it (failure, drain, engine restart), not the client
                        code, why = failure(chunk, name)
                        if code == Code.UNAVAILABLE and not streamed:
                            log.info("request %s: %s before its first token; placing it again", rid, why)
                            break
                        if code == Code.INTERNAL:
                            log.error("request %s (client id %r): %s", rid, req.request_id, why)
                            why = internal_message(req.request_id, rid)
                        elif code == Code.UNAVAILABLE:
                            why = f"{why} after {streamed} chunks; retry the request"
                        await context.abort(code, why)
                    streamed += 1
                    done = chunk.finished
                    yield pb.GenerateResponse(
                        request_id=req.request_id,
                        replica=name,
                        text=chunk.text,
                        token_ids=chunk.token_ids,
                        finished=chunk.finished,
                        finish_reason=chunk.finish_reason,
                        prompt_tokens=len(req.prompt_token_ids),
                    )
                    if chunk.finished:
                        return
            except ray.exceptions.RayActorError as e:
                done = True  # nothing left to abort on a dead replica
                self.controller.mark_failed.remote(name, f"{type(e).__name__} during a request")
                if streamed:
                    await context.abort(Code.UNAVAILABLE, f"replica {name} died mid-stream; retry the request")
                log.warning("replica %s died before request %s started; placing it again", name, rid)
            finally:
                if not done:  # cancelled, deadline, or the client went away: free its blocks now
                    ray.cancel(stream)
                    replica.abort.remote(rid)
        await context.abort(Code.UNAVAILABLE, f"request failed on {len(tried)} replicas: {', '.join(tried)}")

    async def _place(self, rid: str, need: int, tried: list[str], deadline: float | None):
        """Ask the controller until a replica is available (it may be restarting), up to place_timeout_s."""
        loop = asyncio.get_running_loop()
        t_end = loop.time() + self.g.place_timeout_s
        if deadline is not None:
            t_end = min(t_end, deadline)
        while True:
            placed = await self.controller.place.remote(rid, need, tuple(tried))
            if placed is None and tried:  # everything else is down: the one that failed may be back
                placed = await self.controller.place.remote(rid, need, ())
            if placed is not None or loop.time() >= t_end:
                return placed
            await asyncio.sleep(0.2)


# Chunk.code (actors.engines.ERROR_CODES) -> what the client gets.
GRPC_CODES = {"invalid_argument": Code.INVALID_ARGUMENT, "unavailable": Code.UNAVAILABLE, "internal": Code.INTERNAL}


def failure(chunk: Chunk | None, replica: str) -> tuple[grpc.StatusCode, str]:
    """How a stream ends for the client when the server ended it: a failed request's code and one-line
    reason; a request the replica aborted (vLLM's finish_reason "abort", or a stream that stopped before its
    finished chunk) is UNAVAILABLE: never OK, the client did not ask for it."""
    if chunk is None or (chunk.finish_reason == "abort" and not chunk.error):
        return Code.UNAVAILABLE, f"the request was aborted by replica {replica}"
    return GRPC_CODES.get(chunk.code, Code.INTERNAL), chunk.error


def internal_message(client_id: str, rid: str) -> str:
    return f"internal error serving request {client_id!r} (server id {rid}); the server log has the details"


async def _next(stream):
    try:
        return await (await stream.__anext__())
    except StopAsyncIteration:
        return None


def _vllm_sampling(s) -> dict[str, Any]:
    out = s.model_dump(exclude_none=True)
    if not out["stop"]:
        out.pop("stop")
    return out


class PortInUse(ValueError):
    def __init__(self, host: str, port: int, why: str = "in use"):
        super().__init__(
            f"gateway.port: {host}:{port} is {why}; stop what holds it or choose another port (--port, 0 picks a "
            "free one)"
        )


def check_port(host: str, port: int) -> None:
    """Raise PortInUse now, before anything starts, if the gateway could not bind ``host:port`` (0: any)."""
    if port == 0:
        return
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise ValueError(f"gateway.host: cannot resolve {host!r}: {e}") from None
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC does: a port in TIME_WAIT is free
        try:
            s.bind(addr)
        except OSError as e:
            raise PortInUse(host, port, e.strerror.lower() if e.strerror else "in use") from None


HEALTH_PREFIX = "/grpc.health.v1.Health/"


class BearerAuth(grpc.aio.ServerInterceptor):
    """Every call must carry ``authorization: Bearer <token>`` (the scheme in any case, RFC 7235 2.1), except
    the methods under ``open_prefixes`` (by default the health service: load-balancer probes send no token)."""

    def __init__(self, token: str, open_prefixes: tuple[str, ...] = ()):
        self.token, self.open = token.encode(), open_prefixes

    def _allowed(self, details) -> bool:
        if self.open and details.method.startswith(self.open):
            return True
        scheme, _, credentials = dict(details.invocation_metadata or ()).get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(credentials.strip().encode(), self.token)

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or self._allowed(details):
            return handler

        async def deny(request, context):
            await context.abort(Code.UNAUTHENTICATED, "missing or wrong bearer token")

        kind = next(k for k in ("unary_unary", "unary_stream", "stream_unary", "stream_stream") if getattr(handler, k))
        return getattr(grpc, f"{kind}_rpc_method_handler")(
            deny, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
        )
