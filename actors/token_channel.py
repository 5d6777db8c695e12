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
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from actors.wire import Chunk, pack, unpack

log = logging.getLogger("vtoken.token_channel")
SEND_TIMEOUT_S = 30.0  # a gateway that takes no frame for this long is gone: the replica aborts the request
ARRIVAL_GRACE_S = 10.0  # after generate_to returned, the longest wait for its last frames


def encode(rid: str, chunk: Chunk) -> list[bytes]:
    return [rid.encode(), pack(chunk)]


def decode(payload: bytes) -> Chunk:
    return unpack(payload)


def is_loopback(address: str) -> bool:
    host = address.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(host).is_loopback
    return host == "localhost"


class Inbox:
    """One request's chunks as the channel routed them, and the one task waiting for them: ``put`` appends and wakes
    it, without a task or a queue per chunk (a streamed token's path crosses the event loop as few times as it can)."""

    __slots__ = ("chunks", "waiter")

    def __init__(self):
        self.chunks: deque[Chunk] = deque()
        self.waiter: asyncio.Future | None = None

    def put(self, chunk: Chunk) -> None:
        self.chunks.append(chunk)
        self.wake()

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
    """The gateway's end: one PULL socket, bound on first use in the running event loop, read by a reader callback
    that takes every frame waiting (``DRAIN``) at each wake-up. Invariant: a frame for a request with no open inbox
    (it ended, or was never opened here) is dropped."""

    DRAIN = 256  # frames per callback at most, so a flood cannot hold the event loop; the rest on its next turn

    def __init__(self, host: str = "127.0.0.1"):
        self.host = host
        self.address = ""
        self._ctx: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inboxes: dict[bytes, Inbox] = {}

    def _start(self) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port(f"tcp://{self.host}")
        self.address = f"tcp://{self.host}:{port}"
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
            try:
                rid, payload = frames
                inbox = self._inboxes.get(rid)
                if inbox is not None:
                    inbox.put(decode(payload))
            except Exception:  # a malformed frame must not stop the channel for every other request
                log.exception("token channel: dropped a frame it could not read")
        self._loop.call_soon(self._drain)  # more may be waiting, and the FD will not signal them again

    async def aclose(self) -> None:
        if self._sock is not None:
            self._loop.remove_reader(self._sock.getsockopt(zmq.FD))
            self._sock.close(0)
            self._ctx.term()
        self._sock = None


class TokenSender:
    """A replica's end: one PUSH socket per gateway address, connected on first use."""

    def __init__(self):
        self._ctx: zmq.asyncio.Context | None = None
        self._socks: dict[str, zmq.asyncio.Socket] = {}

    def _socket(self, address: str) -> zmq.asyncio.Socket:
        sock = self._socks.get(address)
        if sock is None:
            self._ctx = self._ctx or zmq.asyncio.Context()
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
            self._socks[address] = sock
        return sock

    async def send(self, address: str, rid: str, chunk: Chunk) -> None:
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

    def __init__(self, channel: TokenChannel, rid: str, start: Callable[[str], Any]):
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
                raise Unreachable(self.channel.address)
            if self.received >= self.sent:  # the call ended: only what it sent is still to come
                return None
            try:
                await asyncio.wait_for(inbox.wait(), ARRIVAL_GRACE_S)
            except TimeoutError:
                log.warning("request %s: %d of %d chunks never arrived", self.rid, self.sent - self.received, self.sent)
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
