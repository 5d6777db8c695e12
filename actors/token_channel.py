"""The token channel: a replica's chunks reach the gateway over one ZeroMQ socket instead of a Ray streamed
object per chunk.

Why: a Ray streaming generator makes every chunk a Ray object (serialised, reported to its owner, fetched by
the gateway), about 4 ms of CPU per token on the 2-core machine where vLLM's own front end spends 0.6 ms
(``scripts/serve_cpu_per_token.py``). Here a chunk (actors/wire.py) is one msgpack frame on a ZeroMQ PUSH socket
(pyzmq and msgpack come with vLLM, whose EngineCore talks to its front end the same way). Ray keeps the control: the
gateway starts a request with an ordinary actor call (``Replica.generate_to``), cancels it with
``ray.cancel``, and learns of a dead replica from that call's result.

The gateway binds one PULL socket (``TokenChannel``) and routes each frame by request id to the request's
queue. A replica keeps one PUSH socket per gateway address (``TokenSender``); ZeroMQ keeps the order of one
sender's frames, so a request's chunks arrive in order. ``generate_to`` returns how many chunks it sent, so
the gateway can tell "all arrived" from "some still on the wire" when the call's result overtakes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
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


class TokenChannel:
    """The gateway's end: one PULL socket, bound on first use in the running event loop (zmq.asyncio sockets
    belong to one loop). Invariant: a frame for a request with no open queue (it ended, or was never opened
    here) is dropped."""

    def __init__(self, host: str = "127.0.0.1"):
        self.host = host
        self.address = ""
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task | None = None
        self._queues: dict[str, asyncio.Queue] = {}

    def _start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port(f"tcp://{self.host}")
        self.address = f"tcp://{self.host}:{port}"
        self._reader = asyncio.ensure_future(self._read())
        log.info("token channel listening on %s", self.address)

    def open(self, rid: str) -> asyncio.Queue:
        if self._sock is None:
            self._start()
        q = self._queues[rid] = asyncio.Queue()
        return q

    def close(self, rid: str) -> None:
        self._queues.pop(rid, None)

    async def _read(self) -> None:
        while True:
            try:
                rid, payload = await self._sock.recv_multipart()
                q = self._queues.get(rid.decode())
                if q is not None:
                    q.put_nowait(decode(payload))
            except asyncio.CancelledError:
                raise
            except Exception:  # a malformed frame must not stop the channel for every other request
                log.exception("token channel: dropped a frame it could not read")

    async def aclose(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        if self._sock is not None:
            self._sock.close(0)
            self._ctx.term()
        self._sock = self._reader = None


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
    replica's RayActorError) or Unreachable. ``start(address)`` makes the call (``Replica.generate_to``) once
    the request's queue is open, so no frame can come before it. ``cancel()`` stops the call (``ray.cancel``),
    which aborts the request in the engine; ``close()`` drops the queue."""

    def __init__(self, channel: TokenChannel, rid: str, start: Callable[[str], Any]):
        self.channel, self.rid = channel, rid
        self.queue = channel.open(rid)
        self._ref = start(channel.address)
        self.call = asyncio.ensure_future(self._ref)
        self.call.add_done_callback(lambda f: f.cancelled() or f.exception())  # read, even if nobody waits
        self._get: asyncio.Future | None = None
        self.received = 0
        self.sent: int | None = None  # generate_to's result once the call ended

    async def next(self) -> Chunk | None:
        while True:
            if self._get is None:
                self._get = asyncio.ensure_future(self.queue.get())
            if self.sent is not None:  # the call ended: only what it sent is still to come
                if self.received >= self.sent:
                    return None
                done, _ = await asyncio.wait({self._get}, timeout=ARRIVAL_GRACE_S)
                if not done:
                    missing = self.sent - self.received
                    log.warning("request %s: %d of %d chunks never arrived", self.rid, missing, self.sent)
                    return None
            else:
                await asyncio.wait({self._get, self.call}, return_when=asyncio.FIRST_COMPLETED)
            if self._get.done():
                chunk, self._get = self._get.result(), None
                self.received += 1
                return chunk
            self.sent = self.call.result()  # raises the call's error (RayActorError for a dead replica)
            if self.sent < 0:
                raise Unreachable(self.channel.address)

    def cancel(self) -> None:
        import ray

        ray.cancel(self._ref)

    def close(self) -> None:
        for f in (self._get, self.call):
            if f is not None and not f.done():
                f.cancel()
        self.channel.close(self.rid)
