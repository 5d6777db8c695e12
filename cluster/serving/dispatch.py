"""The request path both front doors share, gRPC (cluster/doors/grpc_server.py) and OpenAI-compatible HTTP
(cluster/doors/http_server.py): admission, placement by the controller, the stream from a replica, retries,
aborts, and the per-request metrics. A door admits a request (``admit``), vLLM's serving layer renders it and the
remote engine client (cluster/serving/remote_engine.py) turns it into a ``ValidRequest``, iterates ``Dispatcher.stream``
and maps a ``Refused``'s code to vLLM's errors; so a request is admitted, placed, retried, aborted and counted the
same way whichever door it came in by.

A request's path: admission at the door (bounded: ``max_inflight`` over both doors, else resource_exhausted; the
bound covers rendering too) -> placement (``n`` x the request's peak blocks) from the gateway's copy of the
controller's views (cluster/placement/placer.py), or by the controller -> the replica's
chunks, through the token channel (actors/token_channel.py; a Ray streaming call with
``gateway.token_channel: ray``). A replica that dies before the first token: the
request is placed again elsewhere (``max_attempts``); after it: unavailable. A deadline, or a client that goes
away (the door stops iterating), aborts the request in the engine at once, so its blocks are free again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any, NamedTuple

import ray

from actors.token_channel import ChannelStream, TokenChannel, Unreachable
from actors.wire import Chunk, GenerateSpec, merge
from cluster.config import ServeConfig
from cluster.placement.placer import Placer
from cluster.placement.strategies import TooLarge
from cluster.serving.metrics import Metrics
from cluster.serving.requests import ValidRequest
from vtoken.core.budget import peak_blocks

log = logging.getLogger("vtoken.gateway")
# What a call to a replica raises when the replica, its process or its node is gone (not a fault of ours, nor the
# request's): the request is placed again elsewhere before its first token, UNAVAILABLE after it. A replica's own
# exception (RayTaskError) stays a fault of ours: INTERNAL.
LOST = (
    ray.exceptions.RayActorError,  # died, or unreachable while Ray restarts it (ActorUnavailableError)
    ray.exceptions.NodeDiedError,
    ray.exceptions.WorkerCrashedError,
    ray.exceptions.LocalRayletDiedError,
    ray.exceptions.ObjectLostError,
)

# Why a request ended without completing; each door maps these to its own status codes.
CODES = (
    "invalid_argument",
    "unauthenticated",
    "not_found",
    "resource_exhausted",
    "too_large",  # no replica's pool can ever hold the request, or it is over a gateway bound (HTTP 413)
    "unavailable",
    "deadline_exceeded",
    "internal",
)


class Refused(Exception):
    """The request ends without completing: ``code`` (one of CODES) and one line meant for the client;
    ``param`` names the request field at fault when there is one."""

    def __init__(self, code: str, message: str, param: str | None = None):
        if code not in CODES:
            raise ValueError(f"unknown code {code!r}; known: {', '.join(CODES)}")
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


class Delta(NamedTuple):
    """One streamed chunk and the replica that produced it."""

    replica: str
    chunk: Chunk


class Dispatcher:
    """Invariants: ``inflight`` counts the requests of both doors between admission and their end; every
    request that reached ``stream`` and ends, however (done, refused, failed, client gone), releases its promise in
    the controller and is counted once in ``metrics`` under its door and outcome."""

    def __init__(self, cfg: ServeConfig, controller: Any, metrics: Metrics | None = None):
        self.cfg, self.g, self.controller = cfg, cfg.gateway, controller
        self.metrics = metrics or Metrics(cfg.model)
        self.inflight = 0
        self.inflight_tokens = 0  # the work of the requests admitted (cluster/serving/work.py)
        self.parsing = 0  # requests admitted and not yet rendered
        self._large: asyncio.Semaphore | None = None  # made in the event loop: large bodies rendering at once
        self._node = ray.util.get_node_ip_address() if ray.is_initialized() else ""
        host = self._node if self.g.token_channel_host == "node" else self.g.token_channel_host
        self.channel = TokenChannel(host or "127.0.0.1") if self.g.token_channel == "zmq" else None
        self._remote: set[str] = set()  # replicas that cannot reach the channel: Ray streams for them
        refresh = self.g.placement_refresh_s
        self.placer = Placer(controller, refresh) if controller is not None and refresh > 0 else None

    async def aclose(self) -> None:
        if self.placer is not None:
            await self.placer.aclose()
        if self.channel is not None:
            await self.channel.aclose()

    @contextlib.contextmanager
    def admit(self, door: str, work: int = 0):
        """One request admitted at ``door`` for as long as the block runs (rendering, placement, streaming), holding
        ``work`` tokens (cluster/serving/work.py); Refused("resource_exhausted") when ``max_inflight`` requests of both
        doors are in already, or their work and this one's would pass ``max_inflight_tokens`` (a request alone is always
        admitted: its own ceilings are checked at the door)."""
        g = self.g
        if self.inflight >= g.max_inflight:
            self.metrics.refused(door, "resource_exhausted")
            raise Refused(
                "resource_exhausted",
                f"server busy: {self.inflight} requests in flight (limit {g.max_inflight}); retry later",
            )
        if self.inflight and self.inflight_tokens + work > g.max_inflight_tokens:
            self.metrics.refused(door, "resource_exhausted")
            raise Refused(
                "resource_exhausted",
                f"server busy: {self.inflight_tokens} tokens of work in flight and this request's {work} would pass "
                f"gateway.max_inflight_tokens ({g.max_inflight_tokens}); retry later",
            )
        self.inflight += 1
        self.inflight_tokens += work
        try:
            yield
        finally:
            self.inflight -= 1
            self.inflight_tokens -= work

    def parse_stage(self, door: str, size: int = 0) -> ParseStage:
        """The request's rendering has begun (its ``end()`` when its prompt is rendered, or it ended); Refused
        ("unavailable") when ``max_parse_pending`` requests are rendering already: they share the parse threads, and
        one more would only wait behind them. A body over ``LARGE_BODY`` bytes renders only once its stage's
        ``turn()`` comes (``large``)."""
        if self.parsing >= self.g.max_parse_pending:
            self.metrics.refused(door, "unavailable")
            raise Refused(
                "unavailable",
                f"{self.parsing} requests are being rendered (gateway.max_parse_pending); retry shortly",
            )
        self.parsing += 1
        if self._large is None:
            self._large = asyncio.Semaphore(max(1, self.g.parse_workers - 1))
        return ParseStage(self, self._large if size > LARGE_BODY else None)

    def _open(self, name: str, replica: Any, spec: GenerateSpec):
        """The request's chunks from ``replica``: through the token channel, or a Ray stream."""
        if self.channel is None or name in self._remote:
            return RayStream(replica.generate.options(num_returns="streaming").remote(spec))
        return ChannelStream(self.channel, spec.request_id, lambda a: replica.generate_to.remote(spec, a, self._node))

    async def stream(self, req: ValidRequest, door: str) -> AsyncIterator[Delta]:
        """The request's chunks as the replica streams them. ``req.request_id`` is the gateway's own id for it: the
        engine, the replica and the controller know the request by this id only (clients may reuse theirs, kept as
        ``req.client_id`` for logs). Raises Refused; a door that stops iterating (its client went away) aborts the
        request. The door admitted it (``admit``)."""
        rid = req.request_id
        timer = self.metrics.timer(door, len(req.prompt_token_ids))
        outcome = "cancelled"
        try:
            async with contextlib.aclosing(self._serve(req)) as deltas:
                async for d in deltas:
                    timer.chunk(d.replica, d.chunk)
                    yield d
            outcome = "ok"
        except Refused as e:
            outcome = e.code
            raise
        except Exception:  # a bug or a Ray failure: the traceback goes to the log, never to the client
            outcome = "internal"
            log.exception("request %s (client id %r) failed", rid, req.client_id)
            raise Refused("internal", internal_message(req.client_id, rid)) from None
        finally:
            late = self.placer.finished(rid) if self.placer is not None else ()
            self._tell("finished", rid, *late)  # release the promise whatever happened
            timer.done(outcome)

    def _tell(self, method: str, *args) -> None:
        """A call to the controller whose answer nobody waits for; a controller being restarted misses it (it
        rebuilds promises and statuses from the replicas' reports)."""
        with contextlib.suppress(ray.exceptions.RayError):
            getattr(self.controller, method).remote(*args)

    async def _serve(self, req: ValidRequest) -> AsyncIterator[Delta]:
        rid = req.request_id
        loop = asyncio.get_running_loop()
        deadline = loop.time() + req.deadline_s if req.deadline_s is not None else None
        v = req.eviction.config if req.eviction else None
        evicting = v is not None and v.enabled
        # What the request will hold at most: the compactor's own rule (vtoken/core/budget.py), for its own options.
        bs = self.cfg.engine.block_size
        bounded = (v.budget, v.sink, v.recent, v.prefill_chunk, v.prefill_evict, bs if v.interval == "block" else
                   v.interval) if evicting else ()  # fmt: skip
        need = req.n * peak_blocks(len(req.prompt_token_ids), req.max_tokens, bs, *bounded)
        spec = GenerateSpec(rid, req.prompt_token_ids, req.spec_sampling(), req.max_tokens, req.n, req.engine_kwargs)
        tried: list[str] = []
        for _ in range(self.g.max_attempts):
            work = req.n * (len(req.prompt_token_ids) + req.max_tokens)
            try:
                placed, why = await self._place(rid, need, tried, deadline, work, req.prefix_hashes)
            except TooLarge as e:
                raise Refused("too_large", e.args[0], "max_tokens") from None
            if placed is None:
                raise Refused("unavailable", f"no replica: {why}; retry the request")
            name, replica = placed
            tried.append(name)
            stream = self._open(name, replica, spec)
            streamed, done = 0, False
            try:
                while True:
                    try:
                        if deadline is None:
                            chunk = await stream.next()
                        else:
                            chunk = await asyncio.wait_for(stream.next(), max(deadline - loop.time(), 0.001))
                    except TimeoutError:
                        raise Refused("deadline_exceeded", "deadline exceeded") from None
                    except Unreachable as e:
                        log.warning(
                            "replica %s cannot reach the token channel at %s (another node); its tokens come "
                            "through Ray streams: set gateway.token_channel_host to this node's address",
                            name,
                            e,
                        )
                        self._remote.add(name)
                        stream.close()
                        stream = self._open(name, replica, spec)
                        continue
                    if chunk is None or chunk.error or chunk.aborted:
                        done = True  # the server ended it (failure, drain, engine restart), not the client
                        code, why = failure(chunk, name)
                        if code == "unavailable" and not streamed:
                            log.info("request %s: %s before its first token; placing it again", rid, why)
                            break
                        if code == "internal":
                            log.error("request %s (client id %r): %s", rid, req.client_id, why)
                            why = internal_message(req.client_id, rid)
                        elif code == "unavailable":
                            why = f"{why} after {streamed} chunks; retry the request"
                        raise Refused(code, why)
                    streamed += 1
                    chunk = coalesce(chunk, stream)
                    done = chunk.finished
                    yield Delta(name, chunk)
                    if chunk.finished:
                        return
            except LOST as e:
                done = True  # nothing left to abort on a dead replica
                self._tell("mark_failed", name, f"{type(e).__name__} during a request")
                if self.placer is not None:
                    self.placer.lost(name)
                if streamed:
                    raise Refused("unavailable", f"replica {name} died mid-stream; retry the request") from None
                log.info("replica %s died before request %s started; placing it again", name, rid)
            finally:
                if not done:  # cancelled, deadline, or the client went away: free its blocks now
                    stream.cancel()
                    replica.abort.remote(rid)
                stream.close()
        raise Refused("unavailable", f"request failed on {len(tried)} replicas: {', '.join(tried)}")

    async def _place(
        self, rid: str, need: int, tried: list[str], deadline: float | None, tokens: int = 0, prefix: tuple = ()
    ):
        """Place from the gateway's views (cluster/placement/placer.py), else ask the controller until a replica is
        available (a replica or the controller itself may be restarting), up to place_timeout_s: (name, handle), or None
        and why none."""
        placed = await self.placer.place(rid, need, tried, tokens, prefix) if self.placer is not None else None
        if placed is not None:
            return placed, ""
        loop = asyncio.get_running_loop()
        t_end = loop.time() + self.g.place_timeout_s
        if deadline is not None:
            t_end = min(t_end, deadline)
        while True:
            try:
                placed = await self._ask_place(rid, need, tried, tokens, t_end, prefix)
                why = "no live replica can take it"
            except TooLarge:  # the controller's own answer (Ray makes its error an instance of its cause)
                raise
            except (ray.exceptions.RayError, TimeoutError) as e:  # the controller is down or restarting
                placed, why = None, f"the controller is not answering ({type(e).__name__}; Ray restarts it)"
            if placed is not None or loop.time() >= t_end:
                return placed, why
            await asyncio.sleep(0.2)

    async def _ask_place(self, rid: str, need: int, tried: list[str], tokens: int, t_end: float, prefix: tuple = ()):
        """One placement, bounded by ``t_end``: a call to a controller Ray is restarting waits for it."""
        timeout = max(t_end - asyncio.get_running_loop().time(), 0.5)
        place = self.controller.place
        placed = await asyncio.wait_for(place.remote(rid, need, tuple(tried), tokens, prefix), timeout)
        if placed is None and tried:  # everything else is down: the one that failed may be back
            placed = await asyncio.wait_for(place.remote(rid, need, (), tokens, prefix), timeout)
        return placed


# A body over this many bytes is a large rendering (64 KiB of text: ~16K tokens, ~40 ms to tokenize here; the 900 KB
# of a /tokenize flood took 0.57 s each). At most parse_workers - 1 of them render at once, so one of vLLM's renderer
# threads is always left to the small requests: two large ones took both threads and a chat waited 0.9 s behind them.
LARGE_BODY = 64 * 1024


class ParseStage:
    """One request between its admission and its rendered prompt: ``end()`` (idempotent) frees its place among the
    ``max_parse_pending`` (and a large body's turn) and sets ``done``, which the door's ``parse_timeout_s`` waits on.
    ``large``: the semaphore a large body waits on (``turn()``) before it renders; None for the rest."""

    def __init__(self, dispatcher: Dispatcher, large: asyncio.Semaphore | None = None):
        self.dispatcher, self.done, self.large = dispatcher, asyncio.Event(), large
        self._turn = False

    async def turn(self) -> None:
        """Until a large body may render (at once for the rest)."""
        if self.large is not None and not self._turn and not self.done.is_set():
            await self.large.acquire()
            if self.done.is_set():  # ended while it waited: nothing left to render
                self.large.release()
                return
            self._turn = True

    def end(self) -> None:
        if not self.done.is_set():
            self.done.set()
            self.dispatcher.parsing -= 1
            if self._turn:
                self.large.release()


def coalesce(chunk: Chunk, stream: Any) -> Chunk:
    """``chunk`` with the request's outputs that are already here merged into it, as vLLM's AsyncLLM merges the
    deltas of a request whose consumer fell behind (``RequestOutputCollector``): a loaded gateway sends fewer, larger
    chunks instead of queueing every token behind the ones before. A failed or aborted chunk is never merged, and
    a chunk in which a sequence finishes ends the merge (with ``n > 1`` the metrics name the request's finish by the
    last sequence to finish, which a merge would reorder)."""
    more = []
    while not chunk.finish_reason and (nxt := stream.ready()) is not None:
        more.append(nxt)
        if nxt.finish_reason or nxt.finished:
            break
    return merge(chunk, *more) if more else chunk


def failure(chunk: Chunk | None, replica: str) -> tuple[str, str]:
    """How a stream ends for the client when the server ended it: a failed request's code and one-line
    reason; a request the replica aborted (vLLM's finish_reason "abort", or a stream that stopped before its
    finished chunk) is unavailable: never a success, the client did not ask for it."""
    if chunk is None or (chunk.aborted and not chunk.error):
        return "unavailable", f"the request was aborted by replica {replica}"
    return (chunk.code if chunk.code in CODES else "internal"), chunk.error


def internal_message(client_id: str, rid: str) -> str:
    which = f"request {client_id!r} (server id {rid})" if client_id else f"a request (server id {rid})"
    return f"internal error serving {which}; the server log has the details"


class RayStream:
    """A replica's chunks as a Ray streaming generator (``Replica.generate``), read like a ChannelStream."""

    def __init__(self, gen: Any):
        self.gen = gen

    async def next(self) -> Chunk | None:
        try:
            return await (await self.gen.__anext__())
        except StopAsyncIteration:
            return None

    def ready(self) -> Chunk | None:
        return None  # a Ray stream's next object is fetched only when asked for

    def cancel(self) -> None:
        ray.cancel(self.gen)

    def close(self) -> None:
        pass
