"""The OpenAI-compatible HTTP front door (FastAPI on uvicorn, in the `vtoken serve` process and event loop,
next to gRPC): ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (whole or as
server-sent events), ``POST /tokenize`` and ``POST /detokenize`` (as vLLM serves them: benchmark clients align
their prompts' lengths with them), ``GET /health``, ``GET /metrics`` (Prometheus).

It keeps the gRPC door's promises: requests go down the same path (cluster/dispatch.py: the same admission
limit, placement, retries, aborts and metrics), the server picks each request's id, bad input is 400 with
one line naming the field (vLLM's own validation included), anything unexpected is 500 with the request id
and no traceback (that goes to the log), the port is never shared (we bind it ourselves, without
SO_REUSEPORT), another address than loopback needs TLS or ``allow_insecure_remote``, and with
``auth_token_env`` every path but ``/health`` needs the same bearer token. A client that disconnects aborts
its request at once, so its blocks are free again.

Rendering and tokenizing run off the event loop (cluster/parsing.py), so no request's parsing holds up another
client's ``/health``, chat or gRPC call.

Statuses: 400 bad input, 401 token, 404 unknown model or path, 413 body over ``max_request_bytes`` or a parse
over ``parse_timeout_s``, 429 over ``max_inflight``, 503 no replica (or a replica lost before the answer started, or
no parse worker free), 504 deadline, 500 a bug. A
client that goes away (mid-body, while waiting, mid-stream) is one INFO line in the log (499, which nobody
reads): the console shows ERROR only for our own faults.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from vllm.entrypoints.serve.engine.protocol import ModelCard, ModelList

from cluster.auth import auth_token, bearer_ok
from cluster.config import ServeConfig
from cluster.dispatch import Dispatcher, Refused, internal_message
from cluster.gateway import bind_socket
from cluster.metrics import CONTENT_TYPE
from cluster.openai_requests import ModelNotFound, chat_request, completion_request, load_json, tokenize_response
from cluster.openai_responses import DONE, HTTP_STATUS, Answer, error_body
from cluster.parsing import ParseBusy, ParsePool, ParseTooLong
from cluster.requests import BadRequest, Tokenizer

log = logging.getLogger("vtoken.http")
DOOR = "http"


class ClientGone(Exception):
    """The client disconnected before the answer (or its first chunk) was ready, or while sending its body.

    A client that goes away is not our fault: it is logged at INFO in one line, never as an ERROR with a
    traceback (50 clients gone mid-body once printed 2,200 lines on the console)."""


class HttpGateway:
    def __init__(
        self, cfg: ServeConfig, controller: Any, tokenizer: Tokenizer, dispatcher: Dispatcher, parser: ParsePool
    ):
        self.cfg, self.g, self.controller, self.tok, self.dispatcher = (
            cfg, cfg.gateway, controller, tokenizer, dispatcher,
        )  # fmt: skip
        self.parser = parser  # rendering and tokenizing, off this event loop (cluster/parsing.py)
        self.metrics = dispatcher.metrics
        self.server: _Server | None = None
        self._task: asyncio.Task | None = None
        self.app = self._app()

    # ------------------------------------------------------------------ server
    async def start(self) -> int:
        """Bind and serve; returns the port (``http_port: any`` picks a free one). Raises PortInUse."""
        token = auth_token(self.g)
        sock = bind_socket(self.g.host, self.g.http_bind_port, "gateway.http_port", "--http-port")
        config = uvicorn.Config(
            _Auth(self.app, token, open_paths=() if self.g.health_requires_auth else ("/health",), gw=self),
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

    # ------------------------------------------------------------------ the app
    def _app(self) -> FastAPI:
        app = FastAPI(title="vToken", docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(StarletteHTTPException)
        async def http_error(request: Request, e: StarletteHTTPException):
            return error(e.status_code, str(e.detail) if e.status_code != 404 else f"no route {request.url.path}")

        @app.exception_handler(Exception)
        async def unexpected(request: Request, e: Exception):
            if isinstance(e, ClientDisconnect | ClientGone):  # a backstop: the handlers below catch it first
                log.info("HTTP %s %s: the client went away", request.method, request.url.path)
                return Response(status_code=499)
            rid = uuid.uuid4().hex
            log.exception("HTTP %s %s failed (server id %s)", request.method, request.url.path, rid)
            return error(500, internal_message("", rid))

        app.get("/health")(self.health)
        app.get("/metrics")(self.scrape)
        app.get("/v1/models")(self.models)
        app.post("/v1/chat/completions")(self.chat)
        app.post("/v1/completions")(self.completions)
        app.post("/tokenize")(self.tokenize)
        app.post("/detokenize")(self.detokenize)
        return app

    async def health(self) -> Response:
        """200 while at least one replica takes requests, else 503 (for load balancers)."""
        try:
            snap = await asyncio.wait_for(self.controller.snapshot.remote(), 5)
        except Exception:
            return JSONResponse({"status": "controller unreachable"}, 503)
        healthy = sum(r.state.serving() for r in snap.replicas)
        return JSONResponse({"status": "ok" if healthy else "no healthy replica", "healthy_replicas": healthy},
                            200 if healthy else 503)  # fmt: skip

    async def scrape(self) -> Response:
        try:
            snap = await asyncio.wait_for(self.controller.snapshot.remote(), 5)
        except Exception as e:  # the gateway's own series still tell something
            log.warning("metrics: cannot read the controller: %s", e)
            snap = None
        return Response(self.metrics.render(snap), media_type=CONTENT_TYPE)

    async def models(self) -> dict:
        card = ModelCard(id=self.cfg.model_name, root=self.cfg.model, owned_by="vtoken",
                         max_model_len=self.cfg.engine.max_model_len)  # fmt: skip
        return ModelList(data=[card]).model_dump(mode="json")

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, "chat", chat_request)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completion", completion_request)

    async def tokenize(self, request: Request) -> Response:
        return await self._tokens(request, "tokenize")

    async def detokenize(self, request: Request) -> Response:
        return await self._tokens(request, "detokenize")

    async def _tokens(self, request: Request, kind: str) -> Response:
        """vLLM's /tokenize (a prompt or chat messages -> token ids) and /detokenize (token ids -> text)."""
        try:
            raw = await read_body(request, self.g.max_request_bytes)
            body = await self.parser.run(lambda: tokenize_response(kind, load_json(raw), self.cfg, self.tok))
            return JSONResponse(body)
        except ClientGone:
            return gone_mid_body(request)
        except (BodyTooLarge, ParseTooLong) as e:
            return error(413, str(e))
        except ParseBusy as e:
            return error(503, str(e))
        except BadRequest as e:
            return error(400, str(e), e.param)
        except ModelNotFound as e:
            return error(404, str(e), "model")

    async def _generate(self, request: Request, kind: str, parse) -> Response:
        try:
            raw = await read_body(request, self.g.max_request_bytes)
            req = await self.parser.run(lambda: parse(load_json(raw), self.cfg, self.tok))
        except ClientGone:
            self.metrics.refused(DOOR, "cancelled")
            return gone_mid_body(request)
        except (BodyTooLarge, ParseTooLong) as e:
            self.metrics.refused(DOOR, "resource_exhausted")
            return error(413, str(e))
        except ParseBusy as e:
            self.metrics.refused(DOOR, "unavailable")
            return error(503, str(e))
        except BadRequest as e:
            self.metrics.refused(DOOR, "invalid_argument")
            return error(400, str(e), e.param)
        except ModelNotFound as e:
            self.metrics.refused(DOOR, "not_found")
            return error(404, str(e), "model")
        rid = uuid.uuid4().hex
        answer = Answer(
            kind, rid, self.cfg.model_name, len(req.valid.prompt_token_ids), req.logprobs, req.continuous_usage
        )
        deltas = self.dispatcher.stream(req.valid, rid, DOOR)
        try:
            if not req.stream:
                for d in await _until_disconnect(request, _drain(deltas)):
                    answer.add(d.chunk)
                return JSONResponse(answer.response(), headers={"x-request-id": rid})
            # The first chunk before the response starts: a refusal until then still gets its status code.
            first = await _until_disconnect(request, anext(deltas))
        except Refused as e:
            return error(HTTP_STATUS[e.code], e.message, e.param)
        except ClientGone:
            await deltas.aclose()
            log.info("request %s: the client went away while waiting for its answer; aborted", rid)
            return Response(status_code=499)  # nobody reads it; the request is aborted and its blocks free
        return AbortingStream(
            _events(answer, first.chunk, deltas, req.include_usage, rid),
            media_type="text/event-stream",
            headers={"x-request-id": rid, "cache-control": "no-cache"},
        )


async def _events(
    answer: Answer, first, deltas: AsyncIterator, include_usage: bool, rid: str = ""
) -> AsyncIterator[str]:
    try:
        yield answer.first_event() + answer.event(first)
        async for d in deltas:
            yield answer.event(d.chunk)
        if include_usage:
            yield answer.usage_event()
    except Refused as e:  # after the first chunk the status is sent: the error goes in the stream
        yield f"data: {_json(error_body(HTTP_STATUS[e.code], e.message, e.param))}\n\n"
    except (GeneratorExit, asyncio.CancelledError):  # the stream was closed under us: the client went away
        log.info("request %s: the client went away mid-stream after %d tokens; aborted", rid, answer.tokens)
        raise
    finally:
        await deltas.aclose()  # a client gone mid-stream: abort the request in its engine now
    yield DONE


async def _drain(deltas: AsyncIterator) -> list:
    return [d async for d in deltas]


async def _until_disconnect(request: Request, work):
    """``await work`` unless the client disconnects first (then ClientGone; the work is cancelled, which
    aborts the request). The body has been read, so the next ASGI message can only be the disconnect."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientGone
    finally:
        for t in (task, gone):
            t.cancel()
        await asyncio.gather(task, gone, return_exceptions=True)


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class AbortingStream(StreamingResponse):
    """A streaming response that listens for the client's disconnect while it streams (whatever ASGI spec
    version the server speaks) and always closes its body generator, so a request whose client left is
    aborted at once, not at its next token or whenever the generator is garbage-collected."""

    async def __call__(self, scope, receive, send) -> None:
        async def stream():
            with contextlib.suppress(OSError):
                await self.stream_response(send)

        streaming = asyncio.ensure_future(stream())
        listening = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait({streaming, listening}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (streaming, listening):
                t.cancel()
            await asyncio.gather(streaming, listening, return_exceptions=True)
            await self.body_iterator.aclose()


class BodyTooLarge(ValueError):
    pass


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused as soon as it exceeds ``limit`` bytes (declared or streamed); ClientGone when the
    client disconnects before sending all of it."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"request body of {declared} bytes exceeds gateway.max_request_bytes ({limit})")
    body = bytearray()
    try:
        async for part in request.stream():
            body += part
            if len(body) > limit:
                raise BodyTooLarge(f"request body exceeds gateway.max_request_bytes ({limit})")
    except ClientDisconnect:
        raise ClientGone from None
    return bytes(body)


def gone_mid_body(request: Request) -> Response:
    log.info("HTTP %s %s: the client went away mid-body; nothing was started", request.method, request.url.path)
    return Response(status_code=499)


def error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status)


def _json(obj: Any) -> str:
    import json

    return json.dumps(obj, separators=(",", ":"))


class _Auth:
    """ASGI middleware: every path needs ``authorization: Bearer <token>`` (the scheme in any case) except
    ``open_paths`` (/health unless gateway.health_requires_auth). Without a token it passes everything."""

    def __init__(self, app, token: str | None, open_paths: tuple[str, ...], gw: HttpGateway):
        self.app, self.token, self.open, self.gw = app, token, open_paths, gw

    async def __call__(self, scope, receive, send):
        if self.token is None or scope["type"] != "http" or scope["path"] in self.open:
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or ())
        if bearer_ok(headers.get(b"authorization", b"").decode("latin-1"), self.token):
            return await self.app(scope, receive, send)
        if scope["path"] in ("/v1/chat/completions", "/v1/completions"):
            self.gw.metrics.refused(DOOR, "unauthenticated")
        response = error(401, "missing or wrong bearer token (authorization: Bearer <token>)")
        response.headers["www-authenticate"] = "Bearer"
        await response(scope, receive, send)


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: `vtoken serve` handles Ctrl-C itself (drain, then stop)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield
