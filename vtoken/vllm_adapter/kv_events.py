"""vLLM's KV-cache events, read by the process that owns the engine: what its prefix cache stores and removes.

vLLM's scheduler publishes them after each step (vllm/v1/core/sched/scheduler.py, through vllm/distributed/
kv_events.py ZmqEventPublisher): multipart messages (topic, 8-byte big-endian sequence number, msgpack of a
``KVEventBatch`` of ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``). ``events_config`` switches them on
for one engine, published on an ``ipc://`` path of its own (the EngineCore binds it; nothing leaves the machine),
unless the caller's engine arguments already configure events; ``KVEventSubscriber`` reads them in a daemon thread
and hands each event to a sink (actors/prefix_tracker.py PrefixTracker) as plain values.

A gap in the sequence numbers (the publisher dropped messages past its high-water mark, or a subscriber joined
late) may hide removals, so the sink is cleared: it then claims fewer blocks than the cache holds until they are
stored again, never blocks the cache no longer has.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
import uuid
from collections.abc import Hashable, Sequence
from typing import Any, Protocol

log = logging.getLogger("vtoken.kv_events")
TOPIC = "kv"


class EventSink(Protocol):
    def stored(self, hashes: Sequence[Hashable], parent: Hashable | None, token_ids: Sequence[int], size: int): ...

    def removed(self, hashes: Sequence[Hashable]) -> None: ...

    def cleared(self) -> None: ...


def events_config(engine_args: dict[str, Any]) -> tuple[dict[str, Any], tuple[str, str] | None]:
    """``engine_args`` with vLLM's KV events on, published for this process alone, and (endpoint, topic) to
    subscribe to. Arguments that configure events already are left as they are; their endpoint is subscribed to
    when it publishes over ZeroMQ (a wildcard bind address read on this machine), else nothing (None)."""
    from vllm.config.kv_events import KVEventsConfig

    given = engine_args.get("kv_events_config")
    if given is None:
        path = os.path.join(tempfile.gettempdir(), f"vtoken-kv-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"ipc://{path}", "topic": TOPIC}
        return {**engine_args, "kv_events_config": cfg}, (cfg["endpoint"], TOPIC)
    cfg = given if isinstance(given, KVEventsConfig) else KVEventsConfig(**given)
    if not cfg.enable_kv_cache_events or cfg.publisher != "zmq":
        return engine_args, None
    return engine_args, (cfg.endpoint.replace("*", "127.0.0.1"), cfg.topic)


class KVEventSubscriber:
    """A daemon thread that feeds one engine's KV events to ``sink`` until ``close()``. ``batches`` and ``gaps``
    count what it read (tests, logs)."""

    def __init__(self, endpoint: str, topic: str, sink: EventSink, poll_ms: int = 100):
        import zmq

        self.endpoint, self.sink, self.poll_ms = endpoint, sink, poll_ms
        self.batches = self.gaps = 0
        self._next: int | None = None  # the sequence number expected next
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(endpoint)  # before the engine binds is fine: ZeroMQ connects once it does
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vtoken-kv-events", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        decode = msgspec.msgpack.Decoder(type=KVEventBatch).decode
        try:
            while not self._stop.is_set():
                if not self._sock.poll(self.poll_ms):
                    continue
                frames = self._sock.recv_multipart()
                if len(frames) != 3:
                    continue
                try:
                    self.apply(int.from_bytes(frames[1], "big"), decode(frames[2]).events)
                except Exception:  # one bad message must not end the thread: the sink is cleared instead
                    log.exception("unreadable KV events from %s; the prefix index starts over", self.endpoint)
                    self.sink.cleared()
                    self._next = None
        finally:
            self._sock.close(0)
            self._ctx.term()

    def apply(self, seq: int, events: Sequence[Any]) -> None:
        """One batch, in order; a batch that does not follow the last one clears the sink first."""
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        if self._next is not None and seq != self._next:
            self.gaps += 1
            log.warning("KV events %d..%d were lost; the prefix index starts over", self._next, seq - 1)
            self.sink.cleared()
        self._next = seq + 1
        self.batches += 1
        for e in events:
            if isinstance(e, BlockStored):
                if e.medium in (None, "GPU"):  # vLLM's name for the engine's own pool, on every platform
                    self.sink.stored(e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size)
            elif isinstance(e, BlockRemoved):
                if e.medium in (None, "GPU"):
                    self.sink.removed(e.block_hashes)
            elif isinstance(e, AllBlocksCleared):
                self.sink.cleared()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2 * self.poll_ms / 1000 + 1)


def remove_endpoint(endpoint: str) -> None:
    """The socket file an ``ipc://`` endpoint of ``events_config`` leaves behind once its engine stopped."""
    path = endpoint.removeprefix("ipc://")
    if path != endpoint:
        with contextlib.suppress(OSError):
            os.unlink(path)


def cached_hashes(llm) -> set:
    """The block hashes an in-process ``LLM``'s prefix cache holds now, as its KV events name them
    (vllm/v1/core/block_pool.py BlockPool.cached_block_hash_to_block): what a subscriber's sink should hold."""
    from vllm.v1.core.kv_cache_utils import get_block_hash, maybe_convert_block_hash

    from vtoken.vllm_adapter.engine import inproc_scheduler

    pool = inproc_scheduler(llm).kv_cache_manager.block_pool
    return {maybe_convert_block_hash(get_block_hash(k)) for k in pool.cached_block_hash_to_block._cache}
