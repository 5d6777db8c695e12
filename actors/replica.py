"""Replica: a Ray actor that hosts one engine, streams tokens, aborts on cancel, and reports its pool.

Lifecycle: the constructor only stores its arguments, so a Ray restart (``max_restarts``) is cheap and the
controller decides when to build the engine: ``start()`` builds it (idempotent; in a thread, so pings keep
answering during the ~30 s vLLM start) and begins reporting. Reports go to the controller at least every
``report_interval_s`` and at once when the pool changes by ``change_fraction`` of its blocks or the
running/waiting counts or the admitted requests change. ``incarnation`` changes with every process, so the
controller can tell a restarted replica from a late report of the dead one. A report's ``admitted`` lists the
requests whose blocks its figures count: the controller keeps a request's promise until then, so its blocks
are never counted twice (promise and ``free_blocks``)
nor not at all (promise dropped, figures older than the admission).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from actors.engines import Chunk, Engine, EngineFactory, GenerateSpec

log = logging.getLogger("vtoken.replica")


class Replica:
    """Invariants: a request is in ``inflight`` exactly while its generator runs; after ``drain()`` returns,
    no request is in flight and new ones are refused; a cancelled or aborted request is aborted in the engine."""

    def __init__(
        self,
        name: str,
        factory: EngineFactory,
        controller: Any = None,
        report_interval_s: float = 1.0,
        change_fraction: float = 0.05,
        poll_s: float = 0.2,
    ):
        self.name, self.factory, self.controller = name, factory, controller
        self.report_interval_s, self.change_fraction, self.poll_s = report_interval_s, change_fraction, poll_s
        self.incarnation = f"{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.engine: Engine | None = None
        self.inflight: set[str] = set()
        self.draining = False
        self._starting: asyncio.Task | None = None
        self._reporter: asyncio.Task | None = None
        self._last: dict[str, Any] = {}

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> str:
        """Build the engine if not built yet and start reporting; returns the incarnation."""
        if self._starting is None:
            self._starting = asyncio.ensure_future(asyncio.to_thread(self.factory))
        self.engine = await asyncio.shield(self._starting)
        if self._reporter is None and self.controller is not None:
            self._reporter = asyncio.ensure_future(self._report_loop())
        return self.incarnation

    async def ping(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "incarnation": self.incarnation,
            "ready": self.engine is not None,
            "draining": self.draining,
            "inflight": len(self.inflight),
        }

    async def drain(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """Refuse new requests, wait for the in-flight ones (abort what is left at the timeout), report."""
        self.draining = True
        t_end = time.monotonic() + timeout_s
        while self.inflight and time.monotonic() < t_end:
            await asyncio.sleep(0.05)
        for rid in list(self.inflight):
            await self.abort(rid)
        return await self.report()

    async def shutdown(self) -> None:
        if self._reporter is not None:
            self._reporter.cancel()
        if self.engine is not None:
            await self.engine.shutdown()

    # ------------------------------------------------------------------ serving
    async def generate(self, spec: GenerateSpec) -> AsyncIterator[Chunk]:
        """Streams the engine's chunks (a Ray streaming generator). Cancellation (``ray.cancel`` or the
        caller dropping the stream) and ``abort`` both abort the request in the engine."""
        if self.engine is None or self.draining:
            yield Chunk(error="unavailable: replica is " + ("draining" if self.draining else "starting"))
            return
        rid = spec.request_id
        self.inflight.add(rid)
        finished = False
        try:
            async for chunk in self.engine.generate(spec):
                finished = chunk.finished or bool(chunk.error)
                yield chunk
        finally:
            self.inflight.discard(rid)
            if not finished:
                await asyncio.shield(self.engine.abort(rid))

    async def abort(self, request_id: str) -> None:
        if self.engine is not None:
            await self.engine.abort(request_id)

    # ------------------------------------------------------------------ reporting
    async def report(self) -> dict[str, Any]:
        """The current figures: the engine's pool statistics plus health."""
        stats = await self.engine.stats() if self.engine is not None else {}
        return {
            **stats,
            "name": self.name,
            "incarnation": self.incarnation,
            "healthy": self.engine is not None,
            "draining": self.draining,
            "inflight": len(self.inflight),
            "time": time.time(),
        }

    def _changed(self, r: dict[str, Any]) -> bool:
        last = self._last
        if not last or r.get("admitted") != last.get("admitted"):
            return True
        step = max(1, int(self.change_fraction * max(r.get("total_blocks", 0), 1)))
        return (
            abs(r.get("free_blocks", 0) - last.get("free_blocks", 0)) >= step
            or r.get("running") != last.get("running")
            or r.get("waiting") != last.get("waiting")
        )

    async def _report_loop(self) -> None:
        sent_at = 0.0
        while True:
            try:
                r = await self.report()
                if self._changed(r) or time.monotonic() - sent_at >= self.report_interval_s:
                    await asyncio.wait_for(self.controller.report.remote(self.name, r), timeout=5)
                    self._last, sent_at = r, time.monotonic()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a slow or restarting controller must not stop the reports
                log.warning("replica %s: report failed: %s", self.name, e)
            await asyncio.sleep(self.poll_s)
