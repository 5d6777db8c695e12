"""The gRPC front door: Generate (server streaming), GetClusterStatus, Scale, WatchCapacity (the capacity stream
for routers), plus the standard health service and server reflection (so `grpcurl` works). Runs in the
`vtoken serve` process on asyncio, next to the HTTP door (cluster/doors/http_server.py); both send every request
down the same path (cluster/serving/dispatch.py): admission, placement, the replica's stream, retries and aborts.

Generate's statuses: bad input INVALID_ARGUMENT (vLLM's own validation included), over ``max_inflight``
RESOURCE_EXHAUSTED, no replica or a replica lost mid-stream UNAVAILABLE, deadline DEADLINE_EXCEEDED, anything
unexpected INTERNAL with the request id (the traceback in the server log). vLLM's serving classes render the request,
as for HTTP (cluster/doors/grpc_requests.py), with vLLM's renderer (its tokenizer off the event loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import ray
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from cluster.config import ServeConfig
from cluster.control.capacity import CapacityFeed
from cluster.control.status import to_proto
from cluster.doors.auth import auth_token, bearer_ok
from cluster.doors.grpc_requests import parse, render, sampling_fields
from cluster.doors.sockets import PortInUse
from cluster.proto import vtoken_pb2 as pb
from cluster.serving.dispatch import Dispatcher, Refused, internal_message
from cluster.serving.frontend import Served
from cluster.serving.requests import CONTEXT, BadRequest, render_too_long
from cluster.serving.work import WorkTally, request_work

log = logging.getLogger("vtoken.gateway")
SERVICE = pb.DESCRIPTOR.services_by_name["VToken"].full_name
Code = grpc.StatusCode
DOOR = "grpc"


class Gateway:
    def __init__(self, cfg: ServeConfig, controller: Any, dispatcher: Dispatcher, served: Served | None):
        """``served``: vLLM's app over the replicas (cluster/serving/frontend.py), whose serving classes render
        Generate's requests; None serves only the control RPCs (tests of the server's start)."""
        self.cfg, self.g, self.controller, self.dispatcher = cfg, cfg.gateway, controller, dispatcher
        self.state = served.app.state if served is not None else None
        self.engine = served.engine if served is not None else None
        self.capacity = CapacityFeed(controller)
        self.server: grpc.aio.Server | None = None
        self.health = health.aio.HealthServicer()

    # ------------------------------------------------------------------ server
    async def start(self) -> int:
        """Bind and serve; returns the port (``port: 0`` picks a free one). Raises PortInUse."""
        token = auth_token(self.g)
        open_methods = () if self.g.health_requires_auth else (HEALTH_PREFIX,)
        self.server = grpc.aio.server(
            interceptors=[BearerAuth(token, open_methods, self.dispatcher.metrics)] if token else [],
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
                        "WatchCapacity": grpc.unary_stream_rpc_method_handler(
                            self.watch_capacity,
                            request_deserializer=pb.WatchCapacityRequest.FromString,
                            response_serializer=pb.CapacityUpdate.SerializeToString,
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
        await self.capacity.close()  # capacity streams end now rather than hold the grace period
        if self.server is not None:
            await self.server.stop(grace_s)

    # ------------------------------------------------------------------ RPCs
    async def get_cluster_status(self, request, context) -> pb.ClusterStatus:
        return to_proto(await self._ask(context, self.controller.status.remote()))

    async def scale(self, request, context) -> pb.ScaleResponse:
        limit, why = await self._ask(context, self.controller.replica_limit.remote())
        if not 1 <= request.replicas <= limit:
            await context.abort(Code.INVALID_ARGUMENT, f"replicas must be between 1 and {limit} ({why})")
        target = await self._ask(context, self.controller.scale.remote(request.replicas))
        return pb.ScaleResponse(target_replicas=target)

    async def _ask(self, context, ref, timeout_s: float = 10.0):
        """The controller's answer; UNAVAILABLE in one line when it is down or being restarted (never UNKNOWN with
        Ray's multi-line ActorDiedError)."""
        try:
            return await asyncio.wait_for(ref, timeout_s)
        except ray.exceptions.RayTaskError:  # the controller's own answer (an error of ours): not unavailability
            raise
        except (ray.exceptions.RayError, TimeoutError) as e:
            why = f"the controller is not answering ({type(e).__name__}; Ray restarts it): retry shortly"
            await context.abort(Code.UNAVAILABLE, why)

    async def watch_capacity(self, request, context) -> AsyncIterator[pb.CapacityUpdate]:
        seq = 0
        async for rows in self.capacity.watch(request.min_interval_s):
            seq += 1
            yield pb.CapacityUpdate(
                sequence=seq, time=time.time(), replicas=[pb.ReplicaCapacity(**r._asdict()) for r in rows]
            )

    async def generate(self, raw: bytes, context) -> AsyncIterator[pb.GenerateResponse]:
        """vLLM's serving classes render the request (cluster/doors/grpc_requests.py), the remote engine client streams
        it (the same path as HTTP's); each step's new text, token ids and log-probabilities are one response."""
        g = self.g
        try:
            msg = parse(raw)
            context_len = self.engine.model_config.max_model_len
            bs = self.cfg.engine.block_size
            work = request_work(DOOR, sampling_fields(msg.sampling), len(raw), g, context_len, bs)
            with self.dispatcher.admit(DOOR, work.tokens):
                stage = self.dispatcher.parse_stage(DOOR, len(raw))

                async def rendered():
                    await stage.turn()
                    return await render(msg, self.state, self.cfg.model_name, self.cfg.vtoken)

                try:
                    req = await asyncio.wait_for(rendered(), g.parse_timeout_s)
                except TimeoutError as e:
                    if render_too_long(e) is not None:  # vLLM's own bound on one template: its own message
                        raise
                    raise Refused(
                        "too_large",
                        f"rendering and tokenizing this request took over {g.parse_timeout_s:g} s "
                        "(gateway.parse_timeout_s); send a shorter request",
                    ) from None
                finally:
                    stage.end()
                ctx = req.context._replace(tally=WorkTally(g.max_request_tokens, bs))
                remaining = context.time_remaining()
                if remaining is not None and (ctx.deadline_s is None or remaining < ctx.deadline_s):
                    ctx = ctx._replace(deadline_s=remaining)
                n_prompt = len(req.prompt["prompt_token_ids"])
                # For the whole iteration: the engine client's generator reads it as it runs, in this task.
                CONTEXT.set(ctx)
                outputs = self.engine.generate(req.prompt, req.params, uuid.uuid4().hex)
                async with contextlib.aclosing(outputs):
                    async for out in outputs:
                        c = out.outputs[0]
                        yield pb.GenerateResponse(
                            request_id=ctx.client_id,
                            replica=ctx.seen.get("replica", ""),
                            text=c.text,
                            token_ids=c.token_ids,
                            finished=out.finished,
                            finish_reason=c.finish_reason or "",
                            prompt_tokens=n_prompt,
                            logprobs=_logprobs(c.token_ids, c.logprobs, req.params.logprobs),
                        )
        except BadRequest as e:
            self.dispatcher.metrics.refused(DOOR, "invalid_argument")
            await context.abort(Code.INVALID_ARGUMENT, str(e))
        except Refused as e:  # admission, or rendering past its bound
            await context.abort(grpc_code(e.code), e.message)
        except asyncio.CancelledError:  # the client cancelled or went away: its fault-free end, one INFO line
            log.info("gRPC request: the client went away; aborted")
            raise
        except Exception as e:  # the remote engine client's vLLM errors: the dispatcher's code where it refused
            if isinstance(e, grpc.aio.AbortError):
                raise
            code, message = _status(render_too_long(e) or e)
            if code == Code.INVALID_ARGUMENT:
                self.dispatcher.metrics.refused(DOOR, "invalid_argument")
            await context.abort(code, message)


def _status(e: Exception) -> tuple[grpc.StatusCode, str]:
    """A failure of vLLM's serving layer or of the dispatcher as a gRPC status and one line; our own faults are
    logged with an id the client sees."""
    from vllm.entrypoints.serve import create_error_response

    if isinstance(e.__cause__, Refused):
        return grpc_code(e.__cause__.code), e.__cause__.message
    err = create_error_response(e).error
    if err.code >= 500:
        rid = uuid.uuid4().hex
        log.error("gRPC request failed (server id %s)", rid, exc_info=e)
        return Code.INTERNAL, internal_message("", rid)
    return GRPC_CODE.get(err.code, Code.INVALID_ARGUMENT), err.message.splitlines()[0]


def grpc_code(code: str) -> grpc.StatusCode:
    """The dispatcher's code as gRPC's (``too_large`` has none of its own: RESOURCE_EXHAUSTED, as HTTP 413 maps)."""
    return Code.RESOURCE_EXHAUSTED if code == "too_large" else Code[code.upper()]


GRPC_CODE = {400: Code.INVALID_ARGUMENT, 404: Code.NOT_FOUND, 413: Code.RESOURCE_EXHAUSTED, 422: Code.INVALID_ARGUMENT,
             429: Code.RESOURCE_EXHAUSTED, 503: Code.UNAVAILABLE, 504: Code.DEADLINE_EXCEEDED}  # fmt: skip


def _logprobs(token_ids, logprobs, top: int | None) -> list[pb.TokenLogprob]:
    """vLLM's per-position ``{token_id: Logprob}`` (the sampled token, then the ``top`` most likely by rank) as the
    protobuf's; ``-inf`` clamped to -9999.0 as vLLM's serving layer clamps it for JSON."""
    if top is None or not logprobs:
        return []
    out = []
    for tid, position in zip(token_ids, logprobs):
        ranked = sorted(position.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)
        alts = [pb.TopLogprob(token_id=t, token=lp.decoded_token or "", logprob=max(lp.logprob, -9999.0))
                for t, lp in ranked[:top]]  # fmt: skip
        sampled = position.get(tid)
        token, value = ((sampled.decoded_token or ""), max(sampled.logprob, -9999.0)) if sampled else ("", -9999.0)
        out.append(pb.TokenLogprob(token_id=tid, token=token, logprob=value, top=alts))
    return out


HEALTH_PREFIX = "/grpc.health.v1.Health/"


class BearerAuth(grpc.aio.ServerInterceptor):
    """Every call must carry ``authorization: Bearer <token>`` (the scheme in any case, RFC 7235 2.1), except
    the methods under ``open_prefixes`` (by default the health service: load-balancer probes send no token)."""

    def __init__(self, token: str, open_prefixes: tuple[str, ...] = (), metrics=None):
        self.token, self.open, self.metrics = token, open_prefixes, metrics

    def _allowed(self, details) -> bool:
        if self.open and details.method.startswith(self.open):
            return True
        return bearer_ok(dict(details.invocation_metadata or ()).get("authorization", ""), self.token)

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or self._allowed(details):
            return handler
        if self.metrics is not None and details.method == f"/{SERVICE}/Generate":
            self.metrics.refused(DOOR, "unauthenticated")

        async def deny(request, context):
            await context.abort(Code.UNAUTHENTICATED, "missing or wrong bearer token")

        kind = next(k for k in ("unary_unary", "unary_stream", "stream_unary", "stream_stream") if getattr(handler, k))
        return getattr(grpc, f"{kind}_rpc_method_handler")(
            deny, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
        )
