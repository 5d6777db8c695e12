"""What the HTTP door adds around vLLM's OpenAI app (an ASGI middleware): the bearer token, the body's bounds, the
``vtoken`` extension, admission by work, bounded rendering, client disconnects and stalls, and statuses that survive
streaming. vLLM's serving layer trusts its one engine and its operator; a gateway in front of a fleet cannot.

    auth       every path but the open ones (/health) needs ``authorization: Bearer <token>`` (401)
    headers    a POST with a body has exactly one ``Content-Type``, ``application/json`` (400): the door and vLLM's
               app must read the same one
    body       read whole before anything runs, refused past ``max_request_bytes`` (413) or ``body_timeout_s`` (408);
               a client gone mid-body is one INFO line (499, which nobody reads); the JSON must be JSON (NaN,
               Infinity and nesting Python cannot parse are a 400, never an engine's NaN or a 500)
    vtoken     the request's own eviction options, popped from the body and checked once (cluster/serving/requests.py),
               carried to the engine client in ``remote_engine.CONTEXT``; vLLM's models never see the field
    template   ``chat_template_kwargs`` hold only variables the model's chat template reads (400 naming the key,
               cluster/serving/template_kwargs.py)
    admission  every route that generates, renders or tokenizes is admitted over both doors from here to its end,
               weighed by its work (cluster/serving/work.py: ``n`` and ``max_request_tokens`` ceilings are a 400 naming
               the field; ``max_inflight`` and ``max_inflight_tokens`` a 429)
    rendering  at most ``max_parse_pending`` requests render at once (503), each for at most ``parse_timeout_s``
               (413); structured outputs are checked in worker processes (cluster/serving/grammar_pool.py)
    first      a streamed answer's status is held until its first event: a refusal before any output (no replica,
               a deadline, a bad request the engine found) keeps its status as a JSON error, as Ray Serve's
               ingress peeks at its first chunk; vLLM's serving layer would send it as an event after a 200
    gone       a client that disconnects while its answer is computed or streamed cancels it (its request is
               aborted in its replica at once, its blocks free) and is one INFO line; so does one that takes no
               piece of its answer for ``write_timeout_s``
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from typing import Any

from vllm.entrypoints.serve.engine.protocol import ErrorInfo, ErrorResponse

from cluster.doors.auth import bearer_ok
from cluster.serving.dispatch import Refused, internal_message
from cluster.serving.remote_engine import vllm_error
from cluster.serving.requests import (
    CONTEXT,
    EXTENSION,
    BadRequest,
    Live,
    RequestContext,
    render_too_long,
    vtoken_options,
)
from cluster.serving.template_kwargs import check_template_kwargs
from cluster.serving.work import RENDER, WorkTally, request_work

log = logging.getLogger("vtoken.http")
DOOR = "http"
# Paths that generate (admitted, counted): the OpenAI routes, Anthropic's messages.
GENERATE = frozenset({"/v1/chat/completions", "/v1/chat/completions/batch", "/v1/completions", "/v1/responses",
                      "/v1/messages", "/inference/v1/generate", "/invocations", "/generative_scoring"})  # fmt: skip
# vLLM's routes that steer its one engine (elastic expert parallelism, its KV event sockets): a cluster of replicas is
# steered by `vtoken scale` and the controller, so they answer 404 here.
NOT_SERVED = frozenset({"/scale_elastic_ep", "/is_scaling_elastic_ep", "/kv_event_sources"})
GONE_GRACE_S = 1.0  # how long vLLM's app may take to end a request whose client went away before it is cancelled
# Paths the gateway answers itself, not vLLM's app (whose versions know one engine): cluster/doors/http_server.py.
OWN = frozenset({"/health", "/metrics"})
OWN_PREFIXES = ("/metrics/",)  # vLLM mounts its own metrics app under /metrics: only the exact path is served
# Events a streamed answer sends before its engine's first output (Responses' created and in_progress): held with
# the status, so a refusal before the first output still gets its own.
PREAMBLE = (b'"type":"response.created"', b'"type":"response.in_progress"')
ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 408: "RequestTimeoutError",
               413: "RequestTooLargeError",
               429: "RateLimitError", 500: "InternalServerError", 503: "ServiceUnavailableError",
               504: "TimeoutError"}  # fmt: skip
STATUS_OF = {"invalid_argument": 400, "resource_exhausted": 429, "too_large": 413, "unavailable": 503,
             "deadline_exceeded": 504, "internal": 500, "not_found": 404, "unauthenticated": 401}  # fmt: skip


def error_body(status: int, message: str, param: str | None = None) -> bytes:
    """OpenAI's error JSON, as vLLM's server writes it (``ErrorResponse``)."""
    info = ErrorInfo(message=message, type=ERROR_TYPES.get(status, "Error"), param=param, code=status)
    return ErrorResponse(error=info).model_dump_json().encode()


class ClientGone(Exception):
    """The client disconnected while sending its body."""


class BodyTooLarge(ValueError):
    pass


class BodyTimeout(ValueError):
    """The body did not arrive within ``gateway.body_timeout_s`` (HTTP 408)."""


class Door:
    """The middleware around vLLM's app. ``gw`` is the HttpGateway: its config, token, dispatcher, metrics, the model's
    context length and the chat template's variables."""

    def __init__(self, app: Any, gw: Any, token: str | None, open_paths: tuple[str, ...], own: Any = None):
        self.app, self.gw, self.token, self.open, self.own = app, gw, token, open_paths, own

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        generate = path in GENERATE and scope["method"] == "POST"
        if self.token is not None and path not in self.open:
            headers = dict(scope.get("headers") or ())
            if not bearer_ok(headers.get(b"authorization", b"").decode("latin-1"), self.token):
                if generate:
                    self.gw.metrics.refused(DOOR, "unauthenticated")
                message = "missing or wrong bearer token (authorization: Bearer <token>)"
                return await _reply(send, 401, error_body(401, message), ((b"www-authenticate", b"Bearer"),))
        if self.own is not None and path in OWN:
            return await self.own(scope, receive, send)
        if path in NOT_SERVED or path.startswith(OWN_PREFIXES):  # /metrics/...: vLLM's metrics app is not ours
            return await _reply(send, 404, error_body(404, f"{path} is not served by vtoken serve"))
        if scope["method"] != "POST":
            return await self.app(scope, receive, send)
        admitted = generate or path in RENDER
        try:
            body, scope, ctx, work = await self._read(scope, receive, path)
        except ClientGone:
            log.info("HTTP POST %s: the client went away mid-body; nothing was started", path)
            if generate:
                self.gw.metrics.refused(DOOR, "cancelled")
            return
        except BodyTimeout as e:
            return await _reply(send, 408, error_body(408, str(e)), ((b"connection", b"close"),))
        except BodyTooLarge as e:
            return await self._refuse(send, generate, "too_large", str(e))
        except BadRequest as e:
            return await self._refuse(send, generate, "invalid_argument", str(e), e.param)
        if not admitted:
            return await self._run(scope, body, receive, send, ctx, path)
        slot = self.gw.dispatcher.admit(DOOR, work)
        try:
            slot.__enter__()
            stage = self.gw.dispatcher.parse_stage(DOOR, len(body))
        except Refused as e:  # admission: counted by the dispatcher
            if e.code != "resource_exhausted":  # the parse stage's refusal: the slot was taken
                slot.__exit__(None, None, None)
            return await _reply(send, STATUS_OF[e.code], error_body(STATUS_OF[e.code], e.message, e.param))
        ctx = ctx._replace(parse=stage)
        live = ctx.live
        try:
            await self._run(scope, body, receive, send, ctx, path)
        finally:
            stage.end()
            live.door_done = True
            if live.n == 0:
                slot.__exit__(None, None, None)
            else:  # a background request runs on after its answer: the slot stays with it until it ends
                asyncio.ensure_future(_release_when_idle(live, slot))

    async def _refuse(self, send, generate: bool, code: str, message: str, param: str | None = None) -> None:
        if generate:
            self.gw.metrics.refused(DOOR, code)
        await _reply(send, STATUS_OF[code], error_body(STATUS_OF[code], message, param))

    async def _read(self, scope, receive, path: str) -> tuple[bytes, dict, RequestContext, int]:
        """The body (limited in size and time), with the ``vtoken`` extension taken out and checked, the chat
        template's variables checked; the scope it is sent with, and the request's work (cluster/serving/work.py)."""
        g = self.gw.g
        limit = g.max_request_bytes
        types = [v for k, v in scope.get("headers") or () if k == b"content-type"]
        if len(types) > 1:  # the door would read one and vLLM's app another: never guess which the client meant
            raise BadRequest(f"{len(types)} Content-Type headers; send exactly one (application/json)")
        headers = dict(scope.get("headers") or ())
        declared = headers.get(b"content-length", b"").decode("latin-1")
        if declared.isdigit() and int(declared) > limit:
            raise BodyTooLarge(f"request body of {declared} bytes exceeds gateway.max_request_bytes ({limit})")
        parts, size = [], 0
        loop = asyncio.get_running_loop()
        t_end = loop.time() + g.body_timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(t_end - loop.time(), 0))
            except TimeoutError:
                raise BodyTimeout(
                    f"the request body did not arrive within gateway.body_timeout_s ({g.body_timeout_s:g} s)"
                ) from None
            if message["type"] == "http.disconnect":
                raise ClientGone
            part = message.get("body", b"")
            size += len(part)
            if size > limit:
                raise BodyTooLarge(f"request body exceeds gateway.max_request_bytes ({limit})")
            parts.append(part)
            if not message.get("more_body", False):
                break
        body = b"".join(parts)
        ctx = RequestContext(door=DOOR, client_id=headers.get(b"x-request-id", b"").decode("latin-1"), live=Live())
        if not body:
            return body, scope, ctx, 1  # vLLM's own checks answer
        kind = types[0].split(b";")[0].strip().lower() if types else b""
        if kind != b"application/json":
            raise BadRequest(
                f"Content-Type must be application/json for a request body, got {kind.decode('latin-1') or 'none'}"
            )
        obj = load_json(body)
        bs = self.gw.cfg.engine.block_size
        work = request_work(path, obj, size, g, self.gw.max_model_len, bs)
        if isinstance(obj, dict):
            check_template_kwargs(obj, self.gw.template_variables, path)
            grammar = "response_format" if obj.get("response_format") is not None else "structured_outputs"
            ctx = ctx._replace(tally=WorkTally(g.max_request_tokens, bs), grammar_field=grammar)
        if isinstance(obj, dict) and EXTENSION in obj:
            ctx = ctx._replace(eviction=vtoken_options(obj.pop(EXTENSION), self.gw.cfg.vtoken))
            body = json.dumps(obj).encode()
            rest = [(k, v) for k, v in scope.get("headers") or () if k != b"content-length"]
            scope = {**scope, "headers": [*rest, (b"content-length", str(len(body)).encode())]}
        return body, scope, ctx, work.tokens

    async def _run(self, scope, body: bytes, receive, send, ctx: RequestContext, path: str) -> None:
        """vLLM's app on the body, with the request's context set; a disconnect cancels it, rendering past
        ``parse_timeout_s`` is a 413, a client that takes no piece of the answer for ``write_timeout_s`` ends it, and
        a streamed answer's status waits for its first event."""
        gone = asyncio.Event()
        replayed = False
        g = self.gw.g
        too_long = (f"rendering and tokenizing this request took over {g.parse_timeout_s:g} s "
                    "(gateway.parse_timeout_s); send a shorter request")  # fmt: skip
        if ctx.parse is not None and ctx.parse.large is not None:  # a large body waits for its turn to render
            try:
                await asyncio.wait_for(ctx.parse.turn(), g.parse_timeout_s)
            except TimeoutError:
                log.info("HTTP POST %s: a large body found no turn to render within parse_timeout_s; refused", path)
                return await _reply(send, 413, error_body(413, too_long))

        async def app_receive():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        stalled = False

        async def timed_send(message: dict) -> None:
            nonlocal stalled
            if stalled:
                return  # nothing more goes to a client that takes nothing
            try:
                await asyncio.wait_for(send(message), g.write_timeout_s)
            except TimeoutError:
                # The client is treated as gone (below): vLLM's app hears a disconnect and cancels its stream where it
                # waits for the engine, which closes its generator and aborts the request. Raising here instead left
                # the generator suspended at its yield (Starlette never closes a body iterator whose send raised): the
                # request ran on in its replica and held its admission until the garbage collector found it.
                stalled = first.done = ctx.live.stalled = True
                watch.cancel()

        first = FirstEvent(timed_send)
        token = CONTEXT.set(ctx)
        try:
            app = asyncio.ensure_future(self.app(scope, app_receive, first.send))
        finally:
            CONTEXT.reset(token)
        watch = asyncio.ensure_future(_disconnected(receive))
        try:
            if ctx.parse is not None and not await _rendered_in_time(ctx.parse, {app, watch}, g.parse_timeout_s):
                gone.set()
                app.cancel()
                with contextlib.suppress(BaseException):
                    await app
                log.info("HTTP POST %s: rendering took over gateway.parse_timeout_s; refused", path)
                if not first.started:
                    first.done = True
                    await _reply(send, 413, error_body(413, too_long))
                return
            await asyncio.wait({app, watch}, return_when=asyncio.FIRST_COMPLETED)
            if app.done() and not stalled:
                app.result()
                return
            # vLLM's app hears the disconnect itself (its routes' with_cancellation, StreamingResponse) and cancels
            # its handler, which aborts the request; cancelling the app from outside would orphan that handler
            # (with_cancellation does not cancel it when it is cancelled itself). A backstop if it does not end.
            gone.set()
            done, _ = await asyncio.wait({app}, timeout=GONE_GRACE_S)
            if not done:
                app.cancel()
            with contextlib.suppress(BaseException):
                await app
            if stalled:
                log.info("HTTP POST %s: the client took nothing for gateway.write_timeout_s (%g s); ended, aborted",
                         path, g.write_timeout_s)  # fmt: skip
                return
            where = "mid-stream" if first.streaming else "while waiting for its answer"
            log.info("HTTP POST %s: the client went away %s; aborted", path, where)
        except Exception as e:  # an error the app let out: vLLM's mapping if nothing was sent yet, else an event
            await first.fail(e)
        finally:
            watch.cancel()
            gone.set()


async def _rendered_in_time(stage: Any, running: set, timeout_s: float) -> bool:
    """Wait until the request's prompt is rendered or ``running`` (the app, the disconnect watch) has an end: False
    when ``timeout_s`` passed first."""
    rendered = asyncio.ensure_future(stage.done.wait())
    try:
        done, _ = await asyncio.wait({rendered, *running}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        rendered.cancel()
    return bool(done)


class FirstEvent:
    """``send`` for vLLM's app that holds a streamed answer's start (status, headers) and preamble until its first
    real event: an error event there becomes a JSON error with the error's own status (a refusal before any output
    keeps its status), anything else releases everything held, in order."""

    def __init__(self, send):
        self._send = send
        self.held: list[dict] | None = None  # the start and preamble while holding
        self.started = False  # the client has the status
        self.streaming = False  # the client has events
        self.done = False  # a JSON error replaced the stream: nothing more goes out

    async def send(self, message: dict) -> None:
        if self.done:
            return
        if message["type"] == "http.response.start":
            headers = dict(message.get("headers") or ())
            if message["status"] == 200 and headers.get(b"content-type", b"").startswith(b"text/event-stream"):
                self.held = [message]
                return
            self.started = True
            await self._send(message)
            return
        if self.held is None:
            await self._send(message)
            return
        data = message.get("body", b"")
        if not data.strip() and message.get("more_body", False):
            self.held.append(message)
            return
        error = stream_error(data)
        if error is not None:
            status, payload = error
            self.done = True
            await _reply(self._send, status, payload)
            return
        self.held.append(message)
        if data and any(p in data for p in PREAMBLE) and message.get("more_body", False):
            return
        held, self.held = self.held, None
        self.started = self.streaming = True
        for m in held:
            await self._send(m)

    async def fail(self, e: Exception) -> None:
        """The app raised: a JSON error with vLLM's status for it if the client has no status yet, else an error
        event ends the stream (never a clean end after a truncated answer). Our own faults are logged."""
        from vllm.entrypoints.serve import create_error_response

        if isinstance(e, RuntimeError) and str(e).startswith("Caught handled exception") and e.__cause__:
            # Starlette's words for an error its handlers would map after the held start went out (a streamed
            # Responses request refused before its first output: vLLM's generator lets it out): the error itself
            e = e.__cause__
        while isinstance(e, BaseExceptionGroup) and len(e.exceptions) == 1:
            e = e.exceptions[0]
        if isinstance(e, Refused):
            e = vllm_error(e)
        e = render_too_long(e) or e
        err = create_error_response(e)
        if err.error.code >= 500 and not _ours_expected(e):
            rid = uuid.uuid4().hex
            log.error("HTTP request failed (server id %s)", rid, exc_info=e)
            err.error.message = internal_message("", rid)
        if self.done:
            return
        if not self.started:
            self.held, self.done = None, True
            await _reply(self._send, err.error.code, err.model_dump_json().encode())
            return
        if self.streaming:
            with contextlib.suppress(Exception):
                await self._send({"type": "http.response.body", "body": f"data: {err.model_dump_json()}\n\n".encode(),
                                  "more_body": False})  # fmt: skip


def _ours_expected(e: Exception) -> bool:
    """A failure we raised on purpose with its own status (no replica, a deadline): not a bug to log loudly."""
    from vllm.exceptions import GracefulHTTPError

    return isinstance(e, GracefulHTTPError)


def stream_error(data: bytes) -> tuple[int, bytes] | None:
    """(status, OpenAI error JSON) when a stream's first event is an error (vLLM's ``data: {"error": ...}``, or a
    Responses ``error`` event), else None."""
    for line in data.split(b"\n"):
        if not line.startswith(b"data: {"):
            continue
        try:
            event = json.loads(line[6:])
        except ValueError:
            return None
        err = event.get("error") if isinstance(event, dict) else None
        if isinstance(err, dict) and isinstance(err.get("code"), int):
            return err["code"], json.dumps({"error": err}).encode()
        if isinstance(event, dict) and event.get("type") == "error":
            status = event.get("code") if isinstance(event.get("code"), int) else 500
            return status, error_body(status, str(event.get("message", "")), event.get("param"))
        return None
    return None


def load_json(raw: bytes) -> Any:
    """The body as JSON, or a BadRequest: malformed, NaN or Infinity (not JSON; Python's parser takes them and an
    engine would sample with them), or nested deeper than Python's parser goes."""

    def no_constant(name: str):
        raise BadRequest(f"malformed JSON: {name} is not a number JSON allows")

    try:
        return json.loads(raw, parse_constant=no_constant)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadRequest(f"malformed JSON: {e}") from None
    except RecursionError:  # Python's parser recurses once per nesting level
        raise BadRequest("malformed JSON: nested too deeply") from None


async def _release_when_idle(live: Live, slot) -> None:
    try:
        await live.idle.wait()
    finally:
        slot.__exit__(None, None, None)


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _reply(send, status: int, body: bytes, headers: tuple = ()) -> None:
    with contextlib.suppress(OSError):
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                *headers]})  # fmt: skip
        await send({"type": "http.response.body", "body": body, "more_body": False})
