"""The token channel: a replica's chunks reach the gateway over one ZeroMQ socket instead of a Ray streamed
object per chunk.

Why: a Ray streaming generator makes every chunk a Ray object (serialised, reported to its owner, fetched by
the gateway), about 4 ms of CPU per token on the 2-core machine where vLLM's own front end spends 0.6 ms
(``scripts/serve_cpu_per_token.py``). Here a chunk (actors/wire.py) is one msgpack frame on a ZeroMQ PUSH socket
(pyzmq and msgpack come with vLLM, whose EngineCore talks to its front end the same way). Ray keeps the control: the
gateway starts a request with an ordinary actor call (``Replica.generate_to``), cancels it with
``ray.cancel``, and learns of a dead replica from that call's result.

The gateway binds one PULL socket (``TokenChannel``) and routes each frame by request id to the request's
inbox. A replica keeps one PUSH socket per gateway address (``TokenSender``); ZeroMQ keeps the order of one
sender's frames, so a request's chunks arrive in order. ``generate_to`` returns how many chunks it sent, so
the gateway can tell "all arrived" from "some still on the wire" when the call's result overtakes them.

Who may push: this gateway's replicas, no one else. The channel may bind a node's network address
(``gateway.token_channel_host: node``) and what it takes becomes a client's output, so it does not use ZeroMQ's
default NULL mechanism, which admits any peer. Each ``TokenChannel`` makes two CURVE keypairs: its own (it is the
CURVE server) and one client keypair, which it hands to replicas through Ray in its ``ChannelAddress`` (the
argument of ``generate_to``). A ZAP handler (``zmq.auth.thread.ThreadAuthenticator``: its own thread, so a busy
event loop does not stall a handshake) admits that client key and no other; a peer without CURVE, or with a key of
its own, fails the handshake, and none of its frames reaches an inbox. The socket enforces its ZAP domain, so a
channel whose handler is gone refuses every peer instead of admitting any. CURVE is on for loopback too: it adds
about 1 us of CPU a frame to NULL's 6 (20,000 frames of 200 bytes, PUSH to PULL on 127.0.0.1), not worth a second
path.
A malformed frame from an admitted peer (a replica's bug) is dropped with one warning line, at most one a second
with the count since the last, so a flood of them cannot flood the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio
from zmq.auth.thread import ThreadAuthenticator

from actors.wire import Chunk, merge, pack, unpack

log = logging.getLogger("vtoken.token_channel")
SEND_TIMEOUT_S = 30.0  # a gateway that takes no frame for this long is gone: the replica aborts the request
ARRIVAL_GRACE_S = 10.0  # after generate_to returned, the longest wait for its last frames
ZAP_DOMAIN = "vtoken.token_channel"


def encode(rid: str, chunk: Chunk) -> list[bytes]:
    return [rid.encode(), pack(chunk)]


def decode(payload: bytes) -> Chunk:
    return unpack(payload)


def is_loopback(address: str) -> bool:
    host = address.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(host).is_loopback
    return host == "localhost"


@dataclass(frozen=True)
class ChannelAddress:
    """What a replica needs to push into one gateway's channel, handed to it through Ray: the endpoint, the
    channel's CURVE public key and the client keypair the channel admits (z85 bytes, as ``zmq.curve_keypair``
    makes them). Invariant: its repr and str show the endpoint only, so logging an address never logs a key."""

    endpoint: str
    server_key: bytes = field(repr=False)
    client_public: bytes = field(repr=False)
    client_secret: bytes = field(repr=False)

    def __str__(self) -> str:
        return self.endpoint


class AdmitKey:
    """The ZAP credentials provider (``configure_curve_callback``): admits one client public key (z85)."""

    def __init__(self, key: bytes):
        self.key = key

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.key


class DropLog:
    """Warns of dropped frames: one line at most every ``interval`` seconds, with how many were dropped since
    the last line, so a peer that floods the channel with bad frames cannot flood the log."""

    def __init__(self, interval: float = 1.0, clock: Callable[[], float] = time.monotonic):
        self.interval, self.clock = interval, clock
        self.dropped = 0  # since the last line
        self._last = -math.inf

    def drop(self, why: str) -> None:
        self.dropped += 1
        now = self.clock()
        if now - self._last >= self.interval:
            log.warning("token channel: dropped %d malformed frame(s), the last %s", self.dropped, why)
            self.dropped, self._last = 0, now


class Inbox:
    """One request's chunks as the channel routed them, and the one task waiting for them: ``put`` appends and wakes
    it, without a task or a queue per chunk (a streamed token's path crosses the event loop as few times as it can).

    Bounded: past ``MAX_QUEUED`` chunks waiting (a consumer that fell behind: a slow client), the waiting deltas are
    merged into one, as vLLM's ``RequestOutputCollector`` merges the outputs of a request whose consumer fell
    behind; a failed or aborted chunk, and one in which a sequence finishes, are kept apart (``dispatch.coalesce``'s
    rule). So a request holds a few chunk objects at most, whose tokens its own ``max_tokens`` bounds, and a client
    that takes nothing at all is ended by the door's ``write_timeout_s``, which aborts the request in its replica.
    ``merged`` counts the chunks merged away, so a stream still knows when all its replica sent has arrived."""

    __slots__ = ("chunks", "waiter", "merged")
    MAX_QUEUED = 64

    def __init__(self):
        self.chunks: deque[Chunk] = deque()
        self.waiter: asyncio.Future | None = None
        self.merged = 0

    def put(self, chunk: Chunk) -> None:
        self.chunks.append(chunk)
        if len(self.chunks) > self.MAX_QUEUED:
            self._collapse()
        self.wake()

    def _collapse(self) -> None:
        out: deque[Chunk] = deque()
        run: list[Chunk] = []
        for c in self.chunks:
            if not (c.error or c.finished or c.finish_reason):  # an aborted chunk has a finish reason
                run.append(c)
                continue
            if run:
                out.append(merge(*run))
                self.merged += len(run) - 1
                run = []
            out.append(c)
        if run:
            out.append(merge(*run))
            self.merged += len(run) - 1
        self.chunks = out

    def wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def wait(self) -> None:
        """Until a ``put`` or a ``wake`` (return at once when chunks are there)."""
        if self.chunks:
            return
        self.waiter = asyncio.get_running_loop().create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None


class TokenChannel:
    """The gateway's end: one PULL socket, a CURVE server, bound on first use in the running event loop, read by a
    reader callback that takes every frame waiting (``DRAIN``) at each wake-up. Invariants: only a peer with the
    client key in ``address`` completes a handshake (the module's docstring); a frame for a request with no open
    inbox (it ended, or was never opened here) is dropped; a malformed one is dropped and counted (``DropLog``)."""

    DRAIN = 256  # frames per callback at most, so a flood cannot hold the event loop; the rest on its next turn

    def __init__(self, host: str = "127.0.0.1"):
        self.host = host
        self.address: ChannelAddress | None = None  # set when bound
        self._server_key, self._server_secret = zmq.curve_keypair()
        self._client_key, self._client_secret = zmq.curve_keypair()
        self._ctx: zmq.Context | None = None
        self._auth: ThreadAuthenticator | None = None
        self._sock: zmq.Socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inboxes: dict[bytes, Inbox] = {}
        self._drops = DropLog()

    def _start(self) -> None:
        self._ctx = zmq.Context()
        # the ZAP handler binds in this context, so it answers for this channel's socket alone
        self._auth = ThreadAuthenticator(self._ctx)
        self._auth.start()
        self._auth.configure_curve_callback(ZAP_DOMAIN, AdmitKey(self._client_key))
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.curve_server = True
        self._sock.curve_secretkey = self._server_secret
        self._sock.zap_domain = ZAP_DOMAIN.encode()
        self._sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no handler answering: refuse, not admit
        port = self._sock.bind_to_random_port(f"tcp://{self.host}")
        endpoint = f"tcp://{self.host}:{port}"
        self.address = ChannelAddress(endpoint, self._server_key, self._client_key, self._client_secret)
        # ZeroMQ's FD is edge-triggered: it signals that the socket's events may have changed, so the reader takes
        # frames until ZMQ_EVENTS says none is left (as pyzmq's own asyncio integration does), and once at the start
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._sock.getsockopt(zmq.FD), self._drain)
        self._loop.call_soon(self._drain)
        log.info("token channel listening on %s", self.address)

    def open(self, rid: str) -> Inbox:
        if self._sock is None:
            self._start()
        inbox = self._inboxes[rid.encode()] = Inbox()
        return inbox

    def close(self, rid: str) -> None:
        self._inboxes.pop(rid.encode(), None)

    def _drain(self) -> None:
        sock = self._sock
        if sock is None:  # closed while this call was pending
            return
        for _ in range(self.DRAIN):
            if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                return
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:
                self._drops.drop(f"had {len(frames)} parts, not 2")
                continue
            rid, payload = frames
            inbox = self._inboxes.get(rid)
            if inbox is None:
                continue
            try:
                chunk = decode(payload)
            except Exception as e:  # a malformed frame must not stop the channel for every other request
                self._drops.drop(f"could not be decoded ({type(e).__name__})")
                continue
            inbox.put(chunk)
        self._loop.call_soon(self._drain)  # more may be waiting, and the FD will not signal them again

    async def aclose(self) -> None:
        if self._sock is not None:
            self._loop.remove_reader(self._sock.getsockopt(zmq.FD))
            self._sock.close(0)
            self._auth.stop()
            self._ctx.term()
        self._sock = None


class TokenSender:
    """A replica's end: one PUSH socket, a CURVE client with the keys of the address, per gateway channel (endpoint
    and server key: a gateway restarted on the same port has new keys), connected on first use."""

    def __init__(self):
        self._ctx: zmq.asyncio.Context | None = None
        self._socks: dict[tuple[str, bytes], zmq.asyncio.Socket] = {}

    def _socket(self, address: ChannelAddress) -> zmq.asyncio.Socket:
        key = (address.endpoint, address.server_key)
        sock = self._socks.get(key)
        if sock is None:
            self._ctx = self._ctx or zmq.asyncio.Context()
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.curve_serverkey = address.server_key
            sock.curve_publickey = address.client_public
            sock.curve_secretkey = address.client_secret
            sock.connect(address.endpoint)
            self._socks[key] = sock
        return sock

    async def send(self, address: ChannelAddress, rid: str, chunk: Chunk) -> None:
        """Raises TimeoutError when the gateway takes nothing for SEND_TIMEOUT_S (it is gone)."""
        await asyncio.wait_for(self._socket(address).send_multipart(encode(rid, chunk)), SEND_TIMEOUT_S)

    def close(self) -> None:
        for sock in self._socks.values():
            sock.close(0)
        self._socks.clear()


class Unreachable(Exception):
    """The replica cannot reach the channel's address (a loopback address, and the replica on another node)."""


class ChannelStream:
    """One request's chunks through the channel, read like the Ray stream it replaces: ``next()`` returns the
    next chunk, None when the replica's call ended without more, and raises what that call raised (a dead
    replica's RayActorError) or Unreachable; ``ready()`` takes the chunks already here without waiting. ``start``
    makes the call (``Replica.generate_to``) once the request's inbox is open, so no frame can come before it.
    ``cancel()`` stops the call (``ray.cancel``), which aborts the request in the engine; ``close()`` drops the
    inbox."""

    def __init__(self, channel: TokenChannel, rid: str, start: Callable[[ChannelAddress], Any]):
        self.channel, self.rid = channel, rid
        self.inbox = channel.open(rid)
        self._ref = start(channel.address)
        self.call = asyncio.ensure_future(self._ref)
        self.call.add_done_callback(self._ended)
        self.received = 0
        self.sent: int | None = None  # generate_to's result once the call ended

    def _ended(self, f: asyncio.Future) -> None:
        f.cancelled() or f.exception()  # read, even if nobody waits
        self.inbox.wake()

    async def next(self) -> Chunk | None:
        inbox = self.inbox
        while True:
            if inbox.chunks:
                self.received += 1
                return inbox.chunks.popleft()
            if not self.call.done():
                await inbox.wait()
                continue
            self.sent = self.call.result()  # raises the call's error (RayActorError for a dead replica)
            if self.sent < 0:
                raise Unreachable(self.channel.address.endpoint)
            if self.received + inbox.merged >= self.sent:  # the call ended: only what it sent is still to come
                return None
            try:
                await asyncio.wait_for(inbox.wait(), ARRIVAL_GRACE_S)
            except TimeoutError:
                missing = self.sent - self.received - inbox.merged
                log.warning("request %s: %d of %d chunks never arrived", self.rid, missing, self.sent)
                return None

    def ready(self) -> Chunk | None:
        """The next chunk if it is here already and carries output (a failed or aborted one waits for ``next``)."""
        chunks = self.inbox.chunks
        if not chunks or chunks[0].error or chunks[0].aborted:
            return None
        self.received += 1
        return chunks.popleft()

    def cancel(self) -> None:
        import ray

        ray.cancel(self._ref)

    def close(self) -> None:
        if not self.call.done():
            self.call.cancel()
        self.inbox.wake()
        self.channel.close(self.rid)
